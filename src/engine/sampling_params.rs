//! Per-request sampling parameters, in the shape the OpenAI / vLLM APIs use, so the
//! server can deserialize request fields straight into this struct.

use super::grammar::Grammar;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::HashMap;

/// Most alternatives a request may ask for per token (OpenAI's limit; vLLM's default).
pub const MAX_LOGPROBS: usize = 20;

/// How a single sequence picks its next token and when it stops.
///
/// `Default` is greedy decoding with every filter and penalty switched off.
/// Every field has a default, so a JSON object with any subset of the fields
/// deserializes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 means off. JSON `null` and
    /// negative values (vLLM's `-1`) also mean off. Values above the vocabulary
    /// size are clamped, not rejected.
    #[serde(deserialize_with = "de_top_k")]
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set whose probability mass reaches
    /// `top_p`; 1 means off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * p_max`; 0 means off.
    pub min_p: f32,
    /// CTRL / HF repetition penalty over prompt and output tokens; 1 means off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over output tokens (subtracted once per distinct token).
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over output tokens (subtracted once per occurrence).
    pub frequency_penalty: f32,
    /// Added to the logit of the given token ids before anything else. Accepts
    /// either the OpenAI map `{"123": -100}` or a list of pairs `[[123, -100]]`.
    #[serde(deserialize_with = "de_logit_bias")]
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed for this sequence's private RNG; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Number of top alternatives to return with each token; `Some(0)` returns only
    /// the sampled token's logprob, `None` returns no logprobs.
    pub logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: the logprob of every prompt token after the first under the
    /// raw model (no penalties, no temperature), with this many alternatives each. `None`
    /// computes none.
    pub prompt_logprobs: Option<usize>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// EOS and stop token ids are suppressed until this many tokens were generated.
    pub min_tokens: usize,
    /// Stop strings; generation ends when the text contains one (it is not emitted).
    pub stop: Vec<String>,
    /// Token ids that end generation (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (benchmarks).
    pub ignore_eos: bool,
    /// Drop special tokens from the detokenized text.
    pub skip_special_tokens: bool,
    /// Structured outputs: the grammar the output must match (compiled by the server from
    /// `response_format` / `guided_*`; never read from JSON). The sequence ends when the
    /// grammar is complete and nothing may follow.
    #[serde(skip)]
    pub grammar: Option<Grammar>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            logprobs: None,
            prompt_logprobs: None,
            // OpenAI's and vLLM's default for completions; the server usually
            // overrides it with the remaining context length.
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            skip_special_tokens: true,
            grammar: None,
        }
    }
}

/// A sampling parameter that cannot be honoured, with a message fit for an HTTP 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{param}`: {reason}")]
pub struct SamplingError {
    pub param: &'static str,
    pub reason: String,
}

fn invalid(param: &'static str, reason: impl Into<String>) -> Result<(), SamplingError> {
    Err(SamplingError { param, reason: reason.into() })
}

impl SamplingParams {
    /// Below this temperature we decode greedily: dividing by a tiny temperature
    /// overflows f32 and the result is argmax anyway (vLLM uses the same cut-off).
    pub const GREEDY_EPSILON: f32 = 1e-5;

    /// Whether the sampler will take the argmax (no randomness involved).
    pub fn is_greedy(&self) -> bool {
        self.temperature < Self::GREEDY_EPSILON
    }

    /// Check the parameters against a model with `vocab_size` tokens.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return invalid("temperature", format!("must be a finite number >= 0, got {t}"));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return invalid("top_p", format!("must be in (0, 1], got {p}"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return invalid("min_p", format!("must be in [0, 1], got {m}"));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return invalid("repetition_penalty", format!("must be a finite number > 0, got {r}"));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return invalid(name, format!("must be in [-2, 2], got {v}"));
            }
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                return invalid(
                    "logit_bias",
                    format!("token id {id} is out of range for a vocabulary of {vocab_size}"),
                );
            }
            if !bias.is_finite() {
                return invalid("logit_bias", format!("bias for token {id} must be finite, got {bias}"));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return invalid("logprobs", format!("must be at most {MAX_LOGPROBS}, got {n}"));
            }
        }
        if let Some(n) = self.prompt_logprobs {
            if n > MAX_LOGPROBS {
                return invalid("prompt_logprobs", format!("must be at most {MAX_LOGPROBS}, got {n}"));
            }
        }
        if self.max_tokens == 0 {
            return invalid("max_tokens", "must be at least 1");
        }
        if self.min_tokens > self.max_tokens {
            return invalid(
                "min_tokens",
                format!("({}) must not exceed max_tokens ({})", self.min_tokens, self.max_tokens),
            );
        }
        if self.stop.iter().any(String::is_empty) {
            return invalid("stop", "stop strings must not be empty");
        }
        if let Some(&id) = self.stop_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return invalid(
                "stop_token_ids",
                format!("token id {id} is out of range for a vocabulary of {vocab_size}"),
            );
        }
        Ok(())
    }
}

