//! The OpenAI and Anthropic APIs of `iris serve`, over raw HTTP against the real binary.

mod server_support;

use serde_json::{json, Value};
use server_support::Server;

fn chat_body(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "messages": [{ "role": "user", "content": content }],
        "temperature": 0,
        "max_tokens": 12,
        "ignore_eos": true,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// Concatenated `delta.content` of a chat stream, its finish reasons, and the usage chunk.
fn chat_stream_parts(data: &[String]) -> (String, Vec<String>, Option<Value>) {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream ends with [DONE]");
    let mut text = String::new();
    let mut finishes = Vec::new();
    let mut usage = None;
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finishes.push(f.to_string());
            }
        }
    }
    (text, finishes, usage)
}

#[test]
fn chat_completion_matches_its_stream_with_exact_usage() {
    let s = Server::start(&[]);
    let r = s.post("/v1/chat/completions", &chat_body("Hello there", json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny-llama");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let usage = &v["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    // The prompt is what /tokenize says the chat template renders.
    let t = s.post("/tokenize", &json!({ "messages": [{ "role": "user", "content": "Hello there" }] })).json();
    assert_eq!(usage["prompt_tokens"], t["count"]);
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), t["count"].as_u64().unwrap() + 12);

    let r = s.post(
        "/v1/chat/completions",
        &chat_body("Hello there", json!({ "stream": true, "stream_options": { "include_usage": true } })),
    );
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let (streamed, finishes, susage) = chat_stream_parts(&r.sse_data());
    assert_eq!(streamed, text);
    assert_eq!(finishes, vec!["length"]);
    // The same usage, except that the second run of the prompt found its blocks cached.
    let mut susage = susage.expect("a usage chunk");
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = susage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached.is_multiple_of(16) && cached < usage["prompt_tokens"].as_u64().unwrap(), "{susage}");
    susage["prompt_tokens_details"]["cached_tokens"] = json!(0);
    assert_eq!(&susage, usage);
}

#[test]
fn content_parts_and_developer_role_render_like_strings() {
    let s = Server::start(&[]);
    let plain = s.post(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "a\nb" }],
                 "temperature": 0, "max_tokens": 6 }),
    );
    let parts = s.post(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "developer", "content": [{ "type": "text", "text": "Be brief." }] },
                              { "role": "user", "content": [{ "type": "text", "text": "a" }, { "type": "text", "text": "b" }] }],
                 "temperature": 0, "max_completion_tokens": 6 }),
    );
    assert_eq!(plain.status, 200, "{}", plain.text());
    assert_eq!(parts.status, 200, "{}", parts.text());
    assert_eq!(plain.json()["choices"], parts.json()["choices"]);
    // The same prompt: the second found its blocks in the prefix cache.
    let usage = |r: &server_support::Response| {
        let mut u = r.json()["usage"].clone();
        u.as_object_mut().unwrap().remove("prompt_tokens_details");
        u
    };
    assert_eq!(usage(&plain), usage(&parts));
}

#[test]
fn stop_strings_end_generation_and_are_not_returned() {
    let s = Server::start(&[]);
    let full = s.post(
        "/v1/completions",
        &json!({ "prompt": "the cat", "max_tokens": 24, "temperature": 0, "ignore_eos": true }),
    );
    assert_eq!(full.status, 200, "{}", full.text());
    let text = full.json()["choices"][0]["text"].as_str().unwrap().to_string();
    // Pick a stop string from the middle of the greedy output.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "output too short: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    let r = s.post(
        "/v1/completions",
        &json!({ "prompt": "the cat", "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stop": [stop.clone(), "\u{1}never"] }),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], expected);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Anthropic names the stop sequence that matched.
    let m = s.post(
        "/v1/messages",
        &json!({ "max_tokens": 24, "temperature": 0, "messages": [{ "role": "user", "content": "x" }] }),
    );
    let mtext = m.json()["content"][0]["text"].as_str().unwrap().to_string();
    let mchars: Vec<char> = mtext.chars().collect();
    if mchars.len() >= 4 && m.json()["stop_reason"] == "max_tokens" {
        let stop: String = mchars[mchars.len() / 2..mchars.len() / 2 + 2].iter().collect();
        let m2 = s.post(
            "/v1/messages",
            &json!({ "max_tokens": 24, "temperature": 0, "stop_sequences": [stop.clone()],
                     "messages": [{ "role": "user", "content": "x" }] }),
        );
        let v2 = m2.json();
        assert_eq!(v2["stop_reason"], "stop_sequence", "{v2}");
        assert_eq!(v2["stop_sequence"], stop);
        assert_eq!(v2["content"][0]["text"], &mtext[..mtext.find(&stop).unwrap()]);
    }
}

