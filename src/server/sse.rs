//! Server-sent events: a stream that turns a request's engine events into SSE events.
//!
//! The stream owns the [`Submission`]; when the client goes away hyper drops the stream, the
//! event channel closes, and the engine thread aborts the sequences before its next step.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};

use super::engine_loop::{SeqEvent, Submission};
use super::errors::ApiError;
use super::generate::timed_out;

/// Turns engine events into SSE events for one API's format.
pub trait Converter: Send + 'static {
    /// Events sent before the first engine event (e.g. the role chunk, `message_start`).
    fn start(&mut self, out: &mut Vec<Event>);
    /// Handles one engine event; returns true once every sequence has finished.
    fn on_event(&mut self, ev: SeqEvent, out: &mut Vec<Event>) -> bool;
    /// The request is cut short by the server (`--request-timeout`): the API's error event,
    /// and a finish for what had not finished. `end(false)` follows.
    fn abort(&mut self, err: ApiError, out: &mut Vec<Event>);
    /// Events after the last sequence finished (usage, `[DONE]`, `message_stop`).
    /// `complete` is false when the engine went away before the end.
    fn end(&mut self, complete: bool, out: &mut Vec<Event>);
}

struct State<C> {
    sub: Submission,
    /// `--request-timeout` from the start of the stream.
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    conv: C,
    pending: VecDeque<Event>,
    done: bool,
}

pub fn event_stream<C: Converter>(sub: Submission, mut conv: C) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut first = Vec::new();
    conv.start(&mut first);
    let deadline = sub.deadline.map(|d| Box::pin(tokio::time::sleep(d)));
    let state = State { sub, conv, pending: first.into(), done: false, deadline };
    stream::unfold(state, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            let mut out = Vec::new();
            let next = match &mut st.deadline {
                None => Some(st.sub.events.recv().await),
                Some(deadline) => tokio::select! {
                    ev = st.sub.events.recv() => Some(ev),
                    _ = deadline.as_mut() => None,
                },
            };
            let Some(next) = next else {
                // Past the deadline: the stream ends here, and dropping the submission with
                // it cancels the sequences.
                let limit = st.sub.deadline.unwrap_or_default();
                st.conv.abort(timed_out(limit), &mut out);
                st.conv.end(false, &mut out);
                st.done = true;
                st.pending.extend(out);
                continue;
            };
            match next {
                Some(ev) => {
                    if st.conv.on_event(ev, &mut out) {
                        st.conv.end(true, &mut out);
                        st.done = true;
                    }
                }
                None => {
                    st.conv.end(false, &mut out);
                    st.done = true;
                }
            }
            st.pending.extend(out);
        }
    })
}

pub fn sse_response<C: Converter>(sub: Submission, conv: C) -> Response {
    Sse::new(event_stream(sub, conv)).keep_alive(KeepAlive::default()).into_response()
}

/// `data: {json}`.
pub fn json_event(v: &serde_json::Value) -> Event {
    Event::default().data(v.to_string())
}

/// `event: NAME` + `data: {json}` (Anthropic's stream).
pub fn named_event(name: &str, v: &serde_json::Value) -> Event {
    Event::default().event(name).data(v.to_string())
}
