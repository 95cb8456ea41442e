//! The Anthropic Messages API: `/v1/messages` (text, image, tool and thinking blocks; the
//! request side is `anthropic_request.rs`) and its token counter.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::anthropic_request::{self, prefill_text, thinking_vars, to_chat};
use super::chat_prompt::encode_chat;
use super::engine_loop::{SeqEvent, SeqEventKind};
use super::errors::ApiError;
use super::fields;
use super::generate::{
    aborted, check_request, collect, matched_stop, parse_json, random_id, request_error, submit_with_images, typed,
    MaxTokens,
};
use super::reply::{Delta, Reply, ReplyParser};
use super::sse::{named_event, sse_response, Converter};
use super::state::AppState;
use super::structured;
use super::tool_request::{reply_setup, ToolRequest};
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
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    thinking: Option<Value>,
    /// vLLM's sampling extensions, as the OpenAI endpoints read them.
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    min_tokens: Option<i64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    stop_token_ids: Option<Vec<u32>>,
}

/// Renders the conversation; an assistant message last is continued (prefill), as the
/// Messages API does.
fn encode(
    tok: &TextTokenizer,
    messages: &[ChatMessage],
    extra: serde_json::Map<String, Value>,
) -> Result<Vec<u32>, ApiError> {
    let prefill = messages.last().filter(|m| m.role == "assistant").and_then(|m| prefill_text(m).map(|t| (m, t)));
    match prefill {
        None => encode_chat(tok, messages, true, extra),
        Some((_, text)) => {
            let mut head = encode_chat(tok, &messages[..messages.len() - 1], true, extra)?;
            // The prefill is the client's text: special-token strings in it stay text.
            head.extend(tok.encode_plain_text(text).map_err(|e| ApiError::bad_request(e.to_string()))?);
            Ok(head)
        }
    }
}

/// The template variables of a request: its tools and its thinking setting.
fn template_vars(tools: &ToolRequest, thinking: Option<&Value>) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut extra = serde_json::Map::new();
    tools.template_vars(&mut extra);
    thinking_vars(thinking, &mut extra)?;
    Ok(extra)
}

fn stop_reason(finish: &Option<FinishReason>, stop: &Option<String>, called: bool) -> &'static str {
    // A complete call is what the client must act on, even when a stop sequence ended it.
    match (finish, stop) {
        (_, Some(_)) if !called => "stop_sequence",
        (Some(FinishReason::Length), _) => "max_tokens",
        _ if called => "tool_use",
        _ => "end_turn",
    }
}

/// A parsed reply as content blocks: thinking, text, tool uses (an empty text block when
/// there is nothing, as the API always answers with a block).
fn content_blocks(reply: &Reply) -> Vec<Value> {
    let mut blocks = Vec::new();
    if !reply.reasoning.is_empty() {
        blocks.push(json!({ "type": "thinking", "thinking": reply.reasoning, "signature": "" }));
    }
    if !reply.content.is_empty() || reply.calls.is_empty() {
        blocks.push(json!({ "type": "text", "text": reply.content }));
    }
    for c in &reply.calls {
        blocks.push(json!({ "type": "tool_use", "id": c.id, "name": c.name, "input": input_object(&c.arguments) }));
    }
    blocks
}

