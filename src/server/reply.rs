//! A choice's output split into thinking, answer text and tool calls, as it streams: the
//! reasoning parser first (tool calls inside the thinking are thinking), then the tool-call
//! parser on the answer. Both APIs read the same [`Delta`]s, streamed or folded into a
//! [`Reply`], so a streamed reply assembles to the non-streamed one.

use super::ids::random_id;
use super::reasoning::{Piece, ReasoningFormat, ReasoningParser};
use super::tools::{ToolEvent, ToolFormat, ToolParser, Tools};

/// One piece of a parsed reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Reasoning(String),
    /// Call `index` (0, 1, ... in the reply) begins.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// A piece of call `index`'s JSON arguments.
    CallArgs {
        index: usize,
        args: String,
    },
}

/// How one request's replies are parsed.
#[derive(Debug, Clone)]
pub struct ReplySetup {
    pub reasoning: Option<ReasoningFormat>,
    /// The prompt opened the thinking (the reply begins inside it).
    pub starts_in_thinking: bool,
    /// Parse tool calls in this format (the request has tools and lets the model call them).
    pub tools: Option<(ToolFormat, Tools)>,
    /// `parallel_tool_calls: false`: only the first call is kept.
    pub single_call: bool,
    /// Tool-call ids: `call_` (OpenAI) or `toolu_` (Anthropic).
    pub id_prefix: &'static str,
    /// Tokens that end the model's turn after its calls (`ToolFormat::stop_markers`).
    pub stop_token_ids: Vec<u32>,
}

impl ReplySetup {
    /// Text passes through untouched.
    pub fn is_plain(&self) -> bool {
        self.reasoning.is_none() && self.tools.is_none()
    }

    /// What the parsers need of the sampling: the tags (which may be special tokens: GLM's
    /// and Gemma's are) unless the request said otherwise (`explicit`), and the end of the
    /// turn at the format's stop tokens, which end a turn as EOS does (so `ignore_eos`, set
    /// before, ignores them too).
    pub fn fit(&self, params: &mut crate::engine::SamplingParams, explicit: Option<bool>) {
        if !self.is_plain() && explicit.is_none() {
            params.skip_special_tokens = false;
        }
        if params.ignore_eos {
            return;
        }
        for &id in &self.stop_token_ids {
            if !params.stop_token_ids.contains(&id) {
                params.stop_token_ids.push(id);
            }
        }
    }

    /// The reply begins inside a thinking: the prompt opened it, or the format always does
    /// (as its parser reads it).
    pub fn begins_in_thinking(&self) -> bool {
        match self.reasoning {
            Some(ReasoningFormat::DeepSeekR1) => true,
            Some(_) => self.starts_in_thinking,
            None => false,
        }
    }
}

pub struct ReplyParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<Box<dyn ToolParser>>,
    single_call: bool,
    id_prefix: &'static str,
    /// Calls begun so far, and whether the current one is being dropped (past the first
    /// under `single_call`).
    calls: usize,
    dropping: bool,
}

impl ReplyParser {
    pub fn new(setup: &ReplySetup) -> Self {
        ReplyParser {
            reasoning: setup.reasoning.map(|f| ReasoningParser::new(f, setup.starts_in_thinking)),
            tools: setup.tools.as_ref().map(|(f, t)| f.parser(t.clone())),
            single_call: setup.single_call,
            id_prefix: setup.id_prefix,
            calls: 0,
            dropping: false,
        }
    }

    pub fn feed(&mut self, text: &str, out: &mut Vec<Delta>) {
        if text.is_empty() {
            return;
        }
        let mut pieces = Vec::new();
        match &mut self.reasoning {
            Some(r) => r.feed(text, &mut pieces),
            None => pieces.push(Piece::Text(text.to_string())),
        }
        self.pieces(pieces, false, out);
    }

    pub fn finish(&mut self, out: &mut Vec<Delta>) {
        let mut pieces = Vec::new();
        if let Some(r) = &mut self.reasoning {
            r.finish(&mut pieces);
        }
        self.pieces(pieces, true, out);
    }

