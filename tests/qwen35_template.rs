//! Qwen3.5's real chat template (llama-cpp-python 0.3.36's `Qwen3.5-4B.jinja`) through the
//! server's path: the OpenAI request's messages through `parse_messages`, the tools through
//! `ToolRequest`, the template through minijinja and the prompt through the tokenizer's
//! `encode_chat_with`, which must give transformers' text and ids: thinking on and off, earlier
//! turns' reasoning dropped and the last query's kept, tools with multi-step calls, images
//! (tests/fixtures/qwen35_template, made by scripts/make_qwen35_template_fixtures.py).

use std::path::{Path, PathBuf};

use iris::server::openai::parse_messages;
use iris::server::tool_request::ToolRequest;
use iris::tokenizer::TextTokenizer;
use serde_json::Value;

/// The fixture's tokenizer with the template as its `chat_template.jinja`, as a model
/// directory ships it.
fn tokenizer_dir(root: &Path, template: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iris-qwen35-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(root.join("qwen35_template").join(file), dir.join(file)).expect("copy tokenizer");
    }
    std::fs::copy(root.join("templates").join(template), dir.join("chat_template.jinja")).expect("copy template");
    dir
}

#[test]
fn qwen35_template_gives_transformers_text_and_ids() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let f: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("qwen35_template/cases.json")).expect("read"))
            .expect("json");
    let dir = tokenizer_dir(&root, f["template"].as_str().expect("template"));
    let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
    std::fs::remove_dir_all(&dir).ok();
    let cases = f["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10, "expected every case, found {}", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("name");
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
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
