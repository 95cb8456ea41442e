//! What the API front ends share: body parsing, sampling fields, prompt checks, submission,
//! and collecting a request's sequences for non-streaming responses.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::engine_loop::{EngineHandle, SeqEvent, SeqEventKind, Submission, SubmitError};
use super::errors::ApiError;
use super::state::AppState;
use crate::engine::{FinishReason, Request, RequestError, Sampled, SamplingParams};
use crate::tokenizer::TextTokenizer;

/// Most choices (`n`) one request may ask for.
pub const MAX_N: usize = 64;

pub use super::ids::random_id;

/// Reads a JSON object body into `serde_json::Value`, with a clear error for each way it can
/// be wrong (too large, not UTF-8, not JSON, not an object).
pub fn parse_json(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<serde_json::Value, ApiError> {
    let bytes = body.map_err(|rej| {
        if let Some(cut) = super::timed_body::BodyCut::find(&rej) {
            return match cut {
                super::timed_body::BodyCut::Timeout(_) => {
                    ApiError::new(StatusCode::REQUEST_TIMEOUT, cut.to_string()).code("request_timeout")
                }
                super::timed_body::BodyCut::ShuttingDown => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, cut.to_string()).code("shutting_down")
                }
            };
        }
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is larger than the limit of {limit} bytes"),
            )
            .code("request_too_large")
        } else {
            ApiError::new(rej.status(), format!("cannot read the request body: {}", rej.body_text()))
        }
    })?;
    let text = std::str::from_utf8(&bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the request body is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the request body must be a JSON object"));
    }
    Ok(value)
}

/// Deserializes a JSON object into `T`, naming the field at fault.
pub fn typed<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = plain_words(&e.into_inner().to_string(), &path);
        if path == "." || path.is_empty() {
            ApiError::bad_request(format!("invalid request: {inner}"))
        } else {
            ApiError::invalid_param(path.clone(), format!("invalid value for `{path}`: {inner}"))
        }
    })
}

/// serde's message in the API's words: no Rust type names (`i64`, `struct StreamOptions`,
/// `untagged enum PromptField`) reach the client.
fn plain_words(msg: &str, path: &str) -> String {
    if msg.contains("untagged enum") {
        let expected = match path.rsplit('.').next().unwrap_or(path) {
            "prompt" => "a string, a list of strings, a list of token ids or a list of lists of token ids",
            "stop" => "a string or a list of strings",
            _ => "one of the accepted forms",
        };
        return format!("expected {expected}");
    }
    let mut out = msg.to_string();
    for (rust, words) in [
        ("usize", "a non-negative integer"),
        ("u64", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("u16", "a non-negative integer"),
        ("u8", "a non-negative integer"),
        ("i64", "an integer"),
        ("i32", "an integer"),
        ("f32", "a number"),
        ("f64", "a number"),
    ] {
        out = out.replace(&format!("expected {rust}"), &format!("expected {words}"));
    }
    if let Some(i) = out.find("expected struct ") {
        let end = out[i + 16..].find(|c: char| !c.is_alphanumeric() && c != '_').map_or(out.len(), |j| i + 16 + j);
        out.replace_range(i..end, "expected an object");
    }
    if let Some(i) = out.find("expected enum ") {
        let end = out[i + 14..].find(|c: char| !c.is_alphanumeric() && c != '_').map_or(out.len(), |j| i + 14 + j);
        out.replace_range(i..end, "expected one of the accepted values");
    }
    out.replace("a sequence", "a list").replace("a map", "an object")
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// Sampling fields shared by the OpenAI endpoints (vLLM's extensions included). Read from
/// the same body as the endpoint's own struct, so wrong types name their field.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
}

impl SamplingFields {
    /// `n`, checked.
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if n >= 1 && n as usize <= MAX_N => Ok(n as usize),
            Some(n) => Err(ApiError::invalid_param("n", format!("`n` must be between 1 and {MAX_N}, got {n}"))),
        }
    }

    /// `max_completion_tokens` or else `max_tokens`, when given: at least 1.
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        let (name, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        match max {
            Some(m) if m <= 0 => Err(ApiError::invalid_param(name, format!("`{name}` must be at least 1, got {m}"))),
            Some(m) => Ok(Some(m as usize)),
            None => Ok(None),
        }
    }

    /// The parameters, except logprobs and max_tokens (see [`check_request`]).
    pub fn params(&self) -> Result<SamplingParams, ApiError> {
        let mut p = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(k) = self.top_k {
            p.top_k = usize::try_from(k).unwrap_or(0);
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        if let Some(v) = self.presence_penalty {
            p.presence_penalty = v;
        }
        if let Some(v) = self.frequency_penalty {
            p.frequency_penalty = v;
        }
        if let Some(v) = self.repetition_penalty {
            p.repetition_penalty = v;
        }
        p.seed = self.seed.map(|s| s as u64);
        if let Some(stop) = &self.stop {
            p.stop = stop.clone().into_vec();
        }
        if let Some(m) = &self.logit_bias {
            let mut bias = Vec::with_capacity(m.len());
            for (k, v) in m {
                let id = k.trim().parse::<u32>().map_err(|_| {
                    ApiError::invalid_param("logit_bias", format!("logit_bias key `{k}` is not a token id"))
                })?;
                if !(-100.0..=100.0).contains(v) {
                    return Err(ApiError::invalid_param(
                        "logit_bias",
                        format!("logit_bias values must be in [-100, 100], got {v} for token {id}"),
                    ));
                }
                bias.push((id, *v));
            }
            bias.sort_by_key(|&(id, _)| id);
            p.logit_bias = bias;
        }
        p.ignore_eos = self.ignore_eos.unwrap_or(false);
        if let Some(m) = self.min_tokens {
            p.min_tokens = usize::try_from(m)
                .map_err(|_| ApiError::invalid_param("min_tokens", format!("`min_tokens` must be >= 0, got {m}")))?;
        }
        if let Some(ids) = &self.stop_token_ids {
            p.stop_token_ids = ids.clone();
        }
        if let Some(s) = self.skip_special_tokens {
            p.skip_special_tokens = s;
        }
        Ok(p)
    }
}

