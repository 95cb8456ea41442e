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

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::Value;
use tokenizers::Tokenizer;

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
        Ok(Grammar { parser: Arc::new(Mutex::new(parser)), kind, eos: self.eos.clone().into() })
    }
}

/// JSON schemas are matched without free whitespace between tokens (llguidance's default
/// lets any amount through, so a sampled reply could spend its whole budget on spaces); a
/// schema that sets its own `x-guidance` options keeps them.
fn compact(mut schema: Value) -> Value {
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
}

impl Grammar {
    /// A fresh matcher at the start of the output.
    pub fn constraint(&self) -> Constraint {
        // The lock only guards the clone: a parser is not shared while it runs.
        let parser = self.parser.lock().unwrap_or_else(|p| p.into_inner()).deep_clone();
        Constraint { matcher: Matcher::new(Ok(parser)), eos: self.eos.clone(), tentative: 0 }
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

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    eos: Arc<[u32]>,
    /// Draft tokens consumed while verifying, to roll back once the row is judged.
    tentative: usize,
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
        match self.matcher.compute_mask_or_eos() {
            Ok(m) => m,
            Err(_) => trie_eos(&self.matcher).unwrap_or_else(|_| SimpleVob::alloc(0)),
        }
    }

    /// Sets every logit the grammar does not allow to -inf. The model's other EOS ids follow
    /// the one llguidance knows: allowed (with their own logits) exactly when it is.
    pub fn apply(&mut self, logits: &mut [f32]) {
        let mask = self.mask();
        let eos_allowed = self.eos.first().is_some_and(|&e| mask.is_allowed(e));
        let other_eos: Vec<(usize, f32)> = if eos_allowed {
            self.eos.iter().skip(1).filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l))).collect()
        } else {
            Vec::new()
        };
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for (e, l) in other_eos {
            logits[e] = l;
        }
    }

    /// Consumes an accepted output token. EOS ends the sequence without entering the grammar.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.eos.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Consumes a draft token while its sequence's rows are verified; `end_verify` undoes it.
    pub fn accept_tentative(&mut self, token: u32) {
        if self.eos.contains(&token) || self.matcher.is_stopped() {
            return;
        }
        if self.matcher.consume_token(token).is_ok() {
            self.tentative += 1;
        }
    }

    /// Rolls back the drafts consumed by `accept_tentative`.
    pub fn end_verify(&mut self) {
        if self.tentative > 0 {
            // A failed rollback leaves the matcher in its error state, which masks to EOS.
            let _ = self.matcher.rollback(self.tentative);
            self.tentative = 0;
        }
    }

    /// Whether the output is complete and nothing more may follow it.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampler::SequenceSampler;
    use crate::engine::sampling_params::SamplingParams;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    const VOCAB: usize = 1024; // tiny-llama's config (its tokenizer has fewer tokens)
    const EOS: u32 = 2;

    fn tokenizer() -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama/tokenizer.json");
        Tokenizer::from_file(path).expect("fixture tokenizer")
    }

    fn compiler() -> (GrammarCompiler, Tokenizer) {
        let tok = tokenizer();
        (GrammarCompiler::new(&tok, VOCAB, &[EOS, 0]).expect("compiler"), tok)
    }

    /// Samples from random logits under `grammar` at temperature 1 until the grammar ends it
    /// (or EOS), as the engine would: mask, draw, accept.
    fn generate(grammar: &Grammar, tok: &Tokenizer, seed: u64) -> String {
        let params = SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() };
        let mut sampler = SequenceSampler::for_params(&params).with_eos_token_ids(vec![EOS]);
        let mut noise = StdRng::seed_from_u64(seed ^ 0x5eed);
        let mut c = grammar.constraint();
        let mut out = Vec::new();
        for _ in 0..400 {
            let mut logits: Vec<f32> = (0..VOCAB).map(|_| noise.random::<f32>() * 8.0).collect();
            let t = sampler.sample_constrained(&mut logits, &params, &[], &out, Some(&mut c)).token;
            if t == EOS || t == 0 {
                break;
            }
            c.accept(t).expect("a masked draw is allowed");
            out.push(t);
            if c.is_finished() {
                break;
            }
        }
        tok.decode(&out, false).expect("decode")
    }

    #[test]
    fn random_logits_under_a_schema_give_valid_json() {
        let (comp, tok) = compiler();
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "tag": {"enum": ["a", "b"]},
            },
            "required": ["name", "age", "tag"],
            "additionalProperties": false,
        });
        let g = comp.compile(&GrammarSpec::JsonSchema(schema)).expect("compiles");
        for seed in 0..20 {
            let text = generate(&g, &tok, seed);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
            assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 8), "{text}");
            assert!(v["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{text}");
            assert!(v["tag"] == "a" || v["tag"] == "b", "{text}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
        }
    }

    #[test]
    fn choices_and_regexes_are_matched_whole() {
        let (comp, tok) = compiler();
        let g = comp.compile(&GrammarSpec::Choice(vec!["yes".into(), "no (maybe)".into()])).expect("choice");
        let r = comp.compile(&GrammarSpec::Regex("[0-9]{3}-[a-c]+".into())).expect("regex");
        let mut seen = std::collections::HashSet::new();
        for seed in 0..30 {
            let c = generate(&g, &tok, seed);
            assert!(c == "yes" || c == "no (maybe)", "{c:?}");
            seen.insert(c);
            let x = generate(&r, &tok, seed);
            let (digits, letters) = x.split_once('-').unwrap_or_else(|| panic!("{x:?}"));
            assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{x:?}");
            assert!(!letters.is_empty() && letters.bytes().all(|b| (b'a'..=b'c').contains(&b)), "{x:?}");
        }
        assert_eq!(seen.len(), 2, "both choices are reachable");
    }

    #[test]
    fn bad_and_unsatisfiable_grammars_are_errors() {
        let (comp, _) = compiler();
        for spec in [
            GrammarSpec::JsonSchema(json!({"type": "objekt"})),
            GrammarSpec::JsonSchema(json!("a string")),
            GrammarSpec::JsonSchema(json!({"enum": []})),
            GrammarSpec::Regex("(unclosed".into()),
            GrammarSpec::Lark("start: undefined_rule".into()),
            GrammarSpec::Choice(Vec::new()),
        ] {
            assert!(comp.compile(&spec).is_err(), "{spec:?}");
        }
        assert!(comp.compile(&GrammarSpec::Lark("start: \"a\" | \"b\"".into())).is_ok());
        assert!(comp.compile(&GrammarSpec::JsonObject).is_ok());
    }

    #[test]
    fn masks_allow_every_eos_only_with_the_grammar_eos() {
        let (comp, tok) = compiler();
        let g = comp.compile(&GrammarSpec::Regex("ab?".into())).expect("regex");
        let mut c = g.constraint();
        let mut logits = vec![0.0f32; VOCAB];
        c.apply(&mut logits);
        assert!(logits[EOS as usize].is_infinite() && logits[0].is_infinite(), "nothing output yet: no EOS");
        let a = tok.token_to_id("a").expect("a token");
        assert!(logits[a as usize].is_finite());
        c.accept(a).expect("a");
        let mut logits = vec![0.0f32; VOCAB];
        c.apply(&mut logits);
        assert!(logits[EOS as usize].is_finite() && logits[0].is_finite(), "complete: both EOS ids allowed");
        assert!(!c.is_finished(), "b may still follow");
    }

    #[test]
    fn verification_rejects_a_draft_the_grammar_rejects_and_rolls_back() {
        let (comp, tok) = compiler();
        let g = comp.compile(&GrammarSpec::Regex("ab".into())).expect("regex");
        let (a, b) = (tok.token_to_id("a").expect("a"), tok.token_to_id("b").expect("b"));
        let params = SamplingParams::default();
        let mut sampler = SequenceSampler::for_params(&params);
        // Raw logits favour `a` at every row: the drafts [a, a] are both the argmax, but the
        // second breaks the grammar, so it is rejected and the row gives `b`.
        let row = |fav: u32| {
            let mut r = vec![0.0f32; VOCAB];
            r[fav as usize] = 10.0;
            r[b as usize] = 5.0;
            r
        };
        let mut c = g.constraint();
        let mut rows = vec![row(a), row(a), row(a)];
        let got = sampler.verify_constrained(&mut rows, &[a, a], &params, &[], &[], Some(&mut c));
        assert_eq!(got.iter().map(|s| s.token).collect::<Vec<_>>(), vec![a, b]);
        // Nothing was consumed for good: the matcher is back at the start.
        let mut first = vec![0.0f32; VOCAB];
        c.apply(&mut first);
        assert!(first[a as usize].is_finite() && first[b as usize].is_infinite());
        // Unconstrained, the same rows accept both drafts.
        let mut rows = vec![row(a), row(a), row(a)];
        assert_eq!(sampler.verify(&mut rows, &[a, a], &params, &[], &[]).len(), 3);
    }
}