#[test]
fn completions_batch_prompts_n_echo_and_logprobs() {
    let s = Server::start(&[]);
    let r = s.post(
        "/v1/completions",
        &json!({ "prompt": ["one two", "three"], "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": true,
                 "echo": true, "logprobs": 2 }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let prefix = if i < 2 { "one two" } else { "three" };
        assert!(c["text"].as_str().unwrap().starts_with(prefix), "{c}");
        let lp = &c["logprobs"];
        let n_tokens = lp["tokens"].as_array().unwrap().len();
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n_tokens);
        // Generated tokens carry a logprob and at most 2 alternatives.
        let gen = &lp["top_logprobs"].as_array().unwrap()[n_tokens - 1];
        assert!(gen.as_object().unwrap().len() <= 2 && !gen.as_object().unwrap().is_empty());
        assert!(lp["token_logprobs"][n_tokens - 1].as_f64().unwrap() <= 0.0);
    }
    // Greedy: both choices of a prompt agree.
    assert_eq!(choices[0]["text"], choices[1]["text"]);
    assert_eq!(v["usage"]["completion_tokens"], 20);
    let p1 = s.post("/tokenize", &json!({ "prompt": "one two" })).json()["count"].as_u64().unwrap();
    let p2 = s.post("/tokenize", &json!({ "prompt": "three" })).json()["count"].as_u64().unwrap();
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), p1 + p2);

    // Streaming gives the same text per choice.
    let r = s.post(
        "/v1/completions",
        &json!({ "prompt": "one two", "max_tokens": 5, "temperature": 0, "ignore_eos": true, "stream": true }),
    );
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let text: String = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(format!("one two{text}"), choices[0]["text"].as_str().unwrap());
}

#[test]
fn seeded_n_choices_equal_single_requests_with_seed_plus_i() {
    let s = Server::start(&[]);
    let body = |n: usize, seed: u64| {
        json!({ "prompt": "random words", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
                "seed": seed, "n": n, "ignore_eos": true })
    };
    let many = s.post("/v1/completions", &body(3, 7)).json();
    for i in 0..3 {
        let one = s.post("/v1/completions", &body(1, 7 + i as u64)).json();
        assert_eq!(many["choices"][i]["text"], one["choices"][0]["text"], "choice {i}");
    }
}

