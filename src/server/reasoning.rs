//! Reasoning parsers (`--reasoning-parser`, vLLM's names): the thinking a model writes
//! between `<think>` and `</think>` (Gemma 4: its thought channel, `<|channel>thought\n` ..
//! `<channel|>`, control tokens) is split from the answer, incrementally and with the same
//! result for any split of the text into pieces.
//!
//! A reply may begin inside the thinking: Qwen3.5's and DeepSeek-R1's templates end the
//! prompt with `<think>` (the reply then has only the closing tag), which the caller reads
//! from the prompt ([`ReasoningParser::new`]'s `inside`); `deepseek_r1` always begins inside,
//! as vLLM's parser does. Only an opening at the very start opens the thinking and only the
//! first closing closes it: tags later in the answer are answer text. Whitespace at the
//! edges of the thinking and at the start of the answer after it is dropped.
//!
//! Gemma 4's template never ends a prompt inside the thinking: with thinking on the model
//! opens the channel itself, with it off the prompt ends with an empty one
//! (`<|channel>thought\n<channel|>`), as transformers' response template for `gemma4` reads it.

use super::tools::tagged::partial_suffix;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    Qwen3,
    Glm45,
    DeepSeekR1,
    Gemma4,
}

impl ReasoningFormat {
    pub const NAMES: &'static [&'static str] = &["qwen3", "glm45", "deepseek_r1", "gemma4"];

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "qwen3" => ReasoningFormat::Qwen3,
            "glm45" | "glm4_moe" => ReasoningFormat::Glm45,
            "deepseek_r1" => ReasoningFormat::DeepSeekR1,
            "gemma4" => ReasoningFormat::Gemma4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ReasoningFormat::Qwen3 => "qwen3",
            ReasoningFormat::Glm45 => "glm45",
            ReasoningFormat::DeepSeekR1 => "deepseek_r1",
            ReasoningFormat::Gemma4 => "gemma4",
        }
    }

    /// What opens and what closes the thinking. Gemma's channel is named: `thought` is part
    /// of the opening (the newline after it is edge whitespace).
    pub fn markers(self) -> (&'static str, &'static str) {
        match self {
            ReasoningFormat::Gemma4 => ("<|channel>thought", "<channel|>"),
            _ => ("<think>", "</think>"),
        }
    }

    /// The special token a reply opens its thinking with (the first token of `markers().0`).
    pub fn opening_token(self) -> &'static str {
        match self {
            ReasoningFormat::Gemma4 => "<|channel>",
            _ => "<think>",
        }
    }

    /// What closes a thinking the prompt opened, as the format's templates write it (before
    /// an answer iris writes itself: a forced call).
    pub fn close_text(self) -> &'static str {
        match self {
            ReasoningFormat::Gemma4 => "\n<channel|>",
            _ => "\n</think>\n\n",
        }
    }

    /// The format of a chat template whose model's thinking cannot be read without its parser,
    /// used when the server was given no `--reasoning-parser`: Gemma 4's markers are control
    /// tokens, which a plain reply drops, leaving the thought run into the answer. (`<think>`
    /// formats read as text without a parser, as vLLM serves them.)
    pub fn detect(template: &str) -> Option<Self> {
        template.contains("<|channel>thought").then_some(ReasoningFormat::Gemma4)
    }
}

/// A piece of a reply: thinking or answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Text(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// At the start of the reply: does it open with `<think>`?
    Before,
    /// In the thinking; `fresh` until its first non-space character.
    Inside { fresh: bool },
    /// In the answer; `fresh` until its first non-space character after the thinking.
    After { fresh: bool },
}

pub struct ReasoningParser {
    open: &'static str,
    close: &'static str,
    state: State,
    pending: String,
}

/// Does a prompt end inside a thinking block (its last opening after its last closing)?
/// Then the reply begins in the thinking.
pub fn prompt_opens_thinking(format: ReasoningFormat, prompt_tail: &str) -> bool {
    let (open, close) = format.markers();
    match (prompt_tail.rfind(open), prompt_tail.rfind(close)) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => true,
        _ => false,
    }
}

impl ReasoningParser {
    /// `inside`: the prompt already opened the thinking.
    pub fn new(format: ReasoningFormat, inside: bool) -> Self {
        let inside = inside || format == ReasoningFormat::DeepSeekR1;
        let (open, close) = format.markers();
        ReasoningParser {
            open,
            close,
            state: if inside { State::Inside { fresh: true } } else { State::Before },
            pending: String::new(),
        }
    }

