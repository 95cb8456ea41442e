//! Speculative decoding: what the user configures (`--speculative-config`, vLLM's JSON) and
//! the drafters that propose tokens for the target model to verify in one pass.
//!
//! The n-gram drafter (prompt lookup) needs no second model: it finds the latest earlier
//! occurrence of the sequence's last n tokens (n from `prompt_lookup_max` down to
//! `prompt_lookup_min`) and proposes the tokens that followed it. It pays off where the output
//! repeats its input: editing code, summarising or quoting a given text.

use serde::Deserialize;

/// Why a `--speculative-config` was refused. Each says what to change.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SpeculativeConfigError {
    #[error("--speculative-config is not valid JSON for it: {0} (e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}')")]
    Json(String),
    #[error(
        "--speculative-config: method `{0}` is not supported; use \"ngram\", \"mtp\", or \"gemma4_mtp\" with \"model\""
    )]
    Method(String),
    #[error("--speculative-config: method gemma4_mtp needs \"model\": the directory of the target's gemma4_assistant checkpoint")]
    NeedsModel,
    #[error("--speculative-config: method `{0}` takes no \"model\" (it drafts from the tokens); leave it out")]
    NoModel(String),
    #[error("--speculative-config: num_speculative_tokens must be 1..={MAX_SPECULATIVE_TOKENS}, got {0}")]
    NumTokens(usize),
    #[error("speculative decoding is off: start with --speculative-config")]
    NotEnabled,
    #[error("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got min {min}, max {max}")]
    Lookup { min: usize, max: usize },
}

/// Most draft tokens per sequence and step.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    method: String,
    num_speculative_tokens: usize,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
    model: Option<std::path::PathBuf>,
    adaptive: Option<bool>,
}

/// How to speculate: drafts of up to `num_tokens` tokens (n-gram lookup bounds for that
/// drafter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub num_tokens: usize,
    pub lookup_min: usize,
    pub lookup_max: usize,
    /// Draft only where it pays at the batch size running (`spec_governor`): `"adaptive"` in
    /// the JSON, on unless false.
    pub adaptive: bool,
}

impl std::str::FromStr for SpeculativeConfig {
    type Err = SpeculativeConfigError;

    /// vLLM's form: `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
    /// "prompt_lookup_min": 2}`. Without either lookup bound, n runs from 4 down to 1; with one,
    /// the other equals it.
    /// A drafter model's directory, if the method names one, is dropped: see `parse`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s).map(|(c, _)| c)
    }
}

/// Where drafts come from besides the tokens (an n-gram config has neither).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraftSource {
    /// Gemma 4's assistant checkpoint in this directory (method gemma4_mtp).
    Assistant(std::path::PathBuf),
    /// The target's own MTP head (method mtp; `model`, if given, is the head's file).
    Mtp(crate::loader::MtpWeights),
}

/// `--speculative-config` with where drafts come from, when not from the tokens: vLLM's
/// `{"method": "gemma4_mtp", "model": DIR, "num_speculative_tokens": K}` (Gemma 4's assistant),
/// `{"method": "mtp", "num_speculative_tokens": K}` (the checkpoint's MTP head; "model" may
/// name a head kept apart), or an n-gram config (see `SpeculativeConfig::from_str`).
pub fn parse(s: &str) -> Result<(SpeculativeConfig, Option<DraftSource>), SpeculativeConfigError> {
    {
        let raw: RawConfig = serde_json::from_str(s).map_err(|e| SpeculativeConfigError::Json(e.to_string()))?;
        let source = match (raw.method.as_str(), raw.model) {
            ("ngram", None) => None,
            ("gemma4_mtp", Some(dir)) => Some(DraftSource::Assistant(dir)),
            ("mtp", None) => Some(DraftSource::Mtp(crate::loader::MtpWeights::Checkpoint)),
            ("mtp", Some(file)) => Some(DraftSource::Mtp(crate::loader::MtpWeights::File(file))),
            ("ngram", Some(_)) => return Err(SpeculativeConfigError::NoModel(raw.method)),
            ("gemma4_mtp", None) => return Err(SpeculativeConfigError::NeedsModel),
            _ => return Err(SpeculativeConfigError::Method(raw.method)),
        };
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&raw.num_speculative_tokens) {
            return Err(SpeculativeConfigError::NumTokens(raw.num_speculative_tokens));
        }
        let (min, max) = match (raw.prompt_lookup_min, raw.prompt_lookup_max) {
            (None, None) => (1, 4),
            (Some(n), None) | (None, Some(n)) => (n, n),
            (Some(min), Some(max)) => (min, max),
        };
        if min == 0 || min > max {
            return Err(SpeculativeConfigError::Lookup { min, max });
        }
        let adaptive = raw.adaptive.unwrap_or(true);
        Ok((
            SpeculativeConfig { num_tokens: raw.num_speculative_tokens, lookup_min: min, lookup_max: max, adaptive },
            source,
        ))
    }
}

