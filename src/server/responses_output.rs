//! The output side of the Responses API: a reply's [`Delta`]s as output items (`reasoning`,
//! `message` with `output_text`, `function_call`) together with the stream events that build
//! them, and the Response object. The non-streamed reply is built by the same
//! [`OutputBuilder`] (its events dropped), so a stream assembles to exactly the stored and
//! returned object: same items, same order, same ids.

use serde_json::{json, Value};

use super::ids::random_id;
use super::reply::Delta;
use crate::engine::FinishReason;

/// The item being built.
enum Open {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call_id: String, name: String, args: String },
}

#[derive(Default)]
pub struct OutputBuilder {
    items: Vec<Value>,
    open: Option<Open>,
    /// All the thinking, for `usage.output_tokens_details.reasoning_tokens`.
    pub reasoning: String,
}

fn output_text(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

impl OutputBuilder {
    /// The finished items.
    pub fn items(&self) -> &[Value] {
        &self.items
    }

    /// `output_index` of the open item (items are built one at a time, in order).
    fn index(&self) -> usize {
        self.items.len()
    }

    /// Adds one delta; the events it makes go to `ev` (each with its `type`; the stream
    /// numbers them).
    pub fn push(&mut self, d: Delta, ev: &mut Vec<Value>) {
        match d {
            Delta::Reasoning(t) if !t.is_empty() => {
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    self.close("completed", ev);
                    let id = random_id("rs_");
                    ev.push(json!({ "type": "response.output_item.added", "output_index": self.index(),
                        "item": { "type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress" } }));
                    ev.push(
                        json!({ "type": "response.content_part.added", "item_id": id, "output_index": self.index(),
                        "content_index": 0, "part": { "type": "reasoning_text", "text": "" } }),
                    );
                    self.open = Some(Open::Reasoning { id, text: String::new() });
                }
                let index = self.index();
                if let Some(Open::Reasoning { id, text }) = &mut self.open {
                    ev.push(json!({ "type": "response.reasoning_text.delta", "item_id": id, "output_index": index,
                        "content_index": 0, "delta": t }));
                    text.push_str(&t);
                }
                self.reasoning.push_str(&t);
            }
            Delta::Content(t) if !t.is_empty() => {
                if !matches!(self.open, Some(Open::Message { .. })) {
                    self.open_message(ev);
                }
                let index = self.index();
                if let Some(Open::Message { id, text }) = &mut self.open {
                    ev.push(json!({ "type": "response.output_text.delta", "item_id": id, "output_index": index,
                        "content_index": 0, "delta": t, "logprobs": [] }));
                    text.push_str(&t);
                }
            }
            Delta::Reasoning(_) | Delta::Content(_) => {}
            Delta::CallStart { id: call_id, name, .. } => {
                self.close("completed", ev);
                let id = random_id("fc_");
                ev.push(json!({ "type": "response.output_item.added", "output_index": self.index(),
                    "item": { "type": "function_call", "id": id, "call_id": call_id, "name": name,
                              "arguments": "", "status": "in_progress" } }));
                self.open = Some(Open::Call { id, call_id, name, args: String::new() });
            }
            Delta::CallArgs { args, .. } => {
                // A parser sends a call's arguments right after its start, before anything
                // else: they belong to the open call.
                let index = self.index();
                if let Some(Open::Call { id, args: a, .. }) = &mut self.open {
                    ev.push(json!({ "type": "response.function_call_arguments.delta", "item_id": id,
                        "output_index": index, "delta": args }));
                    a.push_str(&args);
                }
            }
        }
    }

    fn open_message(&mut self, ev: &mut Vec<Value>) {
        self.close("completed", ev);
        let id = random_id("msg_");
        ev.push(json!({ "type": "response.output_item.added", "output_index": self.index(),
            "item": { "type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": [] } }));
        ev.push(json!({ "type": "response.content_part.added", "item_id": id, "output_index": self.index(),
            "content_index": 0, "part": output_text("") }));
        self.open = Some(Open::Message { id, text: String::new() });
    }

    /// Finishes the open item with `status`.
    fn close(&mut self, status: &str, ev: &mut Vec<Value>) {
        let index = self.index();
        let item = match self.open.take() {
            None => return,
            Some(Open::Reasoning { id, text }) => {
                let part = json!({ "type": "reasoning_text", "text": text });
                ev.push(json!({ "type": "response.reasoning_text.done", "item_id": id, "output_index": index,
                    "content_index": 0, "text": text }));
                ev.push(json!({ "type": "response.content_part.done", "item_id": id, "output_index": index,
                    "content_index": 0, "part": part }));
                json!({ "type": "reasoning", "id": id, "summary": [], "content": [part], "status": status })
            }
            Some(Open::Message { id, text }) => {
                ev.push(json!({ "type": "response.output_text.done", "item_id": id, "output_index": index,
                    "content_index": 0, "text": text, "logprobs": [] }));
                ev.push(json!({ "type": "response.content_part.done", "item_id": id, "output_index": index,
                    "content_index": 0, "part": output_text(&text) }));
                json!({ "type": "message", "id": id, "status": status, "role": "assistant",
                        "content": [output_text(&text)] })
            }
            Some(Open::Call { id, call_id, name, args }) => {
                ev.push(json!({ "type": "response.function_call_arguments.done", "item_id": id,
                    "output_index": index, "arguments": args }));
                json!({ "type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": args,
                        "status": status })
            }
        };
        ev.push(json!({ "type": "response.output_item.done", "output_index": index, "item": item }));
        self.items.push(item);
    }

    /// Ends the output of a failed response: the open item is incomplete.
    pub fn abandon(&mut self, ev: &mut Vec<Value>) {
        self.close("incomplete", ev);
    }

    /// Ends the output: the open item takes the response's status; a reply with nothing in
    /// it is one empty message (a response always has an output to read).
    pub fn finish(&mut self, status: Status, ev: &mut Vec<Value>) {
        if self.items.is_empty() && self.open.is_none() {
            self.open_message(ev);
        }
        self.close(status.item_status(), ev);
    }
}

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Status {
    Completed,
    /// `max_output_tokens` (or the context) ran out.
    Incomplete,
}

