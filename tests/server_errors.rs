//! Bad input gets a clear 4xx with an OpenAI-style body (Anthropic's on /v1/messages), never
//! a panic or a hung connection, and never disturbs the requests already running.

mod server_support;

use serde_json::{json, Value};
use server_support::{OpenStream, Server};

/// Posts `body` and checks the status and the OpenAI error shape; returns the error object.
fn openai_error(s: &Server, path: &str, body: &[u8], status: u16) -> Value {
    let r = s.post_raw(path, &[], body);
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e.clone()
}

fn chat(messages: Value, extra: Value) -> Vec<u8> {
    let mut b = json!({ "messages": messages, "max_tokens": 4 });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string().into_bytes()
}

fn user(text: &str) -> Value {
    json!([{ "role": "user", "content": text }])
}

#[test]
fn malformed_json() {
    let s = Server::start(&[]);
    let e = openai_error(&s, "/v1/chat/completions", b"{\"messages\": [", 400);
    assert!(e["message"].as_str().unwrap().contains("not valid JSON"), "{e}");
    openai_error(&s, "/v1/completions", b"[1, 2]", 400);
    openai_error(&s, "/v1/completions", b"", 400);
}

#[test]
fn wrong_field_types() {
    let s = Server::start(&[]);
    let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "temperature": "hot" })), 400);
    assert_eq!(e["param"], "temperature");
    let e = openai_error(&s, "/v1/chat/completions", &chat(json!("hi"), json!({})), 400);
    assert_eq!(e["param"], "messages");
    let e = openai_error(&s, "/v1/completions", &json!({ "prompt": 5 }).to_string().into_bytes(), 400);
    assert_eq!(e["param"], "prompt");
    let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "stream": "yes" })), 400);
    assert_eq!(e["param"], "stream");
    let e = openai_error(&s, "/v1/chat/completions", &json!({ "max_tokens": 3 }).to_string().into_bytes(), 400);
    assert!(e["message"].as_str().unwrap().contains("messages"), "{e}");
}

#[test]
fn unknown_model_is_404() {
    let s = Server::start(&[]);
    let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "model": "gpt-9" })), 404);
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-9"));
    openai_error(&s, "/v1/completions", &json!({ "model": "nope", "prompt": "a" }).to_string().into_bytes(), 404);
}

#[test]
fn empty_messages() {
    let s = Server::start(&[]);
    let e = openai_error(&s, "/v1/chat/completions", &chat(json!([]), json!({})), 400);
    assert_eq!(e["param"], "messages");
}

#[test]
fn unknown_role() {
    let s = Server::start(&[]);
    let e =
        openai_error(&s, "/v1/chat/completions", &chat(json!([{ "role": "wizard", "content": "hi" }]), json!({})), 400);
    assert_eq!(e["param"], "messages[0].role");
    assert!(e["message"].as_str().unwrap().contains("wizard"));
}

#[test]
fn max_tokens_not_positive() {
    let s = Server::start(&[]);
    for bad in [0, -5] {
        let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "max_tokens": bad })), 400);
        assert_eq!(e["param"], "max_tokens");
        let e =
            openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "max_completion_tokens": bad })), 400);
        assert_eq!(e["param"], "max_completion_tokens");
        let e = openai_error(
            &s,
            "/v1/completions",
            &json!({ "prompt": "a", "max_tokens": bad }).to_string().into_bytes(),
            400,
        );
        assert_eq!(e["param"], "max_tokens");
    }
}

#[test]
fn prompt_longer_than_context_names_both_lengths() {
    let s = Server::start(&["--max-model-len", "64"]);
    let long = "word ".repeat(200);
    let n = s.post("/tokenize", &json!({ "prompt": long })).json()["count"].as_u64().unwrap();
    assert!(n > 64);
    let e = openai_error(&s, "/v1/completions", &json!({ "prompt": long }).to_string().into_bytes(), 400);
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("maximum context length is 64 tokens") && msg.contains(&format!("{n} tokens")), "{msg}");
    assert_eq!(e["code"], "context_length_exceeded");
    let e = openai_error(&s, "/v1/chat/completions", &chat(user(&long), json!({})), 400);
    assert!(e["message"].as_str().unwrap().contains("maximum context length is 64 tokens"), "{e}");
}

fn prompt_len(s: &Server, text: &str) -> u64 {
    s.post("/tokenize", &json!({ "prompt": text })).json()["count"].as_u64().unwrap()
}

