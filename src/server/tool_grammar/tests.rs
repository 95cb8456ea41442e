//! Forced calls under their grammar, in every format: random walks through what the grammar
//! allows (each step a random allowed token, as a random model would pick) always give text
//! that the format's parser reads as calls to the request's tools, with arguments that
//! validate against the tool's schema, and nothing outside the calls.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::*;
use crate::engine::{Grammar, GrammarCompiler};
use crate::server::tool_request::forced_opening;
use crate::server::tools::{ToolEvent, Tools};

const VOCAB: usize = 1024; // tiny-llama's and tiny-gemma4's configs (their tokenizers have fewer tokens)
const EOS: u32 = 2;
const FORMATS: [ToolFormat; 5] =
    [ToolFormat::Hermes, ToolFormat::Qwen3Xml, ToolFormat::Glm45, ToolFormat::Llama3Json, ToolFormat::Gemma4];

fn tokenizer() -> Tokenizer {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama/tokenizer.json");
    Tokenizer::from_file(path).expect("fixture tokenizer")
}

/// The tokenizer a format's model has (Gemma 4's markup is special tokens), its EOS and the
/// markup tokens.
fn vocabulary(format: ToolFormat) -> (Tokenizer, u32, Markup) {
    if format != ToolFormat::Gemma4 {
        return (tokenizer(), EOS, Markup::default());
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemma4_template/tokenizer.json");
    let tok = Tokenizer::from_file(path).expect("gemma4 fixture tokenizer");
    let markup = Markup::new(|s| tok.token_to_id(s));
    let eos = tok.token_to_id("<eos>").expect("<eos>");
    (tok, eos, markup)
}

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "New York"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 2},
            }, "required": ["city", "days"]}),
        },
        ToolSpec {
            name: "note".into(),
            parameters: json!({"type": "object", "properties": {
                "text": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                "level": {"enum": [1, 2, 3]},
                "meta": {"type": "object", "properties": {
                    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b c"]}, "minItems": 1, "maxItems": 2},
                    "any": {"anyOf": [{"type": "string", "pattern": "^[xy]$"}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
                }, "required": ["tags"], "additionalProperties": false},
            }, "required": ["text"]}),
        },
    ]
}

/// What the tests' schemas use of JSON schema, checked.
fn validate(schema: &Value, v: &Value) -> Result<(), String> {
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        return if e.contains(v) { Ok(()) } else { Err(format!("{v} is not in {schema}")) };
    }
    match schema["type"].as_str() {
        Some("object") => {
            let o = v.as_object().ok_or(format!("{v} is not an object"))?;
            for r in schema["required"].as_array().into_iter().flatten() {
                if !o.contains_key(r.as_str().unwrap_or_default()) {
                    return Err(format!("{r} is missing from {v}"));
                }
            }
            for (k, x) in o {
                validate(schema["properties"].get(k).ok_or(format!("extra `{k}`"))?, x)?;
            }
        }
        Some("integer") => {
            let n = v.as_i64().ok_or(format!("{v} is not an integer"))?;
            let (lo, hi) =
                (schema["minimum"].as_i64().unwrap_or(i64::MIN), schema["maximum"].as_i64().unwrap_or(i64::MAX));
            if !(lo..=hi).contains(&n) {
                return Err(format!("{n} is outside [{lo}, {hi}]"));
            }
        }
        Some("boolean") if !v.is_boolean() => return Err(format!("{v} is not a boolean")),
        Some("array") => {
            let a = v.as_array().ok_or(format!("{v} is not an array"))?;
            if a.len() as u64 > schema["maxItems"].as_u64().unwrap_or(u64::MAX) {
                return Err(format!("{v} has too many items"));
            }
            a.iter().try_for_each(|x| validate(&schema["items"], x))?;
        }
        Some("string") => {
            let s = v.as_str().ok_or(format!("{v} is not a string"))?;
            if schema.get("pattern").is_some()
                && !((1..=6).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase()))
            {
                return Err(format!("{s:?} does not match ^[a-z]{{1,6}}$"));
            }
        }
        _ => {}
    }
    Ok(())
}

/// A random walk through `grammar`: random allowed tokens until only EOS is allowed, or,
/// where EOS is one of the choices, until a coin says to end.
fn walk(grammar: &Grammar, tok: &Tokenizer, eos: u32, seed: u64) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = grammar.constraint();
    let mut out = Vec::new();
    for _ in 0..3000 {
        let mask = c.mask();
        let allowed: Vec<u32> = (0..VOCAB as u32).filter(|&t| t != eos && mask.is_allowed(t)).collect();
        if allowed.is_empty() || c.is_finished() || (mask.is_allowed(eos) && rng.random_bool(0.5)) {
            return tok.decode(&out, false).expect("decode");
        }
        let t = allowed[rng.random_range(0..allowed.len())];
        c.accept(t).expect("an allowed token is accepted");
        out.push(t);
    }
    panic!("seed {seed}: the grammar never ended: {:?}", tok.decode(&out, false));
}

