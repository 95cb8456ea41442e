//! Each format on model outputs written from its documentation (the chat templates'
//! instructions and the way they write earlier calls), fed whole and cut at every char
//! boundary (in two and in three pieces, and one char at a time): every split gives the
//! same text and calls as the whole.

use serde_json::{json, Value};

use super::*;

/// (text, calls as (name, arguments parsed)) from `pieces`.
fn run(format: ToolFormat, tools: &Tools, pieces: &[&str]) -> (String, Vec<(String, Value)>) {
    let mut p = format.parser(tools.clone());
    let mut events = Vec::new();
    for s in pieces {
        p.feed(s, &mut events);
    }
    p.finish(&mut events);
    let mut text = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut open = false;
    for e in events {
        match e {
            ToolEvent::Text(t) => {
                assert!(!open, "text inside a call");
                text.push_str(&t)
            }
            ToolEvent::Start { name } => {
                assert!(!open, "a call inside a call");
                open = true;
                calls.push((name, String::new()))
            }
            ToolEvent::Args(a) => calls.last_mut().expect("a call is open").1.push_str(&a),
            ToolEvent::End => open = false,
        }
    }
    assert!(!open, "a call never ended");
    let calls = calls
        .into_iter()
        .map(|(n, a)| (n, serde_json::from_str(&a).unwrap_or_else(|e| panic!("arguments {a:?} are not JSON: {e}"))))
        .collect();
    (text, calls)
}

fn every_split(format: ToolFormat, tools: &Tools, text: &str, want_text: &str, want_calls: &[(&str, Value)]) {
    let whole = run(format, tools, &[text]);
    let want: Vec<(String, Value)> = want_calls.iter().map(|(n, a)| (n.to_string(), a.clone())).collect();
    assert_eq!(whole, (want_text.to_string(), want), "{} on the whole of {text:?}", format.name());
    let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    for &a in &cuts {
        assert_eq!(run(format, tools, &[&text[..a], &text[a..]]), whole, "{}: cut at {a} of {text:?}", format.name());
        for &b in cuts.iter().filter(|&&b| b >= a) {
            let got = run(format, tools, &[&text[..a], &text[a..b], &text[b..]]);
            assert_eq!(got, whole, "{}: cuts at {a}, {b} of {text:?}", format.name());
        }
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(format, tools, &refs), whole, "{}: char by char", format.name());
}

fn weather_tools() -> Tools {
    Tools(vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
            }, "required": ["city"]}),
        },
        ToolSpec {
            name: "note".into(),
            parameters: json!({"type": "object", "properties": {"text": {"type": "string"}, "meta": {"type": "object"}}}),
        },
    ])
}

#[test]
fn hermes_calls() {
    let t = weather_tools();
    let h = ToolFormat::Hermes;
    every_split(
        h,
        &t,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
        "",
        &[("get_weather", json!({"city": "Paris", "days": 2}))],
    );
    // Text before, two calls, nothing after (the newlines next to calls are not content).
    every_split(
        h,
        &t,
        "Let me check both.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"note\", \"arguments\": {\"text\": \"a < b </tool\"}}\n</tool_call>\n",
        "Let me check both.",
        &[("get_weather", json!({"city": "Zürich"})), ("note", json!({"text": "a < b </tool"}))],
    );
    // Plain answers, with a `<` that is no tag, stay as they are.
    every_split(h, &t, "1 < 2 and <b>bold</b>\n", "1 < 2 and <b>bold</b>\n", &[]);
    // Arguments as a JSON string (some fine-tunes), and none at all.
    every_split(
        h,
        &t,
        "<tool_call>{\"name\": \"note\", \"arguments\": \"{\\\"text\\\": \\\"x\\\"}\"}</tool_call><tool_call>{\"name\": \"note\"}</tool_call>",
        "",
        &[("note", json!({"text": "x"})), ("note", json!({}))],
    );
    // A call the reply ends inside of (EOS before the closing tag) still counts.
    every_split(h, &t, "<tool_call>\n{\"name\": \"note\", \"arguments\": {}}\n", "", &[("note", json!({}))]);
}

#[test]
fn hermes_malformed_calls_are_text() {
    let t = weather_tools();
    let h = ToolFormat::Hermes;
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    every_split(h, &t, bad, bad, &[]);
    every_split(h, &t, "Hi <tool_call>{\"oops\"", "Hi <tool_call>{\"oops\"", &[]);
    every_split(h, &t, "<tool_call>[1, 2]</tool_call> after", "<tool_call>[1, 2]</tool_call> after", &[]);
    // A good call after a bad one is still a call.
    every_split(
        h,
        &t,
        "<tool_call>nope</tool_call>\n<tool_call>{\"name\": \"note\", \"arguments\": {}}</tool_call>",
        "<tool_call>nope</tool_call>",
        &[("note", json!({}))],
    );
}

