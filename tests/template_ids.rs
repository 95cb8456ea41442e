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

use std::path::{Path, PathBuf};

use iris::server::openai::parse_messages;
use iris::server::tool_request::ToolRequest;
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
    let dir = std::env::temp_dir().join(format!("iris-template-ids-{fixture}-{stem}-{}", std::process::id()));
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
