"""Expected renderings of tool conversations through real chat templates, by transformers.

For each template in tests/fixtures/templates/ and each conversation below, renders what
transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)`
renders (its `render_jinja_template`, the same jinja2 environment) and writes
tests/fixtures/tool_templates/<template>.<case>.json: the OpenAI-shaped request (assistant
`tool_calls` with `function.arguments` as the JSON text clients send), the kwargs, and the
expected text. tests/tool_templates.rs sends the request through iris's message conversion and
its template renderer and compares.

The messages handed to the template are the request's with each call's `arguments` read from
JSON into a dict (what vLLM does before rendering, and what the Qwen3-Coder, Qwen3.5, GLM and
Llama templates need: they iterate the arguments as a mapping), and `content: null` as "".

Run: python scripts/make_tool_template_fixtures.py   (transformers 5.24.0, jinja2)
"""

import copy
import json
import pathlib

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests/fixtures/templates"
OUT = ROOT / "tests/fixtures/tool_templates"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        }, "required": ["city"]},
    }},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    }},
]

FIRST_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]

ROUND_TRIP = FIRST_TURN + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18, \"sky\": \"clear\"}"},
]

PARALLEL = FIRST_TURN + [
    {"role": "assistant", "content": "Let me look that up.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "call_2", "type": "function",
         "function": {"name": "search", "arguments": "{\"query\": \"Paris events\"}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "A fair."},
]

THINKING = FIRST_TURN + [
    {"role": "assistant", "content": None, "reasoning_content": "The user wants the weather.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]

CASES = {
    "first_turn": (FIRST_TURN, {}),
    "round_trip": (ROUND_TRIP, {}),
    "parallel": (PARALLEL, {}),
    "thinking": (THINKING, {}),
    "no_thinking": (ROUND_TRIP, {"enable_thinking": False}),
}

# Per template: the special tokens it reads, and the cases it can render (Llama 3.1's
# template takes one call per message).
TEMPLATE_CASES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ({}, ["first_turn", "round_trip", "parallel"]),
    "Qwen-Qwen3-0.6B.jinja": ({}, ["first_turn", "round_trip", "parallel", "thinking", "no_thinking"]),
    "Qwen3-Coder.jinja": ({}, ["first_turn", "round_trip", "parallel"]),
    "Qwen3.5-4B.jinja": ({}, ["first_turn", "round_trip", "parallel", "thinking", "no_thinking"]),
    "GLM-4.6.jinja": ({}, ["first_turn", "round_trip", "parallel", "thinking", "no_thinking"]),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ({"bos_token": "<|begin_of_text|>"}, ["first_turn", "round_trip"]),
}


def for_template(messages):
    """The request's messages as iris (and vLLM) hand them to the template."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None and m["role"] == "assistant":
            m["content"] = ""
        for c in m.get("tool_calls") or []:
            try:
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
            except json.JSONDecodeError:
                pass
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (specials, cases) in TEMPLATE_CASES.items():
        source = (TEMPLATES / name).read_text()
        for case in cases:
            messages, kwargs = CASES[case]
            rendered, _ = render_jinja_template(
                conversations=[for_template(messages)],
                tools=TOOLS,
                chat_template=source,
                add_generation_prompt=True,
                **specials,
                **kwargs,
            )
            fixture = {
                "template": name,
                "messages": messages,
                "tools": TOOLS,
                "kwargs": kwargs,
                "special_tokens": specials,
                "expected": rendered[0],
                "transformers": transformers.__version__,
            }
            (OUT / f"{name.removesuffix('.jinja')}.{case}.json").write_text(
                json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
            print(name, case, len(rendered[0]))


if __name__ == "__main__":
    main()
