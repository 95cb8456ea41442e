//! How the chat and the completions API put a sequence's output into `choices`: their
//! logprobs formats, and one SSE stream for both that differs only in a [`ChoiceFormat`].

use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::engine_loop::{SeqEvent, SeqEventKind};
use super::errors::ApiError;
use super::generate::{aborted, request_error, token_text};
use super::reply::{Delta, ReplyParser, ReplySetup};
use super::sse::{json_event, Converter};
use crate::engine::FinishReason;
use crate::engine::{Sampled, SeqUpdate};
use crate::tokenizer::TextTokenizer;

/// JSON has no -inf: clamp like vLLM does.
pub fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// The prompt tokens read from the prefix cache over a request's prompts: each prompt's
/// first choice's (its `n` choices share one prompt, which usage counts once).
pub fn cached_per_prompt(per_choice: &[usize], per_prompt: usize) -> usize {
    per_choice.iter().step_by(per_prompt.max(1)).sum()
}

/// `cached`: prompt tokens read from the prefix cache (`prompt_tokens_details.cached_tokens`).
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

/// One entry of the chat API's `logprobs.content`.
pub fn chat_logprob_entry(tok: &TextTokenizer, lp: &Sampled) -> Value {
    let entry = |id: u32, logprob: f32| {
        let text = token_text(tok, id);
        let bytes: Vec<u8> = text.as_bytes().to_vec();
        json!({ "token": text, "logprob": finite(logprob), "bytes": bytes })
    };
    let mut e = entry(lp.token, lp.logprob);
    e["top_logprobs"] = Value::Array(lp.top_logprobs.iter().map(|&(id, l)| entry(id, l)).collect());
    e
}

/// The completions API's logprobs object; `text_offset` counts on from `offset`.
#[derive(Default)]
pub struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    text_offset: Vec<usize>,
    pub offset: usize,
}

impl LegacyLogprobs {
    pub fn with_offset(offset: usize) -> Self {
        LegacyLogprobs { offset, ..Default::default() }
    }

    /// Echoed prompt tokens. `logprobs[k]` belongs to token `k + 1`; the first token has no
    /// context, so no logprob (null, as in OpenAI's and vLLM's answers), nor do tokens
    /// without an entry.
    pub fn push_prompt(&mut self, tok: &TextTokenizer, ids: &[u32], logprobs: &[Sampled]) {
        for (k, &id) in ids.iter().enumerate() {
            let lp = k.checked_sub(1).and_then(|j| logprobs.get(j));
            self.push_token(tok, id, lp);
        }
    }

    pub fn push(&mut self, tok: &TextTokenizer, e: &Sampled) {
        self.push_token(tok, e.token, Some(e));
    }

    fn push_token(&mut self, tok: &TextTokenizer, id: u32, lp: Option<&Sampled>) {
        let t = token_text(tok, id);
        self.text_offset.push(self.offset);
        self.offset += t.len();
        self.tokens.push(t);
        self.token_logprobs.push(lp.map(|e| finite(e.logprob)));
        self.top_logprobs
            .push(lp.map(|e| e.top_logprobs.iter().map(|&(id, l)| (token_text(tok, id), json!(finite(l)))).collect()));
    }

    pub fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// What a choice of one API carries in a stream chunk: its content fields (`delta` or
/// `text`) and its `logprobs`.
pub trait ChoiceFormat: Send + 'static {
    /// `object` of the stream's chunks.
    const CHUNK_OBJECT: &'static str;
    /// Content fields of a chunk that opens choice `index` before any output (chat: the role).
    fn opening(&mut self, index: usize) -> Option<Value>;
    /// The (content fields, logprobs) pieces one update of choice `index` adds; none when it
    /// brings no text and no token to report.
    fn update(&mut self, index: usize, u: &SeqUpdate, out: &mut Vec<(Value, Value)>);
    /// Content fields of the chunk that carries only a finish reason.
    fn closing(&self) -> Value;
    /// The `finish_reason` choice `index` ends with (chat: `tool_calls` after calls).
    fn finish_reason(&self, _index: usize, reason: &FinishReason) -> &'static str {
        reason.as_openai_str()
    }
}

/// The chat API's choices: text, or with parsers on (tools, reasoning) the deltas of each
/// choice's [`ReplyParser`]: `content`, `reasoning_content` and `tool_calls` in OpenAI's
/// shape (a call's first delta has its index, id, type and name; later ones carry pieces of
/// its arguments).
pub struct ChatFormat {
    tok: Arc<TextTokenizer>,
    logprobs: bool,
    /// Per choice, its parser (already fed the call opening iris appended to the prompt
    /// under tool_choice required or named, if any).
    parsers: Vec<Option<ReplyParser>>,
    /// Per choice, what that opening gave (a streaming format's call starts there), sent
    /// with the choice's first update.
    early: Vec<Vec<Delta>>,
}

