//! An Anthropic Messages request as the chat template sees it: `system`, the messages with
//! their content blocks (text, image, `tool_use` and `thinking` in assistant turns,
//! `tool_result` in user turns), `tools`, `tool_choice` and `thinking`.
//!
//! A user turn's `tool_result` blocks become `tool` messages (what chat templates render as
//! tool output), ahead of the turn's other blocks; an assistant turn's `tool_use` blocks
//! become its `tool_calls` and its `thinking` blocks its `reasoning_content`. `cache_control`
//! on blocks and tools is accepted and ignored (iris caches every prompt's blocks by itself:
//! automatic prefix caching), as are thinking signatures and `redacted_thinking` blocks (no
//! other server can read them).
//!
//! Claude Code puts an `x-anthropic-billing-header: ...` line at the start of `system` that
//! changes with every request; left in, it would make every prompt differ from its first
//! tokens on, and no prefix would ever be cached. It is billing metadata for Anthropic's API,
//! not an instruction, so system lines that start with it are dropped before templating.

use serde_json::{json, Value};

use super::content::{mixed_items, text_items};
use super::errors::ApiError;
use super::images::{anthropic_image, ImageRef};
use super::tool_request::{spec, ToolChoice, ToolRequest};
use crate::tokenizer::{ChatMessage, MessageContent};

/// A string or a list of `{"type": "text", "text": ...}` blocks, concatenated.
pub fn blocks_text(v: &Value, path: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => Ok(text_items(blocks, path, "block")?.concat()),
        _ => Err(ApiError::invalid_param(path, format!("`{path}` must be a string or a list of content blocks"))),
    }
}

/// What starts Claude Code's per-request billing line in `system`.
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// `system` as text, without billing-header lines (see the module doc); a block that held only
/// that line is gone with it.
fn system_text(system: &Value) -> Result<String, ApiError> {
    Ok(match system {
        Value::Array(blocks) => text_items(blocks, "system", "block")?.into_iter().map(without_billing_lines).collect(),
        other => without_billing_lines(&blocks_text(other, "system")?),
    })
}

/// `text` without its lines that start with the billing header (leading spaces allowed).
fn without_billing_lines(text: &str) -> String {
    if !text.contains(BILLING_HEADER) {
        return text.to_string();
    }
    text.split_inclusive('\n').filter(|line| !line.trim_start().starts_with(BILLING_HEADER)).collect()
}

/// The conversation for the chat template, and the images of its `image` blocks in order.
pub fn to_chat(system: Option<&Value>, messages: &[Value]) -> Result<(Vec<ChatMessage>, Vec<ImageRef>), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut images = Vec::new();
    if let Some(system) = system {
        let text = system_text(system)?;
        if !text.is_empty() {
            out.push(ChatMessage::text("system", text));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            Some(other) => {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].role"),
                    format!(
                        "unknown role `{other}` in `messages[{i}]`: use user or assistant (system goes in `system`)"
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].role"),
                    format!("`messages[{i}].role` must be a string"),
                ))
            }
        };
        let content = m.get("content").ok_or_else(|| {
            ApiError::invalid_param(format!("messages[{i}].content"), format!("`messages[{i}]` has no `content`"))
        })?;
        let path = format!("messages[{i}].content");
        let Value::Array(blocks) = content else {
            out.push(ChatMessage::text(role, blocks_text(content, &path)?));
            continue;
        };
        let turn = if role == "user" { user_turn(blocks, &path, &mut images)? } else { assistant_turn(blocks, &path)? };
        out.extend(turn);
    }
    Ok((out, images))
}

fn block_type<'a>(b: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    b.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid_param(format!("{at}.type"), format!("`{at}` must be an object with a string `type`"))
    })
}

/// A user turn: its tool results as `tool` messages, then the rest as one user message.
fn user_turn(blocks: &[Value], path: &str, images: &mut Vec<ImageRef>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    let mut rest = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{path}[{j}]");
        if block_type(b, &at)? != "tool_result" {
            rest.push(b.clone());
            continue;
        }
        let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(format!("{at}.tool_use_id"), format!("`{at}.tool_use_id` must be a string"))
        })?;
        let mut msg = match b.get("content") {
            None | Some(Value::Null) => ChatMessage::text("tool", ""),
            Some(Value::String(s)) => ChatMessage::text("tool", s.clone()),
            Some(Value::Array(items)) if items.iter().any(|x| x.get("type") == Some(&json!("image"))) => {
                let (parts, refs) = mixed_items(items, &format!("{at}.content"), "block", "image", anthropic_image)?;
                images.extend(refs);
                ChatMessage::parts("tool", parts)
            }
            Some(v) => ChatMessage::text("tool", blocks_text(v, &format!("{at}.content"))?),
        };
        if b.get("is_error").and_then(Value::as_bool) == Some(true) {
            // Templates have no error flag: the model reads it in the text.
            if let Some(MessageContent::Text(t)) = &mut msg.content {
                *t = format!("Error: {t}");
            }
        }
        msg.extra.insert("tool_call_id".into(), json!(id));
        out.push(msg);
    }
    if !rest.is_empty() || out.is_empty() {
        if rest.iter().any(|b| b.get("type") == Some(&json!("image"))) {
            let (parts, refs) = mixed_items(&rest, path, "block", "image", anthropic_image)?;
            images.extend(refs);
            out.push(ChatMessage::parts("user", parts));
        } else {
            out.push(ChatMessage::text("user", blocks_text(&Value::Array(rest), path)?));
        }
    }
    Ok(out)
}

