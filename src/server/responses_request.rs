//! The request side of the Responses API: `input` (a string, or items: messages with
//! `input_text` / `input_image` parts, earlier outputs, `function_call` and
//! `function_call_output` items) as chat template messages; function tools in the Responses'
//! flat shape and `tool_choice` as the chat endpoint reads them; `reasoning`, `text` and the
//! settings iris has no use for but must not ignore silently.
//!
//! Earlier outputs come back as items (`reasoning`, an assistant `message`, `function_call`s),
//! which the chat templates know as one assistant message: consecutive ones are folded into
//! it (its `reasoning_content`, `content` and `tool_calls`).

use serde_json::{json, Map, Value};

use super::content::{typed_mixed_items, typed_text_items};
use super::errors::ApiError;
use super::images::{ImageRef, Source};
use super::tool_request::{spec, template_tool_calls, ToolRequest};
use crate::tokenizer::ChatMessage;

fn bad(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message).code("unsupported_field")
}

/// An `input_image` part: `image_url` a `data:` or http(s) URL (as the chat endpoint takes
/// it); `file_id` needs OpenAI's file store, which iris does not have.
fn input_image(part: &Value, path: &str) -> Result<ImageRef, ApiError> {
    match part.get("image_url") {
        Some(Value::String(url)) => Ok(ImageRef {
            item: path.to_string(),
            item_type: "input_image",
            path: format!("{path}.image_url"),
            source: Source::from_url(url),
        }),
        _ if part.get("file_id").is_some_and(|f| !f.is_null()) => Err(unsupported(
            format!("{path}.file_id"),
            format!("`{path}.file_id`: iris has no file store; send the image as `image_url` (a data: URL)"),
        )),
        _ => Err(bad(format!("{path}.image_url"), format!("`{path}.image_url` must be a string (a URL)"))),
    }
}

/// A message's content: a string, or parts whose text type is `text_type`; images only in
/// `input_text` content (what users send).
fn content(
    v: Option<&Value>,
    path: &str,
    role: &str,
    text_type: &str,
    images: &mut Vec<ImageRef>,
) -> Result<ChatMessage, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(ChatMessage::text(role, s.as_str())),
        Some(Value::Array(parts)) if text_type == "input_text" => {
            if parts.iter().any(|p| p.get("type").and_then(Value::as_str) == Some("input_image")) {
                let (parts, refs) = typed_mixed_items(parts, path, ("part", "input_text"), "input_image", input_image)?;
                images.extend(refs);
                Ok(ChatMessage::parts(role, parts))
            } else {
                Ok(ChatMessage::text(role, typed_text_items(parts, path, "part", "input_text")?.join("\n")))
            }
        }
        Some(Value::Array(parts)) => {
            Ok(ChatMessage::text(role, typed_text_items(parts, path, "part", text_type)?.join("\n")))
        }
        _ => Err(bad(path, format!("`{path}` must be a string or a list of content parts"))),
    }
}

fn string_field<'a>(item: &'a Value, at: &str, name: &str) -> Result<&'a str, ApiError> {
    item.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("{at}.{name}"), format!("`{at}` needs a string `{name}`")))
}

/// The assistant turn being folded from consecutive output items.
#[derive(Default)]
struct Assistant {
    reasoning: String,
    content: Option<String>,
    /// In the chat API's shape, for [`template_tool_calls`].
    calls: Vec<Value>,
    /// Where the turn's first item is (errors about its calls name it).
    at: String,
}

impl Assistant {
    fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_none() && self.calls.is_empty()
    }

    fn flush(&mut self, out: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
        if self.is_empty() {
            return Ok(());
        }
        let turn = std::mem::take(self);
        let mut msg = ChatMessage::text("assistant", turn.content.unwrap_or_default());
        if !turn.reasoning.is_empty() {
            // The field Qwen3's and GLM's templates read, as on the chat endpoint.
            msg.extra.insert("reasoning_content".into(), json!(turn.reasoning));
        }
        if !turn.calls.is_empty() {
            msg.extra.insert("tool_calls".into(), template_tool_calls(&Value::Array(turn.calls), &turn.at)?);
        }
        out.push(msg);
        Ok(())
    }
}

