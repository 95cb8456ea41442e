//! The sampler's tests: filters against full sorts, seeded determinism, and the rejection
//! rules' output distributions (point-mass and sampled drafts).

use super::*;

fn params(temperature: f32) -> SamplingParams {
    SamplingParams { temperature, ..Default::default() }
}

/// Log-probabilities of a hand-made distribution, usable as logits.
fn logits_of(probs: &[f32]) -> Vec<f32> {
    probs.iter().map(|p| p.ln()).collect()
}

fn counts(logits: &[f32], p: &SamplingParams, draws: usize, seed: u64) -> Vec<usize> {
    let mut s = SequenceSampler::new(Some(seed));
    let mut c = vec![0; logits.len()];
    for _ in 0..draws {
        let mut row = logits.to_vec();
        c[s.sample(&mut row, p, &[], &[]).token as usize] += 1;
    }
    c
}

fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let e: Vec<f64> = logits.iter().map(|&l| (((l - m) / t) as f64).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut s = SequenceSampler::new(Some(0));
    let mut l = vec![0.1, 3.0, -2.0, 3.0, f32::NAN];
    assert_eq!(s.sample(&mut l, &params(0.0), &[], &[]).token, 1);
    let mut l = vec![f32::NEG_INFINITY, -5.0, -4.0];
    assert_eq!(s.sample(&mut l, &params(0.0), &[], &[]).token, 2);
}

#[test]
fn top_k_never_leaves_the_top_k() {
    let l = logits_of(&[0.4, 0.35, 0.25]);
    let p = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
    let c = counts(&l, &p, 1000, 1);
    assert_eq!(c[2], 0);
    assert!(c[0] > 300 && c[1] > 300, "{c:?}");
    // top_k larger than the vocabulary is clamped, not an error.
    let p = SamplingParams { temperature: 1.0, top_k: 10, ..Default::default() };
    assert!(counts(&l, &p, 1000, 1)[2] > 150);
}

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    let l = logits_of(&[0.05, 0.5, 0.15, 0.3]);
    // 0.5 + 0.3 = 0.8 >= 0.75: tokens 1 and 3 only.
    let p = SamplingParams { temperature: 1.0, top_p: 0.75, ..Default::default() };
    let c = counts(&l, &p, 2000, 2);
    assert_eq!((c[0], c[2]), (0, 0), "{c:?}");
    // Renormalised: 0.5/0.8 = 0.625.
    assert!((c[1] as f64 / 2000.0 - 0.625).abs() < 0.04, "{c:?}");
    // 0.85 needs the 0.15 token too, but never the 0.05 one.
    let p = SamplingParams { temperature: 1.0, top_p: 0.85, ..Default::default() };
    let c = counts(&l, &p, 2000, 3);
    assert_eq!(c[0], 0);
    assert!(c[2] > 100, "{c:?}");
    // Tiny top_p still keeps the single most likely token.
    let p = SamplingParams { temperature: 1.0, top_p: 1e-6, ..Default::default() };
    assert_eq!(counts(&l, &p, 200, 4)[1], 200);
}

#[test]
fn min_p_drops_tokens_below_the_scaled_threshold() {
    let l = logits_of(&[0.5, 0.3, 0.15, 0.05]);
    // Threshold 0.2 * 0.5 = 0.1: drops only the 0.05 token.
    let p = SamplingParams { temperature: 1.0, min_p: 0.2, ..Default::default() };
    let c = counts(&l, &p, 2000, 5);
    assert_eq!(c[3], 0);
    assert!(c[2] > 150, "{c:?}");
    // Threshold 0.5 * 0.5 = 0.25: keeps 0 and 1.
    let p = SamplingParams { temperature: 1.0, min_p: 0.5, ..Default::default() };
    let c = counts(&l, &p, 2000, 6);
    assert_eq!((c[2], c[3]), (0, 0), "{c:?}");
}

