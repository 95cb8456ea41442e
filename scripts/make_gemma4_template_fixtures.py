"""Gemma 4's real chat template rendered and tokenized by transformers: text and ids.

The templates are llama.cpp's copies of Gemma 4's (`vendor/llama.cpp/models/templates/
google-gemma-4-31B-it.jinja` and its `-interleaved` variant in the llama-cpp-python 0.3.36
sdist; tests/fixtures/templates/ holds them unchanged).

The tokenizer is tiny-gemma4's (tests/fixtures/tiny-gemma4) with Gemma 4's control tokens put
in the unused ids of its vocabulary (all below the model's 1024 rows, so the same tokenizer
serves a tiny Gemma 4 in the server tests), each a special added token as in Gemma 4's own
tokenizer: the turn, thinking, channel, tool, call, response and string-quote tokens. The ids
then check that every control string the template writes becomes its one id, and that the text
around them is split the same way.

Writes tests/fixtures/gemma4_template/: tokenizer.json, tokenizer_config.json and cases.json,
each case an OpenAI-shaped request (messages, tools, kwargs), the template it renders through,
what transformers' `apply_chat_template(..., add_generation_prompt=True)` renders, and its ids.
tests/template_ids.rs sends each request through iris's message conversion, template and
tokenizer and compares both.

The messages handed to transformers are the request's as the server hands them to the
template: each call's JSON-text `arguments` read into a dict, `content: null` as "", and an
`image_url` part as `{"type": "image"}` (transformers' processors' convention, which the
template tests for).

Run: /work/venv-torch/bin/python scripts/make_gemma4_template_fixtures.py   (transformers 5.24.0)
"""

import copy
import json
import pathlib

import transformers
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests/fixtures/templates"
BASE_TOKENIZER = ROOT / "tests/fixtures/tiny-gemma4"
OUT = ROOT / "tests/fixtures/gemma4_template"

# Gemma 4's control tokens (special in its tokenizer: llama.cpp's converter has to mark the
# channel, call, response and quote tokens visible for its parser to see them).
CONTROL = [
    "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
    "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "description": "How many days"},
            "hourly": {"type": "boolean"},
            "hours": {"type": "array", "items": {"type": "integer"}},
            "where": {"type": "object", "properties": {
                "lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat"]},
            "note": {"type": "string", "nullable": True},
        }, "required": ["city"]},
    }},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    }},
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
HISTORY = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    # An earlier answer's reasoning is dropped. (A thinking written inline in its content,
    # `<|channel>thought\n...<channel|>`, the template would strip, but iris tokenizes the
    # control strings in content as text, never as the control tokens: role injection.)
    {"role": "assistant", "reasoning_content": "Simple.", "content": "4."},
    {"role": "user", "content": "  And 3+3?  "},
]
CALL = {"id": "call_1", "type": "function", "function": {
    "name": "get_weather",
    "arguments": json.dumps({"city": "Paris", "days": 2, "hourly": True, "hours": [9, 12],
                             "where": {"lat": 48.85, "lon": 2.35}, "note": "line one\nline two"}),
}}
ROUND_TRIP = [SYSTEM, ASK,
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18, \"sky\": \"clear\"}"}]
PARALLEL = [SYSTEM, ASK,
            {"role": "assistant", "content": "Let me look that up.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"note\": null}"}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "search", "arguments": "{\"query\": \"Paris events\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "A fair."}]},
            {"role": "assistant", "content": "It is 18C, and there is a fair."},
            {"role": "user", "content": "Thanks!"}]
# After the last user turn a call's reasoning is kept.
THINKING_CALL = [ASK,
                 {"role": "assistant", "content": None, "reasoning_content": "The user wants the weather.",
                  "tool_calls": [{"id": "call_1", "type": "function",
                                  "function": {"name": "search", "arguments": "{\"query\": \"weather\"}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]
# (A system message of parts renders as Python's repr of the list: the template reads it as a
# string.)
IMAGE = [
    {"role": "system", "content": "Describe images."},
    {"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}},
    ]},
]

MAIN = "google-gemma-4-31B-it.jinja"
INTERLEAVED = "google-gemma-4-31B-it-interleaved.jinja"
CASES = {
    "plain": ([{"role": "user", "content": "Hi"}], None, {}),
    "system": ([SYSTEM, ASK], None, {}),
    "thinking": ([SYSTEM, ASK], None, {"enable_thinking": True}),
    "history": (HISTORY, None, {}),
    "history_thinking": (HISTORY, None, {"enable_thinking": True}),
    "tools_first_turn": ([SYSTEM, ASK], TOOLS, {}),
    "tools_no_system_thinking": ([ASK], TOOLS, {"enable_thinking": True}),
    "tools_round_trip": (ROUND_TRIP, TOOLS, {}),
    "tools_parallel": (PARALLEL, TOOLS, {}),
    "tools_thinking_call": (THINKING_CALL, TOOLS, {"enable_thinking": True}),
    "image": (IMAGE, None, {}),
}


def for_template(messages):
    """The request's messages as iris hands them to the template."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None and m["role"] == "assistant":
            m["content"] = ""
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def make_tokenizer():
    """tiny-gemma4's tokenizer with Gemma 4's control tokens in its free ids."""
    tok = json.loads((BASE_TOKENIZER / "tokenizer.json").read_text())
    used = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    free = [i for i in range(1024) if i not in used]
    assert len(free) >= len(CONTROL), free
    for content, i in zip(CONTROL, free):
        tok["model"]["vocab"][content] = i
        tok["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    tok["added_tokens"].sort(key=lambda t: t["id"])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tokenizer.json").write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    config = json.loads((BASE_TOKENIZER / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = sorted(set(config.get("extra_special_tokens", [])) | set(CONTROL))
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main():
    make_tokenizer()
    tok = AutoTokenizer.from_pretrained(OUT)
    for c in CONTROL:
        assert len(tok.encode(c, add_special_tokens=False)) == 1, c
    cases = []
    for template in [MAIN, INTERLEAVED]:
        source = (TEMPLATES / template).read_text()
        for name, (messages, tools, kwargs) in CASES.items():
            args = dict(tools=tools, chat_template=source, add_generation_prompt=True, **kwargs)
            text = tok.apply_chat_template(for_template(messages), tokenize=False, **args)
            ids = tok.apply_chat_template(for_template(messages), tokenize=True, return_dict=False, **args)
            assert tok.encode(text, add_special_tokens=False) == ids, name
            cases.append({"name": f"{template.removesuffix('.jinja')}.{name}", "template": template,
                          "messages": messages, "tools": tools, "kwargs": kwargs, "expected": text, "ids": ids})
            print(template, name, len(text), len(ids))
    fixture = {"transformers": transformers.__version__, "cases": cases}
    (OUT / "cases.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
