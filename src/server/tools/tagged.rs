//! The scanner the tagged formats share (`hermes`, `qwen3_xml`, `glm45`): calls sit between
//! an opening and a closing tag, everything else is text. What a call's body means is the
//! format's own [`BlockFormat`].
//!
//! A format may stream its calls ([`BlockFormat::STREAMS`], the XML formats): the call
//! begins as soon as its function's name is complete, and each parameter is an arguments
//! piece as soon as its closing tag is there. Such a call is read by the same steps whether
//! its text arrives at once or in pieces: a header that names a function makes a call (a
//! block without one is text), and what follows its last complete parameter and is no
//! parameter is dropped when the block ends.
//!
//! Whitespace next to a call (the newline between two calls, before the first one, after the
//! last one) is not content: it is held back until text follows it, and dropped when a call
//! follows it or the reply ends after a call. Whether it is dropped depends only on the text,
//! never on how the text was split.

use serde_json::Value;

use super::parser::{call_events, ToolEvent, ToolParser, Tools};

/// A tagged format: its tags and how a call's body (between them) reads.
pub trait BlockFormat: Send {
    const OPEN: &'static str;
    const CLOSE: &'static str;
    /// Calls are read step by step ([`Self::header`], [`Self::item`]) as the body arrives,
    /// rather than from the whole body ([`Self::parse`]).
    const STREAMS: bool = false;
    /// The calls (name, JSON arguments) in one body; `None` when it is malformed, and then
    /// the whole block is given back as text.
    fn parse(_body: &str, _tools: &Tools) -> Option<Vec<(String, String)>> {
        None
    }
    /// A streaming format: the function's name at the start of `rest`. `complete`: no more
    /// body will come, so nothing may stay pending.
    fn header(_rest: &str, _complete: bool) -> Header {
        Header::Invalid
    }
    /// A streaming format: the next item of function `name`'s body at the start of `rest`.
    /// Without `complete`, only an item whose text is all there may be returned.
    fn item(_rest: &str, _name: &str, _tools: &Tools, _complete: bool) -> Item {
        Item::End
    }
}

/// The start of a function in a streaming format's body.
#[derive(Debug, PartialEq)]
pub enum Header {
    Pending,
    /// The name, and the bytes it took.
    Name(String, usize),
    Invalid,
}

/// The next piece of a function's body.
#[derive(Debug, PartialEq)]
pub enum Item {
    Pending,
    /// A parameter (name, value) and the bytes it took.
    Param(String, Value, usize),
    /// The function's closing tag, and the bytes up to its end.
    EndFunction(usize),
    /// Nothing more that reads as a parameter.
    End,
}

/// A streaming call in progress: where in the body reading has reached.
#[derive(Default)]
struct Progress {
    cursor: usize,
    /// The open function: its name, and how many parameters were emitted.
    open: Option<(String, usize)>,
    /// A call was emitted from this block.
    any: bool,
}

pub struct Tagged<F> {
    tools: Tools,
    progress: Progress,
    /// Text not yet decided: after the last emitted piece (outside a call), or the body of
    /// the open call.
    pending: String,
    in_call: bool,
    text: TextOut,
    _format: std::marker::PhantomData<F>,
}

impl<F: BlockFormat> Tagged<F> {
    pub fn new(tools: Tools) -> Self {
        Tagged {
            tools,
            progress: Progress::default(),
            pending: String::new(),
            in_call: false,
            text: TextOut::default(),
            _format: Default::default(),
        }
    }

    /// Reads a streaming call's body (`body`: all of it so far) from where reading stopped.
    /// `complete`: the body ends here, closed by `close` (the closing tag, or nothing when
    /// the reply ended inside the call).
    fn advance(&mut self, body: &str, complete: Option<&str>, out: &mut Vec<ToolEvent>) {
        let close = complete.unwrap_or_default();
        let complete = complete.is_some();
        loop {
            let rest = &body[self.progress.cursor..];
            match self.progress.open.take() {
                None => match F::header(rest, complete) {
                    Header::Pending => break,
                    Header::Invalid => {
                        if complete && !self.progress.any {
                            let raw = format!("{}{body}{close}", F::OPEN);
                            self.text.push(&raw, out);
                        }
                        break;
                    }
                    Header::Name(name, used) => {
                        if !self.progress.any {
                            self.text.before_call();
                            self.progress.any = true;
                        }
                        out.push(ToolEvent::Start { name: name.clone() });
                        self.progress.cursor += used;
                        self.progress.open = Some((name, 0));
                    }
                },
                Some((name, n)) => match F::item(rest, &name, &self.tools, complete) {
                    Item::Pending => {
                        self.progress.open = Some((name, n));
                        break;
                    }
                    Item::Param(key, value, used) => {
                        // Compact JSON, as serde writes a whole object (the hermes calls).
                        let sep = if n == 0 { "{" } else { "," };
                        out.push(ToolEvent::Args(format!("{sep}{}:{value}", Value::String(key))));
                        self.progress.cursor += used;
                        self.progress.open = Some((name, n + 1));
                    }
                    Item::EndFunction(used) => {
                        close_function(n, out);
                        self.progress.cursor += used;
                    }
                    Item::End => {
                        if complete {
                            close_function(n, out);
                            // What follows is no parameter: dropped.
                            self.progress.cursor = body.len();
                        } else {
                            self.progress.open = Some((name, n));
                        }
                        break;
                    }
                },
            }
        }
        if complete {
            if let Some((_, n)) = self.progress.open.take() {
                close_function(n, out);
            }
            self.progress = Progress::default();
        }
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
            if self.in_call && F::STREAMS {
                let pending = std::mem::take(&mut self.pending);
                match pending.find(F::CLOSE) {
                    Some(end) => {
                        self.advance(&pending[..end], Some(F::CLOSE), out);
                        self.pending = pending[end + F::CLOSE.len()..].to_string();
                        self.in_call = false;
                        continue;
                    }
                    None => {
                        // A tail that may be the closing tag is not body yet.
                        let cut = pending.len() - partial_suffix(&pending, F::CLOSE);
                        self.advance(&pending[..cut], None, out);
                        self.pending = pending;
                        return;
                    }
                }
            }
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
        if self.in_call && F::STREAMS {
            self.in_call = false;
            self.advance(&rest, Some(""), out);
        } else if self.in_call {
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

/// Closes a streamed function that has `n` parameters.
fn close_function(n: usize, out: &mut Vec<ToolEvent>) {
    out.push(ToolEvent::Args(if n == 0 { "{}" } else { "}" }.to_string()));
    out.push(ToolEvent::End);
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