/// The calls `format`'s parser reads from `text`, and the text outside them.
fn parse(format: ToolFormat, text: &str) -> (String, Vec<(String, Value)>) {
    let mut p = format.parser(Tools(tools()));
    let mut events = Vec::new();
    p.feed(text, &mut events);
    p.finish(&mut events);
    let (mut content, mut calls) = (String::new(), Vec::<(String, String)>::new());
    for e in events {
        match e {
            ToolEvent::Text(t) => content.push_str(&t),
            ToolEvent::Start { name } => calls.push((name, String::new())),
            ToolEvent::Args(a) => calls.last_mut().expect("open call").1.push_str(&a),
            ToolEvent::End => {}
        }
    }
    let calls = calls.into_iter().map(|(n, a)| (n, serde_json::from_str(&a).expect("arguments are JSON"))).collect();
    (content, calls)
}

#[test]
fn forced_calls_parse_and_validate_in_every_format() {
    let specs = tools();
    let cases: [(Option<&str>, bool); 4] =
        [(Some("note"), true), (Some("get_weather"), false), (None, false), (None, true)];
    for format in FORMATS {
        let (tok, eos, markup) = vocabulary(format);
        let compiler = GrammarCompiler::new(&tok, VOCAB, &[eos]).expect("compiler");
        for (name, parallel) in cases {
            let grammar = compiler
                .compile(&forced_call(format, &specs, name, parallel, &markup))
                .unwrap_or_else(|e| panic!("{}: {e}", format.name()));
            let mut names = std::collections::HashSet::new();
            let mut most = 0;
            for seed in 0..25 {
                let text = format!("{}{}", forced_opening(format, name), walk(&grammar, &tok, eos, seed));
                let (content, calls) = parse(format, &text);
                let at = format!("{} {name:?} parallel {parallel} seed {seed}: {text:?}", format.name());
                assert_eq!(content.trim(), "", "{at}: text outside the calls");
                assert!(!calls.is_empty(), "{at}: no call");
                assert!(parallel || calls.len() == 1, "{at}: {} calls", calls.len());
                for (n, args) in &calls {
                    let tool = specs.iter().find(|t| &t.name == n).unwrap_or_else(|| panic!("{at}: unknown {n}"));
                    assert!(name.is_none_or(|want| want == n), "{at}: called {n}");
                    validate(&tool.parameters, args).unwrap_or_else(|e| panic!("{at}: {e}"));
                    names.insert(n.clone());
                }
                most = most.max(calls.len());
            }
            // The walks explore: under `required` both tools get called, and parallel calls happen.
            if name.is_none() {
                assert_eq!(names.len(), 2, "{} parallel {parallel}: {names:?}", format.name());
                assert_eq!(most > 1, parallel, "{} parallel {parallel}", format.name());
            }
        }
    }
}

/// A string parameter without enum or pattern is any text up to its closing tag (Gemma 4:
/// its closing quote token), and its parameter can not be left out.
#[test]
fn free_text_values_end_at_their_closing_tag() {
    let specs = vec![ToolSpec {
        name: "write".into(),
        parameters: json!({"type": "object", "properties": {"body": {"type": "string"}}, "required": ["body"]}),
    }];
    for (format, good, bad) in [
        (
            ToolFormat::Qwen3Xml,
            "<parameter=body>\nfn main() {\n  a < b\n}\n</parameter>\n</function>\n</tool_call>",
            "</function>\n</tool_call>",
        ),
        (ToolFormat::Glm45, "<arg_key>body</arg_key>\n<arg_value>x\ny < z</arg_value>\n</tool_call>", "</tool_call>"),
        (ToolFormat::Gemma4, "body:<|\"|>fn f() {\n  a < b, c: d\n}<|\"|>}<tool_call|>", "}<tool_call|>"),
    ] {
        let (tok, eos, markup) = vocabulary(format);
        let compiler = GrammarCompiler::new(&tok, VOCAB, &[eos]).expect("compiler");
        let g = compiler.compile(&forced_call(format, &specs, Some("write"), false, &markup)).expect("compiles");
        let accepts = |text: &str| {
            let mut c = g.constraint();
            let ids = tok.encode(text, false).expect("encode").get_ids().to_vec();
            ids.iter().all(|&t| c.mask().is_allowed(t) && c.accept(t).is_ok())
                && (c.is_finished() || c.mask().is_allowed(eos))
        };
        assert!(accepts(good), "{}: {good:?}", format.name());
        assert!(!accepts(bad), "{}: a required parameter left out: {bad:?}", format.name());
    }
}
