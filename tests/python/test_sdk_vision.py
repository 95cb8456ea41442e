"""The official OpenAI and Anthropic Python SDKs send images to `iris serve` on the tiny
Qwen2-VL fixture. Run by tests/server_vision.rs, which sets IRIS_BASE_URL, IRIS_IMAGE (a PNG),
IRIS_QUESTION and IRIS_EXPECTED (transformers' greedy continuation of that prompt, as text).
"""

import base64
import os
import unittest

import anthropic
import openai

BASE = os.environ["IRIS_BASE_URL"]
with open(os.environ["IRIS_IMAGE"], "rb") as fh:
    PNG = base64.b64encode(fh.read()).decode()
QUESTION = os.environ["IRIS_QUESTION"]
EXPECTED = os.environ["IRIS_EXPECTED"]


class Vision(unittest.TestCase):
    def test_openai_image_url(self):
        c = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}},
            {"type": "text", "text": QUESTION},
        ]}]
        r = c.chat.completions.create(model="tiny-qwen2-vl", messages=msgs, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].message.content, EXPECTED)
        stream = c.chat.completions.create(model="tiny-qwen2-vl", messages=msgs, max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        self.assertEqual("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices), EXPECTED)
        with self.assertRaises(openai.BadRequestError):
            bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
            c.chat.completions.create(model="tiny-qwen2-vl", messages=bad, max_tokens=5)

    def test_anthropic_image_block(self):
        c = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=120)
        r = c.messages.create(model="tiny-qwen2-vl", max_tokens=10, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "text", "text": QUESTION},
        ]}])
        text = r.content[0].text
        self.assertTrue(text and EXPECTED.startswith(text), (text, EXPECTED))


if __name__ == "__main__":
    unittest.main()