#[test]
fn temperature_sampling_matches_softmax() {
    let l = vec![1.0, 0.5, 0.0, -0.5, 2.0, -1.0];
    for (t, seed) in [(1.0, 7), (0.7, 8), (1.8, 9)] {
        let draws = 20_000;
        let c = counts(&l, &params(t), draws, seed);
        let expected = softmax(&l, t);
        let chi2: f64 = c
            .iter()
            .zip(&expected)
            .map(|(&o, &p)| {
                let e = p * draws as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum();
        // 5 degrees of freedom: P(chi2 > 20.5) = 0.001.
        assert!(chi2 < 20.5, "t={t} chi2={chi2} counts={c:?} expected={expected:?}");
    }
}

#[test]
fn seeds_are_reproducible_and_independent_of_the_batch() {
    let l: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
    let p = params(1.0);
    let run = |seed: u64| -> Vec<u32> {
        let mut s = SequenceSampler::new(Some(seed));
        (0..100).map(|_| s.sample(&mut l.clone(), &p, &[], &[]).token).collect()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));

    // Same seed inside a batch, next to another (unseeded) sequence.
    let mut a = SequenceSampler::new(Some(42));
    let mut b = SequenceSampler::new(None);
    let mut got = Vec::new();
    for _ in 0..100 {
        let (mut la, mut lb) = (l.clone(), l.clone());
        let out = sample_batch(vec![
            SampleRow { logits: &mut lb, sampler: &mut b, params: &p, prompt_tokens: &[], output_tokens: &[] },
            SampleRow { logits: &mut la, sampler: &mut a, params: &p, prompt_tokens: &[], output_tokens: &[] },
        ]);
        got.push(out[1].token);
    }
    assert_eq!(got, run(42));
}

#[test]
fn penalties_follow_the_formulas() {
    let mut l = vec![2.0, -1.0, 0.5, 3.0, 1.0];
    let p = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..Default::default()
    };
    // Prompt {0, 1}; output {1, 2, 2}; token 3 and 4 unseen.
    process_logits(&mut l, &p, &[], &[0, 1, 0], &[1, 2, 2]);
    let want = [
        2.0 / 2.0,         // positive: divided, once despite appearing twice
        -2.0 - 0.5 - 0.25, // negative: multiplied by 2; then 1 occurrence + presence
        0.5 / 2.0 - 2.0 * 0.5 - 0.25,
        3.0,
        1.0,
    ];
    for (got, want) in l.iter().zip(want) {
        assert!((got - want).abs() < 1e-6, "{l:?} vs {want:?}");
    }
}

#[test]
fn logit_bias_and_min_tokens() {
    let mut s = SequenceSampler::new(Some(0)).with_eos_token_ids(vec![0]);
    let p = SamplingParams { logit_bias: vec![(2, 10.0)], ..Default::default() };
    assert_eq!(s.sample(&mut [5.0, 1.0, 0.0], &p, &[], &[]).token, 2);

    let p = SamplingParams { min_tokens: 2, stop_token_ids: vec![1], ..Default::default() };
    assert_eq!(s.sample(&mut [5.0, 4.0, 0.0], &p, &[], &[7]).token, 2);
    assert_eq!(s.sample(&mut [5.0, 4.0, 0.0], &p, &[], &[7, 7]).token, 0);
    let p = SamplingParams { ignore_eos: true, ..p };
    assert_eq!(s.sample(&mut [5.0, 4.0, 0.0], &p, &[], &[7]).token, 0);
}

#[test]
fn logprobs_are_normalised_sorted_and_temperature_free() {
    let l = vec![0.3, 2.0, -1.0, 2.0, 0.0];
    let mut s = SequenceSampler::new(Some(3));
    let p = SamplingParams { temperature: 0.5, logprobs: Some(5), ..Default::default() };
    let out = s.sample(&mut l.clone(), &p, &[], &[]);
    let total: f32 = out.top_logprobs.iter().map(|t| t.1.exp()).sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    let ids: Vec<u32> = out.top_logprobs.iter().map(|t| t.0).collect();
    assert_eq!(ids, vec![1, 3, 0, 4, 2]);
    let own = out.top_logprobs.iter().find(|t| t.0 == out.token).map(|t| t.1);
    assert_eq!(own, Some(out.logprob));
    // Measured before temperature: equal to the T=1 log_softmax.
    let want = softmax(&l, 1.0);
    for &(id, lp) in &out.top_logprobs {
        assert!((lp as f64 - want[id as usize].ln()).abs() < 1e-5);
    }

    let p = SamplingParams { logprobs: Some(2), ..Default::default() };
    let out = s.sample(&mut l.clone(), &p, &[], &[]);
    assert_eq!(out.top_logprobs.len(), 2);
    let p = SamplingParams { logprobs: Some(0), ..Default::default() };
    let out = s.sample(&mut l.clone(), &p, &[], &[]);
    assert!(out.top_logprobs.is_empty());
    assert!((out.logprob as f64 - want[1].ln()).abs() < 1e-5);
    assert!(s.sample(&mut l.clone(), &params(0.0), &[], &[]).logprob.is_nan());
}

