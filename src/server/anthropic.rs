//! The Anthropic Messages API: `/v1/messages` (text content blocks) and its token counter.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::engine_loop::{SeqEvent, SeqEventKind};
use super::errors::ApiError;
use super::generate::{
    aborted, check_request, collect, matched_stop, parse_json, random_id, request_error, submit_with_images, typed,
    MaxTokens,
};
use super::images::ImageRef;
use super::openai::encode_chat;
use super::sse::{named_event, sse_response, Converter};
use super::state::AppState;
use crate::engine::{FinishReason, Request, SamplingParams};
use crate::tokenizer::{ChatMessage, TextTokenizer};

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
}

/// A string or a list of `{"type": "text", "text": ...}` blocks, concatenated.
fn blocks_text(v: &Value, path: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => Ok(super::content::text_items(blocks, path, "block")?.concat()),
        _ => Err(ApiError::invalid_param(path, format!("`{path}` must be a string or a list of content blocks"))),
    }
}

/// The conversation for the chat template, and the images of its `image` blocks in order.
fn to_chat(req: &MessagesRequest) -> Result<(Vec<ChatMessage>, Vec<ImageRef>), ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    let mut images = Vec::new();
    if let Some(system) = &req.system {
        let text = blocks_text(system, "system")?;
        if !text.is_empty() {
            out.push(ChatMessage::text("system", text));
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let role = match role {
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
        match content {
            Value::Array(blocks) if blocks.iter().any(|b| b.get("type") == Some(&json!("image"))) => {
                let (parts, refs) =
                    super::content::mixed_items(blocks, &path, "block", "image", super::images::anthropic_image)?;
                images.extend(refs);
                out.push(ChatMessage::parts(role, parts));
            }
            _ => out.push(ChatMessage::text(role, blocks_text(content, &path)?)),
        }
    }
    Ok((out, images))
}

/// Renders the conversation; an assistant message last is continued (prefill), as the
/// Messages API does.
fn encode(tok: &TextTokenizer, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    let prefill = messages.last().filter(|m| m.role == "assistant");
    match prefill {
        None => encode_chat(tok, messages, true, Default::default()),
        Some(last) => {
            let mut head = encode_chat(tok, &messages[..messages.len() - 1], true, Default::default())?;
            if let Some(crate::tokenizer::MessageContent::Text(t)) = &last.content {
                // The prefill is the client's text: special-token strings in it stay text.
                head.extend(tok.encode_plain_text(t).map_err(|e| ApiError::bad_request(e.to_string()))?);
            }
            Ok(head)
        }
    }
}

fn stop_reason(finish: &Option<FinishReason>, stop: &Option<String>) -> &'static str {
    match (finish, stop) {
        (_, Some(_)) => "stop_sequence",
        (Some(FinishReason::Length), _) => "max_tokens",
        _ => "end_turn",
    }
}

pub async fn messages(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match messages_inner(app, body).await {
        Ok(r) => r,
        Err(e) => e.anthropic().into_response(),
    }
}

async fn messages_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    let req: MessagesRequest = typed(&v)?;
    let model = app.check_model(req.model.as_deref())?;
    let max_tokens = match req.max_tokens {
        None => return Err(ApiError::invalid_param("max_tokens", "`max_tokens` is required")),
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid_param("max_tokens", format!("`max_tokens` must be at least 1, got {m}")))
        }
        Some(m) => m as usize,
    };
    let (messages, images) = to_chat(&req)?;
    super::images::check_accepted(&engine, &images)?;
    let tok = engine.tokenizer.clone();
    let prompt = encode(&tok, &messages)?;
    let (prompt, images) = super::images::prepare(&app.cfg.media, &engine, prompt, images).await?;
    let mut params = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.map(|k| usize::try_from(k).unwrap_or(0)).unwrap_or(0),
        max_tokens,
        stop: req.stop_sequences.clone().unwrap_or_default(),
        ..SamplingParams::default()
    };
    let max_tokens = MaxTokens { requested: Some(max_tokens), default: None };
    check_request(&engine, &prompt, &mut params, max_tokens, "messages")?;
    let stops = params.stop.clone();
    let sub = submit_with_images(&app, &engine, vec![Request { prompt_tokens: prompt.clone(), params }], images)?;
    let id = random_id("msg_");
    if req.stream.unwrap_or(false) {
        let conv = MessageStream {
            id,
            model,
            tok,
            stops,
            eos: engine.info.eos_token_ids.clone(),
            prompt_tokens: prompt.len(),
            tokens: Vec::new(),
            output_tokens: 0,
            finished: false,
            failed: false,
        };
        return Ok(sse_response(sub, conv));
    }
    let mut results = collect(sub, 1, false).await?;
    let c = results.remove(0);
    let stop = matched_stop(&tok, &c.tokens, &stops, &engine.info.eos_token_ids);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{ "type": "text", "text": c.text }],
        "stop_reason": stop_reason(&c.finish, &stop),
        "stop_sequence": stop,
        "usage": { "input_tokens": prompt.len(), "output_tokens": c.num_output_tokens },
    }))
    .into_response())
}