    fn pieces(&mut self, pieces: Vec<Piece>, last: bool, out: &mut Vec<Delta>) {
        let mut events = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(r) => {
                    // Reasoning comes before any answer text, so no tool event is waiting.
                    out.push(Delta::Reasoning(r));
                }
                Piece::Text(t) => match &mut self.tools {
                    Some(tp) => tp.feed(&t, &mut events),
                    None => out.push(Delta::Content(t)),
                },
            }
        }
        if last {
            if let Some(tp) = &mut self.tools {
                tp.finish(&mut events);
            }
        }
        for e in events {
            self.event(e, out);
        }
    }

    fn event(&mut self, e: ToolEvent, out: &mut Vec<Delta>) {
        match e {
            ToolEvent::Text(t) => out.push(Delta::Content(t)),
            ToolEvent::Start { name } => {
                self.dropping = self.single_call && self.calls >= 1;
                if !self.dropping {
                    let id = random_id(self.id_prefix);
                    out.push(Delta::CallStart { index: self.calls, id, name });
                    self.calls += 1;
                }
            }
            ToolEvent::Args(args) if !self.dropping => {
                // Arguments belong to the call begun last (a parser never sends them first).
                if let Some(index) = self.calls.checked_sub(1) {
                    out.push(Delta::CallArgs { index, args });
                }
            }
            ToolEvent::Args(_) => {}
            ToolEvent::End => self.dropping = false,
        }
    }

    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }
}

/// A tool call as a reply carries it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments' JSON text.
    pub arguments: String,
}

/// A whole parsed reply: the fold of its deltas.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Reply {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<Call>,
}

impl Reply {
    pub fn apply(&mut self, d: Delta) {
        match d {
            Delta::Content(t) => self.content.push_str(&t),
            Delta::Reasoning(t) => self.reasoning.push_str(&t),
            Delta::CallStart { id, name, .. } => self.calls.push(Call { id, name, arguments: String::new() }),
            Delta::CallArgs { index, args } => {
                if let Some(c) = self.calls.get_mut(index) {
                    c.arguments.push_str(&args);
                }
            }
        }
    }

