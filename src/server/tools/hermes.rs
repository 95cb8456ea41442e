//! `hermes`: Qwen2.5 and Qwen3 (and Hermes) write each call as
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, as their chat templates
//! tell them (Qwen-Qwen2.5-7B-Instruct.jinja, Qwen-Qwen3-0.6B.jinja).

use serde_json::Value;

use super::parser::Tools;
use super::tagged::BlockFormat;

pub struct Hermes;

impl BlockFormat for Hermes {
    const OPEN: &'static str = "<tool_call>";
    const CLOSE: &'static str = "</tool_call>";

    fn parse(body: &str, _tools: &Tools) -> Option<Vec<(String, String)>> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        if name.is_empty() {
            return None;
        }
        // `arguments` as the template writes it; `parameters` as some fine-tunes do.
        let args = match v.get("arguments").or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(o @ Value::Object(_)) => o,
                _ => return None,
            },
            Some(o @ Value::Object(_)) => o.clone(),
            Some(_) => return None,
        };
        Some(vec![(name, args.to_string())])
    }
}