    pub fn feed(&mut self, text: &str, out: &mut Vec<Piece>) {
        let (open, close) = (self.open, self.close);
        self.pending.push_str(text);
        loop {
            match self.state {
                State::Before => {
                    let lead = self.pending.trim_start();
                    if lead.starts_with(open) {
                        let cut = self.pending.len() - lead.len() + open.len();
                        self.pending.drain(..cut);
                        self.state = State::Inside { fresh: true };
                    } else if open.starts_with(lead) {
                        return; // spaces, or the start of the tag, so far
                    } else {
                        self.state = State::After { fresh: false };
                    }
                }
                State::Inside { fresh } => {
                    if fresh {
                        // A model may write the opening tag the prompt already has.
                        let lead = self.pending.trim_start();
                        if lead.is_empty() || (lead.len() < open.len() && open.starts_with(lead)) {
                            return;
                        }
                        let lead = lead.strip_prefix(open).map(str::trim_start).unwrap_or(lead);
                        if lead.is_empty() {
                            self.pending.clear();
                            return;
                        }
                        let cut = self.pending.len() - lead.len();
                        self.pending.drain(..cut);
                        self.state = State::Inside { fresh: false };
                    }
                    match self.pending.find(close) {
                        Some(end) => {
                            let thought = self.pending[..end].trim_end().to_string();
                            self.pending.drain(..end + close.len());
                            if !thought.is_empty() {
                                out.push(Piece::Reasoning(thought));
                            }
                            self.state = State::After { fresh: true };
                        }
                        None => {
                            // Hold back a partial closing tag and trailing spaces (they are
                            // dropped if the tag follows).
                            let keep = partial_suffix(&self.pending, close);
                            let body = &self.pending[..self.pending.len() - keep];
                            let cut = body.trim_end().len();
                            if cut > 0 {
                                out.push(Piece::Reasoning(self.pending[..cut].to_string()));
                                self.pending.drain(..cut);
                            }
                            return;
                        }
                    }
                }
                State::After { fresh } => {
                    let text = if fresh { self.pending.trim_start() } else { self.pending.as_str() };
                    if !text.is_empty() {
                        out.push(Piece::Text(text.to_string()));
                        self.state = State::After { fresh: false };
                    }
                    self.pending.clear();
                    return;
                }
            }
        }
    }

    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Before if !rest.is_empty() => out.push(Piece::Text(rest)),
            State::Inside { fresh } => {
                // The reply ended in the thinking (max_tokens, or a model that never closed it).
                let t = if fresh { rest.trim_start() } else { rest.as_str() };
                let t = if fresh { t.strip_prefix(self.open).unwrap_or(t) } else { t };
                let t = t.trim_end();
                if !t.is_empty() {
                    out.push(Piece::Reasoning(t.to_string()));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (reasoning, text) from feeding `text` cut at the given char boundaries.
    fn run(format: ReasoningFormat, inside: bool, pieces: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(format, inside);
        let mut out = Vec::new();
        for s in pieces {
            p.feed(s, &mut out);
        }
        p.finish(&mut out);
        let (mut r, mut t) = (String::new(), String::new());
        for piece in out {
            match piece {
                Piece::Reasoning(s) => r.push_str(&s),
                Piece::Text(s) => t.push_str(&s),
            }
        }
        (r, t)
    }

    /// Every way of cutting `text` in two and in three pieces (at char boundaries) gives
    /// the same result as the whole text.
    fn every_split(format: ReasoningFormat, inside: bool, text: &str, want: (&str, &str)) {
        let whole = run(format, inside, &[text]);
        assert_eq!((whole.0.as_str(), whole.1.as_str()), want, "whole text {text:?}");
        let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        for &a in &cuts {
            assert_eq!(run(format, inside, &[&text[..a], &text[a..]]), whole, "cut at {a} of {text:?}");
            for &b in cuts.iter().filter(|&&b| b >= a) {
                let got = run(format, inside, &[&text[..a], &text[a..b], &text[b..]]);
                assert_eq!(got, whole, "cuts at {a}, {b} of {text:?}");
            }
        }
        // One character at a time.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(format, inside, &refs), whole);
    }

    #[test]
    fn qwen3_thinking_then_answer() {
        let q = ReasoningFormat::Qwen3;
        every_split(
            q,
            false,
            "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nIt is 4.",
            ("Let me add: 2 + 2 = 4.", "It is 4."),
        );
        // No thinking at all: everything is the answer.
        every_split(q, false, "Just the answer, with <think> inside.", ("", "Just the answer, with <think> inside."));
        // Thinking switched off in the prompt (`<think>\n\n</think>\n\n` there).
        every_split(q, false, "4", ("", "4"));
        // Tags in the answer stay text.
        every_split(q, false, "<think>a</think>b </think> <think>c", ("a", "b </think> <think>c"));
        // Non-ASCII, and an unclosed thinking cut by max_tokens.
        every_split(q, false, "<think>日本語で考える…", ("日本語で考える…", ""));
        every_split(q, false, "", ("", ""));
    }

    #[test]
    fn a_prompt_that_opens_the_thinking() {
        // Qwen3.5's template ends the prompt with `<think>\n`: the reply has only `</think>`.
        let q = ReasoningFormat::Qwen3;
        every_split(q, true, "The user greets.\n</think>\n\nHello!", ("The user greets.", "Hello!"));
        every_split(q, true, "<think>\nthinks again</think>ok", ("thinks again", "ok"));
        every_split(q, true, "never closed", ("never closed", ""));
        assert!(prompt_opens_thinking(q, "<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_thinking(q, "<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_thinking(q, "<|im_start|>assistant\n"));
    }

    #[test]
    fn deepseek_r1_begins_inside() {
        let d = ReasoningFormat::DeepSeekR1;
        every_split(d, false, "hmm, 7 is prime</think>Yes.", ("hmm, 7 is prime", "Yes."));
        every_split(d, false, "<think>\nhmm\n</think>\n\nYes.", ("hmm", "Yes."));
    }

    #[test]
    fn glm45_thinking() {
        let g = ReasoningFormat::Glm45;
        every_split(
            g,
            false,
            "\n<think>Weather needs a tool.</think>\nCalling it.",
            ("Weather needs a tool.", "Calling it."),
        );
        every_split(g, false, "<think></think>\nDirect.", ("", "Direct."));
    }

    #[test]
    fn gemma4_thought_channel() {
        // As Gemma 4 writes it with thinking on (`<|turn>model\n` ends the prompt).
        let g = ReasoningFormat::Gemma4;
        every_split(
            g,
            false,
            "<|channel>thought\nThe user wants the weather.\n<channel|>It is sunny.",
            ("The user wants the weather.", "It is sunny."),
        );
        // A call after the thinking is answer (the tool parser's).
        every_split(
            g,
            false,
            "<|channel>thought\nA tool.<channel|><|tool_call>call:f{}<tool_call|>",
            ("A tool.", "<|tool_call>call:f{}<tool_call|>"),
        );
        // Thinking off: the prompt closed an empty channel; the reply is the answer.
        every_split(g, false, "Hello there.", ("", "Hello there."));
        // An empty channel, `<think>` tags (text to Gemma), an unclosed thought.
        every_split(g, false, "<|channel>thought\n<channel|>Hi", ("", "Hi"));
        every_split(g, false, "<think>x</think>", ("", "<think>x</think>"));
        every_split(g, false, "<|channel>thought\nstill thinking", ("still thinking", ""));
        // The prompts Gemma 4's template ends with: thinking off, thinking on, after a result.
        assert!(!prompt_opens_thinking(g, "<|turn>model\n<|channel>thought\n<channel|>"));
        assert!(!prompt_opens_thinking(g, "<|turn>model\n"));
        assert!(!prompt_opens_thinking(g, "<tool_response|>"));
        assert!(prompt_opens_thinking(g, "<|turn>model\n<|channel>thought\n"));
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
        for (file, want) in [
            ("google-gemma-4-31B-it.jinja", Some(g)),
            ("google-gemma-4-31B-it-interleaved.jinja", Some(g)),
            ("Qwen3.5-4B.jinja", None),
            ("GLM-4.6.jinja", None),
        ] {
            let src = std::fs::read_to_string(dir.join(file)).expect("template");
            assert_eq!(ReasoningFormat::detect(&src), want, "{file}");
        }
    }
}