#[test]
fn large_vocab_filters_agree_with_a_full_sort() {
    let vocab = 200_000;
    // Deterministic pseudo-random logits with a few dominant tokens.
    let mut x = 0x9E3779B97F4A7C15u64;
    let l: Vec<f32> = (0..vocab)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let base = (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0;
            if i % 9973 == 0 {
                base + 9.0
            } else {
                base
            }
        })
        .collect();
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));

    let p = SamplingParams { temperature: 1.0, top_k: 50, ..Default::default() };
    let top50 = &order[..50];
    let mut s = SequenceSampler::new(Some(11));
    for _ in 0..200 {
        assert!(top50.contains(&s.sample(&mut l.clone(), &p, &[], &[]).token));
    }

    let top_p = 0.9;
    let probs = softmax(&l, 1.0);
    let mut cum = 0.0;
    let nucleus = order
        .iter()
        .take_while(|&&id| {
            let before = cum;
            cum += probs[id as usize];
            before < top_p
        })
        .count();
    let p = SamplingParams { temperature: 1.0, top_p: top_p as f32, ..Default::default() };
    let mut seen_outside_head = false;
    for _ in 0..200 {
        let t = s.sample(&mut l.clone(), &p, &[], &[]).token;
        let rank = order.iter().position(|&id| id == t).unwrap_or(usize::MAX);
        assert!(rank < nucleus, "rank {rank} outside nucleus of {nucleus}");
        seen_outside_head |= rank >= 21;
    }
    // The nucleus here is far larger than the 21 boosted tokens; make sure the
    // growing-prefix search actually reached into it.
    assert!(nucleus > 64 && seen_outside_head, "nucleus {nucleus}");
}
/// Chi-square of observed counts against probabilities (cells with p = 0 must be empty).
fn chi2(counts: &[usize], p: &[f32]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&o, &p)| {
            if p == 0.0 {
                assert_eq!(o, 0, "a token of probability 0 was drawn");
                return 0.0;
            }
            let e = p as f64 * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum()
}

/// Speculation with rejection sampling draws the first token from the target distribution
/// (with and without truncation), and the token after an accepted draft from the next row's.
/// Each case has 3 degrees of freedom: P(chi2 > 16.27) = 0.001. Returns the largest chi2.
fn speculative_chi2() -> f64 {
    let p0 = [0.1, 0.4, 0.3, 0.2];
    let p1 = [0.25, 0.35, 0.15, 0.25];
    let mut worst: f64 = 0.0;
    // (params, first draft, the first row's target distribution)
    let truncated = [0.0, 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9];
    let cases = [
        (SamplingParams { temperature: 1.0, ..Default::default() }, 2u32, p0),
        (SamplingParams { temperature: 1.0, ..Default::default() }, 1, p0),
        // The draft is outside top-k 3: always rejected, the residual is the whole target.
        (SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() }, 0, truncated),
        (SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() }, 3, truncated),
    ];
    for (params, draft, target) in cases {
        let (mut first, mut second) = (vec![0usize; 4], vec![0usize; 4]);
        for seed in 0..20_000u64 {
            let mut s = SequenceSampler::new(Some(seed));
            let mut rows = vec![logits_of(&p0), logits_of(&p1), logits_of(&p1)];
            let out = s.verify(&mut rows, &[draft, 1], &params, &[], &[]);
            assert!(!out.is_empty() && out.len() <= 3);
            first[out[0].token as usize] += 1;
            match out.get(1) {
                Some(t) => second[t.token as usize] += 1,
                // (A wrong residual may "reject" into the draft itself.)
                None => {
                    assert!(out[0].token != draft || WRONG_RESIDUAL.with(|w| w.get()), "an accepted draft is followed")
                }
            }
        }
        worst = worst.max(chi2(&first, &target));
        if second.iter().sum::<usize>() > 1000 {
            // Top-3 of p1 keeps ids 1, 0 and 3 (0.35, 0.25, 0.25).
            let p1t = if params.top_k == 3 { [0.25 / 0.85, 0.35 / 0.85, 0.0, 0.25 / 0.85] } else { p1 };
            worst = worst.max(chi2(&second, &p1t));
        }
    }
    worst
}

