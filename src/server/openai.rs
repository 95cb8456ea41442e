//! The OpenAI API: chat completions, completions, models; vLLM's tokenize / detokenize.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::chat_prompt::ChatPrompt;
use super::errors::ApiError;
use super::fields;
use super::generate::{
    check_request, collect, parse_json, random_id, seeded, submit, submit_with_images, typed, Collected, MaxTokens,
    SamplingFields,
};
use super::images::ImageRef;
use super::openai_choices::{
    cached_per_prompt, chat_logprob_entry, usage, ChatFormat, CompletionFormat, LegacyLogprobs, OpenAiStream,
};
use super::reply::Reply;
use super::sse::sse_response;
use super::state::{now_unix, AppState};
use super::structured;
use super::tool_request::{template_tool_calls, ToolRequest};
use crate::engine::sampling_params::MAX_LOGPROBS;
use crate::engine::{FinishReason, Request};
use crate::tokenizer::ChatMessage;

type AppRef = State<Arc<AppState>>;

fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| e.into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    modalities: Option<Value>,
}

/// OpenAI messages -> chat template messages, and the images of their `image_url` parts in
/// order. Roles: system, developer (rendered as system, which is what chat templates know),
/// user, assistant (with `tool_calls`, and its thinking as `reasoning_content`, the field
/// Qwen3's and GLM's templates read), tool (with `tool_call_id`).
pub fn parse_messages(messages: &[Value]) -> Result<(Vec<ChatMessage>, Vec<ImageRef>), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::with_capacity(messages.len());
    let mut images = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid_param(
                format!("messages[{i}]"),
                format!("`messages[{i}]` must be an object"),
            ));
        };
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].role"),
                    format!("`messages[{i}].role` must be a string"),
                ))
            }
            None => {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].role"),
                    format!("`messages[{i}]` has no `role`"),
                ))
            }
        };
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].role"),
                    format!(
                        "unknown role `{other}` in `messages[{i}]`: use one of system, developer, user, assistant, tool"
                    ),
                ))
            }
        };
        let path = format!("messages[{i}].content");
        let has_calls = role == "assistant" && obj.get("tool_calls").is_some_and(|c| !c.is_null());
        let mut msg = match obj.get("content") {
            Some(Value::Array(items)) if items.iter().any(|p| p.get("type") == Some(&json!("image_url"))) => {
                let (parts, refs) =
                    super::content::mixed_items(items, &path, "part", "image_url", super::images::openai_image)?;
                images.extend(refs);
                ChatMessage::parts(role, parts)
            }
            content => ChatMessage::text(role, content_text(content, &path, role == "assistant")?),
        };
        let at = |field: &str| format!("messages[{i}].{field}");
        if has_calls {
            let calls = obj.get("tool_calls").unwrap_or(&Value::Null);
            msg.extra.insert("tool_calls".into(), template_tool_calls(calls, &at("tool_calls"))?);
        }
        if role == "assistant" {
            // vLLM's newer name `reasoning` and the older `reasoning_content` alike.
            match obj.get("reasoning_content").or_else(|| obj.get("reasoning")) {
                None | Some(Value::Null) => {}
                Some(Value::String(r)) => {
                    msg.extra.insert("reasoning_content".into(), json!(r));
                }
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        at("reasoning_content"),
                        format!("`{}` must be a string", at("reasoning_content")),
                    ))
                }
            }
        }
        if role == "tool" {
            match obj.get("tool_call_id") {
                Some(Value::String(id)) => {
                    msg.extra.insert("tool_call_id".into(), json!(id));
                }
                _ => {
                    return Err(ApiError::invalid_param(
                        at("tool_call_id"),
                        format!("`messages[{i}]` (a tool result) needs a string `tool_call_id`"),
                    ))
                }
            }
        }
        if let Some(name) = obj.get("name") {
            let Value::String(name) = name else {
                return Err(ApiError::invalid_param(at("name"), format!("`{}` must be a string", at("name"))));
            };
            msg.extra.insert("name".into(), json!(name));
        }
        out.push(msg);
    }
    Ok((out, images))
}

