//! Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice
//! of strings, a lark grammar) compiled by llguidance against the model's vocabulary, and the
//! per-sequence matcher that turns it into a token mask at each step.
//!
//! The compiled form (`Grammar`) is shared by a request's choices; each sequence gets its own
//! `Constraint` (a matcher) at admission, which the sampler reads (the mask is applied to the
//! row's logits before anything else) and the output processor advances with every accepted
//! token. Draft verification advances it tentatively, row by row, and rolls those tokens back
//! before the output processor consumes the accepted ones, so the matcher only ever holds the
//! sequence's output. Preemption keeps the output, and so the matcher, as it is.
//!
//! A thinking model's reply may begin with its thinking, which no schema describes: a grammar
//! made `after` the thinking's closing tokens lets everything through until the output has
//! written them, and holds the rest (vLLM does the same with its reasoning parsers).

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::ops::token_mask::mask_row;

/// What a request asks its output to match, before compiling.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema.
    JsonSchema(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A lark grammar (llguidance's dialect, which takes vLLM's `guided_grammar` lark).
    Lark(String),
}

impl GrammarSpec {
    /// The kind of grammar, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "json_object",
            GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Lark(_) => "grammar",
        }
    }
}

/// Why a grammar cannot be used; each message names the grammar and llguidance's reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("invalid {kind}: {reason}")]
    Invalid { kind: &'static str, reason: String },
    #[error("the choice list is empty")]
    EmptyChoice,
    #[error("structured outputs are not available for this tokenizer: {0}")]
    Tokenizer(String),
}

/// The model's vocabulary as llguidance reads it: every token's bytes (special tokens marked
/// so that grammars never produce them as text), and the tokenizer for literal strings.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // llguidance tokenizes the grammar's forced text only as a hint for its forced-token
        // path, which iris does not use; a failed encode is then no tokens, never a wrong mask.
        let text = String::from_utf8_lossy(s);
        self.tokenizer.encode(text.as_ref(), false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
}

/// Compiles grammars for one model. Built once per server (its vocabulary trie is the costly
/// part), shared by every request.
pub struct GrammarCompiler {
    factory: ParserFactory,
    eos: Vec<u32>,
}

impl GrammarCompiler {
    /// `vocab_size` is the model's (its logits rows; the tokenizer may have fewer tokens, the
    /// rest are never allowed); `eos` the ids that end a sequence (the first is the one the
    /// grammar knows, the others are allowed exactly when it is).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self, GrammarError> {
        let json = tokenizer.to_string(false).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let json: Value = serde_json::from_str(&json).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(GrammarError::Tokenizer(format!(
                "the tokenizer has {} tokens, more than the model's {vocab_size}",
                words.len()
            )));
        }
        words.resize(vocab_size, Vec::new());
        let eos_id = *eos.first().ok_or_else(|| GrammarError::Tokenizer("the model has no EOS token".into()))?;
        let info = TokRxInfo::new(vocab_size as u32, eos_id);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        // llguidance logs grammar warnings to stderr by default; they reach the client as
        // errors where they matter, so the server's log stays quiet.
        factory.quiet();
        Ok(GrammarCompiler { factory, eos: eos.to_vec() })
    }

    /// Compiles `spec`; a malformed or unsatisfiable grammar is an error naming the problem.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, GrammarError> {
        let kind = spec.kind();
        let top = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(GrammarError::Invalid { kind, reason: "a schema is a JSON object".into() });
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::EmptyChoice);
                }
                let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
                TopLevelGrammar::from_regex(&alternatives.join("|"))
            }
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser =
            self.factory.create_parser(top).map_err(|e| GrammarError::Invalid { kind, reason: e.to_string() })?;
        // A grammar that admits no output at all (an empty enum, `"not": {}`, an impossible
        // regex) compiles, but its first mask is empty: refuse it now rather than emit nothing.
        let mut probe = Matcher::new(Ok(parser.deep_clone()));
        let first = probe.compute_mask().map_err(|e| GrammarError::Invalid { kind, reason: e.to_string() })?;
        if first.is_zero() {
            return Err(GrammarError::Invalid { kind, reason: "no output satisfies it".into() });
        }
        Ok(Grammar {
            parser: Arc::new(Mutex::new(parser)),
            kind,
            eos: self.eos.clone().into(),
            after: None,
            opening: None,
        })
    }
}

/// JSON schemas are matched without free whitespace between tokens (llguidance's default
/// lets any amount through, so a sampled reply could spend its whole budget on spaces); a
/// schema that sets its own `x-guidance` options keeps them.
pub fn compact(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// `s` as a regex matching exactly itself.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('(');
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/\"".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out.push(')');
    out
}