/// A call's JSON arguments as a `tool_use` block's `input` object.
fn input_object(args: &str) -> Value {
    match serde_json::from_str::<Value>(args) {
        Ok(o @ Value::Object(_)) => o,
        _ => json!({}),
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
    fields::MESSAGES.check(&v)?;
    let req: MessagesRequest = typed(&v)?;
    let model = app.check_model(req.model.as_deref())?;
    let max_tokens = match req.max_tokens {
        None => return Err(ApiError::invalid_param("max_tokens", "`max_tokens` is required")),
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid_param("max_tokens", format!("`max_tokens` must be at least 1, got {m}")))
        }
        Some(m) => m as usize,
    };
    let tools = anthropic_request::tools(req.tools.as_ref(), req.tool_choice.as_ref())?;
    let (messages, images) = to_chat(req.system.as_ref(), &req.messages)?;
    super::images::check_accepted(&engine, &images)?;
    let tok = engine.tokenizer.clone();
    let mut prompt = encode(&tok, &messages, template_vars(&tools, req.thinking.as_ref())?)?;
    let (setup, forced) = reply_setup(&app.cfg.parsers, &engine, &tools, &prompt, "toolu_")?;
    forced.append_to(&tok, &mut prompt)?;
    let grammar = structured::compile_off_thread(&engine, forced.asked().as_ref()).await?;
    let forced = forced.text;
    let (prompt, images) = super::images::prepare(&app.cfg.media, &engine, prompt, images).await?;
    let mut params = SamplingParams {
        grammar,
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.map(|k| usize::try_from(k).unwrap_or(0)).unwrap_or(0),
        max_tokens,
        stop: req.stop_sequences.clone().unwrap_or_default(),
        ignore_eos: req.ignore_eos.unwrap_or(false),
        seed: req.seed.map(|s| s as u64),
        min_p: req.min_p.unwrap_or(0.0),
        repetition_penalty: req.repetition_penalty.unwrap_or(1.0),
        stop_token_ids: req.stop_token_ids.clone().unwrap_or_default(),
        ..SamplingParams::default()
    };
    // Tool-call and thinking tags may be special tokens (GLM's, Gemma's): the parsers need them.
    setup.fit(&mut params, None);
    if let Some(m) = req.min_tokens {
        params.min_tokens = usize::try_from(m)
            .map_err(|_| ApiError::invalid_param("min_tokens", format!("`min_tokens` must be >= 0, got {m}")))?;
    }
    let max_tokens = MaxTokens { requested: Some(max_tokens), default: None };
    check_request(&engine, &prompt, &mut params, max_tokens, "messages")?;
    let stops = params.stop.clone();
    let sub = submit_with_images(&app, &engine, vec![Request { prompt_tokens: prompt.clone(), params }], images)?;
    let id = random_id("msg_");
    if req.stream.unwrap_or(false) {
        // What the forced opening gives (a streaming format's call starts there) goes out
        // after message_start.
        let mut early = Vec::new();
        let parser = (!setup.is_plain()).then(|| {
            let mut p = ReplyParser::new(&setup);
            p.feed(&forced, &mut early);
            p
        });
        let conv = MessageStream {
            id,
            model,
            tok,
            stops,
            eos: engine.info.eos_token_ids.clone(),
            prompt_tokens: prompt.len(),
            tokens: Vec::new(),
            output_tokens: 0,
            cached_tokens: 0,
            finished: false,
            failed: false,
            parser,
            early,
            blocks: Blocks::default(),
        };
        return Ok(sse_response(sub, conv));
    }
    let mut results = collect(sub, 1, false).await?;
    let c = results.remove(0);
    let stop = matched_stop(&tok, &c.tokens, &stops, &engine.info.eos_token_ids);
    let (content, called) = if setup.is_plain() {
        (vec![json!({ "type": "text", "text": c.text })], false)
    } else {
        let reply = Reply::parse(&setup, &format!("{forced}{}", c.text));
        (content_blocks(&reply), !reply.calls.is_empty())
    };
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(&c.finish, &stop, called),
        "stop_sequence": stop,
        "usage": anthropic_usage(prompt.len(), c.num_cached_tokens, c.num_output_tokens),
    }))
    .into_response())
}

