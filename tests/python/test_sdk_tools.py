"""Tool round trips (call, result, final answer) with the official OpenAI and Anthropic SDKs,
streamed and not, against a running `iris serve`, and forced calls whose arguments validate.

Run by tests/server_sdk.rs on the tiny Qwen3 fixture with Qwen3.5's real chat template
(`--tool-call-parser qwen3_xml --reasoning-parser qwen3`), and on tiny Gemma 4 with Gemma 4's
template and tokenizer (`gemma4`, read from the template). A random tiny model writes no calls
of its own, so the call turn forces one (tool_choice a named function, or `required`): iris
then writes the call's opening (`<tool_call>\\n<function=get_weather>\\n`) after the prompt,
and a grammar holds the rest of the call to the tool's schema, so even a random model's reply
is a call whose arguments validate (checked with the `jsonschema` package), and the reply ends
with the call. Its id is answered with a tool result in the next turn.
"""

import json
import os
import unittest

import anthropic
import jsonschema
import openai

BASE = os.environ["IRIS_BASE_URL"]
KEY = os.environ["IRIS_API_KEY"]
MODEL = os.environ["IRIS_MODEL"]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "London", "New York"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
}, "required": ["city", "days"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {
    "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "level": {"enum": [1, 2, 3]},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
}, "required": ["tag"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "note": NOTE}
OAI_TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}}
             for n, p in SCHEMAS.items()]
CLAUDE_TOOLS = [{"name": n, "description": n, "input_schema": p, "cache_control": {"type": "ephemeral"}}
                for n, p in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def oai():
    return openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)


def claude():
    return anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


def check_call(test, name, args):
    test.assertIn(name, SCHEMAS)
    jsonschema.validate(args, SCHEMAS[name])


class OpenAITools(unittest.TestCase):
    def call(self, stream, tool_choice=None, temperature=0, seed=None, parallel=None):
        kw = dict(model=MODEL, messages=ASK, tools=OAI_TOOLS, max_tokens=200, temperature=temperature, seed=seed,
                  tool_choice=tool_choice or {"type": "function", "function": {"name": "get_weather"}})
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        c = oai()
        if not stream:
            r = c.chat.completions.create(**kw)
            ch = r.choices[0]
            return ch.finish_reason, ch.message.content, [(t.id, t.function.name, t.function.arguments)
                                                          for t in ch.message.tool_calls or []]
        calls, content, finish = {}, "", None
        for chunk in c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                d = ch.delta
                content += d.content or ""
                for t in d.tool_calls or []:
                    if t.index not in calls:
                        # The first delta of a call names it.
                        self.assertTrue(t.id and t.id.startswith("call_"), t)
                        self.assertEqual(t.type, "function")
                        calls[t.index] = [t.id, t.function.name, ""]
                    calls[t.index][2] += t.function.arguments or ""
                finish = ch.finish_reason or finish
        return finish, content or None, [tuple(calls[i]) for i in sorted(calls)]

    def test_round_trip(self):
        for stream in (False, True):
            finish, content, calls = self.call(stream)
            self.assertEqual(finish, "tool_calls", (stream, content, calls))
            self.assertIsNone(content)
            self.assertEqual(len(calls), 1)
            call_id, name, args = calls[0]
            self.assertTrue(call_id.startswith("call_"))
            self.assertEqual(name, "get_weather")
            check_call(self, name, json.loads(args))
            history = ASK + [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "18C and sunny"},
            ]
            kw = dict(model=MODEL, messages=history, tools=OAI_TOOLS, max_tokens=5, temperature=0,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
            r = oai().chat.completions.create(**kw)
            self.assertEqual(r.choices[0].finish_reason, "length")
            text = "".join(ch.choices[0].delta.content or "" for ch in oai().chat.completions.create(stream=True, **kw)
                           if ch.choices)
            self.assertEqual(text, r.choices[0].message.content or "")
            self.assertNotIn("<tool_call>", text)

    def test_required_calls_validate(self):
        """`required` at temperature 1: a random model's calls are to the tools, with arguments
        that validate, one call without parallel_tool_calls and maybe several with it (that
        several come is shown by the grammar's own test, src/server/tool_grammar/tests.rs)."""
        names = set()
        for seed in range(12):
            stream = seed % 2 == 1
            finish, content, calls = self.call(stream, "required", 1.0, seed, parallel=seed % 3 != 0)
            self.assertEqual(finish, "tool_calls", (seed, content, calls))
            self.assertIsNone(content, seed)
            self.assertGreaterEqual(len(calls), 1, seed)
            if seed % 3 == 0:
                self.assertEqual(len(calls), 1, (seed, calls))
            for _, name, args in calls:
                check_call(self, name, json.loads(args))
                names.add(name)
        self.assertEqual(names, set(SCHEMAS))

    def test_unsupported_fields_are_400(self):
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                          response_format={"type": "json_schema", "json_schema": {"name": "x"}})
        self.assertIn("response_format", str(e.exception))
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                          extra_body={"guided_json": {"type": "objekt"}})
        self.assertIn("guided_json", str(e.exception))