#[test]
fn rejection_sampling_keeps_the_target_distribution() {
    let worst = speculative_chi2();
    assert!(worst < 16.27, "chi2 {worst}");
}

#[test]
fn the_distribution_test_catches_a_wrong_residual() {
    WRONG_RESIDUAL.with(|w| w.set(true));
    let worst = speculative_chi2();
    WRONG_RESIDUAL.with(|w| w.set(false));
    assert!(worst > 1000.0, "a residual that keeps the draft went unnoticed: chi2 {worst}");
}

/// Probabilities as a dense row over `n` tokens (0 where q has none).
fn dense(q: &DraftDist, n: usize) -> Vec<f32> {
    (0..n as u32).map(|t| q.prob(t)).collect()
}

/// Speculation with drafts sampled from a q of their own (`draw_draft`, then Leviathan et
/// al.'s rule in `verify_masked`), at temperature 1 with and without top-k / top-p: the
/// first token follows the first row's target distribution and the token after an accepted
/// draft the next row's, whatever q is. Returns each case's largest chi2 (3 degrees of
/// freedom: P(chi2 > 16.27) = 0.001); it also checks that the drafts follow the q returned.
fn sampled_drafts_chi2() -> Vec<f64> {
    let p0 = [0.1, 0.4, 0.3, 0.2];
    let p1 = [0.25, 0.35, 0.15, 0.25];
    let t1 = SamplingParams { temperature: 1.0, ..Default::default() };
    let top_k = SamplingParams { top_k: 3, ..t1.clone() };
    let top_p = SamplingParams { top_p: 0.8, ..t1.clone() };
    // Top-3 and top-0.8 of p0 both keep ids 1, 2, 3; of p1, ids 1, 0, 3.
    let p0t = [0.0, 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9];
    let p1t = [0.25 / 0.85, 0.35 / 0.85, 0.0, 0.25 / 0.85];
    // (params, the rows' target distributions, the drafter's two heads)
    let cases = [
        // A skewed q, heavy where p is light.
        (t1.clone(), [p0, p1], [[0.05, 0.1, 0.6, 0.25], [0.6, 0.05, 0.05, 0.3]]),
        // q puts mass on token 0, which p has not (a -inf logit).
        (t1.clone(), [[0.0, 0.5, 0.3, 0.2], p1], [[0.4, 0.2, 0.2, 0.2], [0.1, 0.1, 0.7, 0.1]]),
        // Truncation cuts q as it cuts p: q keeps token 0 (none of p) and not token 2 (p's).
        (top_k, [p0, p1], [[0.5, 0.1, 0.05, 0.35], [0.1, 0.2, 0.6, 0.1]]),
        (top_p, [p0, p1], [[0.6, 0.05, 0.05, 0.3], [0.05, 0.1, 0.7, 0.15]]),
    ];
    let n = 20_000u64;
    let mut worst = Vec::new();
    for (params, [r0, r1], heads) in cases {
        let truncated = params.top_k > 0 || params.top_p < 1.0;
        let (want0, want1) = if truncated { (p0t, p1t) } else { (r0, r1) };
        let (mut first, mut second, mut drafted) = (vec![0usize; 4], vec![0usize; 4], vec![0usize; 4]);
        let mut q0 = DraftDist::point();
        for seed in 0..n {
            let mut s = SequenceSampler::new(Some(seed));
            let (d0, q) = s.draw_draft(&mut logits_of(&heads[0]), &params);
            let (d1, q1) = s.draw_draft(&mut logits_of(&heads[1]), &params);
            drafted[d0 as usize] += 1;
            q0 = q;
            let mut rows = vec![logits_of(&r0), logits_of(&r1), logits_of(&r1)];
            let qs = [q0.clone(), q1];
            let out = s.verify_masked(&mut rows, &[d0, d1], &qs, &params, &[], &[], None);
            first[out[0].token as usize] += 1;
            if let Some(t) = out.get(1) {
                second[t.token as usize] += 1;
            }
        }
        assert!(!q0.is_point());
        assert!(chi2(&drafted, &dense(&q0, 4)) < 16.27, "drafts {drafted:?} against q {q0:?}");
        let mut w = chi2(&first, &want0);
        if second.iter().sum::<usize>() > 1000 {
            w = w.max(chi2(&second, &want1));
        }
        worst.push(w);
    }
    worst
}

