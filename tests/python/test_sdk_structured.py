"""Structured outputs through the official OpenAI SDK: for 100 seeds at temperature 1 a random
tiny model's every reply parses and validates (the `jsonschema` package) against a schema with
nesting, enums, arrays, required fields, numbers with bounds and string patterns; through chat
`response_format` and the Responses API's `text.format`.

Run by tests/server_sdk.rs twice, on the tiny llama fixture: plain, and with n-gram speculation
on (IRIS_EXPECT_SPECULATION=1: the server's /metrics must then show drafts verified).
"""

import concurrent.futures
import json
import os
import re
import unittest
import urllib.request

import jsonschema
import openai

BASE = os.environ["IRIS_BASE_URL"]
KEY = os.environ["IRIS_API_KEY"]
MODEL = os.environ["IRIS_MODEL"]
SPECULATION = os.environ.get("IRIS_EXPECT_SPECULATION") == "1"

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 300},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "kind": {"enum": ["cat", "dog", 7]},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "ok": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                           "code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["n"], "additionalProperties": False},
        },
    },
    "required": ["id", "score", "kind", "name", "ok", "owner", "items"],
    "additionalProperties": False,
}
SEEDS = range(100)
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]


def oai():
    return openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=300)


def drafts_verified():
    req = urllib.request.Request(BASE + "/metrics", headers={"Authorization": "Bearer " + KEY})
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    m = re.search(r"^iris_spec_decode_num_draft_tokens_total (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


class StructuredOutputs(unittest.TestCase):
    def check_all(self, reply_of):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(reply_of, SEEDS))
        for seed, (text, finish) in zip(SEEDS, replies):
            self.assertEqual(finish, "stop", (seed, text))
            jsonschema.validate(json.loads(text), SCHEMA)

    def test_chat_replies_validate_for_100_seeds(self):
        before = drafts_verified()
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}

        def reply(seed):
            r = oai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=400, temperature=1.0,
                                              seed=seed, response_format=fmt)
            return r.choices[0].message.content, r.choices[0].finish_reason

        self.check_all(reply)
        # Speculation really ran (its drafts were verified), or really did not.
        self.assertEqual(drafts_verified() > before, SPECULATION)

    def test_responses_text_format_validates(self):
        fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}

        def reply(seed):
            r = oai().responses.create(model=MODEL, input="Describe a pet as JSON.", max_output_tokens=400,
                                       temperature=1.0, text={"format": fmt}, extra_body={"seed": seed})
            return r.output_text, "stop" if r.status == "completed" else r.status

        self.check_all(reply)


if __name__ == "__main__":
    unittest.main()