/// Where draft tokens come from.
#[derive(Debug, Clone)]
pub enum Drafter {
    Ngram(NgramDrafter),
    Replay(ReplayDrafter),
}

impl Drafter {
    /// Up to `max` tokens to follow `tokens` (fewer, or none, when the drafter has no guess).
    pub fn propose(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        match self {
            Drafter::Ngram(d) => d.propose(tokens, max),
            Drafter::Replay(d) => d.propose(tokens, max),
        }
    }
}

/// For benchmarks and tests: proposes, for a sequence whose prompt is that of a recorded token
/// sequence, the recorded tokens at its next positions (the target's own greedy continuation,
/// recorded in a first pass), up to K at a time. Where a sequence's output left the recording
/// (a near-tie that rounds the other way), the drafts still follow the recording by position.
#[derive(Debug, Clone)]
pub struct ReplayDrafter {
    num_tokens: usize,
    /// (prompt length, whole token sequence).
    recorded: Vec<(usize, Vec<u32>)>,
}

impl ReplayDrafter {
    /// `recorded`: (prompt length, prompt and output) of each recorded sequence.
    pub fn new(num_tokens: usize, recorded: Vec<(usize, Vec<u32>)>) -> Self {
        ReplayDrafter { num_tokens, recorded }
    }

    pub fn propose(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let n = tokens.len();
        let hit = self.recorded.iter().find(|(p, r)| *p <= n && r.len() > n && r[..*p] == tokens[..*p]);
        match hit {
            Some((_, r)) => r[n..(n + max.min(self.num_tokens)).min(r.len())].to_vec(),
            None => Vec::new(),
        }
    }
}

/// Proposes draft tokens by prompt lookup.
#[derive(Debug, Clone, Copy)]
pub struct NgramDrafter {
    cfg: SpeculativeConfig,
}

impl NgramDrafter {
    pub fn new(cfg: SpeculativeConfig) -> Self {
        NgramDrafter { cfg }
    }

