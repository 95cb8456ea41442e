//! The Responses API's stream: `response.created`, `response.in_progress`, then the output
//! items' events as the reply is parsed (`OutputBuilder`), and `response.completed` (or
//! `response.incomplete` when `max_output_tokens` ran out, `response.failed` when the
//! server ended the response), each a named SSE event with its `type` and a
//! `sequence_number` counting from 0, as OpenAI's SDK reads them. No `[DONE]`: OpenAI sends
//! none on this endpoint.
//!
//! The stream owns the submission ([`super::sse`]): a client that goes away cancels the
//! generation, and nothing is stored.

use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::engine_loop::{SeqEvent, SeqEventKind};
use super::errors::ApiError;
use super::generate::{aborted, request_error};
use super::reply::{Delta, ReplyParser};
use super::response_store::Turn;
use super::responses_output::{usage, OutputBuilder, ResponseMeta, Status};
use super::sse::{named_event, Converter};
use crate::engine::SeqUpdate;
use crate::tokenizer::TextTokenizer;

pub struct ResponseStream {
    meta: ResponseMeta,
    tok: Arc<TextTokenizer>,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Prompt tokens read from the prefix cache.
    cached_tokens: usize,
    seq: u64,
    parser: ReplyParser,
    /// What the forced call opening gave, sent after `response.in_progress`.
    early: Vec<Delta>,
    out: OutputBuilder,
    /// Stored when it completes (`store: true`).
    turn: Option<Turn>,
    done: bool,
}

/// `usage.output_tokens_details.reasoning_tokens`: the thinking's text tokenized again (the
/// engine counts tokens per sequence, not per part), at most the output's count.
pub fn reasoning_tokens(tok: &TextTokenizer, reasoning: &str, output: usize) -> usize {
    if reasoning.is_empty() {
        return 0;
    }
    tok.encode_plain_text(reasoning).map(|t| t.len()).unwrap_or(0).min(output)
}

impl ResponseStream {
    pub fn new(
        meta: ResponseMeta,
        tok: Arc<TextTokenizer>,
        prompt_tokens: usize,
        parser: ReplyParser,
        early: Vec<Delta>,
        turn: Option<Turn>,
    ) -> Self {
        ResponseStream {
            meta,
            tok,
            prompt_tokens,
            output_tokens: 0,
            cached_tokens: 0,
            seq: 0,
            parser,
            early,
            out: OutputBuilder::default(),
            turn,
            done: false,
        }
    }

    fn emit(&mut self, mut ev: Value, out: &mut Vec<Event>) {
        ev["sequence_number"] = json!(self.seq);
        self.seq += 1;
        let name = ev["type"].as_str().unwrap_or("message").to_string();
        out.push(named_event(&name, &ev));
    }

    fn emit_all(&mut self, events: Vec<Value>, out: &mut Vec<Event>) {
        for e in events {
            self.emit(e, out);
        }
    }

    fn usage(&self) -> Value {
        let reasoning = reasoning_tokens(&self.tok, &self.out.reasoning, self.output_tokens);
        usage(self.prompt_tokens, self.output_tokens, reasoning, self.cached_tokens)
    }

    fn deltas(&mut self, deltas: Vec<Delta>, out: &mut Vec<Event>) {
        let mut events = Vec::new();
        for d in deltas {
            self.out.push(d, &mut events);
        }
        self.emit_all(events, out);
    }

    /// The normal end: the last items, the final Response object, stored if asked.
    fn complete(&mut self, status: Status, out: &mut Vec<Event>) {
        let mut events = Vec::new();
        self.out.finish(status, &mut events);
        self.emit_all(events, out);
        let (name, state) = match status {
            Status::Completed => ("response.completed", "completed"),
            Status::Incomplete => ("response.incomplete", "incomplete"),
        };
        let response = self.meta.object(state, self.out.items(), self.usage(), Value::Null);
        if let Some(turn) = self.turn.take() {
            turn.keep(response.clone());
        }
        self.emit(json!({ "type": name, "response": response }), out);
        self.done = true;
    }

    /// The server ended the response: `response.failed` with the error (once).
    fn fail(&mut self, err: ApiError, out: &mut Vec<Event>) {
        if self.done {
            return;
        }
        self.done = true;
        let mut events = Vec::new();
        self.out.abandon(&mut events);
        self.emit_all(events, out);
        let error = json!({ "code": "server_error", "message": err.message });
        let response = self.meta.object("failed", self.out.items(), self.usage(), error);
        self.emit(json!({ "type": "response.failed", "response": response }), out);
    }

    fn update(&mut self, u: SeqUpdate, out: &mut Vec<Event>) -> bool {
        self.output_tokens = u.num_output_tokens;
        self.cached_tokens = u.num_cached_tokens;
        let mut deltas = Vec::new();
        self.parser.feed(&u.text, &mut deltas);
        let Some(finish) = u.finish else {
            self.deltas(deltas, out);
            return false;
        };
        match Status::of(&finish) {
            Some(status) => {
                self.parser.finish(&mut deltas);
                self.deltas(deltas, out);
                self.complete(status, out);
            }
            None => {
                self.deltas(deltas, out);
                self.fail(aborted(&finish), out);
            }
        }
        true
    }
}

impl Converter for ResponseStream {
    fn start(&mut self, out: &mut Vec<Event>) {
        let response = self.meta.object("in_progress", &[], Value::Null, Value::Null);
        self.emit(json!({ "type": "response.created", "response": response }), out);
        self.emit(json!({ "type": "response.in_progress", "response": response }), out);
        let early = std::mem::take(&mut self.early);
        self.deltas(early, out);
    }

    fn on_event(&mut self, ev: SeqEvent, out: &mut Vec<Event>) -> bool {
        match ev.kind {
            SeqEventKind::Rejected(e) => {
                self.fail(request_error(e), out);
                true
            }
            SeqEventKind::Ended(reason) => {
                self.fail(aborted(&reason), out);
                true
            }
            SeqEventKind::Update(u) => self.update(u, out),
        }
    }

    fn abort(&mut self, err: ApiError, out: &mut Vec<Event>) {
        self.fail(err, out);
    }

    fn end(&mut self, complete: bool, out: &mut Vec<Event>) {
        if !complete {
            self.fail(aborted(&crate::engine::FinishReason::Cancelled), out);
        }
    }
}
