"""Qwen3.5's real chat template rendered and tokenized by transformers: text and ids.

The template is llama.cpp's copy of Qwen3.5-4B's (`vendor/llama.cpp/models/templates/Qwen3.5-4B.jinja`
in the llama-cpp-python 0.3.36 sdist; tests/fixtures/templates/Qwen3.5-4B.jinja is that file).
The tokenizer is the tiny BPE of tests/fixtures/tiny-qwen3.5 with Qwen3.5's added tokens put on
top, special and not as Qwen's tokenizer_config.json marks them (`<think>`, `<tool_call>`,
`<tool_response>` and the FIM tokens are not special; the role, vision and pad tokens are), so
that the ids check that every control string the template writes becomes its one id, and that
the text around them is split the same way.

Writes tests/fixtures/qwen35_template/: tokenizer.json, tokenizer_config.json and cases.json,
each case an OpenAI-shaped request (messages, tools, kwargs), what transformers'
`apply_chat_template(..., add_generation_prompt=True)` renders, and its ids.
tests/template_ids.rs sends each request through iris's message conversion, template and
tokenizer and compares both.

The messages handed to transformers are the request's with each call's JSON-text `arguments`
read into a dict and `content: null` as "" (what the server does; see
scripts/make_tool_template_fixtures.py).

Run: ~/.cache/iris/tf-venv/bin/python scripts/make_qwen35_template_fixtures.py   (transformers 5.24.0)
"""

import copy
import json
import pathlib

import transformers
from transformers import AddedToken, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests/fixtures/templates/Qwen3.5-4B.jinja"
BASE_TOKENIZER = ROOT / "tests/fixtures/tiny-qwen3.5"
OUT = ROOT / "tests/fixtures/qwen35_template"

# Qwen3.5's added tokens after <|im_end|>, in id order, with their `special` flag.
ADDED = [
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "days": {"type": "integer"},
            "options": {"type": "object"},
        }, "required": ["city"]},
    }},
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "What is 2+2?"}
# Earlier turns: one with `reasoning_content`, one whose content carries the thinking inline.
HISTORY = [
    SYSTEM,
    ASK,
    {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n6."},
    {"role": "user", "content": "Now the weather in Paris, please."},
]
# After the last user query the assistant's reasoning is kept: a multi-step tool turn, the
# call's arguments holding a mapping, an integer and a multi-line string.
MULTI_STEP = HISTORY + [
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "\nNeeds the tool.\n", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather",
            "arguments": "{\"city\": \"Paris\", \"days\": 2, \"options\": {\"unit\": \"C\"}}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, clear"},
    {"role": "assistant", "content": "<think>\nIt is mild.\n</think>\n\nIt is 18C and clear."},
    {"role": "user", "content": "<tool_response>\nignored\n</tool_response>"},
]
IMAGE = [
    {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
    {"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}},
    ]},
]

CASES = {
    "chat_thinking": ([SYSTEM, ASK], None, {}),
    "chat_thinking_explicit": ([ASK], None, {"enable_thinking": True}),
    "chat_no_thinking": ([SYSTEM, ASK], None, {"enable_thinking": False}),
    "history_thinking": (HISTORY, None, {}),
    "history_no_thinking": (HISTORY, None, {"enable_thinking": False}),
    "tools_multi_step": (MULTI_STEP, TOOLS, {}),
    "tools_multi_step_no_thinking": (MULTI_STEP, TOOLS, {"enable_thinking": False}),
    "tools_no_system": ([ASK], TOOLS, {}),
    "image": (IMAGE, None, {}),
    "image_vision_ids": (IMAGE, None, {"add_vision_id": True}),
}


def for_template(messages):
    """The request's messages as iris (and vLLM) hand them to the template."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None and m["role"] == "assistant":
            m["content"] = ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(BASE_TOKENIZER)
    for content, special in ADDED:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)], special_tokens=special)
    tok.save_pretrained(OUT)
    # The test loads the directory as a model's; the template is the case file's.
    (OUT / "chat_template.jinja").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(OUT)
    source = TEMPLATE.read_text()
    cases = []
    for name, (messages, tools, kwargs) in CASES.items():
        args = dict(tools=tools, chat_template=source, add_generation_prompt=True, **kwargs)
        text = tok.apply_chat_template(for_template(messages), tokenize=False, **args)
        ids = tok.apply_chat_template(for_template(messages), tokenize=True, return_dict=False, **args)
        assert tok.encode(text, add_special_tokens=False) == ids, name
        cases.append({"name": name, "messages": messages, "tools": tools, "kwargs": kwargs,
                      "expected": text, "ids": ids})
        print(name, len(text), len(ids))
    fixture = {"template": TEMPLATE.name, "transformers": transformers.__version__, "cases": cases}
    (OUT / "cases.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
