//! Structured outputs through the real server on the random tiny llama fixture: whatever a
//! random model samples at temperature 1, the grammar holds every reply to its schema, regex
//! or choice; bad grammars are 400s naming the field; speculation changes no greedy output.

mod server_support;

use serde_json::{json, Value};
use server_support::Server;

/// A nested schema with what the checks below must see held: required fields, enums,
/// integer bounds, bounded arrays of objects, a string pattern, no extra properties.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "id": { "type": "integer", "minimum": -5, "maximum": 300 },
            "kind": { "enum": ["cat", "dog", 7] },
            "name": { "type": "string", "pattern": "^[a-z]{1,6}$" },
            "ok": { "type": "boolean" },
            "items": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": { "n": { "type": "integer", "minimum": 0, "maximum": 9 } },
                    "required": ["n"],
                    "additionalProperties": false,
                },
            },
        },
        "required": ["id", "kind", "name", "items", "ok"],
        "additionalProperties": false,
    })
}

/// A JSON schema check for what `schema()` uses (patterns checked by the caller).
fn validate(schema: &Value, v: &Value, at: &str) -> Result<(), String> {
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        return if e.contains(v) { Ok(()) } else { Err(format!("{at}: {v} not in the enum")) };
    }
    match schema["type"].as_str() {
        Some("integer") => {
            let n = v.as_i64().ok_or(format!("{at}: {v} is not an integer"))?;
            let (lo, hi) =
                (schema["minimum"].as_i64().unwrap_or(i64::MIN), schema["maximum"].as_i64().unwrap_or(i64::MAX));
            if !(lo..=hi).contains(&n) {
                return Err(format!("{at}: {n} outside [{lo}, {hi}]"));
            }
        }
        Some("string") if !v.is_string() => return Err(format!("{at}: {v} is not a string")),
        Some("boolean") if !v.is_boolean() => return Err(format!("{at}: {v} is not a boolean")),
        Some("array") => {
            let a = v.as_array().ok_or(format!("{at}: {v} is not an array"))?;
            let (lo, hi) = (schema["minItems"].as_u64().unwrap_or(0), schema["maxItems"].as_u64().unwrap_or(u64::MAX));
            if !(lo..=hi).contains(&(a.len() as u64)) {
                return Err(format!("{at}: {} items outside [{lo}, {hi}]", a.len()));
            }
            for (i, x) in a.iter().enumerate() {
                validate(&schema["items"], x, &format!("{at}[{i}]"))?;
            }
        }
        Some("object") => {
            let o = v.as_object().ok_or(format!("{at}: {v} is not an object"))?;
            let props = schema["properties"].as_object().cloned().unwrap_or_default();
            for r in schema["required"].as_array().into_iter().flatten() {
                let r = r.as_str().unwrap_or_default();
                if !o.contains_key(r) {
                    return Err(format!("{at}: `{r}` is missing"));
                }
            }
            for (k, x) in o {
                match props.get(k) {
                    Some(s) => validate(s, x, &format!("{at}.{k}"))?,
                    None if schema["additionalProperties"] == false => return Err(format!("{at}: extra `{k}`")),
                    None => {}
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{ "role": "user", "content": "Describe a pet as JSON." }],
        "max_tokens": 400,
    });
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

fn content(s: &Server, body: &Value) -> (String, String) {
    let r = s.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    let j = r.json();
    let c = &j["choices"][0];
    (
        c["message"]["content"].as_str().expect("content").to_string(),
        c["finish_reason"].as_str().expect("finish").into(),
    )
}

#[test]
fn sampled_replies_always_match_their_schema() {
    let s = Server::start(&[]);
    let format = json!({ "type": "json_schema", "json_schema": { "name": "pet", "schema": schema(), "strict": true } });
    for seed in 0..60 {
        let (text, finish) = content(&s, &chat(json!({ "temperature": 1.0, "seed": seed, "response_format": format })));
        assert_eq!(finish, "stop", "seed {seed}: the grammar ends the reply: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        validate(&schema(), &v, "$").unwrap_or_else(|e| panic!("seed {seed}: {text}: {e}"));
        let name = v["name"].as_str().expect("name");
        assert!((1..=6).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase()), "{text}");
    }
    // Any JSON object, vLLM's guided_json (a string schema) and the structured_outputs form.
    for seed in 0..20 {
        let (text, _) = content(
            &s,
            &chat(json!({ "temperature": 1.0, "seed": seed, "max_tokens": 60,
            "response_format": { "type": "json_object" }, "logit_bias": { "2": 5 } })),
        );
        // A random model may run out of tokens inside an object; what it wrote is a prefix of
        // one, and every complete reply parses as an object.
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            assert!(v.is_object(), "{text}");
        } else {
            assert!(text.starts_with('{'), "{text}");
        }
        let (text, _) =
            content(&s, &chat(json!({ "temperature": 1.0, "seed": seed, "guided_json": schema().to_string() })));
        validate(&schema(), &serde_json::from_str(&text).expect("json"), "$").expect("valid");
        let (text, _) = content(
            &s,
            &chat(json!({ "temperature": 1.0, "seed": seed,
            "structured_outputs": { "json": schema() } })),
        );
        validate(&schema(), &serde_json::from_str(&text).expect("json"), "$").expect("valid");
    }
}

