//! The Responses API (`/v1/responses`) through the real server: string and item input,
//! instructions, the stored conversation (`previous_response_id`, GET, DELETE, eviction),
//! a tool round trip, the stream's events, and the fields it refuses.
//!
//! What the model saw is checked exactly: `usage.input_tokens` of a response against
//! `/tokenize` of the chat conversation it must have been rendered from.

mod server_support;

use std::time::Duration;

use serde_json::{json, Value};
use server_support::{eventually, model_with_template, request, OpenStream, Server};

fn tokens(s: &Server, messages: Value, tools: Option<Value>) -> u64 {
    let mut body = json!({ "messages": messages });
    if let Some(t) = tools {
        body["tools"] = t;
    }
    let r = s.post("/tokenize", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["count"].as_u64().expect("count")
}

fn create(s: &Server, body: &Value) -> Value {
    let r = s.post("/v1/responses", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

/// The text of a response's message items.
fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().expect("content").iter())
        .map(|c| c["text"].as_str().expect("text").to_string())
        .collect()
}

fn error_param(s: &Server, body: &Value) -> (u16, Value) {
    let r = s.post("/v1/responses", body);
    let param = if r.status == 200 { Value::Null } else { r.json()["error"]["param"].clone() };
    (r.status, param)
}

#[test]
fn string_and_item_input_and_instructions() {
    let s = Server::start(&["--served-model-name", "tiny"]);
    let r = create(&s, &json!({ "model": "tiny", "input": "Hi", "max_output_tokens": 4, "temperature": 0 }));
    assert!(r["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{r}");
    assert_eq!((r["object"].as_str(), r["model"].as_str()), (Some("response"), Some("tiny")));
    assert!(r["created_at"].as_u64().is_some());
    // Four tokens of a random model: cut by max_output_tokens.
    assert_eq!(r["status"], "incomplete", "{r}");
    assert_eq!(r["incomplete_details"], json!({ "reason": "max_output_tokens" }));
    let msg = &r["output"][0];
    assert_eq!((msg["type"].as_str(), msg["role"].as_str()), (Some("message"), Some("assistant")));
    assert!(msg["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(msg["content"][0]["type"], "output_text");
    let u = &r["usage"];
    assert_eq!(u["output_tokens"], 4);
    assert_eq!(u["input_tokens"], tokens(&s, json!([{ "role": "user", "content": "Hi" }]), None));
    assert_eq!(u["total_tokens"].as_u64(), Some(u["input_tokens"].as_u64().unwrap_or(0) + 4));
    // The same answer as the chat endpoint gives for the same conversation.
    let chat = s.post(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 4, "temperature": 0 }),
    );
    assert_eq!(output_text(&r), chat.json()["choices"][0]["message"]["content"].as_str().expect("content"));

    // Items: a developer message and a user message of parts; instructions go first.
    let items = json!([
        { "role": "developer", "content": "Answer in French." },
        { "type": "message", "role": "user", "content": [
            { "type": "input_text", "text": "Hello" }, { "type": "input_text", "text": "there" } ] },
    ]);
    let r = create(
        &s,
        &json!({ "input": items, "instructions": "Be brief.", "max_output_tokens": 2, "temperature": 0,
                 "metadata": { "k": "v" }, "user": "u1", "store": false }),
    );
    let expected = json!([
        { "role": "system", "content": "Be brief." },
        { "role": "system", "content": "Answer in French." },
        { "role": "user", "content": "Hello\nthere" },
    ]);
    assert_eq!(r["usage"]["input_tokens"], tokens(&s, expected, None), "{r}");
    assert_eq!(
        (r["instructions"].as_str(), r["metadata"].clone(), r["user"].as_str()),
        (Some("Be brief."), json!({ "k": "v" }), Some("u1"))
    );
    assert_eq!(r["store"], false);
    // store: false: nothing to get back.
    let id = r["id"].as_str().expect("id");
    assert_eq!(s.get(&format!("/v1/responses/{id}")).status, 404);
}

#[test]
fn previous_response_id_continues_the_stored_conversation() {
    let s = Server::start(&[]);
    let first =
        create(&s, &json!({ "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 3, "temperature": 0 }));
    let id = first["id"].as_str().expect("id");
    let answer = output_text(&first);
    // GET returns what create returned.
    let got = s.get(&format!("/v1/responses/{id}"));
    assert_eq!(got.status, 200);
    assert_eq!(got.json(), first);
    let second = create(
        &s,
        &json!({ "input": [{ "role": "user", "content": "And then?" }], "previous_response_id": id,
                 "max_output_tokens": 3, "temperature": 0 }),
    );
    assert_eq!(second["previous_response_id"], id);
    // The history without the first request's instructions (OpenAI does not carry them over).
    let history = json!([
        { "role": "user", "content": "Hi" },
        { "role": "assistant", "content": answer },
        { "role": "user", "content": "And then?" },
    ]);
    assert_eq!(second["usage"]["input_tokens"], tokens(&s, history.clone(), None), "{second}");
    // A chain of three: the second's own history continues.
    let third = create(
        &s,
        &json!({ "input": "Last.", "previous_response_id": second["id"], "max_output_tokens": 2, "temperature": 0, "stream": false }),
    );
    let mut longer = history.as_array().expect("list").clone();
    longer.push(json!({ "role": "assistant", "content": output_text(&second) }));
    longer.push(json!({ "role": "user", "content": "Last." }));
    assert_eq!(third["usage"]["input_tokens"], tokens(&s, Value::Array(longer), None));

    // DELETE, then the id is unknown everywhere; unknown ids are a 404 in OpenAI's shape.
    let d = request(&s.addr, "DELETE", &format!("/v1/responses/{id}"), &[], b"").expect("DELETE");
    assert_eq!(d.status, 200);
    assert_eq!(d.json(), json!({ "id": id, "object": "response.deleted", "deleted": true }));
    for r in [
        s.get(&format!("/v1/responses/{id}")),
        request(&s.addr, "DELETE", &format!("/v1/responses/{id}"), &[], b"").expect("DELETE"),
        s.get("/v1/responses/resp_nope"),
    ] {
        assert_eq!(r.status, 404, "{}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["type"], "not_found_error", "{e}");
        assert!(e["error"]["message"].as_str().expect("message").contains("not found"), "{e}");
    }
    let r = s.post("/v1/responses", &json!({ "input": "x", "previous_response_id": "resp_nope" }));
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (404, json!("previous_response_id")));
    assert!(r.text().contains("resp_nope"), "{}", r.text());
    // The third turn was continued from the second, which is still there; deleting the first
    // does not cut the later turns' history.
    let fourth = create(&s, &json!({ "input": "x", "previous_response_id": third["id"], "max_output_tokens": 1 }));
    assert!(fourth["usage"]["input_tokens"].as_u64() > third["usage"]["input_tokens"].as_u64());
}

#[test]
fn the_store_is_bounded_and_evicts_the_least_recently_used() {
    let s = Server::start(&["--max-stored-responses", "2"]);
    let make = |input: &str| {
        create(&s, &json!({ "input": input, "max_output_tokens": 1 }))["id"].as_str().expect("id").to_string()
    };
    let (a, b) = (make("a"), make("b"));
    // A lookup is a use: a becomes more recent than b.
    assert_eq!(s.get(&format!("/v1/responses/{a}")).status, 200);
    let c = make("c");
    assert_eq!(s.get(&format!("/v1/responses/{b}")).status, 404, "b was the least recently used");
    for id in [&a, &c] {
        assert_eq!(s.get(&format!("/v1/responses/{id}")).status, 200);
    }
    // previous_response_id of an evicted response: the same 404.
    let r = s.post("/v1/responses", &json!({ "input": "x", "previous_response_id": b }));
    assert_eq!(r.status, 404, "{}", r.text());
    // 0 stores nothing.
    let none = Server::start(&["--max-stored-responses", "0"]);
    let id = create(&none, &json!({ "input": "a", "max_output_tokens": 1 }))["id"].as_str().expect("id").to_string();
    assert_eq!(none.get(&format!("/v1/responses/{id}")).status, 404);
}

/// Each event's type and data, checking `type` matches the SSE event name and the sequence
/// numbers count from 0.
fn events(r: &server_support::Response) -> Vec<Value> {
    assert_eq!(r.status, 200, "{}", r.text());
    let evs: Vec<Value> = r
        .sse()
        .into_iter()
        .map(|(name, data)| {
            let v: Value = serde_json::from_str(&data).expect("json event");
            assert_eq!(name.as_deref(), v["type"].as_str(), "{v}");
            v
        })
        .collect();
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    evs
}

fn types(evs: &[Value]) -> Vec<&str> {
    evs.iter().map(|e| e["type"].as_str().expect("type")).collect()
}

#[test]
fn a_stream_is_openai_s_event_sequence_and_assembles_to_the_response() {
    let s = Server::start(&[]);
    let body = json!({ "input": "Hi", "max_output_tokens": 5, "temperature": 0, "ignore_eos": true });
    let whole = create(&s, &body);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let evs = events(&s.post("/v1/responses", &sbody));
    let t = types(&evs);
    let deltas = t.iter().filter(|t| **t == "response.output_text.delta").count();
    assert!(deltas >= 1, "{t:?}");
    let mut expected =
        vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(t, expected);
    assert_eq!(evs[0]["response"]["status"], "in_progress");
    assert_eq!(evs[0]["response"]["output"], json!([]));
    let text: String = evs
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().expect("delta"))
        .collect();
    assert_eq!(text, output_text(&whole));
    let done = evs.iter().find(|e| e["type"] == "response.output_text.done").expect("done");
    assert_eq!(done["text"], json!(text));
    let last = &evs[evs.len() - 1]["response"];
    assert_eq!(last["id"], evs[0]["response"]["id"]);
    assert_eq!(last["output"][0]["id"], evs[2]["item"]["id"]);
    assert_eq!((last["status"].as_str(), output_text(last)), (Some("incomplete"), text));
    // The same usage but for the prefix cache, which the second run of the prompt found.
    let uncached = |u: &Value| {
        let mut u = u.clone();
        u["input_tokens_details"]["cached_tokens"] = json!(0);
        u
    };
    assert_eq!(uncached(&last["usage"]), uncached(&whole["usage"]));
    assert!(last["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{last}");
    // A streamed response is stored as it ended.
    let id = last["id"].as_str().expect("id");
    assert_eq!(&s.get(&format!("/v1/responses/{id}")).json(), last);

    // A reply that ends by itself completes.
    let mut stop = sbody.clone();
    stop["stop"] = json!([" "]);
    stop["ignore_eos"] = json!(false);
    stop["max_output_tokens"] = json!(200);
    let evs = events(&s.post("/v1/responses", &stop));
    let t = types(&evs);
    assert_eq!(t.last(), Some(&"response.completed"), "{t:?}");
    assert_eq!(evs[evs.len() - 1]["response"]["incomplete_details"], Value::Null);
}

#[test]
fn a_client_that_goes_away_cancels_the_stream_and_nothing_is_stored() {
    let s = Server::start(&["--device", "cpu"]);
    let body =
        json!({ "input": "hello", "max_output_tokens": 4000, "ignore_eos": true, "stream": true, "temperature": 0 });
    let mut st = OpenStream::open(&s.addr, "/v1/responses", &body);
    st.read_until("response.output_text.delta");
    let received = String::from_utf8_lossy(&st.received).into_owned();
    let at = received.find("\"id\":\"resp_").expect("the created event names the response") + 6;
    let id = received[at..at + 29].to_string();
    assert!(id.starts_with("resp_"), "{id}");
    drop(st);
    assert!(
        eventually(Duration::from_secs(30), || s.metric("iris_kv_cache_blocks_used") == Some(0.0)),
        "blocks not freed:\n{}",
        s.get("/metrics").text()
    );
    let m = s.get("/metrics").text();
    assert!(m.contains("iris_request_success_total{finished_reason=\"abort\"} 1"), "{m}");
    assert_eq!(s.get(&format!("/v1/responses/{id}")).status, 404);
}

#[test]
fn a_tool_round_trip_stored_and_by_items() {
    let model = model_with_template("tiny-qwen3", "Qwen3.5-4B.jinja");
    let s = Server::start_path(&model, &["--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3"]);
    let params = json!({ "type": "object", "properties": { "city": { "type": "string", "enum": ["Paris"] } },
                         "required": ["city"] });
    let flat = json!([{ "type": "function", "name": "get_weather", "description": "Weather in a city.",
        "parameters": params, "strict": true }]);
    let chat_tools = json!([{ "type": "function", "function": { "name": "get_weather", "description": "Weather in a city.",
        "parameters": params } }]);
    // A random model writes no call of its own: name the function (iris writes the call's
    // opening, and the grammar of the tool's schema writes the rest).
    let ask = |stream: bool| {
        json!({ "input": "Weather in Paris?", "tools": flat, "max_output_tokens": 64, "temperature": 0, "stream": stream,
                "tool_choice": { "type": "function", "name": "get_weather" } })
    };
    let r = create(&s, &ask(false));
    assert_eq!(r["status"], "completed", "{r}");
    let calls: Vec<&Value> =
        r["output"].as_array().expect("output").iter().filter(|i| i["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "{r}");
    let call = calls[0];
    const ARGS: &str = r#"{"city":"Paris"}"#;
    assert_eq!((call["name"].as_str(), call["arguments"].as_str()), (Some("get_weather"), Some(ARGS)));
    assert!(call["call_id"].as_str().is_some_and(|c| c.starts_with("call_")), "{call}");
    assert!(call["id"].as_str().is_some_and(|c| c.starts_with("fc_")), "{call}");
    assert!(output_text(&r).is_empty(), "no markup in the text: {r}");
    assert_eq!(r["tools"], flat);

    // Streamed: the call's item, its arguments in deltas, the same call at the end.
    let evs = events(&s.post("/v1/responses", &ask(true)));
    let t = types(&evs);
    let added = evs
        .iter()
        .position(|e| e["type"] == "response.output_item.added" && e["item"]["type"] == "function_call")
        .expect("call added");
    let args: String = evs
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().expect("delta"))
        .collect();
    assert_eq!(args, ARGS);
    let done = evs.iter().find(|e| e["type"] == "response.function_call_arguments.done").expect("args done");
    assert_eq!((done["arguments"].as_str(), done["item_id"].clone()), (Some(ARGS), evs[added]["item"]["id"].clone()));
    assert_eq!(t.last(), Some(&"response.completed"), "{t:?}");
    let last = &evs[evs.len() - 1]["response"];
    let streamed_call =
        last["output"].as_array().expect("output").iter().find(|i| i["type"] == "function_call").expect("call");
    assert_eq!(streamed_call["call_id"], evs[added]["item"]["call_id"]);

    // The result goes back by previous_response_id, or with the whole history as items.
    let call_id = call["call_id"].as_str().expect("call_id");
    let result = json!({ "type": "function_call_output", "call_id": call_id, "output": "18C and sunny" });
    let answer = |input: Value, previous: Option<&Value>| {
        let mut b = json!({ "input": input, "tools": flat, "max_output_tokens": 3, "temperature": 0, "ignore_eos": true,
                            "reasoning": { "effort": "none" } });
        if let Some(p) = previous {
            b["previous_response_id"] = p.clone();
        }
        create(&s, &b)
    };
    let by_id = answer(json!([result]), Some(&r["id"]));
    let by_items = answer(json!([{ "role": "user", "content": "Weather in Paris?" }, call, result]), None);
    assert_eq!(by_id["status"], "incomplete");
    assert!(by_id["output"].as_array().expect("output").iter().any(|i| i["type"] == "message"), "{by_id}");
    let history = json!([
        { "role": "user", "content": "Weather in Paris?" },
        { "role": "assistant", "content": "", "tool_calls": [
            { "id": call_id, "type": "function", "function": { "name": "get_weather", "arguments": ARGS } }] },
        { "role": "tool", "tool_call_id": call_id, "content": "18C and sunny" },
    ]);
    let mut tok =
        json!({ "messages": history, "tools": chat_tools, "chat_template_kwargs": { "enable_thinking": false } });
    let n = s.post("/tokenize", &tok);
    assert_eq!(n.status, 200, "{}", n.text());
    assert_eq!(by_id["usage"]["input_tokens"], n.json()["count"], "{by_id}");
    assert_eq!(by_items["usage"]["input_tokens"], by_id["usage"]["input_tokens"]);
    assert_eq!(output_text(&by_items), output_text(&by_id));
    // Without effort "none" the thinking stays on (the template reads enable_thinking).
    tok["chat_template_kwargs"] = json!({});
    assert_ne!(s.post("/tokenize", &tok).json()["count"], n.json()["count"]);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn reasoning_becomes_reasoning_items() {
    // Qwen3.5's template opens the thinking: a reply that never closes it is all thinking.
    let model = model_with_template("tiny-qwen3", "Qwen3.5-4B.jinja");
    let s = Server::start_path(&model, &["--reasoning-parser", "qwen3"]);
    let body = json!({ "input": "Hi", "max_output_tokens": 6, "temperature": 0, "ignore_eos": true,
                       "reasoning": { "effort": "high", "summary": "auto" } });
    let r = create(&s, &body);
    let item = &r["output"][0];
    assert_eq!(item["type"], "reasoning", "{r}");
    assert!(item["id"].as_str().is_some_and(|id| id.starts_with("rs_")));
    assert_eq!(item["summary"], json!([]));
    let thinking = item["content"][0]["text"].as_str().expect("reasoning_text").to_string();
    assert!(!thinking.is_empty());
    assert_eq!(item["content"][0]["type"], "reasoning_text");
    let rt = r["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64().expect("reasoning tokens");
    assert!(rt > 0 && rt <= 6, "{r}");
    assert_eq!(r["reasoning"], json!({ "effort": "high", "summary": "auto" }));
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let evs = events(&s.post("/v1/responses", &sbody));
    let streamed: String = evs
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().expect("delta"))
        .collect();
    assert_eq!(streamed, thinking);
    let part = evs.iter().find(|e| e["type"] == "response.content_part.added").expect("part");
    assert_eq!(part["part"]["type"], "reasoning_text");
    // The thinking goes back into the history as the assistant's reasoning_content.
    let next = create(&s, &json!({ "input": "More", "previous_response_id": r["id"], "max_output_tokens": 1 }));
    let history = json!([
        { "role": "user", "content": "Hi" },
        { "role": "assistant", "content": "", "reasoning_content": thinking },
        { "role": "user", "content": "More" },
    ]);
    assert_eq!(next["usage"]["input_tokens"], tokens(&s, history, None), "{next}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn what_iris_does_not_implement_is_a_400_naming_it() {
    let s = Server::start(&[]);
    let cases = [
        (json!({ "input": "x", "max_tokens": 3 }), "max_tokens"),
        (json!({ "input": "x", "conversation": "conv_1" }), "conversation"),
        (
            json!({ "input": "x", "text": { "format": { "type": "json_schema", "name": "n", "schema": { "type": 3 } } } }),
            "text.format",
        ),
        (json!({ "input": "x", "text": { "format": { "type": "xml" } } }), "text.format.type"),
        (json!({ "input": "x", "truncation": "auto" }), "truncation"),
        (json!({ "input": "x", "background": true }), "background"),
        (json!({ "input": "x", "include": ["message.output_text.logprobs"] }), "include[0]"),
        (json!({ "input": "x", "tools": [{ "type": "web_search" }] }), "tools[0].type"),
        (json!({ "input": [{ "type": "computer_call", "id": "c" }] }), "input[0].type"),
        (
            json!({ "input": [{ "role": "user", "content": [{ "type": "input_file", "file_id": "f" }] }] }),
            "input[0].content[0].type",
        ),
        (json!({ "input": "x", "reasoning": { "effort": "max" } }), "reasoning.effort"),
        (json!({ "input": "x", "max_output_tokens": 0 }), "max_output_tokens"),
        (json!({ "input": "x", "temperature": "hot" }), "temperature"),
        (json!({}), "input"),
        // tiny-llama's template shows no tool format.
        (json!({ "input": "x", "tools": [{ "type": "function", "name": "f" }] }), "tools"),
    ];
    for (body, param) in cases {
        let r = s.post("/v1/responses", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        let name = param.split(['[', '.']).next().expect("name");
        assert!(e["error"]["message"].as_str().expect("message").contains(name), "{e}");
    }
    // Accepted: the defaults of what is refused otherwise, and the ignored fields.
    let ok = json!({ "input": "x", "max_output_tokens": 1, "truncation": "disabled", "background": false,
                     "include": ["reasoning.encrypted_content"], "text": { "format": { "type": "text" } },
                     "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s",
                     "stream_options": { "include_obfuscation": false }, "top_logprobs": 0, "parallel_tool_calls": true });
    assert_eq!(error_param(&s, &ok), (200, Value::Null));
    // GET takes no query parameters (OpenAI's `stream=true` replay is not built).
    let id = create(&s, &json!({ "input": "x", "max_output_tokens": 1 }))["id"].as_str().expect("id").to_string();
    let r = s.get(&format!("/v1/responses/{id}?stream=true"));
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("stream")), "{}", r.text());
    // The model is checked as everywhere.
    assert_eq!(s.post("/v1/responses", &json!({ "input": "x", "model": "gpt-5" })).status, 404);
}