    /// Parses a whole text (a non-streamed reply).
    pub fn parse(setup: &ReplySetup, text: &str) -> Reply {
        let mut p = ReplyParser::new(setup);
        let mut deltas = Vec::new();
        p.feed(text, &mut deltas);
        p.finish(&mut deltas);
        let mut r = Reply::default();
        for d in deltas {
            r.apply(d);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::server::tools::ToolSpec;

    fn setup(reasoning: Option<ReasoningFormat>, inside: bool, tools: Option<ToolFormat>, single: bool) -> ReplySetup {
        let specs = Tools(vec![ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        }]);
        ReplySetup {
            reasoning,
            starts_in_thinking: inside,
            tools: tools.map(|f| (f, specs)),
            single_call: single,
            id_prefix: "call_",
            stop_token_ids: Vec::new(),
        }
    }

    /// The reply without its random ids.
    fn strip(mut r: Reply) -> Reply {
        for c in &mut r.calls {
            assert!(c.id.starts_with("call_") && c.id.len() > 10, "{}", c.id);
            c.id.clear();
        }
        r
    }

    fn fed(setup: &ReplySetup, pieces: &[&str]) -> Reply {
        let mut p = ReplyParser::new(setup);
        let mut out = Vec::new();
        for s in pieces {
            p.feed(s, &mut out);
        }
        p.finish(&mut out);
        let mut r = Reply::default();
        for d in out {
            r.apply(d);
        }
        strip(r)
    }

    fn every_split(setup: &ReplySetup, text: &str) -> Reply {
        let whole = strip(Reply::parse(setup, text));
        let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        for &a in &cuts {
            for &b in cuts.iter().filter(|&&b| b >= a) {
                assert_eq!(fed(setup, &[&text[..a], &text[a..b], &text[b..]]), whole, "cuts at {a}, {b}");
            }
        }
        whole
    }

    fn call(name: &str, args: &str) -> Call {
        Call { id: String::new(), name: name.into(), arguments: args.into() }
    }

    #[test]
    fn thinking_then_a_call() {
        let s = setup(Some(ReasoningFormat::Qwen3), false, Some(ToolFormat::Hermes), false);
        let r = every_split(
            &s,
            "<think>\nThe user wants the weather; I call the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
        );
        assert_eq!(
            r,
            Reply {
                content: String::new(),
                reasoning: "The user wants the weather; I call the tool.".into(),
                calls: vec![call("get_weather", "{\"city\":\"Rome\"}")],
            }
        );
    }

    #[test]
    fn gemma4_thought_then_calls() {
        // As Gemma 4 writes it with thinking on: the thought channel, then back-to-back calls
        // (the reply stops at `<|tool_response>`, which the engine does not return).
        let s = setup(Some(ReasoningFormat::Gemma4), false, Some(ToolFormat::Gemma4), false);
        let r = every_split(
            &s,
            "<|channel>thought\nTwo cities: two calls.\n<channel|><|tool_call>call:get_weather{city:<|\"|>Rome<|\"|>}<tool_call|><|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|>",
        );
        assert_eq!(
            r,
            Reply {
                content: String::new(),
                reasoning: "Two cities: two calls.".into(),
                calls: vec![call("get_weather", "{\"city\":\"Rome\"}"), call("get_weather", "{\"city\":\"Oslo\"}")],
            }
        );
    }

    #[test]
    fn a_call_inside_the_thinking_is_thinking() {
        // Qwen3.5: the prompt opened the thinking; the XML call follows it.
        let s = setup(Some(ReasoningFormat::Qwen3), true, Some(ToolFormat::Qwen3Xml), false);
        let r = every_split(
            &s,
            "Maybe <tool_call><function=x></function></tool_call>?\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(r.reasoning, "Maybe <tool_call><function=x></function></tool_call>?");
        assert_eq!(r.content, "Checking.");
        assert_eq!(r.calls, vec![call("get_weather", "{\"city\":\"Oslo\"}")]);
    }

    #[test]
    fn parallel_tool_calls_false_keeps_the_first() {
        let s = setup(None, false, Some(ToolFormat::Glm45), true);
        let r = every_split(
            &s,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>A</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>B</arg_value>\n</tool_call>",
        );
        assert_eq!(r.calls, vec![call("get_weather", "{\"city\":\"A\"}")]);
        assert_eq!(r.content, "");
    }

    #[test]
    fn plain_setup_passes_text_through() {
        let s = setup(None, false, None, false);
        assert!(s.is_plain());
        let r = every_split(&s, "  <think>x</think> <tool_call>{}</tool_call>\n");
        assert_eq!(r.content, "  <think>x</think> <tool_call>{}</tool_call>\n");
    }
}

/// How fast a reply is parsed as it streams: `cargo test --release --lib -- --ignored
/// parser_speed --nocapture` (numbers in the commit that added it and in docs/serving.md).
#[cfg(test)]
mod speed {
    use super::*;
    use crate::server::tools::ToolSpec;

    #[test]
    #[ignore]
    fn parser_speed() {
        let call = "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=content>\nfn main() {\n    println!(\"hello\");\n}\n</parameter>\n</function>\n</tool_call>\n";
        let text: String =
            format!("<think>\n{}\n</think>\n\nWriting files.\n\n{}", "thinking ".repeat(2000), call.repeat(200));
        let setup = ReplySetup {
            reasoning: Some(ReasoningFormat::Qwen3),
            starts_in_thinking: false,
            tools: Some((
                ToolFormat::Qwen3Xml,
                Tools(vec![ToolSpec { name: "write_file".into(), parameters: serde_json::json!({}) }]),
            )),
            single_call: false,
            id_prefix: "call_",
            stop_token_ids: Vec::new(),
        };
        // Pieces of 4 bytes (about a token), cut at char boundaries.
        let mut pieces = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let mut end = (start + 4).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            pieces.push(&text[start..end]);
            start = end;
        }
        let t = std::time::Instant::now();
        let mut p = ReplyParser::new(&setup);
        let mut out = Vec::new();
        for s in &pieces {
            p.feed(s, &mut out);
        }
        p.finish(&mut out);
        let dt = t.elapsed();
        let mut r = Reply::default();
        for d in out {
            r.apply(d);
        }
        assert_eq!(r.calls.len(), 200);
        println!(
            "{} bytes in {} pieces: {:.2} ms, {:.0} ns per piece",
            text.len(),
            pieces.len(),
            dt.as_secs_f64() * 1e3,
            dt.as_nanos() as f64 / pieces.len() as f64
        );
    }
}