/// The texts of a `reasoning` item: its `content` (the thinking itself, as iris returns it),
/// else its `summary`.
fn reasoning_text(item: &Value, at: &str) -> Result<String, ApiError> {
    let texts = |field: &str, ty: &str| -> Result<Option<String>, ApiError> {
        match item.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(parts)) if parts.is_empty() => Ok(None),
            Some(Value::Array(parts)) => {
                Ok(Some(typed_text_items(parts, &format!("{at}.{field}"), "part", ty)?.join("\n")))
            }
            Some(_) => Err(bad(format!("{at}.{field}"), format!("`{at}.{field}` must be a list"))),
        }
    };
    Ok(texts("content", "reasoning_text")?.or(texts("summary", "summary_text")?).unwrap_or_default())
}

/// `input` as chat messages, and the images of their image parts in order. `noun` names
/// the list in errors (`input`; output items read back for the store are named `output`).
pub fn input_messages(input: &Value, noun: &str) -> Result<(Vec<ChatMessage>, Vec<ImageRef>), ApiError> {
    let items = match input {
        Value::String(s) => return Ok((vec![ChatMessage::text("user", s.as_str())], Vec::new())),
        Value::Array(items) => items,
        _ => return Err(bad(noun, format!("`{noun}` must be a string or a list of items"))),
    };
    let mut out = Vec::with_capacity(items.len());
    let mut images = Vec::new();
    let mut turn = Assistant::default();
    for (i, item) in items.iter().enumerate() {
        let at = format!("{noun}[{i}]");
        if !item.is_object() {
            return Err(bad(&at, format!("`{at}` must be an object")));
        }
        let ty = item.get("type").and_then(Value::as_str);
        match (ty, item.get("role")) {
            (None | Some("message"), Some(role)) => {
                let role = match role.as_str() {
                    Some("system" | "developer") => "system",
                    Some("user") => "user",
                    Some("assistant") => "assistant",
                    _ => {
                        return Err(bad(
                            format!("{at}.role"),
                            format!("`{at}.role` must be one of user, system, developer, assistant"),
                        ))
                    }
                };
                let path = format!("{at}.content");
                if role == "assistant" {
                    // Text after the turn's calls is a new turn.
                    if !turn.calls.is_empty() {
                        turn.flush(&mut out)?;
                    }
                    let msg = content(item.get("content"), &path, role, "output_text", &mut images)?;
                    let text = match msg.content {
                        Some(crate::tokenizer::MessageContent::Text(t)) => t,
                        _ => String::new(),
                    };
                    if turn.is_empty() {
                        turn.at = at.clone();
                    }
                    turn.content.get_or_insert_with(String::new).push_str(&text);
                } else {
                    turn.flush(&mut out)?;
                    out.push(content(item.get("content"), &path, role, "input_text", &mut images)?);
                }
            }
            (Some("reasoning"), _) => {
                // A thinking opens a new turn unless nothing of the current one came yet.
                if turn.content.is_some() || !turn.calls.is_empty() {
                    turn.flush(&mut out)?;
                }
                if turn.is_empty() {
                    turn.at = at.clone();
                }
                turn.reasoning.push_str(&reasoning_text(item, &at)?);
            }
            (Some("function_call"), _) => {
                let call_id = string_field(item, &at, "call_id")?;
                let name = string_field(item, &at, "name")?;
                let arguments = match item.get("arguments") {
                    None | Some(Value::Null) => "{}",
                    Some(Value::String(a)) => a.as_str(),
                    Some(_) => {
                        return Err(bad(format!("{at}.arguments"), format!("`{at}.arguments` must be a JSON string")))
                    }
                };
                if turn.is_empty() {
                    turn.at = at.clone();
                }
                turn.calls.push(json!({ "id": call_id, "type": "function",
                                        "function": { "name": name, "arguments": arguments } }));
            }
            (Some("function_call_output"), _) => {
                turn.flush(&mut out)?;
                let call_id = string_field(item, &at, "call_id")?;
                let mut msg = content(item.get("output"), &format!("{at}.output"), "tool", "input_text", &mut images)?;
                msg.extra.insert("tool_call_id".into(), json!(call_id));
                out.push(msg);
            }
            (Some("item_reference"), _) => {
                return Err(unsupported(
                    format!("{at}.type"),
                    format!("`{at}`: `item_reference` items are not supported; send the item itself, or continue a stored response with `previous_response_id`"),
                ))
            }
            (Some(other), _) => {
                return Err(unsupported(
                    format!("{at}.type"),
                    format!(
                        "`{at}` is a `{other}` item, which iris does not support: it takes messages, `reasoning`, \
                         `function_call` and `function_call_output` items"
                    ),
                ))
            }
            (None, None) => return Err(bad(&at, format!("`{at}` has neither a `type` nor a `role`"))),
        }
    }
    turn.flush(&mut out)?;
    Ok((out, images))
}

