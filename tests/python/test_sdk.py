"""The official OpenAI and Anthropic Python SDKs against a running `iris serve`.

Run by tests/server_sdk.rs, which starts the server on the tiny llama fixture with an API key
and sets IRIS_BASE_URL, IRIS_API_KEY and IRIS_MODEL. By hand:
    iris serve --model tests/fixtures/tiny-llama --api-key k --port 8000 &
    IRIS_BASE_URL=http://127.0.0.1:8000 IRIS_API_KEY=k IRIS_MODEL=tiny-llama python tests/python/test_sdk.py -v
"""

import os
import unittest

import anthropic
import openai

BASE = os.environ["IRIS_BASE_URL"]
KEY = os.environ["IRIS_API_KEY"]
MODEL = os.environ["IRIS_MODEL"]


def oai(key=KEY):
    return openai.OpenAI(base_url=BASE + "/v1", api_key=key, max_retries=0, timeout=120)


def claude(key=KEY):
    return anthropic.Anthropic(base_url=BASE, api_key=key, max_retries=0, timeout=120)


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


class OpenAIChat(unittest.TestCase):
    def test_create_and_stream_agree(self):
        c = oai()
        r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.model, MODEL)
        ch = r.choices[0]
        self.assertEqual(ch.finish_reason, "length")
        self.assertEqual(ch.message.role, "assistant")
        self.assertEqual(r.usage.completion_tokens, 10)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + 10)

        stream = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        self.assertEqual(text, ch.message.content)
        self.assertEqual(finish, "length")
        self.assertEqual(usage.prompt_tokens, r.usage.prompt_tokens)
        self.assertEqual(usage.completion_tokens, 10)

    def test_sampling_knobs_n_seed_logprobs(self):
        c = oai()
        r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0.8, top_p=0.9,
                                      seed=3, n=2, presence_penalty=0.5, frequency_penalty=0.5,
                                      logit_bias={"5": -100}, logprobs=True, top_logprobs=2, stop=["\n\n"],
                                      extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
        self.assertEqual(len(r.choices), 2)
        for ch in r.choices:
            self.assertIn(ch.finish_reason, ("stop", "length"))
            for lp in ch.logprobs.content:
                self.assertLessEqual(lp.logprob, 0.0)
                self.assertLessEqual(len(lp.top_logprobs), 2)
        again = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0.8, top_p=0.9,
                                          seed=3, n=2, presence_penalty=0.5, frequency_penalty=0.5,
                                          logit_bias={"5": -100}, stop=["\n\n"],
                                          extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
        self.assertEqual([x.message.content for x in again.choices], [x.message.content for x in r.choices])

    def test_models(self):
        ids = [m.id for m in oai().models.list()]
        self.assertEqual(ids, [MODEL])


class OpenAICompletions(unittest.TestCase):
    def test_prompt_list_and_stream(self):
        c = oai()
        r = c.completions.create(model=MODEL, prompt=["hello", "world"], max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
        self.assertEqual(len(r.choices), 2)
        self.assertEqual(r.usage.completion_tokens, 10)
        text = "".join(ch.choices[0].text for ch in
                       c.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
        self.assertEqual(text, r.choices[0].text)

    def test_echo_logprobs(self):
        r = oai().completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0, echo=True, logprobs=1)
        ch = r.choices[0]
        self.assertTrue(ch.text.startswith("hello"))
        self.assertEqual(len(ch.logprobs.tokens), len(ch.logprobs.token_logprobs))


class OpenAIErrors(unittest.TestCase):
    def test_wrong_key(self):
        with self.assertRaises(openai.AuthenticationError):
            oai("wrong").chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)

    def test_unknown_model(self):
        with self.assertRaises(openai.NotFoundError) as e:
            oai().chat.completions.create(model="gpt-nope", messages=MSGS, max_tokens=2)
        self.assertIn("gpt-nope", str(e.exception))

    def test_bad_requests(self):
        c = oai()
        for kwargs in [dict(messages=[]), dict(messages=MSGS, max_tokens=0), dict(messages=MSGS, n=1000),
                       dict(messages=[{"role": "wizard", "content": "x"}]), dict(messages=MSGS, temperature=-1)]:
            kwargs.setdefault("max_tokens", 2)
            with self.assertRaises(openai.BadRequestError):
                c.chat.completions.create(model=MODEL, **kwargs)


class Anthropic(unittest.TestCase):
    def test_create_stream_count(self):
        c = claude()
        # Recent SDKs dropped the sampling arguments from their signatures; send them raw.
        kwargs = dict(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
                      messages=[{"role": "user", "content": "Say something."}])
        m = c.messages.create(**kwargs)
        self.assertEqual(m.type, "message")
        self.assertEqual(m.role, "assistant")
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens"))
        self.assertGreaterEqual(m.usage.output_tokens, 1)
        with c.messages.stream(**kwargs) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        self.assertEqual(text, m.content[0].text)
        self.assertEqual(final.stop_reason, m.stop_reason)
        self.assertEqual(final.usage.output_tokens, m.usage.output_tokens)
        n = c.messages.count_tokens(model=MODEL, system="Be brief.",
                                    messages=[{"role": "user", "content": "Say something."}])
        # The whole prompt; the reply's input_tokens leaves out what the prefix cache read.
        self.assertEqual(n.input_tokens, m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0))

    def test_stop_sequences_and_top_k(self):
        m = claude().messages.create(model=MODEL, max_tokens=20, stop_sequences=["e"],
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 10}, messages=[{"role": "user", "content": "hi"}])
        if m.stop_reason == "stop_sequence":
            self.assertEqual(m.stop_sequence, "e")
            self.assertNotIn("e", m.content[0].text)

    def test_errors(self):
        with self.assertRaises(anthropic.AuthenticationError):
            claude("wrong").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        with self.assertRaises(anthropic.BadRequestError):
            claude().messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
        with self.assertRaises(anthropic.NotFoundError):
            claude().messages.create(model="claude-nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])


if __name__ == "__main__":
    unittest.main()