#[test]
fn choices_regexes_grammars_and_completions() {
    let s = Server::start(&[]);
    let mut seen = std::collections::HashSet::new();
    for seed in 0..30 {
        let (c, finish) = content(
            &s,
            &chat(json!({ "temperature": 1.0, "seed": seed, "guided_choice": ["red", "green", "blue sky"] })),
        );
        assert!(["red", "green", "blue sky"].contains(&c.as_str()), "{c:?}");
        assert_eq!(finish, "stop");
        seen.insert(c);
        let (r, _) =
            content(&s, &chat(json!({ "temperature": 1.0, "seed": seed, "guided_regex": "[0-9]{2}:[a-f]{4}" })));
        let (d, h) = r.split_once(':').unwrap_or_else(|| panic!("{r:?}"));
        assert!(d.len() == 2 && d.bytes().all(|b| b.is_ascii_digit()), "{r:?}");
        assert!(h.len() == 4 && h.bytes().all(|b| (b'a'..=b'f').contains(&b)), "{r:?}");
        let (g, _) = content(
            &s,
            &chat(json!({ "temperature": 1.0, "seed": seed,
            "guided_grammar": "start: \"(\" num (\",\" num)? \")\"\nnum: /[1-3]/" })),
        );
        let inner = g.strip_prefix('(').and_then(|x| x.strip_suffix(')')).unwrap_or_else(|| panic!("{g:?}"));
        assert!(inner.split(',').all(|n| ["1", "2", "3"].contains(&n)), "{g:?}");
        // The completions endpoint takes the same fields.
        let r = s.post(
            "/v1/completions",
            &json!({ "prompt": "Pick:", "temperature": 1.0, "seed": seed,
            "max_tokens": 20, "guided_choice": ["alpha", "beta"] }),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let t = r.json()["choices"][0]["text"].as_str().expect("text").to_string();
        assert!(t == "alpha" || t == "beta", "{t:?}");
    }
    assert!(seen.len() >= 2, "the choice is sampled, not fixed: {seen:?}");
    // n > 1: every choice has its own matcher.
    let r = s.post(
        "/v1/chat/completions",
        &chat(json!({ "temperature": 1.0, "seed": 3, "n": 4,
        "guided_regex": "x[yz]{3}" })),
    );
    for c in r.json()["choices"].as_array().expect("choices") {
        let t = c["message"]["content"].as_str().expect("content");
        assert!(t.len() == 4 && t.starts_with('x'), "{t:?}");
    }
}

#[test]
fn responses_text_format_is_structured() {
    let s = Server::start(&[]);
    for seed in 0..10 {
        let r = s.post(
            "/v1/responses",
            &json!({ "input": "A pet?", "temperature": 1.0, "seed": seed,
            "max_output_tokens": 400,
            "text": { "format": { "type": "json_schema", "name": "pet", "schema": schema(), "strict": true } } }),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let j = r.json();
        assert_eq!(j["text"]["format"]["type"], "json_schema");
        let text = j["output"][0]["content"][0]["text"].as_str().expect("text");
        validate(&schema(), &serde_json::from_str(text).expect("json"), "$").unwrap_or_else(|e| panic!("{text}: {e}"));
    }
}

#[test]
fn bad_grammars_are_400s_naming_the_problem() {
    let s = Server::start(&[]);
    let cases = [
        (
            json!({ "response_format": { "type": "json_schema", "json_schema": { "name": "x", "schema": { "type": "objekt" } } } }),
            "response_format",
            "JSON schema",
        ),
        (
            json!({ "response_format": { "type": "json_schema", "json_schema": { "name": "x" } } }),
            "response_format.json_schema.schema",
            "required",
        ),
        (
            json!({ "response_format": { "type": "json_schema", "json_schema": { "schema": { "enum": [] } } } }),
            "response_format",
            "JSON schema",
        ),
        (json!({ "guided_regex": "(a" }), "guided_regex", "regex"),
        (json!({ "guided_grammar": "start: nothing_here" }), "guided_grammar", "grammar"),
        (json!({ "guided_choice": [] }), "guided_choice", "at least one"),
        (json!({ "guided_regex": "a", "guided_choice": ["b"] }), "guided_choice", "one structured output"),
        (json!({ "response_format": { "type": "xml" } }), "response_format.type", "json_schema"),
    ];
    for (extra, param, needle) in cases {
        let r = s.post("/v1/chat/completions", &chat(extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert!(e["error"]["message"].as_str().expect("message").contains(needle), "{e}");
    }
}

/// Greedy replies under a grammar, for prompts that repeat JSON so n-gram lookup drafts.
fn greedy_replies(s: &Server) -> Vec<String> {
    let example = r#"{"id":12,"kind":"cat","name":"abc","ok":true,"items":[{"n":1},{"n":2}]}"#;
    (0..6)
        .map(|i| {
            let prompt = format!("{example} {example} {example} {i}");
            let body = json!({ "messages": [{ "role": "user", "content": prompt }], "temperature": 0, "max_tokens": 200,
                "response_format": { "type": "json_schema", "json_schema": { "name": "pet", "schema": schema() } } });
            content(s, &body).0
        })
        .collect()
}

#[test]
fn speculation_keeps_greedy_structured_output() {
    let plain = Server::start(&[]);
    let want = greedy_replies(&plain);
    let spec = Server::start(&["--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 4}"#]);
    assert_eq!(greedy_replies(&spec), want);
    for text in &want {
        validate(&schema(), &serde_json::from_str(text).expect("json"), "$").expect("valid");
    }
    assert!(spec.metric("iris_spec_decode_num_draft_tokens_total").unwrap_or(0.0) > 0.0, "drafts were verified");
}
