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

/// Turns engine events into SSE events for one API's format.
pub trait Converter: Send + 'static {
    /// Events sent before the first engine event (e.g. the role chunk, `message_start`).
    fn start(&mut self, out: &mut Vec<Event>);
    /// Handles one engine event; returns true once every sequence has finished.
    fn on_event(&mut self, ev: SeqEvent, out: &mut Vec<Event>) -> bool;
    /// Events after the last sequence finished (usage, `[DONE]`, `message_stop`).
    /// `complete` is false when the engine went away before the end.
    fn end(&mut self, complete: bool, out: &mut Vec<Event>);
}

struct State<C> {
    sub: Submission,
    conv: C,
    pending: VecDeque<Event>,
    done: bool,
}

pub fn event_stream<C: Converter>(sub: Submission, mut conv: C) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut first = Vec::new();
    conv.start(&mut first);
    let state = State { sub, conv, pending: first.into(), done: false };
    stream::unfold(state, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            let mut out = Vec::new();
            match st.sub.events.recv().await {
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