impl Status {
    /// A normal finish's status; `None` for a cancelled or failed sequence.
    pub fn of(reason: &FinishReason) -> Option<Status> {
        match reason {
            FinishReason::Stop => Some(Status::Completed),
            FinishReason::Length => Some(Status::Incomplete),
            FinishReason::Cancelled | FinishReason::Error(_) => None,
        }
    }

    fn item_status(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
        }
    }
}

/// What a Response object says about its request: everything but the output.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub store: bool,
    pub temperature: f32,
    pub top_p: f32,
    pub max_output_tokens: Option<usize>,
    /// As sent (the Responses' flat shape).
    pub tools: Value,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    pub reasoning: Value,
    pub metadata: Value,
    pub user: Value,
    /// `text.format` as asked (`{"type": "text"}` without a grammar).
    pub text_format: Value,
}

/// The token counts of a response.
/// `cached`: input tokens read from the prefix cache.
pub fn usage(input: usize, output: usize, reasoning: usize, cached: usize) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": { "cached_tokens": cached },
        "output_tokens": output,
        "output_tokens_details": { "reasoning_tokens": reasoning },
        "total_tokens": input + output,
    })
}

impl ResponseMeta {
    /// The Response object with `status` (`in_progress`, `completed`, `incomplete`,
    /// `failed`), its output, usage and error.
    pub fn object(&self, status: &str, output: &[Value], usage: Value, error: Value) -> Value {
        let incomplete = (status == "incomplete").then(|| json!({ "reason": "max_output_tokens" }));
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": false,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": null,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": self.reasoning,
            "service_tier": "default",
            "store": self.store,
            "temperature": self.temperature,
            "text": { "format": self.text_format },
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_logprobs": 0,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": self.user,
            "metadata": self.metadata,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(deltas: Vec<Delta>, status: Status) -> (Vec<Value>, Vec<String>) {
        let mut b = OutputBuilder::default();
        let mut ev = Vec::new();
        for d in deltas {
            b.push(d, &mut ev);
        }
        b.finish(status, &mut ev);
        let types = ev.iter().map(|e| e["type"].as_str().expect("type").to_string()).collect();
        (b.items().to_vec(), types)
    }

    #[test]
    fn thinking_text_and_a_call_are_three_items() {
        let (items, types) = build(
            vec![
                Delta::Reasoning("Think".into()),
                Delta::Reasoning("ing.".into()),
                Delta::Content("Let me ".into()),
                Delta::Content("check.".into()),
                Delta::CallStart { index: 0, id: "call_1".into(), name: "f".into() },
                Delta::CallArgs { index: 0, args: "{\"a\":".into() },
                Delta::CallArgs { index: 0, args: "1}".into() },
            ],
            Status::Completed,
        );
        assert_eq!(items.len(), 3);
        assert_eq!(items[0]["content"][0]["text"], "Thinking.");
        assert_eq!(items[1]["content"][0]["text"], "Let me check.");
        assert_eq!(
            (items[2]["call_id"].as_str(), items[2]["arguments"].as_str(), items[2]["status"].as_str()),
            (Some("call_1"), Some("{\"a\":1}"), Some("completed"))
        );
        assert!(items[2]["id"].as_str().is_some_and(|id| id.starts_with("fc_")));
        let expected = [
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ];
        assert_eq!(types, expected);
    }

    #[test]
    fn an_empty_reply_is_one_empty_message_and_the_last_item_takes_the_status() {
        let (items, _) = build(vec![Delta::Content(String::new())], Status::Completed);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0]["content"][0]["text"], "");
        let (items, _) = build(vec![Delta::Reasoning("a".into()), Delta::Content("b".into())], Status::Incomplete);
        assert_eq!((items[0]["status"].as_str(), items[1]["status"].as_str()), (Some("completed"), Some("incomplete")));
    }
}