#[test]
fn qwen3_xml_calls() {
    let t = weather_tools();
    let q = ToolFormat::Qwen3Xml;
    every_split(
        q,
        &t,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("get_weather", json!({"city": "New York", "days": 3, "metric": false, "hours": [9, 12]}))],
    );
    // Text before (Qwen3.5 writes "\n\n" between), two calls, multi-line string values,
    // an object value, a parameter the schema does not list (text).
    every_split(
        q,
        &t,
        "I will write it down.\n\n<tool_call>\n<function=note>\n<parameter=text>\nline one\nline two\n</parameter>\n<parameter=meta>\n{\"k\": [1]}\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n東京\n</parameter>\n</function>\n</tool_call>",
        "I will write it down.",
        &[
            ("note", json!({"text": "line one\nline two", "meta": {"k": [1]}, "extra": "42"})),
            ("get_weather", json!({"city": "東京"})),
        ],
    );
    // A value that does not fit its type stays text; a call without parameters.
    every_split(
        q,
        &t,
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call><tool_call><function=note></function></tool_call>",
        "",
        &[("get_weather", json!({"days": "three"})), ("note", json!({}))],
    );
    // Malformed: no function tag.
    let bad = "<tool_call>\n{\"name\": \"note\"}\n</tool_call>";
    every_split(q, &t, bad, bad, &[]);
}

#[test]
fn glm45_calls() {
    let t = weather_tools();
    let g = ToolFormat::Glm45;
    every_split(
        g,
        &t,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[8, 20]</arg_value>\n</tool_call>",
        "",
        &[("get_weather", json!({"city": "Beijing", "days": 2, "hours": [8, 20]}))],
    );
    // Text before; a string value that looks like a number stays a string (schema says so);
    // a value of an unknown parameter is read as JSON where it is JSON.
    every_split(
        g,
        &t,
        "Noting it.\n<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>123</arg_value>\n<arg_key>flag</arg_key>\n<arg_value>true</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n</tool_call>",
        "Noting it.",
        &[("note", json!({"text": "123", "flag": true})), ("get_weather", json!({"city": "北京"}))],
    );
    every_split(g, &t, "<tool_call>note</tool_call>", "", &[("note", json!({}))]);
    let bad = "<tool_call>two words\n<arg_key>a</arg_key></tool_call>";
    every_split(g, &t, bad, bad, &[]);
}

#[test]
fn llama3_json_calls() {
    let t = weather_tools();
    let l = ToolFormat::Llama3Json;
    every_split(
        l,
        &t,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Lima\", \"days\": 1}}",
        "",
        &[("get_weather", json!({"city": "Lima", "days": 1}))],
    );
    every_split(
        l,
        &t,
        "<|python_tag|>{\"name\": \"note\", \"parameters\": {\"text\": \"}{\\\"\"}}; {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}",
        "",
        &[("note", json!({"text": "}{\""})), ("get_weather", json!({"city": "Oslo"}))],
    );
    // Text replies, and objects that are not calls, are text.
    every_split(l, &t, "The weather is {mild}.", "The weather is {mild}.", &[]);
    every_split(l, &t, "{\"answer\": 42}", "{\"answer\": 42}", &[]);
    every_split(
        l,
        &t,
        "  {\"name\": \"note\", \"parameters\": {\"text\": ",
        "{\"name\": \"note\", \"parameters\": {\"text\": ",
        &[],
    );
}

#[test]
fn formats_are_detected_from_the_real_templates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    for (file, want) in [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", Some(ToolFormat::Hermes)),
        ("Qwen-Qwen3-0.6B.jinja", Some(ToolFormat::Hermes)),
        ("Qwen3-Coder.jinja", Some(ToolFormat::Qwen3Xml)),
        ("Qwen3.5-4B.jinja", Some(ToolFormat::Qwen3Xml)),
        ("GLM-4.6.jinja", Some(ToolFormat::Glm45)),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", Some(ToolFormat::Llama3Json)),
        ("google-gemma-4-31B-it.jinja", Some(ToolFormat::Gemma4)),
        ("google-gemma-4-31B-it-interleaved.jinja", Some(ToolFormat::Gemma4)),
    ] {
        let src = std::fs::read_to_string(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(ToolFormat::detect(&src), want, "{file}");
    }
    assert_eq!(ToolFormat::detect("{{ messages[0].content }}"), None);
    for name in ToolFormat::NAMES {
        assert!(ToolFormat::from_name(name).is_some(), "{name}");
    }
}