/// An assistant turn: text, thinking (as `reasoning_content`), tool uses (as `tool_calls`).
fn assistant_turn(blocks: &[Value], path: &str) -> Result<Vec<ChatMessage>, ApiError> {
    let mut text = String::new();
    let mut thinking = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{path}[{j}]");
        let string = |field: &str| {
            b.get(field).and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid_param(format!("{at}.{field}"), format!("`{at}.{field}` must be a string"))
            })
        };
        match block_type(b, &at)? {
            "text" => text.push_str(string("text")?),
            "thinking" => thinking.push_str(string("thinking")?),
            "redacted_thinking" => {}
            "tool_use" => {
                let input = match b.get("input") {
                    None | Some(Value::Null) => json!({}),
                    Some(o @ Value::Object(_)) => o.clone(),
                    Some(_) => {
                        return Err(ApiError::invalid_param(
                            format!("{at}.input"),
                            format!("`{at}.input` must be an object"),
                        ))
                    }
                };
                calls.push(json!({
                    "id": string("id")?,
                    "type": "function",
                    "function": { "name": string("name")?, "arguments": input },
                }));
            }
            other => {
                return Err(ApiError::invalid_param(
                    format!("{at}.type"),
                    format!(
                        "unsupported content block type `{other}` in `{at}`: an assistant turn takes text, thinking \
                         and tool_use blocks"
                    ),
                ))
            }
        }
    }
    let mut msg = ChatMessage::text("assistant", text);
    if !thinking.is_empty() {
        msg.extra.insert("reasoning_content".into(), json!(thinking));
    }
    if !calls.is_empty() {
        msg.extra.insert("tool_calls".into(), Value::Array(calls));
    }
    Ok(vec![msg])
}

/// Anthropic's `tools` and `tool_choice`, as the OpenAI-shaped tools the chat template takes.
pub fn tools(tools: Option<&Value>, choice: Option<&Value>) -> Result<ToolRequest, ApiError> {
    let mut req = ToolRequest::none();
    match tools {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                let at = format!("tools[{i}]");
                match t.get("type").and_then(Value::as_str) {
                    None | Some("custom") => {}
                    Some(other) => {
                        return Err(ApiError::invalid_param(
                            format!("{at}.type"),
                            format!(
                            "`{at}` is a `{other}` server tool: only custom tools (name, input_schema) are supported"
                        ),
                        ))
                    }
                }
                let s = spec(t, &at)?;
                let mut function = serde_json::Map::new();
                function.insert("name".into(), json!(s.name));
                if let Some(d) = t.get("description") {
                    function.insert("description".into(), d.clone());
                }
                function.insert("parameters".into(), s.parameters.clone());
                req.template_tools.push(json!({ "type": "function", "function": function }));
                req.specs.0.push(s);
            }
        }
        Some(_) => return Err(ApiError::invalid_param("tools", "`tools` must be a list of tools")),
    }
    req.choice = if req.specs.0.is_empty() { ToolChoice::None } else { ToolChoice::Auto };
    if let Some(c) = choice.filter(|c| !c.is_null()) {
        let ty = c.get("type").and_then(Value::as_str);
        req.choice = match ty {
            Some("auto") => ToolChoice::Auto,
            Some("any") => ToolChoice::Required,
            Some("none") => ToolChoice::None,
            Some("tool") => match c.get("name").and_then(Value::as_str) {
                Some(n) => ToolChoice::Function(n.to_string()),
                None => return Err(ApiError::invalid_param("tool_choice.name", "`tool_choice.name` must be a string")),
            },
            _ => {
                return Err(ApiError::invalid_param(
                    "tool_choice.type",
                    "`tool_choice.type` must be one of auto, any, tool, none",
                ))
            }
        };
        if c.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            req.parallel = false;
        }
    }
    req.check_choice("tool_choice")?;
    Ok(req)
}