/// A string, or a list of `{"type": "text", "text": ...}` parts (joined with newlines).
fn content_text(content: Option<&Value>, path: &str, may_be_null: bool) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if may_be_null => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::invalid_param(path, format!("`{path}` is missing"))),
        Some(Value::Array(parts)) => Ok(super::content::text_items(parts, path, "part")?.join("\n")),
        Some(_) => Err(ApiError::invalid_param(path, format!("`{path}` must be a string or a list of content parts"))),
    }
}

pub use super::chat_prompt::encode_chat;

fn logprobs_setting(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    let top = match top {
        None => 0,
        Some(t) if t >= 0 && t as usize <= MAX_LOGPROBS => t as usize,
        Some(t) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_LOGPROBS}, got {t}"),
            ))
        }
    };
    match logprobs {
        Some(true) => Ok(Some(top)),
        _ if top > 0 => Err(ApiError::invalid_param("top_logprobs", "`top_logprobs` needs `logprobs: true`")),
        _ => Ok(None),
    }
}

pub async fn chat_completions(State(app): AppRef, body: Result<Bytes, BytesRejection>) -> Response {
    respond(chat_inner(app, body).await)
}

async fn chat_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    fields::CHAT.check(&v)?;
    let req: ChatRequest = typed(&v)?;
    let fields: SamplingFields = typed(&v)?;
    let model = app.check_model(req.model.as_deref())?;
    let structured = structured::from_body(&v)?;
    fields::check_modalities(req.modalities.as_ref())?;
    let tools = ToolRequest::openai(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    let (messages, images) = parse_messages(&req.messages)?;
    let tok = engine.tokenizer.clone();
    let extra = req.chat_template_kwargs.clone().unwrap_or_default();
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let mut chat =
        ChatPrompt::build(&app, &engine, &messages, images, &tools, extra, add_generation_prompt, "call_").await?;
    let n = fields.n()?;
    let mut params = fields.params()?;
    chat.fit_params(&mut params, fields.skip_special_tokens);
    params.logprobs = logprobs_setting(req.logprobs, req.top_logprobs)?;
    params.grammar = chat.grammar(&engine, structured.as_ref()).await?;
    // Without max_tokens a chat reply may use the rest of the context (vLLM's default).
    let max_tokens = MaxTokens { requested: fields.max_tokens()?, default: None };
    let prompt_len = chat.tokens.len();
    check_request(&engine, &chat.tokens, &mut params, max_tokens, "messages")?;
    let requests = (0..n).map(|i| Request { prompt_tokens: chat.tokens.clone(), params: seeded(&params, i) }).collect();
    let sub = submit_with_images(&app, &engine, requests, std::mem::take(&mut chat.images))?;
    let id = random_id("chatcmpl-");
    let created = now_unix();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
        let format = ChatFormat::new(tok, params.logprobs.is_some(), chat.setup, chat.forced.text, n);
        let conv = OpenAiStream::new(id, created, model, n, n, include_usage, prompt_len, format);
        return Ok(sse_response(sub, conv));
    }
    let results = collect(sub, n, params.logprobs.is_some()).await?;
    let completion: usize = results.iter().map(|c| c.num_output_tokens).sum();
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = params.logprobs.map(
                |_| json!({ "content": c.logprobs.iter().map(|lp| chat_logprob_entry(&tok, lp)).collect::<Vec<_>>() }),
            );
            let (message, called) = if chat.setup.is_plain() {
                (json!({ "role": "assistant", "content": c.text }), false)
            } else {
                let reply = chat.reply(&c.text);
                (chat_message(&reply, chat.setup.reasoning.is_some()), !reply.calls.is_empty())
            };
            let finish = match &c.finish {
                Some(FinishReason::Stop) if called => "tool_calls",
                _ => finish_str(c),
            };
            json!({ "index": i, "message": message, "logprobs": logprobs, "finish_reason": finish })
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_len, completion, results.first().map_or(0, |c| c.num_cached_tokens)),
        "system_fingerprint": null,
    }))
    .into_response())
}