/// A compiled grammar, shared by a request's sequences (cloning shares it).
#[derive(Clone)]
pub struct Grammar {
    parser: Arc<Mutex<TokenParser>>,
    kind: &'static str,
    eos: Arc<[u32]>,
    /// The tokens after which the grammar begins (a thinking's closing tag), if not at once.
    after: Option<Arc<[u32]>>,
    /// A thinking the output may open with this token, which then defers the grammar to its end.
    opening: Option<Opening>,
}

impl Grammar {
    /// A fresh matcher at the start of the output.
    pub fn constraint(&self) -> Constraint {
        // The lock only guards the clone: a parser is not shared while it runs.
        let parser = self.parser.lock().unwrap_or_else(|p| p.into_inner()).deep_clone();
        let gate = self.after.clone().map(|marker| Gate { marker, recent: Vec::new() });
        let opening = self.opening.clone().filter(|_| gate.is_none());
        Constraint {
            matcher: Matcher::new(Ok(parser)),
            eos: self.eos.clone(),
            tentative: 0,
            gate,
            opening,
            saved: None,
        }
    }

    /// This grammar from the first token, unless the output opens with `open` (a model that
    /// may think before it answers, whose prompt does not open the thinking itself): then from
    /// once it has written `end` on. The first token may be `open` or what the grammar allows.
    pub fn after_optional_opening(mut self, open: u32, end: Vec<u32>) -> Grammar {
        self.opening = (!end.is_empty()).then(|| Opening { open, end: end.into() });
        self
    }

    /// This grammar, begun only once the output has written `marker` (its token ids, as the
    /// model writes them): what comes before is free. An empty marker begins it at once.
    pub fn after(mut self, marker: Vec<u32>) -> Grammar {
        self.after = (!marker.is_empty()).then(|| marker.into());
        self
    }

    pub fn kind(&self) -> &'static str {
        self.kind
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammar({})", self.kind)
    }
}

/// Two requests' grammars are the same when they share one compiled parser.
impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.parser, &other.parser)
    }
}

/// The grammar's masks of one sequence's sampled rows in a step (`Constraint::row_masks`),
/// computed apart from the rows' logits, so that they can be computed while the model runs.
pub struct RowMasks {
    /// None: the grammar has not begun at that row.
    masks: Vec<Option<SimpleVob>>,
    eos: Arc<[u32]>,
}

impl RowMasks {
    /// Sets every logit of sampled row `row` the grammar does not allow to -inf.
    pub fn apply(&self, row: usize, logits: &mut [f32]) {
        // Only a row after a rejected draft has no mask, and on the host it is never judged.
        debug_assert!(row < self.masks.len(), "row {row} of a constrained sequence has no mask");
        if let Some(bits) = self.allowed_bits(row, logits.len()) {
            mask_row(&bits, logits);
        }
    }

    /// The tokens sampled row `row` may take, as bits over a vocabulary of `vocab` tokens
    /// (`ops::token_mask`); None: any token (the grammar has not begun at that row). The
    /// model's other EOS ids follow the one llguidance knows: allowed exactly when it is. A row
    /// past the masks (after a draft the grammar rejects) may only end the sequence; a device
    /// computes such rows, which are never taken.
    pub fn allowed_bits(&self, row: usize, vocab: usize) -> Option<Vec<u32>> {
        let mut bits = vec![0u32; vocab.div_ceil(32)];
        let mut allow = |t: u32| {
            if let Some(w) = bits.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        };
        match self.masks.get(row) {
            Some(None) => return None,
            None => self.eos.iter().for_each(|&e| allow(e)),
            Some(Some(mask)) => {
                if self.eos.first().is_some_and(|&e| mask.is_allowed(e)) {
                    self.eos.iter().for_each(|&e| allow(e));
                }
                let words = mask.as_slice();
                let n = words.len().min(bits.len());
                for (b, w) in bits[..n].iter_mut().zip(words) {
                    *b |= w;
                }
            }
        }
        Some(bits)
    }
}

/// A thinking the output may open with its first token (`Grammar::after_optional_opening`).
#[derive(Clone)]
struct Opening {
    open: u32,
    end: Arc<[u32]>,
}

/// Where the output stands before its grammar begins: the last tokens, to spot the marker.
#[derive(Clone)]
struct Gate {
    marker: Arc<[u32]>,
    recent: Vec<u32>,
}