/// `thinking: {"type": "enabled" | "disabled" | "adaptive"}` as the template's
/// `enable_thinking` (`budget_tokens` is accepted; nothing enforces it yet).
pub fn thinking_vars(thinking: Option<&Value>, extra: &mut serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let Some(t) = thinking.filter(|t| !t.is_null()) else { return Ok(()) };
    let on = match t.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => true,
        Some("disabled") => false,
        _ => {
            return Err(ApiError::invalid_param(
                "thinking.type",
                "`thinking.type` must be one of enabled, disabled, adaptive",
            ))
        }
    };
    extra.insert("enable_thinking".into(), json!(on));
    Ok(())
}

/// The text of a message's content, if it is text (an assistant prefill).
pub fn prefill_text(m: &ChatMessage) -> Option<&str> {
    let has_calls = m.extra.contains_key("tool_calls");
    match &m.content {
        Some(MessageContent::Text(t)) if !has_calls => Some(t),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Claude Code's billing line changes per request; the system text is the same without it.
    #[test]
    fn billing_header_lines_leave_the_system_text() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let system_of = |system: Value| {
            let (msgs, _) = to_chat(Some(&system), user.as_array().expect("list")).expect("ok");
            msgs.iter().find(|m| m.role == "system").and_then(|m| m.content.clone())
        };
        let text = |s: &str| Some(MessageContent::Text(s.into()));
        let blocks = |header: &str| {
            json!([
                {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.0.{header}; cch=ab{header};")},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            ])
        };
        assert_eq!(system_of(blocks("1")), text("You are Claude Code."));
        assert_eq!(system_of(blocks("1")), system_of(blocks("2")));
        // As a line of a string, anywhere.
        let s = "x-anthropic-billing-header: cc_version=1;\nBe brief.\n  x-anthropic-billing-header: x\nEnd.";
        assert_eq!(system_of(json!(s)), text("Be brief.\nEnd."));
        // Only the billing line: no system message at all.
        assert_eq!(system_of(json!("x-anthropic-billing-header: cch=1")), None);
        // Other text mentioning it stays.
        assert_eq!(
            system_of(json!("see x-anthropic-billing-header: docs")),
            text("see x-anthropic-billing-header: docs")
        );
    }

    #[test]
    fn tool_turns_become_template_messages() {
        let messages = json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I need the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}], "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Thanks"},
            ]},
        ]);
        let (msgs, images) = to_chat(Some(&json!("Be brief.")), messages.as_array().expect("list")).expect("ok");
        assert!(images.is_empty());
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        let a = &msgs[2];
        assert_eq!(a.extra["reasoning_content"], json!("I need the tool."));
        assert_eq!(
            a.extra["tool_calls"][0]["function"],
            json!({"name": "get_weather", "arguments": {"city": "Paris"}})
        );
        assert_eq!(msgs[3].extra["tool_call_id"], json!("toolu_1"));
        assert_eq!(msgs[3].content, Some(MessageContent::Text("18C".into())));
    }

    #[test]
    fn tool_results_carry_text_and_images() {
        let messages = json!([
            {"role": "user", "content": "Look at the screen."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                ]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "failed", "is_error": true},
            ]},
        ]);
        let (msgs, images) = to_chat(None, messages.as_array().expect("list")).expect("ok");
        assert_eq!(images.len(), 1);
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "tool"]);
        match &msgs[2].content {
            Some(MessageContent::Parts(p)) => {
                assert_eq!(p.iter().map(|x| x.kind.as_str()).collect::<Vec<_>>(), ["text", "image"])
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(msgs[3].content, Some(MessageContent::Text("Error: failed".into())));
        // A tool_result without its id, and an unknown assistant block, are 400s.
        let bad = json!([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]);
        assert!(to_chat(None, bad.as_array().expect("list")).is_err());
        let bad = json!([{"role": "assistant", "content": [{"type": "server_tool_use", "id": "x"}]}]);
        assert!(to_chat(None, bad.as_array().expect("list")).is_err());
    }

    #[test]
    fn anthropic_tool_choices() {
        let t = json!([{"name": "f", "input_schema": {"type": "object"}}]);
        assert_eq!(tools(Some(&t), None).expect("ok").choice, ToolChoice::Auto);
        assert_eq!(tools(Some(&t), Some(&json!({"type": "any"}))).expect("ok").choice, ToolChoice::Required);
        let named = tools(Some(&t), Some(&json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true})))
            .expect("ok");
        assert_eq!(named.choice, ToolChoice::Function("f".into()));
        assert!(!named.parallel);
        assert_eq!(named.template_tools[0]["function"]["parameters"], json!({"type": "object"}));
        assert!(tools(Some(&t), Some(&json!({"type": "tool", "name": "g"}))).is_err());
        assert!(tools(Some(&json!([{"type": "web_search_20250305", "name": "w"}])), None).is_err());
    }
}