/// How many tokens a request may generate.
#[derive(Debug, Clone, Copy)]
pub struct MaxTokens {
    /// What the request asked for (`max_tokens`); prompt plus this must fit the context.
    pub requested: Option<usize>,
    /// When it did not ask: at most this many, or (`None`) the rest of the context.
    pub default: Option<usize>,
}

/// Checks a prompt and `max_tokens` against the context (vLLM's rule and message: prompt
/// plus requested tokens must fit, else a 400 naming the lengths) and the parameters against
/// the vocabulary; sets `params.max_tokens`. `prompt_noun` names the prompt in messages.
pub fn check_request(
    engine: &EngineHandle,
    prompt: &[u32],
    params: &mut SamplingParams,
    max_tokens: MaxTokens,
    prompt_noun: &str,
) -> Result<(), ApiError> {
    let max_len = engine.info.max_model_len;
    let p = prompt.len();
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
    }
    let too_long = match max_tokens.requested {
        Some(m) if p + m > max_len => Some(format!(
            "This model's maximum context length is {max_len} tokens. However, you requested {} tokens \
             ({p} in the {prompt_noun}, {m} in the completion). Please reduce the length of the \
             {prompt_noun} or completion.",
            p + m
        )),
        None if p >= max_len => Some(format!(
            "This model's maximum context length is {max_len} tokens. However, your {prompt_noun} resulted \
             in {p} tokens, which leaves no room for the completion. Please reduce the length of the \
             {prompt_noun}."
        )),
        _ => None,
    };
    if let Some(msg) = too_long {
        return Err(ApiError::bad_request(msg).code("context_length_exceeded"));
    }
    let vocab = engine.info.vocab_size;
    if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(
            ApiError::bad_request(format!("token id {id} is outside the vocabulary of {vocab} tokens")).param("prompt")
        );
    }
    let rest = max_len - p;
    // Without `max_tokens`: the endpoint's default, else the server's cap
    // (--default-max-tokens), else the rest of the context.
    let default = max_tokens.default.or(engine.limits.default_max_tokens);
    params.max_tokens = max_tokens.requested.unwrap_or_else(|| default.map_or(rest, |d| d.min(rest)));
    params.validate(vocab).map_err(|e| ApiError::invalid_param(e.param, e.to_string()))
}

/// Turns engine-side refusals into API errors.
pub fn request_error(e: RequestError) -> ApiError {
    match e {
        RequestError::BadParams(m) => ApiError::bad_request(m),
        other => ApiError::bad_request(other.to_string()),
    }
}

pub fn submit(state: &AppState, engine: &EngineHandle, requests: Vec<Request>) -> Result<Submission, ApiError> {
    submit_with_images(state, engine, requests, Vec::new())
}

