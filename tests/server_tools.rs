//! Tool calls and reasoning through the real server, on the tiny Qwen3 fixture with the real
//! chat templates of the families (Qwen3, Qwen3-Coder, Qwen3.5, GLM-4.6), and on tiny Gemma 4
//! with Gemma 4's template and control tokens (parsers detected from the template).
//!
//! A random tiny model writes no calls of its own, so the parse side is driven by naming the
//! function (`tool_choice`): iris writes the call's opening after the prompt and a grammar
//! holds the rest of the call to the tool's schema, so the reply is a call whatever the model;
//! what comes back is parsed as the model's own call would be. The request side (tool
//! messages and calls rendered through the template) is compared with transformers'
//! rendering.

mod server_support;

use serde_json::{json, Value};
use server_support::{fixture, gemma4_chat_model, model_with_template, Server};

const CITIES: [&str; 2] = ["Paris", "Rome"];

fn tools() -> Value {
    json!([{ "type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": { "type": "object", "properties": { "city": { "type": "string", "enum": CITIES } },
                        "required": ["city"] },
    } }])
}

fn forced(stream: bool) -> Value {
    json!({
        "messages": [{ "role": "user", "content": "Weather in Paris?" }],
        "tools": tools(),
        "tool_choice": { "type": "function", "function": { "name": "get_weather" } },
        "temperature": 0,
        "max_tokens": 64,
        "stream": stream,
    })
}

/// A forced call's arguments: the one required city, from the schema's enum.
fn check_arguments(args: &str) {
    let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let city = v["city"].as_str().unwrap_or_else(|| panic!("no city in {v}"));
    assert!(CITIES.contains(&city) && v.as_object().is_some_and(|o| o.len() == 1), "{v}");
}

/// A chat stream's content, reasoning, calls (id, name, arguments) and finish reason,
/// checking each call's first delta has its id, type and name.
fn assemble(data: &[String]) -> (String, String, Vec<(String, String, String)>, String) {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let (mut content, mut reasoning, mut calls, mut finish) = (String::new(), String::new(), Vec::new(), String::new());
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).expect("chunk");
        for c in v["choices"].as_array().expect("choices") {
            let delta = &c["delta"];
            content.push_str(delta["content"].as_str().unwrap_or_default());
            reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
            for t in delta["tool_calls"].as_array().into_iter().flatten() {
                let i = t["index"].as_u64().expect("index") as usize;
                if i == calls.len() {
                    assert_eq!(t["type"], "function", "{t}");
                    let id = t["id"].as_str().expect("first delta has the id").to_string();
                    let name = t["function"]["name"].as_str().expect("first delta has the name").to_string();
                    calls.push((id, name, String::new()));
                }
                calls[i].2.push_str(t["function"]["arguments"].as_str().unwrap_or_default());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (content, reasoning, calls, finish)
}

#[test]
fn forced_calls_parse_in_each_format_streamed_and_not() {
    for (template, parser_flag) in
        [("Qwen3-Coder.jinja", None), ("GLM-4.6.jinja", None), ("Qwen3.5-4B.jinja", Some("qwen3_xml"))]
    {
        let model = model_with_template("tiny-qwen3", template);
        let mut flags = vec!["--reasoning-parser", "qwen3"];
        if let Some(p) = parser_flag {
            flags.extend(["--tool-call-parser", p]);
        }
        let s = Server::start_path(&model, &flags);
        let r = s.post("/v1/chat/completions", &forced(false));
        assert_eq!(r.status, 200, "{template}: {}", r.text());
        let v = r.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{template}: {v}");
        let msg = &choice["message"];
        assert_eq!(msg["content"], Value::Null, "{template}: {v}");
        let call = &msg["tool_calls"][0];
        assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        let args = call["function"]["arguments"].as_str().expect("arguments");
        check_arguments(args);

        let streamed = s.post("/v1/chat/completions", &forced(true));
        assert_eq!(streamed.status, 200);
        let (content, _, calls, finish) = assemble(&streamed.sse_data());
        assert_eq!(content, "", "{template}: no markup in content");
        assert_eq!(finish, "tool_calls");
        assert_eq!(calls.len(), 1);
        // Greedy: the stream assembles to the same call.
        assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), ("get_weather", args));
        let _ = std::fs::remove_dir_all(&model);
    }
}