/// Function tools in the Responses' flat shape (`{"type": "function", "name": ...,
/// "parameters": ...}`) as the chat API's, for [`ToolRequest::openai`]; the flat `tool_choice`
/// `{"type": "function", "name": ...}` likewise. Checked at the request's own paths.
pub fn tools(tools: Option<&Value>, choice: Option<&Value>, parallel: Option<bool>) -> Result<ToolRequest, ApiError> {
    let chat_tools = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, t) in list.iter().enumerate() {
                let at = format!("tools[{i}]");
                match t.get("type").and_then(Value::as_str) {
                    Some("function") => {}
                    Some(other) => {
                        return Err(unsupported(
                            format!("{at}.type"),
                            format!("`{at}.type` is `{other}`: only `function` tools are supported (built-in tools need OpenAI's servers)"),
                        ))
                    }
                    None => return Err(bad(format!("{at}.type"), format!("`{at}` must be an object with `type: \"function\"`"))),
                }
                let s = spec(t, &at)?;
                let mut function = Map::new();
                function.insert("name".into(), json!(s.name));
                if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                    function.insert("description".into(), d.clone());
                }
                function.insert("parameters".into(), s.parameters);
                out.push(json!({ "type": "function", "function": function }));
            }
            Some(Value::Array(out))
        }
        Some(_) => return Err(bad("tools", "`tools` must be a list of tools")),
    };
    let chat_choice = match choice {
        Some(Value::Object(c)) => match c.get("type").and_then(Value::as_str) {
            Some("function") => match c.get("name").and_then(Value::as_str) {
                Some(name) => Some(json!({ "type": "function", "function": { "name": name } })),
                None => return Err(bad("tool_choice.name", "a function `tool_choice` needs a string `name`")),
            },
            Some(other) => {
                return Err(unsupported(
                    "tool_choice.type",
                    format!("`tool_choice` of type `{other}` is not supported: use auto, none, required or {{\"type\": \"function\", \"name\": ...}}"),
                ))
            }
            None => return Err(bad("tool_choice", "`tool_choice` must be a string or an object with a `type`")),
        },
        other => other.cloned(),
    };
    ToolRequest::openai(chat_tools.as_ref(), chat_choice.as_ref(), parallel)
}

/// `reasoning`: `effort` reaches the template as `reasoning_effort` (vLLM passes it so, and
/// gpt-oss's template reads it); `effort: "none"` also sets `enable_thinking: false`, the
/// switch Qwen3's and GLM's templates read. `summary` is accepted: iris writes no summaries,
/// the thinking itself is in the reasoning item's `content`.
pub fn reasoning_vars(reasoning: Option<&Value>, extra: &mut Map<String, Value>) -> Result<(), ApiError> {
    let obj = match reasoning {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(bad("reasoning", "`reasoning` must be an object")),
    };
    for (k, v) in obj {
        match (k.as_str(), v) {
            (_, Value::Null) => {}
            ("effort", Value::String(e)) => match e.as_str() {
                "none" => {
                    extra.insert("reasoning_effort".into(), json!("none"));
                    extra.insert("enable_thinking".into(), json!(false));
                }
                "minimal" | "low" | "medium" | "high" | "xhigh" => {
                    extra.insert("reasoning_effort".into(), json!(e));
                }
                other => {
                    return Err(bad(
                        "reasoning.effort",
                        format!("`reasoning.effort` `{other}` is not one of none, minimal, low, medium, high, xhigh"),
                    ))
                }
            },
            ("summary" | "generate_summary", Value::String(s))
                if matches!(s.as_str(), "auto" | "concise" | "detailed") => {}
            (k @ ("effort" | "summary" | "generate_summary"), v) => {
                return Err(bad(format!("reasoning.{k}"), format!("invalid value {v} for `reasoning.{k}`")))
            }
            (k, _) => {
                return Err(unsupported(
                    format!("reasoning.{k}"),
                    format!("unsupported field `reasoning.{k}`: iris reads `effort` and `summary`"),
                ))
            }
        }
    }
    Ok(())
}