#[test]
fn sampled_drafts_keep_the_target_distribution() {
    let worst = sampled_drafts_chi2();
    eprintln!("chi2 by case: {worst:?}");
    assert!(worst.iter().all(|&w| w < 16.27), "chi2 {worst:?}");
}

#[test]
fn the_sampled_draft_test_catches_a_wrong_residual() {
    WRONG_RESIDUAL.with(|w| w.set(true));
    let worst = sampled_drafts_chi2();
    WRONG_RESIDUAL.with(|w| w.set(false));
    eprintln!("chi2 by case, wrong residual: {worst:?}");
    // Each case on its own, far past the 16.27 of P = 0.001.
    assert!(worst.iter().all(|&w| w > 200.0), "a residual that ignores q went unnoticed: chi2 {worst:?}");
}

/// A draft drawn from the target's own distribution (q == p) is always accepted, with and
/// without truncation: u q(d) < p(d) holds for every u < 1 despite q's f32 rounding.
#[test]
fn a_q_equal_to_p_accepts_always() {
    let mut g = StdRng::seed_from_u64(5);
    for seed in 0..3000u64 {
        let params = SamplingParams {
            temperature: [1.0, 0.7, 1.3][seed as usize % 3],
            top_k: [0, 5][seed as usize / 3 % 2],
            top_p: [1.0, 0.9][seed as usize / 6 % 2],
            ..Default::default()
        };
        let row: Vec<f32> = (0..64).map(|_| g.random_range(-3.0f32..3.0)).collect();
        let mut s = SequenceSampler::new(Some(seed));
        let (d, q) = s.draw_draft(&mut row.clone(), &params);
        let mut rows = vec![row.clone(), row];
        let out = s.verify_masked(&mut rows, &[d], &[q], &params, &[], &[], None);
        assert_eq!((out.len(), out[0].token), (2, d), "seed {seed}, {params:?}");
    }
}

/// Drafts come from a generator of their own: the target's numbers are those it takes
/// without drafts, and a seeded drafter repeats.
#[test]
fn drafts_leave_the_target_generator_alone() {
    let head = logits_of(&[0.3, 0.3, 0.2, 0.2]);
    let p = params(1.0);
    let (mut a, mut b) = (SequenceSampler::new(Some(9)), SequenceSampler::new(Some(9)));
    let drafts: Vec<u32> = (0..50).map(|_| a.draw_draft(&mut head.clone(), &p).0).collect();
    assert_eq!(a.rng.random::<u64>(), b.rng.random::<u64>());
    let mut c = SequenceSampler::new(Some(9));
    assert_eq!(drafts, (0..50).map(|_| c.draw_draft(&mut head.clone(), &p).0).collect::<Vec<_>>());
    assert!(drafts.iter().any(|&d| d != drafts[0]), "drafts are sampled");
    // Greedy: the argmax, a point mass.
    assert_eq!(a.draw_draft(&mut vec![0.0, 2.0, 1.0], &params(0.0)), (1, DraftDist::point()));
}