#[test]
fn xml_calls_stream_before_their_block_closes() {
    let t = weather_tools();
    for (format, text) in [
        (
            ToolFormat::Qwen3Xml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n",
        ),
        (
            ToolFormat::Glm45,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>",
        ),
    ] {
        let mut p = format.parser(t.clone());
        let mut events = Vec::new();
        p.feed(text, &mut events);
        // The call has begun and its first argument is out; the second is not complete.
        assert_eq!(
            events,
            vec![
                ToolEvent::Start { name: "get_weather".into() },
                ToolEvent::Args("{\"city\":\"Paris\"}".replace('}', ""))
            ],
            "{}",
            format.name()
        );
        p.finish(&mut events);
        let args: String =
            events.iter().filter_map(|e| if let ToolEvent::Args(a) = e { Some(a.as_str()) } else { None }).collect();
        let v: Value = serde_json::from_str(&args).expect("arguments are JSON");
        assert_eq!(v["city"], "Paris", "{}", format.name());
    }
}

#[test]
fn xml_calls_drop_what_is_no_parameter() {
    let t = weather_tools();
    // A header makes a call: what follows its last complete parameter and is none is dropped.
    every_split(
        ToolFormat::Qwen3Xml,
        &t,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\nI think that is all.\n</function>\n</tool_call>",
        "",
        &[("get_weather", json!({"city": "Rome"}))],
    );
    every_split(
        ToolFormat::Glm45,
        &t,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\noops</tool_call>Done.",
        "Done.",
        &[("get_weather", json!({"city": "Rome"}))],
    );
    // Two functions in one block (Qwen3-Coder sometimes does).
    every_split(
        ToolFormat::Qwen3Xml,
        &t,
        "<tool_call>\n<function=note>\n</function>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("note", json!({})), ("get_weather", json!({"city": "X"}))],
    );
}

/// Gemma 4's syntax, `q` standing for its string quote `<|"|>`.
fn gemma(text: &str) -> String {
    text.replace('q', "<|\"|>")
}

#[test]
fn gemma4_calls() {
    let t = weather_tools();
    let g = ToolFormat::Gemma4;
    // As the template writes a call: sorted bare keys, every kind of value.
    every_split(
        g,
        &t,
        &gemma("<|tool_call>call:get_weather{city:qParis, Franceq,days:2,hours:[9,12],metric:true}<tool_call|>"),
        "",
        &[("get_weather", json!({"city": "Paris, France", "days": 2, "hours": [9, 12], "metric": true}))],
    );
    // Text before, two calls back to back; nested values, multi-line strings holding the
    // format's own punctuation, floats and nulls, a bare value for a string parameter.
    every_split(
        g,
        &t,
        &gemma("Let me check.\n<|tool_call>call:note{meta:{k:[1.5,null,qa}bq],w:{}},text:qline one\n{x:1}, ]q}<tool_call|><|tool_call>call:get_weather{city:75001,days:-3}<tool_call|>"),
        "Let me check.",
        &[
            ("note", json!({"meta": {"k": [1.5, null, "a}b"], "w": {}}, "text": "line one\n{x:1}, ]"})),
            ("get_weather", json!({"city": "75001", "days": -3})),
        ],
    );
    // Thinking-free answers with braces stay text; a call without arguments; text after.
    every_split(g, &t, "f(x) = {x: 1}", "f(x) = {x: 1}", &[]);
    every_split(g, &t, "<|tool_call>call:note{}<tool_call|>Done.", "Done.", &[("note", json!({}))]);
    // The reply ended inside a call (a stop token, max_tokens): what parses is the call.
    every_split(
        g,
        &t,
        &gemma("<|tool_call>call:get_weather{city:qOsloq"),
        "",
        &[("get_weather", json!({"city": "Oslo"}))],
    );
}

#[test]
fn gemma4_malformed_calls_are_text() {
    let t = weather_tools();
    let g = ToolFormat::Gemma4;
    let bad = gemma("<|tool_call>get_weather{city:qParisq}<tool_call|>");
    every_split(g, &t, &bad, &bad, &[]);
    every_split(g, &t, "<|tool_call>call: two words{}<tool_call|>", "<|tool_call>call: two words{}<tool_call|>", &[]);
    // What follows the last good argument and is none is dropped; the call stands.
    every_split(
        g,
        &t,
        &gemma("<|tool_call>call:get_weather{city:qRomeq,days 2}<tool_call|>"),
        "",
        &[("get_weather", json!({"city": "Rome"}))],
    );
}

#[test]
fn gemma4_calls_stream_argument_by_argument() {
    let mut p = ToolFormat::Gemma4.parser(weather_tools());
    let mut events = Vec::new();
    p.feed(&gemma("<|tool_call>call:get_weather{city:qParisq,days:2"), &mut events);
    // The call has begun and its first argument is out; `days` waits for what ends it.
    assert_eq!(
        events,
        vec![ToolEvent::Start { name: "get_weather".into() }, ToolEvent::Args("{\"city\":\"Paris\"".into())]
    );
    p.feed("}<tool_call|>", &mut events);
    assert_eq!(events[2..], [ToolEvent::Args(",\"days\":2".into()), ToolEvent::Args("}".into()), ToolEvent::End]);
}