#[test]
fn tool_history_renders_as_transformers_renders_it() {
    // /tokenize runs the chat request's conversion and template; its text is the prompt.
    let model = model_with_template("tiny-qwen3", "Qwen-Qwen3-0.6B.jinja");
    let s = Server::start_path(&model, &[]);
    for case in ["round_trip", "parallel", "thinking"] {
        let file = fixture("tool_templates").join(format!("Qwen-Qwen3-0.6B.{case}.json"));
        let f: Value = serde_json::from_str(&std::fs::read_to_string(file).expect("fixture")).expect("json");
        let t = s.post("/tokenize", &json!({ "messages": f["messages"], "tools": f["tools"] }));
        assert_eq!(t.status, 200, "{}", t.text());
        let text = s.post("/detokenize", &json!({ "tokens": t.json()["tokens"] })).json()["prompt"].clone();
        assert_eq!(text, f["expected"], "{case}");
        // The same conversation is accepted by the chat endpoint, streamed and not.
        for stream in [false, true] {
            let body = json!({ "messages": f["messages"], "tools": f["tools"], "max_tokens": 3, "stream": stream });
            let r = s.post("/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{case}: {}", r.text());
        }
    }
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn reasoning_is_split_and_thinking_can_be_switched_off() {
    let model = model_with_template("tiny-qwen3", "Qwen3.5-4B.jinja");
    let s = Server::start_path(&model, &["--reasoning-parser", "qwen3"]);
    let body = |stream: bool, kwargs: Value| {
        json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 6, "temperature": 0,
                "ignore_eos": true, "stream": stream, "chat_template_kwargs": kwargs })
    };
    // The template opens the thinking in the prompt: a reply that never closes it is thinking.
    let v = s.post("/v1/chat/completions", &body(false, json!({}))).json();
    let msg = &v["choices"][0]["message"];
    let reasoning = msg["reasoning_content"].as_str().expect("reasoning_content").to_string();
    assert!(!reasoning.is_empty(), "{v}");
    let (content, streamed_reasoning, _, _) =
        assemble(&s.post("/v1/chat/completions", &body(true, json!({}))).sse_data());
    assert_eq!(streamed_reasoning, reasoning);
    assert_eq!(content, msg["content"].as_str().unwrap_or_default());
    // enable_thinking: false puts an empty thinking in the prompt; the reply is the answer.
    let off = s.post("/v1/chat/completions", &body(false, json!({ "enable_thinking": false }))).json();
    assert_eq!(off["choices"][0]["message"]["reasoning_content"], Value::Null, "{off}");
    // Anthropic: the thinking is a `thinking` block, and `thinking: disabled` switches it off.
    let m = json!({ "max_tokens": 6, "temperature": 0, "messages": [{ "role": "user", "content": "Hi" }] });
    let a = s.post("/v1/messages", &m).json();
    assert_eq!(a["content"][0]["type"], "thinking", "{a}");
    assert_eq!(a["content"][0]["thinking"], json!(reasoning));
    let mut off = m.clone();
    off["thinking"] = json!({ "type": "disabled" });
    let a = s.post("/v1/messages", &off).json();
    assert!(a["content"].as_array().expect("blocks").iter().all(|b| b["type"] != "thinking"), "{a}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn anthropic_tool_use_streamed_and_not() {
    let model = model_with_template("tiny-qwen3", "Qwen3-Coder.jinja");
    let s = Server::start_path(&model, &["--served-model-name", "tiny", "claude-*"]);
    let body = |stream: bool| {
        json!({
            "model": "claude-haiku-4-5",
            "max_tokens": 32,
            "temperature": 0,
            "stream": stream,
            "messages": [{ "role": "user", "content": "Weather in Paris?" }],
            "tools": [{ "name": "get_weather", "input_schema": { "type": "object" }, "cache_control": { "type": "ephemeral" } }],
            "tool_choice": { "type": "tool", "name": "get_weather" },
        })
    };
    let r = s.post("/v1/messages", &body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    // count_tokens counts the prompt the request ran, the forced call's opening included.
    let mut count = body(false);
    for k in ["max_tokens", "temperature", "stream"] {
        count.as_object_mut().expect("object").remove(k);
    }
    let n = s.post("/v1/messages/count_tokens", &count);
    assert_eq!(n.json()["input_tokens"], anthropic_prompt_tokens(&v["usage"]), "{}", n.text());
    assert_eq!(v["model"], "claude-haiku-4-5");
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let block = &v["content"][0];
    assert_eq!(block["type"], "tool_use", "{v}");
    assert!(block["id"].as_str().is_some_and(|id| id.starts_with("toolu_")));
    assert_eq!((block["name"].clone(), block["input"].clone()), (json!("get_weather"), json!({})));

    let events = s.post("/v1/messages", &body(true)).sse();
    let names: Vec<&str> = events.iter().filter_map(|(e, _)| e.as_deref()).collect();
    let start = events.iter().find(|(e, _)| e.as_deref() == Some("content_block_start")).expect("a block");
    let start: Value = serde_json::from_str(&start.1).expect("json");
    assert_eq!(start["content_block"]["type"], "tool_use", "{start}");
    assert_eq!(start["content_block"]["name"], "get_weather");
    assert_eq!(start["content_block"]["input"], json!({}));
    let partial: String = events
        .iter()
        .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
        .filter(|v| v["delta"]["type"] == "input_json_delta")
        .map(|v| v["delta"]["partial_json"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(partial, "{}");
    assert!(names.contains(&"content_block_stop") && names.last() == Some(&"message_stop"), "{names:?}");
    let delta = events.iter().find(|(e, _)| e.as_deref() == Some("message_delta")).expect("message_delta");
    assert_eq!(serde_json::from_str::<Value>(&delta.1).expect("json")["delta"]["stop_reason"], "tool_use");

    // The call and its result go back in the history.
    let history = json!({
        "model": "claude-opus-4-1",
        "max_tokens": 3,
        "messages": [
            { "role": "user", "content": "Weather in Paris?" },
            { "role": "assistant", "content": [
                { "type": "thinking", "thinking": "A tool helps.", "signature": "abc" },
                { "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": { "city": "Paris" } } ] },
            { "role": "user", "content": [
                { "type": "tool_result", "tool_use_id": "toolu_1", "content": "18C", "is_error": false },
                { "type": "text", "text": "And tomorrow?", "cache_control": { "type": "ephemeral" } } ] },
        ],
        "tools": [{ "name": "get_weather", "input_schema": { "type": "object" } }],
    });
    let r = s.post("/v1/messages", &history);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut count = history.clone();
    count.as_object_mut().expect("object").remove("max_tokens");
    let n = s.post("/v1/messages/count_tokens", &count);
    assert_eq!(n.json()["input_tokens"], anthropic_prompt_tokens(&r.json()["usage"]));
    // Names that match no alias are still a 404.
    let mut other = history.clone();
    other["model"] = json!("gpt-4o");
    assert_eq!(s.post("/v1/messages", &other).status, 404);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn what_iris_does_not_implement_is_a_400_naming_it() {
    // tiny-llama's template shows no tool format.
    let s = Server::start(&[]);
    let msgs = json!([{ "role": "user", "content": "hi" }]);
    let cases = [
        (json!({ "messages": msgs, "tools": tools() }), "tools"),
        (
            json!({ "messages": msgs, "response_format": { "type": "json_schema", "json_schema": {} } }),
            "response_format.json_schema.schema",
        ),
        (json!({ "messages": msgs, "guided_json": { "type": "objekt" } }), "guided_json"),
        (json!({ "messages": msgs, "functions": [] }), "functions"),
        (json!({ "messages": msgs, "tool_choice": "required" }), "tool_choice"),
        (
            json!({ "messages": msgs, "tools": tools(), "tool_choice": { "type": "function", "function": { "name": "nope" } } }),
            "tool_choice",
        ),
        (json!({ "messages": [{ "role": "tool", "content": "x" }] }), "messages[0].tool_call_id"),
        (json!({ "messages": msgs, "modalities": ["audio"] }), "modalities"),
    ];
    for (body, param) in cases {
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{e}");
        assert!(
            e["error"]["message"].as_str().expect("message").contains(param.split('[').next().expect("name")),
            "{e}"
        );
    }
    // Accepted and ignored fields change nothing.
    let ok = json!({ "messages": msgs, "max_tokens": 2, "user": "u1", "metadata": { "k": "v" }, "store": false,
                     "response_format": { "type": "text" } });
    assert_eq!(s.post("/v1/chat/completions", &ok).status, 200);
    let r = s.post("/v1/completions", &json!({ "prompt": "a", "max_tokens": 2, "best_of": 2 }));
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("best_of")));
    // Anthropic: its error shape, naming the field.
    let m = json!({ "max_tokens": 2, "messages": msgs, "metadata": { "user_id": "u" } });
    assert_eq!(s.post("/v1/messages", &m).status, 200);
    let mut bad = m.clone();
    bad["mcp_servers"] = json!([]);
    let r = s.post("/v1/messages", &bad);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    assert!(r.text().contains("mcp_servers"), "{}", r.text());
    let mut server_tool = m.clone();
    server_tool["tools"] = json!([{ "type": "web_search_20250305", "name": "web_search" }]);
    assert_eq!(s.post("/v1/messages", &server_tool).status, 400);
}

/// An Anthropic reply's whole prompt: computed (`input_tokens`) and read from the prefix cache.
fn anthropic_prompt_tokens(usage: &Value) -> Value {
    json!(usage["input_tokens"].as_u64().unwrap_or(0) + usage["cache_read_input_tokens"].as_u64().unwrap_or(0))
}

/// A chat request for Gemma 4 asking for `choice` with the weather tool.
fn gemma4_forced(choice: Value, stream: bool) -> Value {
    let mut body = forced(stream);
    body["tool_choice"] = choice;
    // One call: a required call may otherwise be followed by more until max_tokens.
    body["parallel_tool_calls"] = json!(false);
    body
}

#[test]
fn gemma4_forced_calls_parse_in_both_apis_streamed_and_not() {
    let model = gemma4_chat_model();
    // No parser flags: both formats are read from Gemma 4's template.
    let s = Server::start_path(&model, &[]);
    let named = json!({ "type": "function", "function": { "name": "get_weather" } });
    for choice in [named, json!("required")] {
        let r = s.post("/v1/chat/completions", &gemma4_forced(choice.clone(), false));
        assert_eq!(r.status, 200, "{choice}: {}", r.text());
        let v = r.json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{choice}: {v}");
        assert_eq!(c["message"]["content"], Value::Null, "{v}");
        assert_eq!(c["message"]["reasoning_content"], Value::Null, "{v}");
        let call = &c["message"]["tool_calls"][0];
        assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
        assert_eq!(call["function"]["name"], "get_weather");
        let args = call["function"]["arguments"].as_str().expect("arguments");
        check_arguments(args);
        let streamed = s.post("/v1/chat/completions", &gemma4_forced(choice.clone(), true));
        assert_eq!(streamed.status, 200);
        let (content, reasoning, calls, finish) = assemble(&streamed.sse_data());
        assert_eq!((content.as_str(), reasoning.as_str(), finish.as_str()), ("", "", "tool_calls"), "{choice}");
        assert_eq!(calls.len(), 1);
        assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), ("get_weather", args), "{choice}: greedy, same call");
    }

    // Anthropic: a tool_use block, streamed as input_json_delta pieces of the same input.
    let body = |stream: bool| {
        json!({
            "max_tokens": 64, "temperature": 0, "stream": stream,
            "messages": [{ "role": "user", "content": "Weather in Paris?" }],
            "tools": [{ "name": "get_weather", "input_schema": tools()[0]["function"]["parameters"] }],
            "tool_choice": { "type": "tool", "name": "get_weather" },
        })
    };
    let v = s.post("/v1/messages", &body(false)).json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let block = &v["content"][0];
    assert_eq!((block["type"].clone(), block["name"].clone()), (json!("tool_use"), json!("get_weather")), "{v}");
    assert!(block["id"].as_str().is_some_and(|id| id.starts_with("toolu_")));
    check_arguments(&block["input"].to_string());
    let events = s.post("/v1/messages", &body(true)).sse();
    let partial: String = events
        .iter()
        .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
        .filter(|v| v["delta"]["type"] == "input_json_delta")
        .map(|v| v["delta"]["partial_json"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&partial).expect("streamed input"), block["input"]);
    let delta = events.iter().find(|(e, _)| e.as_deref() == Some("message_delta")).expect("message_delta");
    assert_eq!(serde_json::from_str::<Value>(&delta.1).expect("json")["delta"]["stop_reason"], "tool_use");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn gemma4_thinking_is_split_and_replies_stop_at_tool_response() {
    let model = gemma4_chat_model();
    let s = Server::start_path(&model, &[]);
    // A random model opens no thought channel of its own: a grammar makes it write one in
    // Gemma 4's tokens (948 `<|channel>`, 949 `<channel|>`), thinking on as the template has it.
    let grammar = "start: <[948]> \"thought\\n\" /[a-z]{2,6}( [a-z]{2,6}){0,3}/ <[949]> /[a-z]{2,6}( [a-z]{2,6}){0,3}/";
    let body = |stream: bool| {
        json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 40, "temperature": 0,
                "stream": stream, "guided_grammar": grammar, "chat_template_kwargs": { "enable_thinking": true } })
    };
    let r = s.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let msg = &v["choices"][0]["message"];
    let reasoning = msg["reasoning_content"].as_str().expect("reasoning_content").to_string();
    let content = msg["content"].as_str().expect("content").to_string();
    let word = |t: &str| !t.is_empty() && t.split(' ').all(|w| (2..=6).contains(&w.len()));
    assert!(word(&reasoning) && word(&content), "no markers left in either: {v}");
    let (streamed, streamed_reasoning, calls, _) = assemble(&s.post("/v1/chat/completions", &body(true)).sse_data());
    assert_eq!((streamed, streamed_reasoning, calls.len()), (content, reasoning, 0));

    // The template's turn after a call goes on with `<|tool_response>` (954): a reply ends
    // there (the model's EOS ids do not list it), while another control token (950) does not
    // end it.
    let biased = |token: &str| json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 5, "logit_bias": { token: 100 } });
    let v = s.post("/v1/chat/completions", &biased("954")).json();
    assert_eq!(
        (v["choices"][0]["finish_reason"].clone(), v["usage"]["completion_tokens"].clone()),
        (json!("stop"), json!(1)),
        "{v}"
    );
    assert_eq!(v["choices"][0]["message"]["content"], "", "{v}");
    // It ends a turn as EOS does: `ignore_eos` goes past it.
    let mut past = biased("954");
    past["ignore_eos"] = json!(true);
    let v = s.post("/v1/chat/completions", &past).json();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    let v = s.post("/v1/chat/completions", &biased("950")).json();
    assert_eq!(
        (v["choices"][0]["finish_reason"].clone(), v["usage"]["completion_tokens"].clone()),
        (json!("length"), json!(5)),
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn gemma4_thinking_the_prompt_opened_is_a_thinking_block() {
    // Gemma 4's template with the thought channel opened in the prompt when thinking is on
    // (the real one leaves that to the model; with thinking off the prompt is the same): a
    // random model's reply is then thought, which both APIs return as such.
    let model = gemma4_chat_model();
    let file = model.join("chat_template.jinja");
    let real = std::fs::read_to_string(&file).expect("template");
    let off = "{%- if not enable_thinking | default(false) -%}\n            {{- '<|channel>thought\\n<channel|>' -}}";
    assert!(real.contains(off), "the real template's empty thought channel");
    let opened = "{{- '<|channel>thought\\n' -}}{%- if not enable_thinking | default(false) -%}{{- '<channel|>' -}}";
    std::fs::write(&file, real.replace(off, opened)).expect("write");
    let s = Server::start_path(&model, &[]);
    let body = |stream: bool| {
        json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 6, "temperature": 0,
                "ignore_eos": true, "stream": stream, "chat_template_kwargs": { "enable_thinking": true } })
    };
    let v = s.post("/v1/chat/completions", &body(false)).json();
    let reasoning = v["choices"][0]["message"]["reasoning_content"].as_str().expect("reasoning").to_string();
    assert!(!reasoning.is_empty() && !reasoning.contains("<|channel>"), "{v}");
    let (content, streamed, _, _) = assemble(&s.post("/v1/chat/completions", &body(true)).sse_data());
    assert_eq!(streamed, reasoning);
    assert_eq!(content, v["choices"][0]["message"]["content"].as_str().unwrap_or_default());
    let m = json!({ "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                    "thinking": { "type": "enabled", "budget_tokens": 1024 },
                    "messages": [{ "role": "user", "content": "Hi" }] });
    let a = s.post("/v1/messages", &m).json();
    assert_eq!(
        (a["content"][0]["type"].clone(), a["content"][0]["thinking"].clone()),
        (json!("thinking"), json!(reasoning)),
        "{a}"
    );
    let mut off = m.clone();
    off["thinking"] = json!({ "type": "disabled" });
    let a = s.post("/v1/messages", &off).json();
    assert!(a["content"].as_array().expect("blocks").iter().all(|b| b["type"] != "thinking"), "{a}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn gemma4_history_renders_as_transformers_and_bad_input_is_a_400() {
    let model = gemma4_chat_model();
    let s = Server::start_path(&model, &[]);
    let file = fixture("gemma4_template").join("cases.json");
    let f: Value = serde_json::from_str(&std::fs::read_to_string(file).expect("fixture")).expect("json");
    let cases = f["cases"].as_array().expect("cases");
    for name in ["tools_round_trip", "tools_parallel", "tools_thinking_call", "history_thinking"] {
        let name = format!("google-gemma-4-31B-it.{name}");
        let case = cases.iter().find(|c| c["name"] == name.as_str()).expect("case");
        let body =
            json!({ "messages": case["messages"], "tools": case["tools"], "chat_template_kwargs": case["kwargs"] });
        let t = s.post("/tokenize", &body);
        assert_eq!(t.status, 200, "{name}: {}", t.text());
        assert_eq!(t.json()["tokens"], case["ids"], "{name}: transformers' ids");
        let mut chat = body.clone();
        chat["max_tokens"] = json!(3);
        assert_eq!(s.post("/v1/chat/completions", &chat).status, 200, "{name}");
    }
    // Anthropic: a thinking block, a call and its result go back in the history.
    let history = json!({
        "max_tokens": 3,
        "thinking": { "type": "enabled", "budget_tokens": 1024 },
        "messages": [
            { "role": "user", "content": "Weather in Paris?" },
            { "role": "assistant", "content": [
                { "type": "thinking", "thinking": "A tool helps.", "signature": "abc" },
                { "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": { "city": "Paris" } } ] },
            { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": "toolu_1", "content": "18C" }] },
        ],
        "tools": [{ "name": "get_weather", "input_schema": { "type": "object" } }],
    });
    let r = s.post("/v1/messages", &history);
    assert_eq!(r.status, 200, "{}", r.text());

    let msgs = json!([{ "role": "user", "content": "hi" }]);
    for (body, param) in [
        (
            json!({ "messages": msgs, "tools": tools(), "tool_choice": { "type": "function", "function": { "name": "nope" } } }),
            "tool_choice",
        ),
        (
            json!({ "messages": msgs, "tools": [{ "type": "function", "function": { "name": "f", "parameters": 3 } }] }),
            "tools[0].function.parameters",
        ),
        (json!({ "messages": msgs, "guided_grammar": "start: <[948] \"x\"" }), "guided_grammar"),
        (json!({ "messages": msgs, "tool_choice": "required" }), "tool_choice"),
    ] {
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.text());
    }
    let mut bad = history.clone();
    bad["tool_choice"] = json!({ "type": "tool", "name": "nope" });
    let r = s.post("/v1/messages", &bad);
    assert_eq!((r.status, r.json()["type"].clone()), (400, json!("error")), "{}", r.text());
    let _ = std::fs::remove_dir_all(&model);
}