/// Verifying on a device (`verify_draws`, the rows drawn by the `Sample` op, then
/// `settle_verify`) gives `verify`'s tokens and leaves the generator where `verify` does,
/// for every count of accepted drafts, including rows with nothing finite.
#[test]
fn device_verification_matches_the_host() {
    use crate::ops::sample::{Sample, PARAMS_PER_ROW};
    use candle_core::{Device, Tensor};
    let vocab = 8;
    let mut outcomes = std::collections::BTreeSet::new();
    for seed in 0..400u64 {
        let params = SamplingParams {
            temperature: [0.0, 0.6, 1.0, 1.5][seed as usize % 4],
            top_k: [0, 3][seed as usize / 4 % 2],
            ..Default::default()
        };
        let mut g = StdRng::seed_from_u64(seed ^ 0xabc);
        let mut rows: Vec<Vec<f32>> =
            (0..4).map(|_| (0..vocab).map(|_| g.random_range(-1.5f32..1.5)).collect()).collect();
        if seed % 37 == 5 {
            rows[1] = vec![f32::NAN; vocab];
        }
        // Drafts mostly each row's likeliest token, so that every count gets accepted.
        let drafts: Vec<u32> = rows[..3]
            .iter()
            .map(|r| if g.random::<f32>() < 0.8 { argmax(r).unwrap_or(0) } else { g.random_range(0..vocab as u32) })
            .collect();
        let (mut host, mut dev) = (SequenceSampler::new(Some(seed)), SequenceSampler::new(Some(seed)));
        let want: Vec<u32> =
            host.verify(&mut rows.clone(), &drafts, &params, &[], &[]).iter().map(|t| t.token).collect();

        let draws = dev.verify_draws(&params, &drafts);
        let flat: Vec<f32> = rows.concat();
        let p: Vec<f32> = draws.iter().flat_map(|d| d.to_params()).collect();
        let ids: Vec<u32> = Sample::forward(
            &Tensor::from_vec(flat, (4, vocab), &Device::Cpu).unwrap(),
            &Tensor::from_vec(p, (4, PARAMS_PER_ROW), &Device::Cpu).unwrap(),
        )
        .unwrap()
        .to_vec1()
        .unwrap();
        let accepted = ids.iter().zip(&drafts).take_while(|(a, b)| a == b).count();
        dev.settle_verify(&params, drafts.len(), accepted);
        let got: Vec<u32> =
            ids[..accepted + 1].iter().map(|&t| if t == crate::ops::sample::NO_TOKEN { 0 } else { t }).collect();
        assert_eq!(got, want, "seed {seed}, {params:?}");
        assert_eq!(host.rng.random::<u64>(), dev.rng.random::<u64>(), "seed {seed}: the generators part");
        outcomes.insert(accepted);
    }
    assert_eq!(outcomes.into_iter().collect::<Vec<_>>(), [0, 1, 2, 3], "every count of accepted drafts");
}

#[test]
fn greedy_verification_accepts_the_argmax_chain() {
    let mut s = SequenceSampler::new(Some(0));
    let p = params(0.0);
    let row = |best: usize| -> Vec<f32> { (0..6).map(|i| if i == best { 2.0 } else { 0.0 }).collect() };
    // Rows' argmax: 3, 4, 1, 5. Drafts 3, 4, 2: two accepted, then the row's 1.
    let mut rows = vec![row(3), row(4), row(1), row(5)];
    let got: Vec<u32> = s.verify(&mut rows, &[3, 4, 2], &p, &[], &[]).iter().map(|t| t.token).collect();
    assert_eq!(got, vec![3, 4, 1]);
    // Every draft accepted: the last row gives one more.
    let mut rows = vec![row(3), row(4), row(1), row(5)];
    let got: Vec<u32> = s.verify(&mut rows, &[3, 4, 1], &p, &[], &[]).iter().map(|t| t.token).collect();
    assert_eq!(got, vec![3, 4, 1, 5]);
    // The first draft wrong: just the row's token.
    let mut rows = vec![row(3), row(4)];
    assert_eq!(s.verify(&mut rows, &[0], &p, &[], &[]).len(), 1);
}

#[test]
fn verification_sees_the_drafts_before_each_row() {
    // A presence penalty on the drafts before a row changes that row's choice, exactly as
    // if they had been output.
    let mut s = SequenceSampler::new(Some(0));
    let p = SamplingParams { presence_penalty: 1.5, logprobs: Some(1), ..Default::default() };
    let mut rows = vec![vec![0.0, 2.0, 1.0], vec![0.0, 2.0, 1.0]];
    let got = s.verify(&mut rows, &[1], &p, &[], &[]);
    assert_eq!(got.iter().map(|t| t.token).collect::<Vec<_>>(), vec![1, 2]);
    // The second token's logprob is that of a plain sample after [1].
    let plain = s.sample(&mut vec![0.0, 2.0, 1.0], &p, &[], &[1]);
    assert_eq!((got[1].token, got[1].logprob), (plain.token, plain.logprob));
}