    /// Up to `max` tokens to follow `tokens`: after the latest earlier occurrence of its
    /// longest suffix of `lookup_max..=lookup_min` tokens that occurs earlier at all. Empty
    /// when none does.
    ///
    /// One pass back from the end over the earlier positions j that hold the last token: the
    /// match length at j is how many tokens ending there equal the suffix's (at most
    /// `lookup_max`). The longest match wins, the latest among equals (found first), and a full
    /// match ends the search. The pass is a compare per token, so a 32k-token sequence costs
    /// tens of microseconds per step, not a scan per suffix length.
    pub fn propose(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let max = max.min(self.cfg.num_tokens);
        let len = tokens.len();
        let (lo, hi) = (self.cfg.lookup_min, self.cfg.lookup_max.min(len.saturating_sub(1)));
        if max == 0 || lo > hi {
            return Vec::new();
        }
        let last = tokens[len - 1];
        // (match length, end position) of the best occurrence so far.
        let mut best: Option<(usize, usize)> = None;
        for j in (0..len - 1).rev().filter(|&j| tokens[j] == last) {
            let m = (0..hi.min(j + 1)).take_while(|&k| tokens[j - k] == tokens[len - 1 - k]).count();
            if m >= lo && best.is_none_or(|(bm, _)| m > bm) {
                best = Some((m, j));
                if m == hi {
                    break;
                }
            }
        }
        best.map_or_else(Vec::new, |(_, j)| tokens[j + 1..(j + 1 + max).min(len)].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter(k: usize, min: usize, max: usize) -> NgramDrafter {
        NgramDrafter::new(SpeculativeConfig { num_tokens: k, lookup_min: min, lookup_max: max, adaptive: false })
    }

    #[test]
    fn parses_vllm_form_and_refuses_bad_settings() {
        let c: SpeculativeConfig =
            r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#
                .parse()
                .unwrap();
        assert_eq!(c, SpeculativeConfig { num_tokens: 3, lookup_min: 2, lookup_max: 4, adaptive: true });
        let c: SpeculativeConfig =
            r#"{"method": "ngram", "num_speculative_tokens": 1, "adaptive": false}"#.parse().unwrap();
        assert!(!c.adaptive);
        let c: SpeculativeConfig = r#"{"method": "ngram", "num_speculative_tokens": 2}"#.parse().unwrap();
        assert_eq!((c.lookup_min, c.lookup_max), (1, 4));
        let c: SpeculativeConfig =
            r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}"#.parse().unwrap();
        assert_eq!((c.lookup_min, c.lookup_max), (3, 3));
        for (bad, want) in [
            ("ngram", "not valid JSON"),
            (r#"{"method": "eagle", "num_speculative_tokens": 2}"#, "method `eagle`"),
            (r#"{"method": "ngram", "num_speculative_tokens": 0}"#, "1..=32"),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}"#,
                "prompt_lookup_min",
            ),
            (r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}"#, "prompt_lookup_min"),
            (r#"{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}"#, "takes no \"model\""),
            (r#"{"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}"#, "unknown field"),
            (r#"{"method": "gemma4_mtp", "num_speculative_tokens": 2}"#, "needs \"model\""),
        ] {
            let e = bad.parse::<SpeculativeConfig>().unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
        let (c, model) = parse(r#"{"method": "gemma4_mtp", "model": "/m/a", "num_speculative_tokens": 4}"#).unwrap();
        assert_eq!((c.num_tokens, model), (4, Some(DraftSource::Assistant("/m/a".into()))));
        let (c, model) = parse(r#"{"method": "mtp", "num_speculative_tokens": 2}"#).unwrap();
        assert_eq!((c.num_tokens, model), (2, Some(DraftSource::Mtp(crate::loader::MtpWeights::Checkpoint))));
        let (_, model) = parse(r#"{"method": "mtp", "model": "/h.safetensors", "num_speculative_tokens": 2}"#).unwrap();
        assert_eq!(model, Some(DraftSource::Mtp(crate::loader::MtpWeights::File("/h.safetensors".into()))));
    }

    #[test]
    fn replay_proposes_the_recorded_rest() {
        let d = ReplayDrafter::new(2, vec![(2, vec![1, 2, 3, 4, 5]), (1, vec![7, 8, 9])]);
        assert_eq!(d.propose(&[1, 2], 8), vec![3, 4]);
        assert_eq!(d.propose(&[1, 2, 3, 4], 8), vec![5]);
        // Off the recording after the prompt: still by position.
        assert_eq!(d.propose(&[1, 2, 6], 8), vec![4, 5]);
        assert_eq!(d.propose(&[7], 1), vec![8]);
        assert!(d.propose(&[1, 3], 8).is_empty(), "another prompt");
        assert!(d.propose(&[7, 8, 9], 8).is_empty(), "past the recording");
    }

    #[test]
    fn proposes_what_followed_the_latest_longest_match() {
        let d = drafter(3, 1, 3);
        // Suffix [1, 2] (3-gram [9, 1, 2] never seen before): latest earlier match at 4.
        let t = [1, 2, 3, 4, 1, 2, 5, 6, 7, 9, 1, 2];
        assert_eq!(d.propose(&t, 8), vec![5, 6, 7]);
        // The 3-gram [7, 1, 2] wins over the later 2-gram match.
        let t = [7, 1, 2, 8, 8, 1, 2, 9, 7, 1, 2];
        assert_eq!(d.propose(&t, 8), vec![8, 8, 1]);
        // Bounded by `max` and by what is there.
        assert_eq!(d.propose(&[1, 2, 3, 4, 1, 2, 5, 6, 7, 9, 1, 2], 1), vec![5]);
        assert_eq!(d.propose(&[5, 6, 5], 8), vec![6, 5]);
        // No match, too short, nothing wanted.
        assert!(d.propose(&[1, 2, 3], 8).is_empty());
        assert!(d.propose(&[1], 8).is_empty());
        assert!(d.propose(&[1, 1, 1], 0).is_empty());
        // lookup_min 2: a lone repeated token does not count.
        assert!(drafter(3, 2, 3).propose(&[4, 1, 5, 1], 8).is_empty());
    }

    /// The one-pass search proposes what the definition does (a scan per suffix length, the
    /// longest first, the latest start), on random sequences over small vocabularies (many
    /// matches, overlaps, runs) and every lookup range.
    #[test]
    fn one_pass_search_equals_a_scan_per_length() {
        fn by_definition(tokens: &[u32], k: usize, min: usize, max: usize) -> Vec<u32> {
            let len = tokens.len();
            for n in (min..=max.min(len.saturating_sub(1))).rev() {
                let suffix = &tokens[len - n..];
                if let Some(i) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
                    return tokens[i + n..(i + n + k).min(len)].to_vec();
                }
            }
            Vec::new()
        }
        let mut x = 7u32;
        let mut next = |m: u32| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % m
        };
        let mut proposed = 0;
        for case in 0..3000 {
            let (vocab, len) = (2 + next(5), 1 + next(40) as usize);
            let tokens: Vec<u32> = (0..len).map(|_| next(vocab)).collect();
            let (min, max) = (1 + case % 3, 1 + case % 3 + case / 3 % 4);
            let k = 1 + case % 5;
            let want = by_definition(&tokens, k, min, max);
            proposed += usize::from(!want.is_empty());
            assert_eq!(drafter(k, min, max).propose(&tokens, 8), want, "{tokens:?} k {k} lookup {min}..={max}");
        }
        assert!(proposed > 1000, "the cases exercise matches ({proposed})");
    }
}
