//! The grammar's tests (a file of their own: they drive the sampler, which uses the grammar).

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

/// Greedy verification of `drafts` under `c`, row i's logits favouring `favs[i]`, then
/// `second`: the tokens the rows give.
fn verify_favouring(c: &mut Constraint, favs: &[u32], second: u32, drafts: &[u32]) -> Vec<u32> {
    let params = SamplingParams::default();
    let mut sampler = SequenceSampler::for_params(&params);
    let row = |fav: u32| {
        let mut r = vec![0.0f32; VOCAB];
        r[fav as usize] = 10.0;
        r[second as usize] = 5.0;
        r
    };
    let mut rows: Vec<Vec<f32>> = favs.iter().map(|&f| row(f)).collect();
    let got = sampler.verify_constrained(&mut rows, drafts, &params, &[], &[], Some(c));
    got.iter().map(|s| s.token).collect()
}

/// A grammar begun after a marker (a thinking's closing tag): free before it, held after it,
/// also when the marker arrives in drafts that verification then takes back.
#[test]
fn a_grammar_after_a_marker_begins_there() {
    let (comp, tok) = compiler();
    let id = |s: &str| tok.token_to_id(s).unwrap_or_else(|| panic!("{s}"));
    let (a, b, x, y) = (id("a"), id("b"), id("x"), id("y"));
    let g = comp.compile(&GrammarSpec::Regex("ab".into())).expect("regex").after(vec![x, y]);
    let free = |c: &mut Constraint| {
        let mut l = vec![0.0f32; VOCAB];
        c.apply(&mut l);
        l.iter().all(|v| v.is_finite())
    };
    let mut c = g.constraint();
    // Before the marker anything goes, `x` alone or `y x` opens nothing.
    for t in [b, x, b, y, x] {
        assert!(free(&mut c));
        c.accept(t).expect("free text");
        assert!(!c.is_finished());
    }
    c.accept(y).expect("the marker's end");
    assert!(!free(&mut c), "the grammar holds after the marker");
    c.accept(a).expect("a");
    c.accept(b).expect("b");
    assert!(c.is_finished());

    // The marker in drafts: the rows after it are held, and the rollback frees them again.
    let mut c = g.constraint();
    // Drafts [x, y, b]: x and y are the argmax and accepted; after them only `a` may start
    // the grammar, so the draft `b` is rejected and its row gives `a`.
    assert_eq!(verify_favouring(&mut c, &[x, y, b, b], a, &[x, y, b]), vec![x, y, a]);
    assert!(free(&mut c), "verification consumed nothing for good");
    for t in [x, y] {
        c.accept(t).expect("accepted drafts");
    }
    assert!(!free(&mut c));
}

/// A grammar the output may defer by opening a thinking with its first token: the first token
/// may be the opening or what the grammar allows; after the opening the text is free until the
/// thinking's end, then the grammar holds; without it the grammar holds from the first token.
/// Drafts that open the thinking are taken back with the rest of verification.
#[test]
fn a_grammar_after_an_optional_opening() {
    let (comp, tok) = compiler();
    let id = |s: &str| tok.token_to_id(s).unwrap_or_else(|| panic!("{s}"));
    let (a, b, x, y) = (id("a"), id("b"), id("x"), id("y"));
    let g = comp.compile(&GrammarSpec::Regex("ab".into())).expect("regex").after_optional_opening(x, vec![y]);
    let allowed = |c: &mut Constraint, t: u32| {
        let mut l = vec![0.0f32; VOCAB];
        c.apply(&mut l);
        l[t as usize].is_finite()
    };
    // Straight into the grammar: `x` is allowed only as the first token.
    let mut c = g.constraint();
    assert!(allowed(&mut c, a) && allowed(&mut c, x) && !allowed(&mut c, b));
    c.accept(a).expect("a");
    assert!(!allowed(&mut c, x) && allowed(&mut c, b), "the opening is gone once the grammar began");
    c.accept(b).expect("b");
    assert!(c.is_finished());
    // Thinking first: free until `y`, then the grammar.
    let mut c = g.constraint();
    c.accept(x).expect("the opening");
    for t in [b, b, x] {
        assert!(allowed(&mut c, b) && allowed(&mut c, a), "free inside the thinking");
        c.accept(t).expect("thinking");
    }
    c.accept(y).expect("the thinking's end");
    assert!(allowed(&mut c, a) && !allowed(&mut c, b) && !allowed(&mut c, x));
    c.accept(a).expect("a");
    c.accept(b).expect("b");
    assert!(c.is_finished());

    // In drafts: [x, b, y] are accepted (free inside the thinking), then `b` is not allowed
    // after `y` and its row gives `a`; verification leaves the constraint at its start.
    let mut c = g.constraint();
    assert_eq!(verify_favouring(&mut c, &[x, b, y, b, b], a, &[x, b, y, b]), vec![x, b, y, a]);
    assert!(allowed(&mut c, x) && !allowed(&mut c, b), "verification consumed nothing for good");

    // A grammar that spells out the thinking itself takes the opening as its own token.
    let g = comp.compile(&GrammarSpec::Regex("xab".into())).expect("regex").after_optional_opening(x, vec![y]);
    let mut c = g.constraint();
    c.accept(x).expect("the grammar's x");
    assert!(allowed(&mut c, a) && !allowed(&mut c, b), "inside the grammar, not a thinking");
}