struct MessageStream {
    id: String,
    model: String,
    tok: Arc<TextTokenizer>,
    stops: Vec<String>,
    eos: Vec<u32>,
    prompt_tokens: usize,
    tokens: Vec<u32>,
    output_tokens: usize,
    finished: bool,
    /// An `error` event was sent: the stream ends without `message_stop`.
    failed: bool,
}

impl MessageStream {
    /// Ends the stream with an `error` event: the server cut the message short.
    fn fail(&mut self, err: ApiError, out: &mut Vec<Event>) -> bool {
        if !self.finished {
            self.finished = true;
            self.failed = true;
            out.push(named_event("error", &err.anthropic().body()));
        }
        true
    }

    fn finish(&mut self, finish: Option<FinishReason>, out: &mut Vec<Event>) -> bool {
        if self.finished {
            return true;
        }
        match &finish {
            Some(f @ (FinishReason::Cancelled | FinishReason::Error(_))) => return self.fail(aborted(f), out),
            // The engine went away before the end.
            None => return self.fail(aborted(&FinishReason::Cancelled), out),
            _ => {}
        }
        self.finished = true;
        let stop = matched_stop(&self.tok, &self.tokens, &self.stops, &self.eos);
        out.push(named_event("content_block_stop", &json!({ "type": "content_block_stop", "index": 0 })));
        out.push(named_event(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": { "stop_reason": stop_reason(&finish, &stop), "stop_sequence": stop },
                "usage": { "output_tokens": self.output_tokens },
            }),
        ));
        true
    }
}

impl Converter for MessageStream {
    fn start(&mut self, out: &mut Vec<Event>) {
        out.push(named_event(
            "message_start",
            &json!({
                "type": "message_start",
                "message": {
                    "id": self.id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.model,
                    "content": [],
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": { "input_tokens": self.prompt_tokens, "output_tokens": 0 },
                },
            }),
        ));
        out.push(named_event(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } }),
        ));
        out.push(named_event("ping", &json!({ "type": "ping" })));
    }

    fn on_event(&mut self, ev: SeqEvent, out: &mut Vec<Event>) -> bool {
        match ev.kind {
            SeqEventKind::Rejected(e) => self.fail(request_error(e), out),
            SeqEventKind::Ended(reason) => self.finish(Some(reason), out),
            SeqEventKind::Update(u) => {
                if let Some(t) = &u.token {
                    self.tokens.push(t.token);
                }
                self.output_tokens = u.num_output_tokens;
                if !u.text.is_empty() {
                    out.push(named_event(
                        "content_block_delta",
                        &json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": u.text } }),
                    ));
                }
                match u.finish {
                    Some(f) => self.finish(Some(f), out),
                    None => false,
                }
            }
        }
    }

    fn abort(&mut self, err: ApiError, out: &mut Vec<Event>) {
        self.fail(err, out);
    }

    fn end(&mut self, _complete: bool, out: &mut Vec<Event>) {
        if !self.finished {
            self.finish(None, out);
        }
        if !self.failed {
            out.push(named_event("message_stop", &json!({ "type": "message_stop" })));
        }
    }
}

#[derive(Debug, Deserialize)]
struct CountTokensRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    system: Option<Value>,
}

pub async fn count_tokens(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    count_tokens_inner(app, body).await.unwrap_or_else(|e| e.anthropic().into_response())
}

/// The length of the prompt `/v1/messages` would run (images expanded to their embeddings).
async fn count_tokens_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    let req: CountTokensRequest = typed(&v)?;
    app.check_model(req.model.as_deref())?;
    let full = MessagesRequest {
        model: None,
        messages: req.messages,
        system: req.system,
        max_tokens: None,
        stop_sequences: None,
        temperature: None,
        top_p: None,
        top_k: None,
        stream: None,
    };
    let (messages, images) = to_chat(&full)?;
    super::images::check_accepted(&engine, &images)?;
    let prompt = encode(&engine.tokenizer, &messages)?;
    let (prompt, _) = super::images::prepare(&app.cfg.media, &engine, prompt, images).await?;
    Ok(Json(json!({ "input_tokens": prompt.len() })).into_response())
}
