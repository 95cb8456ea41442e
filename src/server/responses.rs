//! The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE
//! /v1/responses/{id}`. A request is read into chat messages (`responses_request.rs`), run
//! through the chat endpoint's machinery (`ChatPrompt`: template, tools, parsers; the same
//! sampling fields, checks and submission), and its reply built into output items
//! (`responses_output.rs`), streamed as OpenAI's events (`responses_stream.rs`) or not.
//! `store` (default true, as OpenAI) keeps it in the bounded store (`response_store.rs`)
//! for `previous_response_id` and GET.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::chat_prompt::ChatPrompt;
use super::errors::ApiError;
use super::fields;
use super::generate::{
    check_request, collect, parse_json, random_id, submit_with_images, typed, MaxTokens, SamplingFields,
};
use super::response_store::Turn;
use super::responses_output::{usage, OutputBuilder, ResponseMeta, Status};
use super::responses_request::{check_settings, check_text, input_messages, reasoning_vars, tools};
use super::responses_stream::{reasoning_tokens, ResponseStream};
use super::sse::sse_response;
use super::state::{now_unix, AppState};
use super::structured;
use crate::engine::Request;
use crate::tokenizer::ChatMessage;

#[derive(Debug, Deserialize)]
struct ResponsesBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
}

/// OpenAI's answer for an id the store does not hold (never stored, evicted, deleted).
fn unknown_response(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "Response with id '{id}' not found. Responses are kept in memory, at most --max-stored-responses of them \
         (the least recently used go first), and only with `store: true`."
    ))
    .code("response_not_found")
}

fn max_output_tokens(m: Option<i64>) -> Result<Option<usize>, ApiError> {
    match m {
        Some(m) if m <= 0 => Err(ApiError::invalid_param(
            "max_output_tokens",
            format!("`max_output_tokens` must be at least 1, got {m}"),
        )),
        m => Ok(m.map(|m| m as usize)),
    }
}

pub async fn create(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    create_inner(app, body).await.unwrap_or_else(|e| e.into_response())
}