/// "word word ...": the longest whose chat rendering has at most `max` tokens.
fn words_in_messages(s: &Server, max: u64) -> String {
    let len = |t: &str| s.post("/tokenize", &json!({ "messages": user(t) })).json()["count"].as_u64().unwrap();
    let k = (1..).find(|&k| len(&"word ".repeat(k)) > max).unwrap() - 1;
    assert!(k > 0, "even one word renders to more than {max} tokens");
    "word ".repeat(k)
}

/// vLLM's rule: prompt + max_tokens must fit the context; the 400 names all the lengths.
/// Exactly filling the context is fine.
#[test]
fn prompt_plus_max_tokens_over_the_context_is_400_naming_the_lengths() {
    let s = Server::start(&["--max-model-len", "128"]);
    let text = words_in_messages(&s, 100);
    let p = s.post("/tokenize", &json!({ "prompt": text })).json()["count"].as_u64().unwrap();
    let msgs = user(&text);
    let pc = s.post("/tokenize", &json!({ "messages": msgs })).json()["count"].as_u64().unwrap();
    let pm = s.post("/v1/messages/count_tokens", &json!({ "messages": msgs })).json()["input_tokens"].as_u64().unwrap();
    assert!(p < 128 && pc < 128 && pm < 128);
    let want = |prompt: u64, noun: &str| {
        let m = 128 - prompt + 1;
        format!(
            "This model's maximum context length is 128 tokens. However, you requested {} tokens ({prompt} in the \
             {noun}, {m} in the completion).",
            prompt + m
        )
    };
    let body = json!({ "prompt": text, "max_tokens": 128 - p + 1 }).to_string().into_bytes();
    let e = openai_error(&s, "/v1/completions", &body, 400);
    assert!(e["message"].as_str().unwrap().starts_with(&want(p, "prompt")), "{e}");
    assert_eq!(e["code"], "context_length_exceeded");
    for field in ["max_tokens", "max_completion_tokens"] {
        let e = openai_error(&s, "/v1/chat/completions", &chat(msgs.clone(), json!({ field: 128 - pc + 1 })), 400);
        assert!(e["message"].as_str().unwrap().starts_with(&want(pc, "messages")), "{e}");
    }
    let r = s.post("/v1/messages", &json!({ "max_tokens": 128 - pm + 1, "messages": msgs }));
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert!(v["error"]["message"].as_str().unwrap().starts_with(&want(pm, "messages")), "{v}");

    // Filling the context exactly is allowed and generates every requested token.
    let r = s.post("/v1/completions", &json!({ "prompt": text, "max_tokens": 128 - p, "ignore_eos": true }));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 128 - p);
    let r = s.post("/v1/messages", &json!({ "max_tokens": 128 - pm, "messages": msgs, "temperature": 0 }));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Without max_tokens, chat may use the rest of the context (vLLM's default) and completions
/// 16 tokens (OpenAI's and vLLM's default), or the rest when less is left.
#[test]
fn omitted_max_tokens_defaults() {
    let s = Server::start(&["--max-model-len", "128"]);
    let text = words_in_messages(&s, 100);
    let msgs = user(&text);
    let pc = s.post("/tokenize", &json!({ "messages": msgs })).json()["count"].as_u64().unwrap();
    let r = s.post("/v1/chat/completions", &json!({ "messages": msgs, "ignore_eos": true }));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 128 - pc);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let r = s.post("/v1/completions", &json!({ "prompt": "word", "ignore_eos": true }));
    assert_eq!(r.json()["usage"]["completion_tokens"], 16);
    let long = (1..).map(|k| "word ".repeat(k)).find(|t| prompt_len(&s, t) > 112).unwrap();
    let p = prompt_len(&s, &long);
    assert!(p < 128, "{p}");
    let r = s.post("/v1/completions", &json!({ "prompt": long, "ignore_eos": true }));
    assert_eq!(r.json()["usage"]["completion_tokens"], 128 - p);
}

#[test]
fn body_over_size_limit_is_413() {
    let s = Server::start(&["--max-body-bytes", "2000"]);
    let big = chat(user(&"x".repeat(5000)), json!({}));
    let e = openai_error(&s, "/v1/chat/completions", &big, 413);
    assert!(e["message"].as_str().unwrap().contains("2000"), "{e}");
    let r = s.post_raw("/v1/messages", &[], &big);
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["type"], "request_too_large");
}

#[test]
fn invalid_utf8() {
    let s = Server::start(&[]);
    let mut body = b"{\"prompt\": \"ab".to_vec();
    body.extend_from_slice(&[0xff, 0xfe]);
    body.extend_from_slice(b"\"}");
    let e = openai_error(&s, "/v1/completions", &body, 400);
    assert!(e["message"].as_str().unwrap().contains("UTF-8"), "{e}");
}