impl ChatFormat {
    pub fn new(tok: Arc<TextTokenizer>, logprobs: bool, setup: ReplySetup, forced: String, n: usize) -> Self {
        let mut early = vec![Vec::new(); n];
        let parsers = early
            .iter_mut()
            .map(|out| {
                (!setup.is_plain()).then(|| {
                    let mut p = ReplyParser::new(&setup);
                    p.feed(&forced, out);
                    p
                })
            })
            .collect();
        ChatFormat { tok, logprobs, parsers, early }
    }

    fn delta_fields(d: Delta) -> Value {
        match d {
            Delta::Content(t) => json!({ "delta": { "content": t } }),
            Delta::Reasoning(t) => json!({ "delta": { "reasoning_content": t } }),
            Delta::CallStart { index, id, name } => json!({ "delta": { "tool_calls": [{
                "index": index, "id": id, "type": "function", "function": { "name": name, "arguments": "" },
            }] } }),
            Delta::CallArgs { index, args } => {
                json!({ "delta": { "tool_calls": [{ "index": index, "function": { "arguments": args } }] } })
            }
        }
    }
}

impl ChoiceFormat for ChatFormat {
    const CHUNK_OBJECT: &'static str = "chat.completion.chunk";

    fn opening(&mut self, _index: usize) -> Option<Value> {
        Some(json!({ "delta": { "role": "assistant", "content": "" } }))
    }

    fn update(&mut self, index: usize, u: &SeqUpdate, out: &mut Vec<(Value, Value)>) {
        let lp = match (&u.token, self.logprobs) {
            (Some(t), true) => json!({ "content": [chat_logprob_entry(&self.tok, t)] }),
            _ => Value::Null,
        };
        let Some(Some(parser)) = self.parsers.get_mut(index) else {
            if !u.text.is_empty() || !lp.is_null() {
                out.push((json!({ "delta": { "content": u.text } }), lp));
            }
            return;
        };
        let mut deltas = self.early.get_mut(index).map(std::mem::take).unwrap_or_default();
        parser.feed(&u.text, &mut deltas);
        if u.finish.is_some() {
            parser.finish(&mut deltas);
        }
        let mut lp = Some(lp).filter(|l| !l.is_null());
        for d in deltas {
            out.push((Self::delta_fields(d), lp.take().unwrap_or(Value::Null)));
        }
        // A token whose text the parser holds back still reports its logprobs.
        if let Some(lp) = lp {
            out.push((json!({ "delta": { "content": "" } }), lp));
        }
    }

    fn finish_reason(&self, index: usize, reason: &FinishReason) -> &'static str {
        let called = self.parsers.get(index).and_then(Option::as_ref).is_some_and(ReplyParser::made_calls);
        match reason {
            FinishReason::Stop if called => "tool_calls",
            r => r.as_openai_str(),
        }
    }

    fn closing(&self) -> Value {
        json!({ "delta": {} })
    }
}

pub struct CompletionFormat {
    pub tok: Arc<TextTokenizer>,
    pub logprobs: bool,
    /// Choices per prompt: choice `i` continues prompt `i / n`.
    pub n: usize,
    /// Per prompt, with `echo`: its text and token ids, sent before the choice's first token
    /// (which brings the prompt's logprobs).
    pub echo: Vec<Option<(String, Vec<u32>)>>,
    /// Per choice: `text_offset` reached so far, and whether the echo was sent.
    pub offsets: Vec<usize>,
    pub echoed: Vec<bool>,
}

impl ChoiceFormat for CompletionFormat {
    const CHUNK_OBJECT: &'static str = "text_completion";

    fn opening(&mut self, _index: usize) -> Option<Value> {
        None
    }

    fn update(&mut self, i: usize, u: &SeqUpdate, out: &mut Vec<(Value, Value)>) {
        if !self.echoed[i] {
            self.echoed[i] = true;
            if let Some((text, ids)) = &self.echo[i / self.n] {
                let lp = if self.logprobs {
                    let mut lp = LegacyLogprobs::default();
                    lp.push_prompt(&self.tok, ids, u.prompt_logprobs.as_deref().unwrap_or_default());
                    self.offsets[i] = lp.offset;
                    lp.into_json()
                } else {
                    Value::Null
                };
                out.push((json!({ "text": text }), lp));
            }
        }
        let lp = match (&u.token, self.logprobs) {
            (Some(t), true) => {
                let mut lp = LegacyLogprobs::with_offset(self.offsets[i]);
                lp.push(&self.tok, t);
                self.offsets[i] = lp.offset;
                lp.into_json()
            }
            _ => Value::Null,
        };
        if !u.text.is_empty() || !lp.is_null() {
            out.push((json!({ "text": u.text }), lp));
        }
    }

    fn closing(&self) -> Value {
        json!({ "text": "" })
    }
}

