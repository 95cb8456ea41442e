//! Tool conversations through the real chat templates of the families iris serves (Qwen2.5,
//! Qwen3, Qwen3-Coder, Qwen3.5, GLM-4.6, Llama 3.1): the OpenAI request's messages go
//! through the server's conversion (`parse_messages`: `tool` messages, assistant
//! `tool_calls` with JSON-text arguments, `reasoning_content`) and its template renderer
//! with the tools, and must render exactly what transformers renders
//! (tests/fixtures/tool_templates, made by scripts/make_tool_template_fixtures.py).

use std::path::Path;

use iris::server::openai::parse_messages;
use iris::server::tool_request::ToolRequest;
use iris::tokenizer::{ChatTemplate, RenderOptions};
use serde_json::Value;

#[test]
fn tools_render_as_transformers_renders_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut files: Vec<_> = std::fs::read_dir(root.join("tool_templates"))
        .expect("tests/fixtures/tool_templates")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 20, "expected the fixtures of every template, found {}", files.len());
    let mut failures = Vec::new();
    for file in &files {
        let f: Value = serde_json::from_str(&std::fs::read_to_string(file).expect("read")).expect("json");
        let name = f["template"].as_str().expect("template");
        let source = std::fs::read_to_string(root.join("templates").join(name)).expect("template file");
        let template = ChatTemplate::new(&source).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (messages, _) = parse_messages(f["messages"].as_array().expect("messages")).expect("messages parse");
        let tools = ToolRequest::openai(Some(&f["tools"]), None, None).expect("tools parse");
        let mut extra = f["kwargs"].as_object().cloned().unwrap_or_default();
        tools.template_vars(&mut extra);
        let special_tokens = f["special_tokens"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string())).collect())
            .unwrap_or_default();
        let options = RenderOptions { add_generation_prompt: true, special_tokens, extra };
        match template.render(&messages, &options) {
            Ok(got) if got == f["expected"].as_str().expect("expected") => {}
            Ok(got) => failures.push(format!(
                "{}: rendered differently\n--- iris\n{got}\n--- transformers\n{}",
                file.display(),
                f["expected"].as_str().unwrap_or_default()
            )),
            Err(e) => failures.push(format!("{}: {e}", file.display())),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