/// `top_k`: an integer, where `null`, 0 and negatives (vLLM's -1) all mean "off".
fn de_top_k<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let v = Option::<i64>::deserialize(d)?;
    Ok(v.map_or(0, |k| usize::try_from(k).unwrap_or(0)))
}

/// `logit_bias`: the OpenAI map with string keys, or a list of `[id, bias]` pairs.
fn de_logit_bias<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u32, f32)>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Map(HashMap<String, f32>),
        List(Vec<(u32, f32)>),
    }
    let mut out = match Option::<Repr>::deserialize(d)? {
        None => Vec::new(),
        Some(Repr::List(v)) => v,
        Some(Repr::Map(m)) => m
            .into_iter()
            .map(|(k, v)| {
                k.trim()
                    .parse::<u32>()
                    .map(|id| (id, v))
                    .map_err(|_| serde::de::Error::custom(format!("logit_bias key `{k}` is not a token id")))
            })
            .collect::<Result<_, _>>()?,
    };
    // HashMap order is random; sort so equal requests compare and behave equally.
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_greedy_and_valid() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert!(p.skip_special_tokens);
        assert_eq!(p.validate(100), Ok(()));
    }

    #[test]
    fn deserializes_partial_json_and_both_logit_bias_forms() {
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature": 0.7, "top_k": -1, "logit_bias": {"5": -100, "2": 3.5}}"#)
                .expect("valid json");
        assert_eq!(p.temperature, 0.7);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.top_p, 1.0);
        assert_eq!(p.logit_bias, vec![(2, 3.5), (5, -100.0)]);

        let p: SamplingParams =
            serde_json::from_str(r#"{"logit_bias": [[7, 1.0]], "top_k": null}"#).expect("valid json");
        assert_eq!(p.logit_bias, vec![(7, 1.0)]);
        assert_eq!(p.top_k, 0);

        let bad = serde_json::from_str::<SamplingParams>(r#"{"logit_bias": {"abc": 1}}"#);
        assert!(bad.is_err());
    }

    #[test]
    fn validate_rejects_bad_values() {
        let vocab = 100;
        let cases: Vec<(&str, SamplingParams)> = vec![
            ("temperature", SamplingParams { temperature: -0.1, ..Default::default() }),
            ("temperature", SamplingParams { temperature: f32::NAN, ..Default::default() }),
            ("top_p", SamplingParams { top_p: 0.0, ..Default::default() }),
            ("top_p", SamplingParams { top_p: 1.5, ..Default::default() }),
            ("top_p", SamplingParams { top_p: f32::NAN, ..Default::default() }),
            ("min_p", SamplingParams { min_p: -0.5, ..Default::default() }),
            ("repetition_penalty", SamplingParams { repetition_penalty: 0.0, ..Default::default() }),
            ("presence_penalty", SamplingParams { presence_penalty: 3.0, ..Default::default() }),
            ("frequency_penalty", SamplingParams { frequency_penalty: f32::NAN, ..Default::default() }),
            ("logit_bias", SamplingParams { logit_bias: vec![(100, 1.0)], ..Default::default() }),
            ("logit_bias", SamplingParams { logit_bias: vec![(1, f32::INFINITY)], ..Default::default() }),
            ("logprobs", SamplingParams { logprobs: Some(21), ..Default::default() }),
            ("prompt_logprobs", SamplingParams { prompt_logprobs: Some(21), ..Default::default() }),
            ("max_tokens", SamplingParams { max_tokens: 0, ..Default::default() }),
            ("min_tokens", SamplingParams { min_tokens: 17, ..Default::default() }),
            ("stop", SamplingParams { stop: vec![String::new()], ..Default::default() }),
            ("stop_token_ids", SamplingParams { stop_token_ids: vec![1000], ..Default::default() }),
        ];
        for (param, p) in cases {
            let err = p.validate(vocab).expect_err(param);
            assert_eq!(err.param, param, "{err}");
            assert!(err.to_string().contains(param));
        }
    }

    #[test]
    fn validate_accepts_edge_values() {
        let p = SamplingParams {
            temperature: 2.0,
            top_k: 1_000_000, // clamped by the sampler
            top_p: 1.0,
            min_p: 1.0,
            logprobs: Some(20),
            logit_bias: vec![(99, -100.0)],
            max_tokens: 1,
            min_tokens: 1,
            ..Default::default()
        };
        assert_eq!(p.validate(100), Ok(()));
    }
}