async fn create_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let engine = app.engine()?.clone();
    let v = parse_json(body, app.cfg.max_body_bytes)?;
    fields::RESPONSES.check(&v)?;
    let req: ResponsesBody = typed(&v)?;
    let sampling: SamplingFields = typed(&v)?;
    let model = app.check_model(req.model.as_deref())?;
    check_settings(&v)?;
    check_text(req.text.as_ref())?;
    let structured = structured::from_text_format(req.text.as_ref().and_then(|t| t.get("format")))?;
    let mut extra = Map::new();
    reasoning_vars(req.reasoning.as_ref(), &mut extra)?;
    let tool_req = tools(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    let max_output = max_output_tokens(req.max_output_tokens)?;
    let input = req.input.as_ref().ok_or_else(|| ApiError::invalid_param("input", "`input` is required"))?;
    let (turn_messages, turn_images) = input_messages(input, "input")?;
    let parent = match &req.previous_response_id {
        None => None,
        Some(id) => Some(app.responses.get(id).ok_or_else(|| unknown_response(id).param("previous_response_id"))?),
    };
    // The stored conversation, this request's instructions first (OpenAI does not carry a
    // previous response's instructions over), then this turn.
    let (mut messages, mut images) = parent.as_ref().map(|p| p.history()).unwrap_or_default();
    if let Some(i) = &req.instructions {
        messages.insert(0, ChatMessage::text("system", i.as_str()));
    }
    messages.extend(turn_messages.iter().cloned());
    images.extend(turn_images.iter().cloned());
    let mut chat = ChatPrompt::build(&app, &engine, &messages, images, &tool_req, extra, true, "call_").await?;
    let mut params = sampling.params()?;
    chat.fit_params(&mut params, sampling.skip_special_tokens);
    params.grammar = chat.grammar(&engine, structured.as_ref()).await?;
    check_request(&engine, &chat.tokens, &mut params, MaxTokens { requested: max_output, default: None }, "input")?;
    let meta = ResponseMeta {
        id: random_id("resp_"),
        created_at: now_unix(),
        model,
        instructions: req.instructions.clone(),
        previous_response_id: req.previous_response_id.clone(),
        store: req.store.unwrap_or(true),
        temperature: params.temperature,
        top_p: params.top_p,
        max_output_tokens: max_output,
        tools: req.tools.clone().filter(|t| !t.is_null()).unwrap_or_else(|| json!([])),
        tool_choice: req.tool_choice.clone().filter(|t| !t.is_null()).unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: tool_req.parallel,
        reasoning: json!({
            "effort": req.reasoning.as_ref().and_then(|r| r.get("effort")).cloned().unwrap_or(Value::Null),
            "summary": req.reasoning.as_ref().and_then(|r| r.get("summary")).cloned().unwrap_or(Value::Null),
        }),
        metadata: Value::Object(req.metadata.clone().unwrap_or_default()),
        user: req.user.clone().map_or(Value::Null, Value::String),
        text_format: structured
            .as_ref()
            .and(req.text.as_ref().and_then(|t| t.get("format")).cloned())
            .unwrap_or_else(|| json!({ "type": "text" })),
    };
    let turn =
        meta.store.then(|| Turn { store: app.responses.clone(), parent, messages: turn_messages, images: turn_images });
    let prompt_tokens = chat.tokens.len();
    let request = Request { prompt_tokens: chat.tokens.clone(), params };
    let sub = submit_with_images(&app, &engine, vec![request], std::mem::take(&mut chat.images))?;
    let tok = engine.tokenizer.clone();
    let mut early = Vec::new();
    let mut parser = chat.parser(&mut early);
    if req.stream.unwrap_or(false) {
        let conv = ResponseStream::new(meta, tok, prompt_tokens, parser, early, turn);
        return Ok(sse_response(sub, conv));
    }
    let c = collect(sub, 1, false).await?.remove(0);
    let mut deltas = early;
    parser.feed(&c.text, &mut deltas);
    parser.finish(&mut deltas);
    let mut out = OutputBuilder::default();
    let mut events = Vec::new();
    for d in deltas {
        out.push(d, &mut events);
    }
    // collect() answers only sequences that ended normally.
    let status = c.finish.as_ref().and_then(Status::of).unwrap_or(Status::Completed);
    out.finish(status, &mut events);
    let state = if status == Status::Completed { "completed" } else { "incomplete" };
    let reasoning = reasoning_tokens(&tok, &out.reasoning, c.num_output_tokens);
    let response = meta.object(
        state,
        out.items(),
        usage(prompt_tokens, c.num_output_tokens, reasoning, c.num_cached_tokens),
        Value::Null,
    );
    if let Some(turn) = turn {
        turn.keep(response.clone());
    }
    Ok(Json(response).into_response())
}

/// GET and DELETE take no query parameters: OpenAI's (`stream` to replay, `include`,
/// `starting_after`) ask for what iris does not do, so they are refused, not ignored.
fn no_query(query: Option<String>) -> Result<(), ApiError> {
    let Some(q) = query.filter(|q| !q.is_empty()) else { return Ok(()) };
    let name = q.split('&').next().and_then(|p| p.split('=').next()).unwrap_or(&q).to_string();
    Err(ApiError::invalid_param(
        name.clone(),
        format!("unsupported query parameter `{name}`: iris returns a stored response as JSON and takes no parameters"),
    )
    .code("unsupported_field"))
}

/// `GET /v1/responses/{id}`: a stored response.
pub async fn get(State(app): State<Arc<AppState>>, Path(id): Path<String>, RawQuery(q): RawQuery) -> Response {
    if let Err(e) = no_query(q) {
        return e.into_response();
    }
    match app.responses.get(&id) {
        Some(s) => Json(s.response.clone()).into_response(),
        None => unknown_response(&id).into_response(),
    }
}

/// `DELETE /v1/responses/{id}`. Responses that continued it keep their history.
pub async fn delete(State(app): State<Arc<AppState>>, Path(id): Path<String>, RawQuery(q): RawQuery) -> Response {
    if let Err(e) = no_query(q) {
        return e.into_response();
    }
    if app.responses.remove(&id) {
        Json(json!({ "id": id, "object": "response.deleted", "deleted": true })).into_response()
    } else {
        unknown_response(&id).into_response()
    }
}
