//! `llama3_json`: Llama 3.1 / 3.2 / 3.3 answer a call with the reply itself being
//! `{"name": "f", "parameters": {...}}` (meta-llama-Llama-3.1-8B-Instruct.jinja), several
//! separated by `;`, maybe after `<|python_tag|>`. A reply that does not begin with `{` is
//! text throughout; an object that is not a call, and everything after it, is text too.

use serde_json::Value;

use super::parser::{call_events, ToolEvent, ToolParser};
use super::tagged::partial_suffix;

const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, PartialEq)]
enum State {
    /// Before the first non-space character: is the reply a call?
    Start,
    /// Inside an object: its text so far, brace depth, inside a string, after a backslash.
    Object { depth: usize, in_str: bool, escaped: bool },
    /// After a call: `;` and spaces, then another object or text.
    Between,
    /// Plain text to the end.
    Text,
}

pub struct Llama3Json {
    state: State,
    /// Start: the leading spaces (and a partial `<|python_tag|>`); Object: the object's text.
    buf: String,
    any_call: bool,
}

impl Llama3Json {
    pub fn new() -> Self {
        Llama3Json { state: State::Start, buf: String::new(), any_call: false }
    }

    fn object_done(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.buf);
        match call(&raw) {
            Some((name, args)) => {
                self.any_call = true;
                call_events(name, args, out);
                self.state = State::Between;
            }
            None => {
                out.push(ToolEvent::Text(raw));
                self.state = State::Text;
            }
        }
    }
}

impl Default for Llama3Json {
    fn default() -> Self {
        Self::new()
    }
}

fn call(raw: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(raw).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("parameters").or_else(|| v.get("arguments")) {
        Some(o @ Value::Object(_)) => o.clone(),
        None => Value::Object(Default::default()),
        Some(_) => return None,
    };
    (!name.is_empty()).then(|| (name, args.to_string()))
}

impl ToolParser for Llama3Json {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        let mut rest = text;
        while !rest.is_empty() {
            match &mut self.state {
                State::Text => {
                    out.push(ToolEvent::Text(rest.to_string()));
                    return;
                }
                State::Start => {
                    self.buf.push_str(rest);
                    let lead = self.buf.trim_start();
                    let lead = lead.strip_prefix(PYTHON_TAG).map(str::trim_start).unwrap_or(lead);
                    if lead.is_empty() || (partial_suffix(lead, PYTHON_TAG) == lead.len()) {
                        // Only spaces, or the start of the tag, so far.
                        return;
                    }
                    if lead.starts_with('{') {
                        let lead = lead.to_string();
                        self.buf.clear();
                        self.state = State::Object { depth: 0, in_str: false, escaped: false };
                        self.feed(&lead, out);
                    } else {
                        let all = std::mem::take(&mut self.buf);
                        self.state = State::Text;
                        out.push(ToolEvent::Text(all));
                    }
                    return;
                }
                State::Between => {
                    let t = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
                    if t.is_empty() {
                        return;
                    }
                    if t.starts_with('{') {
                        self.state = State::Object { depth: 0, in_str: false, escaped: false };
                    } else {
                        self.state = State::Text;
                    }
                    rest = t;
                }
                State::Object { depth, in_str, escaped } => {
                    let mut end = None;
                    for (i, c) in rest.char_indices() {
                        if *in_str {
                            match (c, *escaped) {
                                (_, true) => *escaped = false,
                                ('\\', false) => *escaped = true,
                                ('"', false) => *in_str = false,
                                _ => {}
                            }
                            continue;
                        }
                        match c {
                            '"' => *in_str = true,
                            '{' => *depth += 1,
                            '}' => {
                                *depth = depth.saturating_sub(1);
                                if *depth == 0 {
                                    end = Some(i + 1);
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                    match end {
                        Some(e) => {
                            self.buf.push_str(&rest[..e]);
                            rest = &rest[e..];
                            self.object_done(out);
                        }
                        None => {
                            self.buf.push_str(rest);
                            return;
                        }
                    }
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            // An object cut short is text (no call can be read from it).
            State::Object { .. } => out.push(ToolEvent::Text(buf)),
            State::Start if !buf.is_empty() && !self.any_call => out.push(ToolEvent::Text(buf)),
            _ => {}
        }
        self.state = State::Text;
    }
}