/// [`submit`] for requests that share the same images (their prompts hold the image tokens).
pub fn submit_with_images(
    state: &AppState,
    engine: &EngineHandle,
    requests: Vec<Request>,
    images: Vec<crate::engine::ImageInput>,
) -> Result<Submission, ApiError> {
    engine.submit_with_images(requests, images).map_err(|e| match e {
        SubmitError::QueueFull { limit } => {
            state.metrics.rejected_queue_full.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the server is at capacity: {limit} sequences are already running or queued \
                     (--max-num-seqs + --max-queue); retry later"
                ),
            )
            .code("queue_full")
            .retry_after(1)
        }
        SubmitError::NeverFits { asked, limit } => ApiError::invalid_param(
            "n",
            format!(
                "this request asks for {asked} sequences (prompts x n), more than this server can ever hold \
                 at once: {limit} (--max-num-seqs {} + --max-queue {})",
                engine.info.max_num_seqs,
                limit - engine.info.max_num_seqs
            ),
        ),
        SubmitError::EngineGone => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine has stopped (shutting down, or it failed: see the server log)",
        ),
    })
}

/// Everything a sequence produced, for non-streaming responses.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<Sampled>,
    /// The prompt's logprobs, when the request asked for them.
    pub prompt_logprobs: Vec<Sampled>,
    pub finish: Option<FinishReason>,
    pub num_output_tokens: usize,
    /// Prompt tokens read from the prefix cache.
    pub num_cached_tokens: usize,
}

/// Waits until each of the `n` sequences has finished, at most `--request-timeout`.
pub async fn collect(sub: Submission, n: usize, want_logprobs: bool) -> Result<Vec<Collected>, ApiError> {
    match sub.deadline {
        None => collect_all(sub, n, want_logprobs).await,
        Some(limit) => match tokio::time::timeout(limit, collect_all(sub, n, want_logprobs)).await {
            Ok(r) => r,
            // Dropping the submission (inside the timed-out future) cancels its sequences.
            Err(_) => Err(timed_out(limit)),
        },
    }
}

/// The answer to a request that ran past `--request-timeout`.
pub fn timed_out(limit: std::time::Duration) -> ApiError {
    ApiError::new(
        StatusCode::GATEWAY_TIMEOUT,
        format!("the request did not finish within {}s (--request-timeout); it was cancelled", limit.as_secs_f64()),
    )
    .code("request_timeout")
}

async fn collect_all(mut sub: Submission, n: usize, want_logprobs: bool) -> Result<Vec<Collected>, ApiError> {
    let mut out = vec![Collected::default(); n];
    let mut done = 0;
    while done < n {
        let Some(SeqEvent { index, kind }) = sub.events.recv().await else {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine stopped before the request finished",
            ));
        };
        let Some(c) = out.get_mut(index) else { continue };
        match kind {
            SeqEventKind::Rejected(e) => return Err(request_error(e)),
            SeqEventKind::Ended(reason) => return Err(aborted(&reason)),
            SeqEventKind::Update(u) => {
                c.text.push_str(&u.text);
                if let Some(p) = u.prompt_logprobs {
                    c.prompt_logprobs = p;
                }
                if let Some(t) = u.token {
                    c.tokens.push(t.token);
                    if want_logprobs {
                        c.logprobs.push(t);
                    }
                }
                c.num_output_tokens = u.num_output_tokens;
                c.num_cached_tokens = u.num_cached_tokens;
                if let Some(f) = u.finish {
                    if matches!(f, FinishReason::Cancelled | FinishReason::Error(_)) {
                        return Err(aborted(&f));
                    }
                    c.finish = Some(f);
                    done += 1;
                }
            }
        }
    }
    Ok(out)
}

/// The error a request gets when the server ended one of its sequences (shutdown deadline,
/// a failed engine step): never a normal-looking answer with part of the text.
pub fn aborted(reason: &FinishReason) -> ApiError {
    match reason {
        FinishReason::Error(m) => {
            // The details are for the log; the client learns that the server failed.
            tracing::warn!("a request failed: {m}");
            ApiError::internal("the server failed while generating this response (see the server log)")
                .code("engine_error")
        }
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server cancelled this request before it finished (shutting down, or past --request-timeout)",
        )
        .code("cancelled"),
    }
}

/// The text of one token, as logprobs show it.
pub fn token_text(tok: &TextTokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Which stop string ended a sequence, if one did: the earliest one in the decoded output.
pub fn matched_stop(tok: &Arc<TextTokenizer>, tokens: &[u32], stops: &[String], eos: &[u32]) -> Option<String> {
    if stops.is_empty() || tokens.last().is_some_and(|t| eos.contains(t)) {
        return None;
    }
    let text = tok.decode(tokens, true).ok()?;
    stops.iter().filter_map(|s| text.find(s.as_str()).map(|i| (i, s))).min_by_key(|(i, _)| *i).map(|(_, s)| s.clone())
}

/// Seeds for `n` sequences of one request: `seed + i` when seeded.
pub fn seeded(params: &SamplingParams, i: usize) -> SamplingParams {
    let mut p = params.clone();
    if let Some(s) = p.seed {
        p.seed = Some(s.wrapping_add(i as u64));
    }
    p
}