/// `echo` with `logprobs`: every prompt token after the first has the logprob the model gives
/// it after the tokens before it. Checked against generation: asking for one token after the
/// prefix `P[..k]` gives, at the same context, the same top alternatives, and P[k]'s logprob
/// there. Streaming sends the same prompt logprobs.
#[test]
fn completions_echo_logprobs_score_the_prompt() {
    let s = Server::start(&[]);
    let ids: Vec<u64> = s.post("/tokenize", &json!({ "prompt": "the cat sat on the mat" })).json()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(ids.len() >= 4, "{ids:?}");
    let body = json!({ "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 5 });
    let v = s.post("/v1/completions", &body).json();
    let lp = &v["choices"][0]["logprobs"];
    let (tokens, token_lp, top) = (&lp["tokens"], &lp["token_logprobs"], &lp["top_logprobs"]);
    assert_eq!(tokens.as_array().unwrap().len(), ids.len() + 2);
    assert!(token_lp[0].is_null() && top[0].is_null(), "the first prompt token has no logprob: {lp}");
    for k in 1..ids.len() {
        let lpk = token_lp[k].as_f64().unwrap_or_else(|| panic!("prompt token {k} has no logprob: {lp}"));
        let alone = s
            .post("/v1/completions", &json!({ "prompt": ids[..k], "max_tokens": 1, "temperature": 0, "logprobs": 5 }))
            .json();
        let want = alone["choices"][0]["logprobs"]["top_logprobs"][0].as_object().unwrap().clone();
        let got = top[k].as_object().unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "position {k}");
        for (t, w) in &want {
            assert!((got[t].as_f64().unwrap() - w.as_f64().unwrap()).abs() < 1e-4, "position {k}, token {t}");
        }
        let text = tokens[k].as_str().unwrap();
        match want.get(text) {
            Some(w) => assert!((lpk - w.as_f64().unwrap()).abs() < 1e-4, "position {k}"),
            None => assert!(want.values().all(|w| w.as_f64().unwrap() >= lpk), "position {k}"),
        }
    }
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let data = s.post("/v1/completions", &sb).sse_data();
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    let echoed = &first["choices"][0]["logprobs"];
    assert_eq!(echoed["token_logprobs"].as_array().unwrap()[..], token_lp.as_array().unwrap()[..ids.len()]);
    assert_eq!(echoed["top_logprobs"].as_array().unwrap()[..], top.as_array().unwrap()[..ids.len()]);
}

#[test]
fn chat_logprobs_shape() {
    let s = Server::start(&[]);
    let r = s.post(
        "/v1/chat/completions",
        &chat_body("hi", json!({ "logprobs": true, "top_logprobs": 3, "max_tokens": 4 })),
    );
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for e in content {
        assert!(e["token"].is_string() && e["bytes"].is_array() && e["logprob"].as_f64().unwrap() <= 0.0);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["logprob"], e["logprob"]);
    }
}

#[test]
fn models_tokenize_detokenize_health_metrics() {
    let s = Server::start(&["--served-model-name", "tiny"]);
    let m = s.get("/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "tiny");
    let t = s.post("/tokenize", &json!({ "prompt": "hello world", "add_special_tokens": false })).json();
    let tokens = t["tokens"].clone();
    assert_eq!(t["count"], tokens.as_array().unwrap().len());
    let d = s.post("/detokenize", &json!({ "tokens": tokens })).json();
    assert_eq!(d["prompt"], "hello world");
    assert_eq!(s.get("/health").status, 200);
    // The served name works; so does no name.
    let r = s.post("/v1/completions", &json!({ "model": "tiny", "prompt": "a", "max_tokens": 2 }));
    assert_eq!(r.status, 200, "{}", r.text());
    let metrics = s.get("/metrics");
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    for name in [
        "iris_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
        "iris_prompt_tokens_total",
        "iris_generation_tokens_total 2",
        "iris_time_to_first_token_seconds_bucket",
        "iris_inter_token_latency_seconds_count 1",
        "iris_num_requests_running 0",
        "iris_num_requests_waiting 0",
        "iris_kv_cache_blocks_used 0",
        "iris_kv_cache_blocks_free",
        "iris_num_preemptions_total",
    ] {
        assert!(text.contains(name), "/metrics lacks `{name}`:\n{text}");
    }
}

/// With --speculative-config, a greedy completion's text is the same as without, and /metrics
/// counts the drafts (vLLM's spec_decode names).
#[test]
fn speculative_decoding_keeps_the_text_and_counts_drafts() {
    let body = json!({ "prompt": "one two three one two three one two three one two", "max_tokens": 32,
                       "temperature": 0, "ignore_eos": true });
    let want = Server::start(&[]).post("/v1/completions", &body).json()["choices"][0]["text"].clone();
    let s = Server::start(&["--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 3}"#]);
    let r = s.post("/v1/completions", &body).json();
    assert_eq!(r["choices"][0]["text"], want, "speculation changed the greedy text");
    assert_eq!(r["usage"]["completion_tokens"], 32);
    let text = s.get("/metrics").text();
    let value = |name: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(name) && !l.starts_with('#'));
        line.and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name}:\n{text}"))
    };
    let (drafts, tokens, accepted) = (
        value("iris_spec_decode_num_drafts_total"),
        value("iris_spec_decode_num_draft_tokens_total"),
        value("iris_spec_decode_num_accepted_tokens_total"),
    );
    assert!(drafts > 0 && tokens >= drafts && accepted <= tokens, "{drafts} {tokens} {accepted}");
    let per_pos: u64 = (0..3)
        .filter_map(|p| {
            let name = format!("iris_spec_decode_num_accepted_tokens_per_pos_total{{position=\"{p}\"}}");
            text.lines().find(|l| l.starts_with(&name)).and_then(|l| l.rsplit(" ").next()?.parse::<u64>().ok())
        })
        .sum();
    assert_eq!(per_pos, accepted, "accepted by position adds up:\n{text}");
}