class AnthropicTools(unittest.TestCase):
    def call(self, stream, tool_choice=None, temperature=0, seed=None):
        # The pinned SDK takes sampling settings through extra_body.
        kw = dict(model=MODEL, max_tokens=200, messages=ASK, tools=CLAUDE_TOOLS,
                  extra_body={"temperature": temperature, "seed": seed},
                  tool_choice=tool_choice or {"type": "tool", "name": "get_weather"})
        if not stream:
            return claude().messages.create(**kw)
        with claude().messages.stream(**kw) as s:
            events = [e.type for e in s]
            m = s.get_final_message()
        self.assertIn("content_block_start", events)
        self.assertIn("input_json", events)  # the SDK's event for input_json_delta
        return m

    def test_round_trip(self):
        for stream in (False, True):
            m = self.call(stream)
            self.assertEqual(m.stop_reason, "tool_use", m)
            uses = [b for b in m.content if b.type == "tool_use"]
            self.assertEqual(len(uses), 1, m.content)
            self.assertTrue(uses[0].id.startswith("toolu_"))
            self.assertEqual(uses[0].name, "get_weather")
            check_call(self, uses[0].name, uses[0].input)
            history = ASK + [
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I need the weather.", "signature": "x"},
                    {"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": uses[0].id,
                     "content": [{"type": "text", "text": "18C and sunny"}]}]},
            ]
            kw = dict(model=MODEL, max_tokens=5, messages=history, tools=CLAUDE_TOOLS,
                      thinking={"type": "disabled"}, extra_body={"temperature": 0})
            r = claude().messages.create(**kw)
            self.assertIn(r.stop_reason, ("max_tokens", "end_turn"))
            with claude().messages.stream(**kw) as s:
                streamed = s.get_final_message()
            self.assertEqual([b.type for b in streamed.content], [b.type for b in r.content])
            n = claude().messages.count_tokens(model=MODEL, messages=history, tools=CLAUDE_TOOLS,
                                               thinking={"type": "disabled"})
            # count_tokens counts the whole prompt; a reply's input_tokens leaves out what the
            # prefix cache read (Anthropic's split).
            self.assertEqual(n.input_tokens, r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0))

    def test_any_tool_calls_validate(self):
        for seed in range(8):
            m = self.call(seed % 2 == 1, {"type": "any"}, 1.0, seed)
            self.assertEqual(m.stop_reason, "tool_use", (seed, m))
            uses = [b for b in m.content if b.type == "tool_use"]
            self.assertGreaterEqual(len(uses), 1, (seed, m.content))
            self.assertEqual([b.type for b in m.content if b.type == "text"], [], (seed, m.content))
            for u in uses:
                check_call(self, u.name, u.input)

    def test_claude_code_model_names(self):
        r = claude().messages.create(model="claude-next-9", max_tokens=2, messages=ASK)
        self.assertEqual(r.model, "claude-next-9")


if __name__ == "__main__":
    unittest.main()