/// A parsed reply as a chat completion's `message`: `content` null when the reply is only
/// calls (as OpenAI answers), `reasoning_content` when a reasoning parser runs.
fn chat_message(reply: &Reply, with_reasoning: bool) -> Value {
    let content = if reply.content.is_empty() && !reply.calls.is_empty() { Value::Null } else { json!(reply.content) };
    let mut m = json!({ "role": "assistant", "content": content });
    if with_reasoning {
        m["reasoning_content"] = if reply.reasoning.is_empty() { Value::Null } else { json!(reply.reasoning) };
    }
    if !reply.calls.is_empty() {
        m["tool_calls"] = reply
            .calls
            .iter()
            .map(
                |c| json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } }),
            )
            .collect();
    }
    m
}

fn finish_str(c: &Collected) -> &'static str {
    c.finish.as_ref().map(|f| f.as_openai_str()).unwrap_or("abort")
}

// ---------------------------------------------------------------------------------------
// /v1/completions

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: PromptField,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    logprobs: Option<i64>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

pub async fn completions(State(app): AppRef, body: Result<Bytes, BytesRejection>) -> Response {
    respond(completions_inner(app, body).await)
}

async fn completions_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    fields::COMPLETIONS.check(&v)?;
    let req: CompletionRequest = typed(&v)?;
    let fields: SamplingFields = typed(&v)?;
    let model = app.check_model(req.model.as_deref())?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "`suffix` is not supported"));
    }
    let tok = engine.tokenizer.clone();
    let add_special = req.add_special_tokens.unwrap_or(true);
    let encode = |s: &str| tok.encode(s, add_special).map_err(|e| ApiError::bad_request(e.to_string()).param("prompt"));
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        PromptField::Text(s) => vec![encode(s)?],
        PromptField::Texts(v) => v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?,
        PromptField::Tokens(t) => vec![t.clone()],
        PromptField::TokenLists(v) => v.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid_param("prompt", "`prompt` must not be an empty list"));
    }
    let n = fields.n()?;
    if prompts.len() * n > super::generate::MAX_N {
        return Err(ApiError::invalid_param(
            "n",
            format!(
                "{} prompts x n = {n} is more than {} sequences in one request",
                prompts.len(),
                super::generate::MAX_N
            ),
        ));
    }
    let mut params = fields.params()?;
    params.logprobs = match req.logprobs {
        None => None,
        Some(l) if l >= 0 && l as usize <= MAX_LOGPROBS => Some(l as usize),
        Some(l) => {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!("`logprobs` must be between 0 and {MAX_LOGPROBS}, got {l}"),
            ))
        }
    };
    let structured = structured::from_body(&v)?;
    params.grammar = structured::compile_off_thread(&engine, structured.as_ref()).await?;
    let echo = req.echo.unwrap_or(false);
    if echo {
        // Echoed prompt tokens carry logprobs too (vLLM: prompt_logprobs = logprobs).
        params.prompt_logprobs = params.logprobs;
    }
    // OpenAI's and vLLM's default for completions is 16 tokens (capped by the context).
    let max_tokens = MaxTokens { requested: fields.max_tokens()?, default: Some(16) };
    let mut requests = Vec::with_capacity(prompts.len() * n);
    for prompt in &prompts {
        let mut p = params.clone();
        check_request(&engine, prompt, &mut p, max_tokens, "prompt")?;
        requests.extend((0..n).map(|i| Request { prompt_tokens: prompt.clone(), params: seeded(&p, i) }));
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    // What echo shows: the prompt as text (special tokens included, as it was sent).
    let echoed: Vec<Option<(String, Vec<u32>)>> =
        prompts.into_iter().map(|p| echo.then(|| (tok.decode(&p, false).unwrap_or_default(), p))).collect();
    let total = requests.len();
    let sub = submit(&app, &engine, requests)?;
    let id = random_id("cmpl-");
    let created = now_unix();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
        let format = CompletionFormat {
            tok,
            logprobs: params.logprobs.is_some(),
            n,
            echo: echoed,
            offsets: vec![0; total],
            echoed: vec![false; total],
        };
        let conv = OpenAiStream::new(id, created, model, total, n, include_usage, prompt_tokens, format);
        return Ok(sse_response(sub, conv));
    }
    let results = collect(sub, total, params.logprobs.is_some()).await?;
    let completion: usize = results.iter().map(|c| c.num_output_tokens).sum();
    let cached_each: Vec<usize> = results.iter().map(|c| c.num_cached_tokens).collect();
    let cached = cached_per_prompt(&cached_each, n);
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let echo = echoed[i / n].as_ref();
            let text = format!("{}{}", echo.map_or("", |e| e.0.as_str()), c.text);
            let logprobs = params.logprobs.map(|_| {
                let mut lp = LegacyLogprobs::default();
                if let Some((_, ids)) = echo {
                    lp.push_prompt(&tok, ids, &c.prompt_logprobs);
                }
                for e in &c.logprobs {
                    lp.push(&tok, e);
                }
                lp.into_json()
            });
            json!({ "index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_str(c) })
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion, cached),
        "system_fingerprint": null,
    }))
    .into_response())
}

