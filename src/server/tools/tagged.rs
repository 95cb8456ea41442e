//! The scanner the tagged formats share (`hermes`, `qwen3_xml`, `glm45`): calls sit between
//! an opening and a closing tag, everything else is text. What a call's body means is the
//! format's own [`BlockFormat`].
//!
//! Whitespace next to a call (the newline between two calls, before the first one, after the
//! last one) is not content: it is held back until text follows it, and dropped when a call
//! follows it or the reply ends after a call. Whether it is dropped depends only on the text,
//! never on how the text was split.

use super::parser::{call_events, ToolEvent, ToolParser, Tools};

/// A tagged format: its tags and how a call's body (between them) reads.
pub trait BlockFormat: Send {
    const OPEN: &'static str;
    const CLOSE: &'static str;
    /// The calls (name, JSON arguments) in one body; `None` when it is malformed, and then
    /// the whole block is given back as text.
    fn parse(body: &str, tools: &Tools) -> Option<Vec<(String, String)>>;
}

pub struct Tagged<F> {
    tools: Tools,
    /// Text not yet decided: after the last emitted piece (outside a call), or the body of
    /// the open call.
    pending: String,
    in_call: bool,
    text: TextOut,
    _format: std::marker::PhantomData<F>,
}

impl<F: BlockFormat> Tagged<F> {
    pub fn new(tools: Tools) -> Self {
        Tagged { tools, pending: String::new(), in_call: false, text: TextOut::default(), _format: Default::default() }
    }

    fn close_call(&mut self, body: &str, out: &mut Vec<ToolEvent>) {
        match F::parse(body, &self.tools) {
            Some(calls) if !calls.is_empty() => {
                self.text.before_call();
                for (name, args) in calls {
                    call_events(name, args, out);
                }
            }
            _ => {
                let raw = format!("{}{body}{}", F::OPEN, F::CLOSE);
                self.text.push(&raw, out);
            }
        }
    }
}

impl<F: BlockFormat> ToolParser for Tagged<F> {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.pending.push_str(text);
        loop {
            if self.in_call {
                let Some(end) = self.pending.find(F::CLOSE) else { return };
                let body = self.pending[..end].to_string();
                self.pending.drain(..end + F::CLOSE.len());
                self.in_call = false;
                self.close_call(&body, out);
                continue;
            }
            match self.pending.find(F::OPEN) {
                Some(start) => {
                    let before = self.pending[..start].to_string();
                    self.text.push(&before, out);
                    self.pending.drain(..start + F::OPEN.len());
                    self.in_call = true;
                }
                None => {
                    // Keep back a tail that may still become the opening tag.
                    let keep = partial_suffix(&self.pending, F::OPEN);
                    let cut = self.pending.len() - keep;
                    let ready = self.pending[..cut].to_string();
                    self.text.push(&ready, out);
                    self.pending.drain(..cut);
                    return;
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let rest = std::mem::take(&mut self.pending);
        if self.in_call {
            // The reply stopped inside a call (a stop string, max_tokens, the model's end):
            // a body that parses is still a call, vLLM's rule too.
            self.in_call = false;
            match F::parse(&rest, &self.tools) {
                Some(calls) if !calls.is_empty() => {
                    self.text.before_call();
                    for (name, args) in calls {
                        call_events(name, args, out);
                    }
                }
                _ => self.text.push(&format!("{}{rest}", F::OPEN), out),
            }
        } else {
            self.text.push(&rest, out);
        }
        self.text.finish(out);
    }
}

/// The length of the longest tail of `s` that is a proper prefix of `tag`.
pub fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1)).rev().find(|&n| s.ends_with(&tag[..n])).unwrap_or(0)
}

/// Text outside calls, with the whitespace next to calls held back and dropped.
#[derive(Default)]
pub struct TextOut {
    held: String,
    after_call: bool,
    any_call: bool,
}

impl TextOut {
    pub fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        if text.is_empty() {
            return;
        }
        self.held.push_str(text);
        let Some(last) = self.held.char_indices().rev().find(|(_, c)| !c.is_whitespace()) else { return };
        let end = last.0 + last.1.len_utf8();
        let mut ready: String = self.held.drain(..end).collect();
        if self.after_call {
            ready = ready.trim_start().to_string();
            self.after_call = false;
        }
        if !ready.is_empty() {
            out.push(ToolEvent::Text(ready));
        }
    }

    /// A call comes next: the whitespace before it is not content.
    pub fn before_call(&mut self) {
        self.held.clear();
        self.after_call = true;
        self.any_call = true;
    }

    pub fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let held = std::mem::take(&mut self.held);
        if !self.any_call && !held.is_empty() {
            out.push(ToolEvent::Text(held));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("abc<tool", "<tool_call>"), 5);
        assert_eq!(partial_suffix("abc<", "<tool_call>"), 1);
        assert_eq!(partial_suffix("abc", "<tool_call>"), 0);
        assert_eq!(partial_suffix("<tool_call", "<tool_call>"), 10);
        assert_eq!(partial_suffix("", "<tool_call>"), 0);
    }
}