/// Structured outputs with thinking on: Gemma 4's prompt does not open the thought channel, so
/// a reply may open it with its first token (`<|channel>`, 948) and think before its JSON; the
/// schema then holds from `<channel|>` on. A reply pushed to open it does (its first token is
/// not the schema's), and one that does not answers in the schema from its first token.
#[test]
fn gemma4_structured_replies_may_think_first() {
    let model = gemma4_chat_model();
    let s = Server::start_path(&model, &[]);
    let schema = json!({ "type": "object", "properties": { "a": { "type": "integer" } }, "required": ["a"] });
    let body = |bias: Value| {
        json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 12, "temperature": 0,
                "response_format": { "type": "json_schema", "json_schema": { "name": "x", "schema": schema } },
                "chat_template_kwargs": { "enable_thinking": true }, "logit_bias": bias })
    };
    let plain = s.post("/v1/chat/completions", &body(json!({}))).json();
    let answer = plain["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    assert!(answer.starts_with('{'), "the schema holds from the first token: {plain}");
    assert_eq!(plain["choices"][0]["message"]["reasoning_content"], Value::Null, "{plain}");
    // Pushed to open the channel (the bias holds on every token, so it never closes it): the
    // whole reply is inside the thinking, free of the schema.
    let open = s.post("/v1/chat/completions", &body(json!({ "948": 100 }))).json();
    let msg = &open["choices"][0]["message"];
    assert_eq!(open["usage"]["completion_tokens"], 12, "{open}");
    assert!(!msg["content"].as_str().unwrap_or_default().starts_with('{'), "the reply opened its thinking: {open}");
    let _ = std::fs::remove_dir_all(&model);
}