#[test]
fn anthropic_messages_and_stream_events() {
    let s = Server::start(&[]);
    let body = json!({ "model": "tiny-llama", "max_tokens": 8, "temperature": 0, "system": "Be terse.",
                       "messages": [{ "role": "user", "content": [{ "type": "text", "text": "hi" }] }] });
    let r = s.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["content"][0]["type"], "text");
    let out = v["usage"]["output_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&out));
    if out < 8 {
        assert_eq!(v["stop_reason"], "end_turn");
    } else {
        assert!(v["stop_reason"] == "max_tokens" || v["stop_reason"] == "end_turn");
    }
    let count =
        s.post("/v1/messages/count_tokens", &json!({ "messages": body["messages"], "system": "Be terse." })).json();
    assert_eq!(count["input_tokens"], v["usage"]["input_tokens"]);

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = s.post("/v1/messages", &sb);
    let events = r.sse();
    let names: Vec<String> = events.iter().map(|(e, _)| e.clone().unwrap_or_default()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let mut text = String::new();
    for (name, data) in &events {
        let d: Value = serde_json::from_str(data).unwrap();
        assert_eq!(Some(d["type"].as_str().unwrap()), name.as_deref());
        if name.as_deref() == Some("content_block_delta") {
            text.push_str(d["delta"]["text"].as_str().unwrap());
        }
        if name.as_deref() == Some("message_delta") {
            assert_eq!(d["delta"]["stop_reason"], v["stop_reason"]);
            assert_eq!(d["usage"]["output_tokens"], v["usage"]["output_tokens"]);
        }
    }
    assert_eq!(text, v["content"][0]["text"].as_str().unwrap());
}

#[test]
fn api_key_is_required_when_set() {
    let s = Server::start(&["--api-key", "sekret"]);
    let body = json!({ "prompt": "a", "max_tokens": 1 }).to_string();
    let r = s.post_raw("/v1/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = s.post_raw("/v1/completions", &[("Authorization", "Bearer wrong")], body.as_bytes());
    assert_eq!(r.status, 401);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("invalid"));
    let r = s.post_raw("/v1/completions", &[("Authorization", "Bearer sekret")], body.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    let m = json!({ "max_tokens": 1, "messages": [{ "role": "user", "content": "a" }] }).to_string();
    let r = s.post_raw("/v1/messages", &[], m.as_bytes());
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = s.post_raw("/v1/messages", &[("x-api-key", "sekret")], m.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    // Health and metrics stay open for probes.
    assert_eq!(s.get("/health").status, 200);
    assert_eq!(s.get("/metrics").status, 200);
}

/// Automatic prefix caching through the server: a request sharing a long system prompt with
/// an earlier one reports the tokens it read from the cache in OpenAI's usage (plain and
/// streamed) and in Anthropic's (`cache_read_input_tokens`, with Claude Code's per-request
/// billing line stripped from `system`), and /metrics counts the cache's queries and hits.
/// With --no-enable-prefix-caching nothing is cached.
#[test]
fn prefix_cache_reports_cached_tokens_and_counts_them() {
    let system = "You are a careful assistant who answers in one short sentence. ".repeat(6);
    let chat = |user: &str, extra: Value| {
        let mut b = json!({ "messages": [{ "role": "system", "content": system }, { "role": "user", "content": user }],
                            "temperature": 0, "max_tokens": 4, "ignore_eos": true });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cached_of = |usage: &Value| usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let metric = |s: &Server, name: &str| -> u64 {
        let text = s.get("/metrics").text();
        let line = text.lines().find(|l| l.starts_with(name) && !l.starts_with('#'));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no {name}:\n{text}"))
    };

    let s = Server::start(&[]);
    let first = s.post("/v1/chat/completions", &chat("Hello", json!({}))).json();
    assert_eq!(cached_of(&first["usage"]), 0, "{first}");
    let second = s.post("/v1/chat/completions", &chat("Goodbye", json!({}))).json();
    let (cached, prompt) = (cached_of(&second["usage"]), second["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(cached >= 48 && cached.is_multiple_of(16) && cached < prompt, "the system prompt's blocks: {second}");
    let r = s.post(
        "/v1/chat/completions",
        &chat("Again", json!({ "stream": true, "stream_options": { "include_usage": true } })),
    );
    let (_, _, usage) = chat_stream_parts(&r.sse_data());
    assert_eq!(cached_of(&usage.expect("usage chunk")), cached, "streamed usage");
    let c = s.post("/v1/completions", &json!({ "prompt": system, "max_tokens": 2 })).json();
    assert!(c["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64(), "{c}");

    // Anthropic: the billing line changes per request and is not part of the prompt.
    let message = |user: &str, billing: &str, stream: bool| {
        json!({ "model": "tiny-llama", "max_tokens": 4, "temperature": 0, "stream": stream,
                "system": [{ "type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.0; cch={billing};") },
                           { "type": "text", "text": system }],
                "messages": [{ "role": "user", "content": user }] })
    };
    let counted = |body: &Value| {
        let mut b = body.clone();
        for k in ["max_tokens", "temperature", "stream"] {
            b.as_object_mut().unwrap().remove(k);
        }
        s.post("/v1/messages/count_tokens", &b).json()["input_tokens"].as_u64().unwrap()
    };
    let mut plain = message("Bonjour", "a1", false);
    let with_header = counted(&plain);
    plain["system"] = json!(system);
    assert_eq!(with_header, counted(&plain), "the billing line is stripped");
    let m = s.post("/v1/messages", &message("Bonjour", "b2", false)).json();
    let u = &m["usage"];
    let read = u["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read >= 48 && read.is_multiple_of(16), "{m}");
    assert_eq!(u["input_tokens"].as_u64().unwrap() + read, with_header, "computed + cached = the prompt: {m}");
    let events = s.post("/v1/messages", &message("Bonjour", "c3", true)).sse();
    let delta = events.iter().find(|(e, _)| e.as_deref() == Some("message_delta")).expect("message_delta");
    let d: Value = serde_json::from_str(&delta.1).unwrap();
    assert!(d["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= read, "{d}");

    let (queries, hits) = (metric(&s, "iris_prefix_cache_queries_total"), metric(&s, "iris_prefix_cache_hits_total"));
    assert!(hits >= 2 * cached + 2 * read && hits < queries, "hits {hits} of {queries} queries");

    let off = Server::start(&["--no-enable-prefix-caching"]);
    off.post("/v1/chat/completions", &chat("Hello", json!({})));
    let again = off.post("/v1/chat/completions", &chat("Hello", json!({}))).json();
    assert_eq!(cached_of(&again["usage"]), 0, "{again}");
    assert_eq!(metric(&off, "iris_prefix_cache_queries_total"), 0);
}