// ---------------------------------------------------------------------------------------
// /v1/models, /tokenize, /detokenize

fn model_card(app: &AppState) -> Value {
    let max_len = app.engine.get().map(|e| e.info.max_model_len);
    json!({
        "id": app.cfg.served_model_name,
        "object": "model",
        "created": app.started,
        "owned_by": "iris",
        "root": app.cfg.model_path,
        "max_model_len": max_len,
    })
}

pub async fn models(State(app): AppRef) -> Response {
    Json(json!({ "object": "list", "data": [model_card(&app)] })).into_response()
}

/// `GET /v1/models/{id}`: the served model under either of its names, else a 404.
pub async fn model(State(app): AppRef, Path(id): Path<String>) -> Response {
    if id.is_empty() {
        return ApiError::not_found("no model id given: GET /v1/models lists them")
            .code("model_not_found")
            .into_response();
    }
    respond(app.check_model(Some(&id)).map(|_| Json(model_card(&app)).into_response()))
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

pub async fn tokenize(State(app): AppRef, body: Result<Bytes, BytesRejection>) -> Response {
    respond(tokenize_inner(app, body).await)
}

/// The prompt the engine would run: with images, each one's pad token repeated once per
/// embedding (the images are fetched and preprocessed as for a chat request).
async fn tokenize_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    fields::TOKENIZE.check(&v)?;
    let req: TokenizeRequest = typed(&v)?;
    app.check_model(req.model.as_deref())?;
    let tok = &engine.tokenizer;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => {
            tok.encode(p, req.add_special_tokens.unwrap_or(true)).map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        (None, Some(m)) => {
            let (messages, images) = parse_messages(m)?;
            super::images::check_accepted(&engine, &images)?;
            let tools = ToolRequest::openai(req.tools.as_ref(), None, None)?;
            let mut extra = req.chat_template_kwargs.clone().unwrap_or_default();
            tools.template_vars(&mut extra);
            let prompt = encode_chat(tok, &messages, req.add_generation_prompt.unwrap_or(true), extra)?;
            super::images::prepare(&app.cfg.media, &engine, prompt, images).await?.0
        }
        _ => return Err(ApiError::bad_request("give exactly one of `prompt` and `messages`")),
    };
    Ok(Json(json!({ "count": tokens.len(), "max_model_len": engine.info.max_model_len, "tokens": tokens }))
        .into_response())
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

pub async fn detokenize(State(app): AppRef, body: Result<Bytes, BytesRejection>) -> Response {
    respond((|| {
        let engine = app.engine()?;
        let v = parse_json(body, app.cfg.max_body_bytes)?;
        fields::DETOKENIZE.check(&v)?;
        let req: DetokenizeRequest = typed(&v)?;
        app.check_model(req.model.as_deref())?;
        let vocab = engine.info.vocab_size;
        if let Some(&id) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid_param(
                "tokens",
                format!("token id {id} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        let text = engine.tokenizer.decode(&req.tokens, false).map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(Json(json!({ "prompt": text })).into_response())
    })())
}