/// Anthropic's usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens`
/// those read from the prefix cache (their sum is the prompt), nothing is written to a cache
/// on request (`cache_creation_input_tokens` 0: iris caches every prompt by itself).
fn anthropic_usage(prompt: usize, cached: usize, output: usize) -> Value {
    let cached = cached.min(prompt);
    json!({
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
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
    /// Prompt tokens read from the prefix cache.
    cached_tokens: usize,
    finished: bool,
    /// An `error` event was sent: the stream ends without `message_stop`.
    failed: bool,
    /// With tools or a reasoning parser: the reply's parser (blocks then open as their
    /// deltas arrive); without, one text block carries the text as it comes.
    parser: Option<ReplyParser>,
    /// The parser's deltas from the forced call opening, sent at the start.
    early: Vec<Delta>,
    blocks: Blocks,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum BlockKind {
    Text,
    Thinking,
    ToolUse,
}

/// The content blocks of a stream: the open one and how many were opened.
#[derive(Default)]
struct Blocks {
    open: Option<BlockKind>,
    count: usize,
    called: bool,
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Event>) {
        if self.open.take().is_some() {
            let index = self.count - 1;
            out.push(named_event("content_block_stop", &json!({ "type": "content_block_stop", "index": index })));
        }
    }

    /// Makes a block of `kind` the open one (a tool use always opens its own).
    fn open(&mut self, kind: BlockKind, block: Value, out: &mut Vec<Event>) {
        if self.open == Some(kind) && kind != BlockKind::ToolUse {
            return;
        }
        self.close(out);
        out.push(named_event(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": self.count, "content_block": block }),
        ));
        self.open = Some(kind);
        self.count += 1;
    }

    fn delta(&self, delta: Value, out: &mut Vec<Event>) {
        let index = self.count.saturating_sub(1);
        out.push(named_event(
            "content_block_delta",
            &json!({ "type": "content_block_delta", "index": index, "delta": delta }),
        ));
    }

    fn apply(&mut self, d: Delta, out: &mut Vec<Event>) {
        match d {
            Delta::Content(t) => {
                self.open(BlockKind::Text, json!({ "type": "text", "text": "" }), out);
                self.delta(json!({ "type": "text_delta", "text": t }), out);
            }
            Delta::Reasoning(t) => {
                self.open(BlockKind::Thinking, json!({ "type": "thinking", "thinking": "", "signature": "" }), out);
                self.delta(json!({ "type": "thinking_delta", "thinking": t }), out);
            }
            Delta::CallStart { id, name, .. } => {
                self.called = true;
                self.open(BlockKind::ToolUse, json!({ "type": "tool_use", "id": id, "name": name, "input": {} }), out);
            }
            Delta::CallArgs { args, .. } => {
                self.delta(json!({ "type": "input_json_delta", "partial_json": args }), out)
            }
        }
    }
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
        if let Some(p) = &mut self.parser {
            let mut deltas = Vec::new();
            p.finish(&mut deltas);
            for d in deltas {
                self.blocks.apply(d, out);
            }
            if self.blocks.count == 0 {
                // Nothing was said: one empty text block, as a non-streamed reply has.
                self.blocks.open(BlockKind::Text, json!({ "type": "text", "text": "" }), out);
            }
        }
        self.blocks.close(out);
        let stop = matched_stop(&self.tok, &self.tokens, &self.stops, &self.eos);
        out.push(named_event(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": { "stop_reason": stop_reason(&finish, &stop, self.blocks.called), "stop_sequence": stop },
                // The cached share is known once the prompt ran: message_start could not say it.
                "usage": anthropic_usage(self.prompt_tokens, self.cached_tokens, self.output_tokens),
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
        if self.parser.is_none() {
            self.blocks.open(BlockKind::Text, json!({ "type": "text", "text": "" }), out);
        }
        for d in std::mem::take(&mut self.early) {
            self.blocks.apply(d, out);
        }
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
                self.cached_tokens = u.num_cached_tokens;
                match &mut self.parser {
                    Some(p) => {
                        let mut deltas = Vec::new();
                        p.feed(&u.text, &mut deltas);
                        for d in deltas {
                            self.blocks.apply(d, out);
                        }
                    }
                    None if !u.text.is_empty() => {
                        self.blocks.delta(json!({ "type": "text_delta", "text": u.text }), out);
                    }
                    None => {}
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
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    thinking: Option<Value>,
}

pub async fn count_tokens(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    count_tokens_inner(app, body).await.unwrap_or_else(|e| e.anthropic().into_response())
}

/// The length of the prompt `/v1/messages` would run (images expanded to their embeddings).
async fn count_tokens_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    fields::COUNT_TOKENS.check(&v)?;
    let req: CountTokensRequest = typed(&v)?;
    app.check_model(req.model.as_deref())?;
    let tools = anthropic_request::tools(req.tools.as_ref(), req.tool_choice.as_ref())?;
    let (messages, images) = to_chat(req.system.as_ref(), &req.messages)?;
    super::images::check_accepted(&engine, &images)?;
    let tok = &engine.tokenizer;
    let mut prompt = encode(tok, &messages, template_vars(&tools, req.thinking.as_ref())?)?;
    // A forced call's opening is part of the prompt /v1/messages runs.
    let (_, forced) = reply_setup(&app.cfg.parsers, &engine, &tools, &prompt, "toolu_")?;
    forced.append_to(tok, &mut prompt)?;
    let (prompt, _) = super::images::prepare(&app.cfg.media, &engine, prompt, images).await?;
    Ok(Json(json!({ "input_tokens": prompt.len() })).into_response())
}
