//! Text content given as a list of typed items (OpenAI content parts, Anthropic content blocks).

use serde_json::Value;

use super::errors::ApiError;

/// The texts of `[{"type": "text", "text": ...}, ...]` at `path`, in order. `noun` names an
/// item in errors ("part" for OpenAI, "block" for Anthropic).
pub fn text_items<'a>(items: &'a [Value], path: &str, noun: &str) -> Result<Vec<&'a str>, ApiError> {
    let mut texts = Vec::with_capacity(items.len());
    for (j, item) in items.iter().enumerate() {
        match item.get("type").and_then(Value::as_str) {
            Some("text") => match item.get("text") {
                Some(Value::String(t)) => texts.push(t.as_str()),
                _ => {
                    return Err(ApiError::invalid_param(
                        format!("{path}[{j}].text"),
                        format!("`{path}[{j}].text` must be a string"),
                    ))
                }
            },
            Some(other) => {
                return Err(ApiError::invalid_param(
                    format!("{path}[{j}].type"),
                    format!(
                    "unsupported content {noun} type `{other}` in `{path}[{j}]`: this server accepts text {noun}s only"
                ),
                ))
            }
            None => {
                return Err(ApiError::invalid_param(
                    format!("{path}[{j}].type"),
                    format!("`{path}[{j}]` must be an object with a string `type`"),
                ))
            }
        }
    }
    Ok(texts)
}