#[test]
fn unsupported_content_part_type() {
    let s = Server::start(&[]);
    let msgs = json!([{ "role": "user", "content": [{ "type": "image_url", "image_url": { "url": "data:," } }] }]);
    let e = openai_error(&s, "/v1/chat/completions", &chat(msgs, json!({})), 400);
    assert_eq!(e["param"], "messages[0].content[0].type");
    assert!(e["message"].as_str().unwrap().contains("image_url"));
}

#[test]
fn n_too_large() {
    let s = Server::start(&[]);
    let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "n": 1000 })), 400);
    assert_eq!(e["param"], "n");
    let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ "n": 0 })), 400);
    assert_eq!(e["param"], "n");
}

#[test]
fn bad_sampling_values() {
    let s = Server::start(&[]);
    for (field, value) in [
        ("temperature", json!(-1)),
        ("top_p", json!(0)),
        ("presence_penalty", json!(5)),
        ("logit_bias", json!({ "99999": 1 })),
        ("logit_bias", json!({ "abc": 1 })),
    ] {
        let e = openai_error(&s, "/v1/chat/completions", &chat(user("hi"), json!({ field: value })), 400);
        assert_eq!(e["param"], field, "{e}");
    }
    let e = openai_error(
        &s,
        "/v1/chat/completions",
        &chat(user("hi"), json!({ "logprobs": true, "top_logprobs": 50 })),
        400,
    );
    assert_eq!(e["param"], "top_logprobs");
}

#[test]
fn anthropic_errors_have_anthropic_shape() {
    let s = Server::start(&[]);
    for (body, status) in [
        (json!({ "messages": [{ "role": "user", "content": "hi" }] }), 400), // no max_tokens
        (json!({ "max_tokens": 0, "messages": [{ "role": "user", "content": "hi" }] }), 400),
        (json!({ "max_tokens": 5, "messages": [] }), 400),
        (json!({ "max_tokens": 5, "messages": [{ "role": "system", "content": "hi" }] }), 400),
        (
            json!({ "max_tokens": 5, "messages": [{ "role": "user", "content": [{ "type": "image", "source": {} }] }] }),
            400,
        ),
        (json!({ "model": "claude-9", "max_tokens": 5, "messages": [{ "role": "user", "content": "hi" }] }), 404),
    ] {
        let r = s.post("/v1/messages", &body);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert!(v["error"]["type"].is_string() && v["error"]["message"].is_string(), "{v}");
    }
    let r = s.post_raw("/v1/messages", &[], b"{not json");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn unknown_route_is_404_json() {
    let s = Server::start(&[]);
    let r = s.get("/v1/nothing");
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]["message"].is_string());
}

#[test]
fn queue_full_is_429_with_a_clear_message() {
    let s = Server::start(&["--max-num-seqs", "2", "--max-queue", "2"]);
    // One request holding all 4 slots (2 running, 2 queued) for thousands of steps.
    let long =
        json!({ "prompt": "a", "n": 4, "max_tokens": 4000, "ignore_eos": true, "stream": true, "temperature": 0 });
    let mut a = OpenStream::open(&s.addr, "/v1/completions", &long);
    a.read_until("data:");
    let e = openai_error(&s, "/v1/completions", json!({ "prompt": "a", "max_tokens": 2 }).to_string().as_bytes(), 429);
    assert!(e["message"].as_str().unwrap().contains("--max-queue"), "{e}");
    assert_eq!(e["type"], "rate_limit_error");
    drop(a);
    // Once they are gone, there is room again.
    assert!(server_support::eventually(std::time::Duration::from_secs(30), || {
        s.post("/v1/completions", &json!({ "prompt": "a", "max_tokens": 2 })).status == 200
    }));
}

#[test]
fn bad_requests_do_not_disturb_running_ones() {
    let s = Server::start(&[]);
    let body = json!({ "prompt": "once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": true });
    let alone = s.post("/v1/completions", &body).json()["choices"][0]["text"].clone();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let mut st = OpenStream::open(&s.addr, "/v1/completions", &sb);
    st.read_until("data:");
    for bad in [
        b"{".to_vec(),
        chat(json!([]), json!({})),
        chat(user("hi"), json!({ "temperature": "x" })),
        chat(user("hi"), json!({ "max_tokens": 0 })),
        chat(user("hi"), json!({ "model": "other" })),
    ] {
        let r = s.post_raw("/v1/chat/completions", &[], &bad);
        assert!(r.status >= 400 && r.status < 500, "{}", r.text());
    }
    let r = st.finish();
    let data = r.sse_data();
    let text: String = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(Value::String(text), alone);
}