/// The SSE stream of a chat or completions request: a chunk per piece of output, one with
/// each choice's finish reason, the usage chunk when asked for, and `[DONE]`.
pub struct OpenAiStream<F> {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: usize,
    format: F,
    finished: Vec<bool>,
    output_tokens: Vec<usize>,
    /// Per choice, its prompt's tokens read from the prefix cache.
    cached_tokens: Vec<usize>,
    /// Choices per prompt (`n`): usage counts each prompt once, by its first choice.
    per_prompt: usize,
    /// An error event was sent (once per stream).
    failed: bool,
}

impl<F: ChoiceFormat> OpenAiStream<F> {
    /// `choices` in all, `per_prompt` of them (`n`) for each prompt.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        created: u64,
        model: String,
        choices: usize,
        per_prompt: usize,
        include_usage: bool,
        prompt_tokens: usize,
        format: F,
    ) -> Self {
        OpenAiStream {
            id,
            created,
            model,
            include_usage,
            prompt_tokens,
            format,
            finished: vec![false; choices],
            output_tokens: vec![0; choices],
            cached_tokens: vec![0; choices],
            per_prompt: per_prompt.max(1),
            failed: false,
        }
    }

    fn chunk(&self, index: usize, fields: Value, logprobs: Value, finish: Option<&str>) -> Event {
        let mut choice = json!({ "index": index, "logprobs": logprobs, "finish_reason": finish });
        if let (Some(c), Value::Object(f)) = (choice.as_object_mut(), fields) {
            c.extend(f);
        }
        let mut c = json!({
            "id": self.id,
            "object": F::CHUNK_OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        json_event(&c)
    }

    /// Sends choice `index`'s finish reason (once); true when every choice has finished.
    fn finish(&mut self, index: usize, reason: &str, out: &mut Vec<Event>) -> bool {
        if !self.finished[index] {
            self.finished[index] = true;
            out.push(self.chunk(index, self.format.closing(), Value::Null, Some(reason)));
        }
        self.finished.iter().all(|f| *f)
    }

    /// Sends an error event (once per stream; OpenAI's clients raise it as an error).
    fn error_event(&mut self, err: ApiError, out: &mut Vec<Event>) {
        if !self.failed {
            self.failed = true;
            out.push(json_event(&err.body()));
        }
    }

    /// Finishes choice `index` with `reason`; a server-side abort also sends an error event,
    /// so a cut-short answer never looks like a normal ending.
    fn finish_with(&mut self, index: usize, reason: &FinishReason, out: &mut Vec<Event>) -> bool {
        if matches!(reason, FinishReason::Cancelled | FinishReason::Error(_)) && !self.finished[index] {
            self.error_event(aborted(reason), out);
        }
        let name = self.format.finish_reason(index, reason);
        self.finish(index, name, out)
    }
}

impl<F: ChoiceFormat> Converter for OpenAiStream<F> {
    fn start(&mut self, out: &mut Vec<Event>) {
        for i in 0..self.finished.len() {
            if let Some(fields) = self.format.opening(i) {
                out.push(self.chunk(i, fields, Value::Null, None));
            }
        }
    }

    fn on_event(&mut self, ev: SeqEvent, out: &mut Vec<Event>) -> bool {
        let i = ev.index;
        match ev.kind {
            SeqEventKind::Rejected(e) => {
                self.error_event(request_error(e), out);
                self.finish(i, "error", out)
            }
            SeqEventKind::Ended(reason) => self.finish_with(i, &reason, out),
            SeqEventKind::Update(u) => {
                self.output_tokens[i] = u.num_output_tokens;
                self.cached_tokens[i] = u.num_cached_tokens;
                let mut pieces = Vec::new();
                self.format.update(i, &u, &mut pieces);
                for (fields, lp) in pieces {
                    out.push(self.chunk(i, fields, lp, None));
                }
                match u.finish {
                    Some(f) => self.finish_with(i, &f, out),
                    None => false,
                }
            }
        }
    }

    fn abort(&mut self, err: ApiError, out: &mut Vec<Event>) {
        for i in 0..self.finished.len() {
            self.finish(i, "abort", out);
        }
        self.error_event(err, out);
    }

    fn end(&mut self, complete: bool, out: &mut Vec<Event>) {
        if !complete {
            // The engine went away with choices unfinished.
            for i in 0..self.finished.len() {
                if !self.finished[i] {
                    self.finish_with(i, &FinishReason::Cancelled, out);
                }
            }
        }
        if self.include_usage {
            let completion: usize = self.output_tokens.iter().sum();
            let cached = cached_per_prompt(&self.cached_tokens, self.per_prompt);
            out.push(json_event(&json!({
                "id": self.id,
                "object": F::CHUNK_OBJECT,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(self.prompt_tokens, completion, cached),
            })));
        }
        out.push(Event::default().data("[DONE]"));
    }
}
