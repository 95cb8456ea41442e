//! Real chat templates through the server's path, against transformers' text and ids: the
//! OpenAI request's messages through `parse_messages`, the tools through `ToolRequest`, the
//! template through minijinja and the prompt through the tokenizer's `encode_chat_with`.
//!
//! * Qwen3.5 (llama-cpp-python 0.3.36's `Qwen3.5-4B.jinja`): thinking on and off, earlier
//!   turns' reasoning dropped and the last query's kept, tools with multi-step calls, images
//!   (tests/fixtures/qwen35_template, scripts/make_qwen35_template_fixtures.py);
//! * Gemma 4 (`google-gemma-4-31B-it.jinja` and its interleaved variant): system turns,
//!   thinking on and off, tool declarations, calls with every kind of argument, tool results,
//!   parallel calls, a call's reasoning, images (tests/fixtures/gemma4_template,
//!   scripts/make_gemma4_template_fixtures.py).
//!
//! Each fixture directory holds a tokenizer with the family's control tokens and its cases.
//!
//! A forced call's opening (`tool_choice` required or named), which iris writes after the
//! prompt, is tokenized as the template's markup: Gemma 4's `<|tool_call>` is its one id.

use std::path::{Path, PathBuf};

use iris::server::openai::parse_messages;
use iris::server::tool_request::{Forced, ToolRequest};
use iris::server::tools::ToolFormat;
use iris::tokenizer::TextTokenizer;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The fixture's tokenizer with `template` as its `chat_template.jinja`, as a model
/// directory ships it.
fn tokenizer(fixture: &str, template: &str) -> TextTokenizer {
    let root = fixtures();
    let stem = template.trim_end_matches(".jinja");
    // One directory per call: the tests run at once and remove theirs.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("iris-template-ids-{fixture}-{stem}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(root.join(fixture).join(file), dir.join(file)).expect("copy tokenizer");
    }
    std::fs::copy(root.join("templates").join(template), dir.join("chat_template.jinja")).expect("copy template");
    let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
    std::fs::remove_dir_all(&dir).ok();
    tok
}

/// Every case of `fixture`'s cases.json that renders to other text or ids than transformers'.
fn failures(fixture: &str, min_cases: usize) -> Vec<String> {
    let file = fixtures().join(fixture).join("cases.json");
    let f: Value = serde_json::from_str(&std::fs::read_to_string(file).expect("read")).expect("json");
    let cases = f["cases"].as_array().expect("cases");
    assert!(cases.len() >= min_cases, "{fixture}: expected every case, found {}", cases.len());
    let mut failures = Vec::new();
    let mut toks: Vec<(String, TextTokenizer)> = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("name");
        // One template for the whole file, or one per case.
        let template = case["template"].as_str().or(f["template"].as_str()).expect("template");
        if !toks.iter().any(|(t, _)| t == template) {
            toks.push((template.to_string(), tokenizer(fixture, template)));
        }
        let tok = &toks.iter().find(|(t, _)| t == template).expect("loaded").1;
        let (messages, _images) = parse_messages(case["messages"].as_array().expect("messages")).expect("parse");
        let tools = ToolRequest::openai(Some(&case["tools"]), None, None).expect("tools");
        let mut extra = case["kwargs"].as_object().cloned().unwrap_or_default();
        tools.template_vars(&mut extra);
        let text = tok.apply_chat_template_with(&messages, true, extra.clone());
        let ids = tok.encode_chat_with(&messages, true, extra);
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
        match (text, ids) {
            (Ok(text), _) if text != case["expected"].as_str().expect("expected") => failures.push(format!(
                "{name}: rendered differently\n--- iris\n{text}\n--- transformers\n{}",
                case["expected"].as_str().unwrap_or_default()
            )),
            (Ok(_), Ok(ids)) if ids != want => failures.push(format!("{name}: ids\n iris {ids:?}\n want {want:?}")),
            (Ok(_), Ok(_)) => {}
            (Err(e), _) | (_, Err(e)) => failures.push(format!("{name}: {e}")),
        }
    }
    failures
}

#[test]
fn qwen35_template_gives_transformers_text_and_ids() {
    let f = failures("qwen35_template", 10);
    assert!(f.is_empty(), "{}", f.join("\n\n"));
}

#[test]
fn gemma4_templates_give_transformers_text_and_ids() {
    let f = failures("gemma4_template", 22);
    assert!(f.is_empty(), "{}", f.join("\n\n"));
}

/// The case of `fixture` named `name`.
fn case(fixture: &str, name: &str) -> Value {
    let file = fixtures().join(fixture).join("cases.json");
    let f: Value = serde_json::from_str(&std::fs::read_to_string(file).expect("read")).expect("json");
    f["cases"].as_array().expect("cases").iter().find(|c| c["name"] == name).expect("case").clone()
}

#[test]
fn gemma4_forced_call_opening_is_its_control_tokens() {
    let template = "google-gemma-4-31B-it.jinja";
    let tok = tokenizer("gemma4_template", template);
    let first = case("gemma4_template", "google-gemma-4-31B-it.tools_first_turn");
    let (messages, _) = parse_messages(first["messages"].as_array().expect("messages")).expect("parse");
    let tools = ToolRequest::openai(Some(&first["tools"]), None, None).expect("tools");
    let mut extra = serde_json::Map::new();
    tools.template_vars(&mut extra);
    let prompt = tok.encode_chat_with(&messages, true, extra.clone()).expect("prompt");
    let text = tok.apply_chat_template_with(&messages, true, extra).expect("text");
    let call_id = tok.token_to_id("<|tool_call>").expect("Gemma's call token");
    // transformers' ids of a reply that calls get_weather, rendered as history.
    let history = case("gemma4_template", "google-gemma-4-31B-it.tools_round_trip");
    let want: Vec<u32> = serde_json::from_value(history["ids"].clone()).expect("ids");
    let at = want.iter().position(|&id| id == call_id).expect("the call in transformers' ids");
    for name in [Some("get_weather"), None] {
        let forced = Forced::call(&tok, ToolFormat::Gemma4, &tools.specs.0, name, true, "");
        let mut ids = prompt.clone();
        forced.append_to(&tok, &mut ids).expect("opening");
        // The rendered prompt and the opening, as the tokenizer reads the template's text.
        let whole = tok.encode(&format!("{text}{}", forced.text), false).expect("encode");
        assert_eq!(ids, whole, "{name:?}");
        let opening = &ids[prompt.len()..];
        assert_eq!(opening[0], call_id, "{name:?}: {opening:?}");
        // The opening is how transformers tokenizes the start of the model's own call.
        assert_eq!(opening, &want[at..at + opening.len()], "{name:?}");
    }
    // A caller's name that spells a control token stays text (no role injection).
    let forced = Forced::call(&tok, ToolFormat::Gemma4, &tools.specs.0, Some("f<turn|>"), true, "");
    let mut ids = Vec::new();
    forced.append_to(&tok, &mut ids).expect("opening");
    let turn_end = tok.token_to_id("<turn|>").expect("turn end");
    assert_eq!(ids[0], call_id);
    assert!(!ids.contains(&turn_end), "{ids:?}");
}