impl Gate {
    /// Takes a token; whether the marker is now written.
    fn opens_with(&mut self, token: u32) -> bool {
        self.recent.push(token);
        let n = self.marker.len();
        if self.recent.len() > n {
            self.recent.drain(..self.recent.len() - n);
        }
        self.recent[..] == self.marker[..]
    }
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    eos: Arc<[u32]>,
    /// Draft tokens consumed while verifying, to roll back once the row is judged.
    tentative: usize,
    /// Some while the grammar has not begun.
    gate: Option<Gate>,
    /// Some before the first token, when the output may open a thinking with it.
    opening: Option<Opening>,
    /// The gate and opening as they were before the drafts being verified (restored with the
    /// matcher).
    saved: Option<(Option<Gate>, Option<Opening>)>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Constraint {
    /// The tokens allowed next (all EOS ids when the grammar is complete and stopped; on a
    /// matcher error only EOS, so the sequence ends rather than leaves its grammar).
    pub fn mask(&mut self) -> SimpleVob {
        let trie_eos = |m: &Matcher| m.tok_env().map(|env| env.tok_trie().eos_token_set());
        let mut mask = match self.matcher.compute_mask_or_eos() {
            Ok(m) => m,
            Err(_) => trie_eos(&self.matcher).unwrap_or_else(|_| SimpleVob::alloc(0)),
        };
        if let Some(o) = self.opening.as_ref().filter(|o| (o.open as usize) < mask.len()) {
            mask.allow_token(o.open);
        }
        mask
    }

    /// Sets every logit the grammar does not allow next to -inf (none before it begins).
    pub fn apply(&mut self, logits: &mut [f32]) {
        self.row_masks(&[]).apply(0, logits);
    }

    /// The masks of the rows a step samples for this sequence: row 0 after its output, row
    /// i + 1 after `drafts[..=i]` as well (consumed tentatively and rolled back, so the
    /// matcher ends where it began). Rows after a draft the grammar does not allow are never
    /// judged (that draft is rejected) and get no mask.
    pub fn row_masks(&mut self, drafts: &[u32]) -> RowMasks {
        let now = |c: &mut Constraint| c.gate.is_none().then(|| c.mask());
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        masks.push(now(self));
        for &d in drafts {
            if matches!(masks.last(), Some(Some(m)) if !m.is_allowed(d)) {
                break;
            }
            self.accept_tentative(d);
            masks.push(now(self));
        }
        self.end_verify();
        RowMasks { masks, eos: self.eos.clone() }
    }

    /// Consumes an accepted output token. EOS ends the sequence without entering the grammar.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.eos.contains(&token) {
            return Ok(());
        }
        if self.opens(token) {
            return Ok(());
        }
        if let Some(g) = self.gate.as_mut() {
            if g.opens_with(token) {
                self.gate = None;
            }
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Before the first token: whether `token` opens a thinking (the grammar then waits for
    /// its end). Either way the choice is made. A grammar that itself allows the token first
    /// (one that spells out the thinking) takes it as its own.
    fn opens(&mut self, token: u32) -> bool {
        match self.opening.take() {
            Some(o)
                if o.open == token
                    && !self
                        .matcher
                        .compute_mask_or_eos()
                        .is_ok_and(|m| (token as usize) < m.len() && m.is_allowed(token)) =>
            {
                self.gate = Some(Gate { marker: o.end, recent: Vec::new() });
                true
            }
            _ => false,
        }
    }

    /// Consumes a draft token while its sequence's rows are masked; `end_verify` undoes it.
    fn accept_tentative(&mut self, token: u32) {
        if self.eos.contains(&token) {
            return;
        }
        if self.gate.is_some() || self.opening.is_some() {
            self.saved.get_or_insert_with(|| (self.gate.clone(), self.opening.clone()));
        }
        if self.opens(token) {
            return;
        }
        if self.gate.is_some() {
            if self.gate.as_mut().is_some_and(|g| g.opens_with(token)) {
                self.gate = None;
            }
            return;
        }
        if self.matcher.is_stopped() {
            return;
        }
        if self.matcher.consume_token(token).is_ok() {
            self.tentative += 1;
        }
    }

    /// Rolls back the drafts consumed by `accept_tentative`.
    fn end_verify(&mut self) {
        if self.tentative > 0 {
            // A failed rollback leaves the matcher in its error state, which masks to EOS.
            let _ = self.matcher.rollback(self.tentative);
            self.tentative = 0;
        }
        if let Some((gate, opening)) = self.saved.take() {
            (self.gate, self.opening) = (gate, opening);
        }
    }

    /// Whether the output is complete and nothing more may follow it.
    pub fn is_finished(&self) -> bool {
        self.gate.is_none() && self.matcher.is_stopped()
    }
}

// Its own file: the tests drive the sampler, which imports this module (no cycle of files).
#[cfg(test)]
mod tests;