/// `text`: only `format: {"type": "text"}` until structured outputs exist; `verbosity` only
/// at its default, since iris cannot make a reply shorter or longer.
pub fn check_text(text: Option<&Value>) -> Result<(), ApiError> {
    let obj = match text {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(bad("text", "`text` must be an object")),
    };
    for (k, v) in obj {
        match k.as_str() {
            // Read by `structured::from_text_format`.
            "format" => {}
            "verbosity" if v.is_null() || v == "medium" => {}
            "verbosity" => {
                return Err(unsupported("text.verbosity", "`text.verbosity` other than `medium` is not supported"))
            }
            k => return Err(unsupported(format!("text.{k}"), format!("unsupported field `text.{k}`"))),
        }
    }
    Ok(())
}

/// The settings iris accepts only at the value that asks for nothing it lacks: `truncation`
/// (`disabled`: a too long conversation is a 400, as the chat endpoint answers),
/// `background`, `max_tool_calls`, `top_logprobs`, `include` (only
/// `reasoning.encrypted_content`: nothing is encrypted, the reasoning item carries the text),
/// `stream_options` (`include_obfuscation`: iris pads nothing).
pub fn check_settings(body: &Value) -> Result<(), ApiError> {
    let field = |name: &str| body.get(name).filter(|v| !v.is_null());
    if let Some(t) = field("truncation") {
        if t != "disabled" {
            return Err(unsupported(
                "truncation",
                "`truncation` other than `disabled` is not supported: iris does not drop parts of a conversation",
            ));
        }
    }
    if field("background").is_some_and(|b| b != &json!(false)) {
        return Err(unsupported("background", "background responses are not supported"));
    }
    if field("max_tool_calls").is_some() {
        return Err(unsupported("max_tool_calls", "`max_tool_calls` is not supported (iris runs no built-in tools)"));
    }
    if field("top_logprobs").is_some_and(|t| t != &json!(0)) {
        return Err(unsupported("top_logprobs", "logprobs are not supported on /v1/responses yet"));
    }
    match field("include") {
        None => {}
        Some(Value::Array(list)) => {
            for (i, v) in list.iter().enumerate() {
                if v != "reasoning.encrypted_content" {
                    return Err(unsupported(
                        format!("include[{i}]"),
                        format!("`include` value {v} is not supported (only `reasoning.encrypted_content`)"),
                    ));
                }
            }
        }
        Some(_) => return Err(bad("include", "`include` must be a list")),
    }
    match field("stream_options") {
        None => {}
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| k.as_str() != "include_obfuscation") {
                return Err(unsupported(
                    format!("stream_options.{k}"),
                    format!("unsupported field `stream_options.{k}`"),
                ));
            }
        }
        Some(_) => return Err(bad("stream_options", "`stream_options` must be an object")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles_and_text(messages: &[ChatMessage]) -> Vec<String> {
        messages.iter().map(|m| format!("{}:{}", m.role, serde_json::to_string(m).expect("json"))).collect()
    }

    #[test]
    fn a_string_is_one_user_message() {
        let (m, images) = input_messages(&json!("Hi"), "input").expect("ok");
        assert_eq!(m, [ChatMessage::text("user", "Hi")]);
        assert!(images.is_empty());
    }

    #[test]
    fn output_items_fold_into_one_assistant_turn() {
        let input = json!([
            { "role": "developer", "content": "Be brief." },
            { "type": "message", "role": "user", "content": [{ "type": "input_text", "text": "Weather?" }] },
            { "type": "reasoning", "id": "rs_1", "summary": [], "content": [{ "type": "reasoning_text", "text": "Call it." }] },
            { "type": "message", "role": "assistant", "content": [{ "type": "output_text", "text": "Checking.", "annotations": [] }] },
            { "type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}" },
            { "type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}" },
            { "type": "function_call_output", "call_id": "call_1", "output": "18C" },
            { "type": "function_call_output", "call_id": "call_2", "output": [{ "type": "input_text", "text": "9C" }] },
        ]);
        let (m, _) = input_messages(&input, "input").expect("ok");
        assert_eq!(m.len(), 5, "{:?}", roles_and_text(&m));
        assert_eq!(m[0], ChatMessage::text("system", "Be brief."));
        assert_eq!(m[1], ChatMessage::text("user", "Weather?"));
        let a = &m[2];
        assert_eq!((a.role.as_str(), a.extra["reasoning_content"].clone()), ("assistant", json!("Call it.")));
        assert_eq!(a.content, ChatMessage::text("assistant", "Checking.").content);
        let calls = a.extra["tool_calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["id"], "call_1");
        assert_eq!(calls[1]["function"]["arguments"], json!({ "city": "Oslo" }));
        assert_eq!((m[3].role.as_str(), m[3].extra["tool_call_id"].clone()), ("tool", json!("call_1")));
        assert_eq!(m[4].content, ChatMessage::text("tool", "9C").content);
    }

    #[test]
    fn text_after_calls_is_a_new_turn() {
        let input = json!([
            { "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}" },
            { "role": "assistant", "content": "Done." },
        ]);
        let (m, _) = input_messages(&input, "input").expect("ok");
        assert_eq!(m.len(), 2);
        assert!(m[0].extra.contains_key("tool_calls") && !m[1].extra.contains_key("tool_calls"));
    }

    #[test]
    fn bad_items_name_their_place() {
        for (input, param) in [
            (json!([{ "type": "web_search_call", "id": "x" }]), "input[0].type"),
            (json!([{ "type": "item_reference", "id": "x" }]), "input[0].type"),
            (json!(["hi"]), "input[0]"),
            (json!([{ "role": "tool", "content": "x" }]), "input[0].role"),
            (
                json!([{ "role": "user", "content": [{ "type": "input_file", "file_id": "f" }] }]),
                "input[0].content[0].type",
            ),
            (
                json!([{ "role": "user", "content": [{ "type": "input_image", "file_id": "f" }] }]),
                "input[0].content[0].file_id",
            ),
            (json!([{ "type": "function_call", "name": "f" }]), "input[0].call_id"),
            (json!([{ "type": "function_call_output", "call_id": "c" }]), "input[0].output"),
            (json!(7), "input"),
        ] {
            let e = input_messages(&input, "input").expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{input}: {e}");
        }
    }

    #[test]
    fn flat_tools_and_choices() {
        let t = json!([{ "type": "function", "name": "f", "description": "d", "parameters": { "type": "object" }, "strict": true }]);
        let r = tools(Some(&t), Some(&json!({ "type": "function", "name": "f" })), Some(false)).expect("ok");
        assert_eq!(r.template_tools[0]["function"]["name"], "f");
        assert_eq!(r.template_tools[0]["function"]["description"], "d");
        assert_eq!(r.choice, super::super::tool_request::ToolChoice::Function("f".into()));
        for (t, c, param) in [
            (json!([{ "type": "web_search" }]), json!("auto"), "tools[0].type"),
            (json!([{ "type": "function" }]), json!("auto"), "tools[0].name"),
            (t.clone(), json!({ "type": "function", "name": "g" }), "tool_choice"),
            (t.clone(), json!({ "type": "allowed_tools", "mode": "auto", "tools": [] }), "tool_choice.type"),
        ] {
            let e = tools(Some(&t), Some(&c), None).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{t} {c}: {e}");
        }
    }

    #[test]
    fn settings_and_formats() {
        assert!(check_text(Some(&json!({ "format": { "type": "text" } }))).is_ok());
        assert!(check_text(Some(&json!({ "format": { "type": "json_schema", "name": "x", "schema": {} } }))).is_ok());
        assert_eq!(
            check_text(Some(&json!({ "verbosity": "high" }))).expect_err("no").param.as_deref(),
            Some("text.verbosity")
        );
        let mut extra = Map::new();
        reasoning_vars(Some(&json!({ "effort": "none", "summary": "auto" })), &mut extra).expect("ok");
        assert_eq!(extra["enable_thinking"], json!(false));
        assert!(reasoning_vars(Some(&json!({ "effort": "max" })), &mut extra).is_err());
        assert!(check_settings(
            &json!({ "truncation": "disabled", "background": false, "include": ["reasoning.encrypted_content"] })
        )
        .is_ok());
        for (body, param) in [
            (json!({ "truncation": "auto" }), "truncation"),
            (json!({ "background": true }), "background"),
            (json!({ "include": ["message.output_text.logprobs"] }), "include[0]"),
            (json!({ "top_logprobs": 3 }), "top_logprobs"),
        ] {
            assert_eq!(check_settings(&body).expect_err("refused").param.as_deref(), Some(param), "{body}");
        }
    }
}
