"""The Responses API with the official OpenAI SDK: create, retrieve and delete, streaming
(`client.responses.stream` and `create(stream=True)`), `previous_response_id`, and a function
tool round trip (call, result, answer) both through the store and by sending the output back
as input, against a running `iris serve`.

Run by tests/server_sdk.rs on the tiny Qwen3 fixture with Qwen3.5's real chat template
(`--tool-call-parser qwen3_xml --reasoning-parser qwen3`). `reasoning={"effort": "none"}`
switches the template's thinking off, so the random model's text is the answer. Replies are
made to end where the test needs them: `min_tokens` with a bias on EOS (EOS right after the
minimum), a named function (iris writes the call's opening and the tool's schema holds the
rest of the call, which ends the reply), or `max_output_tokens` with `ignore_eos`.
"""

import json
import os
import unittest

import openai

BASE = os.environ["IRIS_BASE_URL"]
KEY = os.environ["IRIS_API_KEY"]
MODEL = os.environ["IRIS_MODEL"]
EOS = int(os.environ["IRIS_EOS_ID"])

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"]}, "strict": False}]
NO_THINKING = {"effort": "none"}
# Three tokens, then EOS: the response completes by itself.
THREE_THEN_EOS = {"min_tokens": 3, "logit_bias": {str(EOS): 100}}


def client():
    return openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)


class Create(unittest.TestCase):
    def test_create_retrieve_delete(self):
        c = client()
        r = c.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0,
                               reasoning=NO_THINKING, extra_body={"ignore_eos": True})
        self.assertTrue(r.id.startswith("resp_"), r.id)
        self.assertEqual(r.object, "response")
        self.assertEqual(r.status, "incomplete")
        self.assertEqual(r.incomplete_details.reason, "max_output_tokens")
        self.assertEqual(r.usage.output_tokens, 4)
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + 4)
        self.assertIsInstance(r.output_text, str)
        self.assertEqual(r.output[0].type, "message")
        got = c.responses.retrieve(r.id)
        self.assertEqual((got.id, got.output_text), (r.id, r.output_text))
        c.responses.delete(r.id)
        with self.assertRaises(openai.NotFoundError):
            c.responses.retrieve(r.id)

    def test_completes_and_streams_the_same_text(self):
        c = client()
        kw = dict(model=MODEL, input="Hi", max_output_tokens=16, temperature=0, reasoning=NO_THINKING,
                  extra_body=THREE_THEN_EOS)
        whole = c.responses.create(**kw)
        self.assertEqual(whole.status, "completed")
        self.assertEqual(whole.usage.output_tokens, 4)  # three, and the EOS
        with c.responses.stream(**kw) as s:
            events = list(s)
            final = s.get_final_response()
        types = [e.type for e in events]
        self.assertEqual(types[:4], ["response.created", "response.in_progress", "response.output_item.added",
                                     "response.content_part.added"], types)
        self.assertEqual(types[-4:], ["response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", "response.completed"], types)
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        self.assertEqual(text, whole.output_text)
        self.assertEqual(final.output_text, whole.output_text)
        self.assertEqual(final.status, "completed")
        # create(stream=True): the raw events; cut by max_output_tokens it ends incomplete.
        raw = list(c.responses.create(stream=True, model=MODEL, input="Hi", max_output_tokens=3, temperature=0,
                                      reasoning=NO_THINKING, extra_body={"ignore_eos": True}))
        self.assertEqual(raw[-1].type, "response.incomplete")
        self.assertEqual(raw[-1].response.incomplete_details.reason, "max_output_tokens")

    def test_previous_response_id(self):
        c = client()
        kw = dict(model=MODEL, max_output_tokens=3, temperature=0, reasoning=NO_THINKING,
                  extra_body={"ignore_eos": True})
        first = c.responses.create(input="My name is Ann.", instructions="Be brief.", **kw)
        second = c.responses.create(input="What is my name?", previous_response_id=first.id, **kw)
        self.assertEqual(second.previous_response_id, first.id)
        # The same conversation sent whole (and not stored) is the same prompt and answer.
        again = c.responses.create(input=[
            {"role": "user", "content": "My name is Ann."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ], store=False, **kw)
        self.assertEqual(again.usage.input_tokens, second.usage.input_tokens)
        self.assertEqual(again.output_text, second.output_text)
        with self.assertRaises(openai.NotFoundError):
            c.responses.retrieve(again.id)
        with self.assertRaises(openai.NotFoundError) as e:
            c.responses.create(input="x", previous_response_id="resp_unknown", **kw)
        self.assertIn("resp_unknown", str(e.exception))

    def test_structured_outputs(self):
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "c": {"enum": ["x", "y"]}},
                  "required": ["n", "c"], "additionalProperties": False}
        for seed in range(5):
            r = client().responses.create(model=MODEL, input="x", max_output_tokens=100, temperature=1.0, reasoning=NO_THINKING,
                                          extra_body={"seed": seed},
                                          text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
            v = json.loads(r.output_text)
            self.assertEqual(set(v), {"n", "c"})
            self.assertIn(v["c"], ["x", "y"])
            self.assertTrue(0 <= v["n"] <= 99)
        with self.assertRaises(openai.BadRequestError) as e:
            client().responses.create(model=MODEL, input="x", max_output_tokens=2, text={
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}})
        self.assertIn("text.format", str(e.exception))


class Tools(unittest.TestCase):
    ASK = dict(model=MODEL, tools=TOOLS, max_output_tokens=64, temperature=0,
               tool_choice={"type": "function", "name": "get_weather"})
    ANSWER = dict(model=MODEL, tools=TOOLS, max_output_tokens=4, temperature=0, reasoning=NO_THINKING,
                  extra_body={"ignore_eos": True})

    def check_call(self, r):
        calls = [o for o in r.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1, r.output)
        call = calls[0]
        self.assertEqual(call.name, "get_weather")
        self.assertIn(json.loads(call.arguments), [{"city": "Paris"}, {"city": "Rome"}])
        self.assertTrue(call.call_id.startswith("call_"), call)
        self.assertEqual(r.output_text, "")
        return call

    def test_round_trip_through_the_store(self):
        c = client()
        r = c.responses.create(input="What is the weather in Paris?", **self.ASK)
        self.assertEqual(r.status, "completed")
        call = self.check_call(r)
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}
        answer = c.responses.create(input=[result], previous_response_id=r.id, **self.ANSWER)
        self.assertEqual(answer.status, "incomplete")
        self.assertNotIn("<tool_call>", answer.output_text)
        self.assertTrue(any(o.type == "message" for o in answer.output), answer.output)

    def test_round_trip_streamed_with_the_output_sent_back(self):
        c = client()
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        with c.responses.stream(input=ask, store=False, **self.ASK) as s:
            events = list(s)
            r = s.get_final_response()
        types = [e.type for e in events]
        self.assertIn("response.function_call_arguments.delta", types)
        self.assertIn("response.function_call_arguments.done", types)
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        call = self.check_call(r)
        self.assertEqual(args, call.arguments)
        # What agents do without the store: the output items go back in the input as they came.
        history = ask + r.output + [{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
        answer = c.responses.create(input=history, store=False, **self.ANSWER)
        self.assertEqual(answer.status, "incomplete")
        self.assertNotIn("<tool_call>", answer.output_text)


if __name__ == "__main__":
    unittest.main()
