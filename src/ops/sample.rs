//! Drawing a token from a row of logits with temperature, top-k, top-p and min-p: the one
//! definition the host sampler and the device kernel (`cuda/sampling.cu`) share.
//!
//! Order the finite logits by value, largest first, ties by lower id. Then
//! - top-k keeps the first k in that order;
//! - top-p keeps the shortest prefix (of what top-k kept) whose mass reaches top_p of its total;
//! - min-p keeps weights >= min_p (the largest weighs 1);
//! - the draw takes x = floor(u M) of the kept total mass M and returns the first id, in id
//!   order, whose running mass exceeds x.
//!
//! A weight is w = exp(l / T - max / T) by [`exp_det`], and a mass is w 2^40 rounded to an
//! integer. Every step is an IEEE operation that the kernel performs identically (explicit
//! fused multiply-adds, no contraction) and masses add up as integers, so host and device pick
//! the same token for the same u: a seeded request gives the same text on either. Weights below
//! 2^-41 of the largest have no mass and are never drawn.

use std::cmp::Ordering;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::kv_elem::f32_slice;
use crate::simd::exp_det;

/// How one row picks its token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// 1 / temperature; 0 picks the largest logit (lowest id on ties).
    pub inv_temperature: f32,
    /// 0: no top-k.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// Uniform in [0, 1), from the sequence's own generator.
    pub u: f32,
    /// Speculative verification: the drafted token this row judges instead of drawing.
    pub draft: Option<DraftCheck>,
}

/// A drafted token judged by a sampled row (rejection sampling): accepted when `u` falls in
/// its mass (probability p(draft)); else the row draws with `u_residual` from what it keeps
/// less the draft, renormalised. The row's token is the draft exactly when it was accepted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftCheck {
    pub token: u32,
    pub u_residual: f32,
}

/// Floats per row in the parameter tensor of [`Sample`].
pub const PARAMS_PER_ROW: usize = 7;

/// What a row that judges a draft gives when none of its logits is finite (a plain row gives
/// 0): never equal to the draft, so the draft counts as rejected.
pub const NO_TOKEN: u32 = u32::MAX;

impl Draw {
    pub fn greedy() -> Self {
        Draw { inv_temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.0, draft: None }
    }

    /// The row's parameters as the kernel reads them (top_k and token ids are exact in f32
    /// below 2^24; a draft of -1 is none).
    pub fn to_params(&self) -> [f32; PARAMS_PER_ROW] {
        let (draft, u_residual) = self.draft.map_or((-1.0, 0.0), |c| (c.token as f32, c.u_residual));
        [self.inv_temperature, self.top_k.min(1 << 24) as f32, self.top_p, self.min_p, self.u, draft, u_residual]
    }

    fn from_params(p: &[f32]) -> Self {
        let draft = (p[5] >= 0.0).then(|| DraftCheck { token: p[5] as u32, u_residual: p[6] });
        Draw { inv_temperature: p[0], top_k: p[1] as u32, top_p: p[2], min_p: p[3], u: p[4], draft }
    }
}

/// Orders floats as integers: a > b <=> key(a) > key(b), for finite a and b.
fn order_key(x: f32) -> u32 {
    let u = x.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

fn from_key(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 { k & 0x7fff_ffff } else { !k })
}

/// (key, id): larger logit first, then lower id.
fn in_order(a: &(u32, u32), b: &(u32, u32)) -> Ordering {
    b.0.cmp(&a.0).then(a.1.cmp(&b.1))
}

const MASS_SCALE: f32 = (1u64 << 40) as f32;

/// The host reference: the token `d` draws from `logits`, None when no logit is finite.
/// With a draft to judge (not greedy: a greedy row's argmax is compared by the caller), the
/// draft when accepted, else the residual draw. `cand` is scratch space (kept between calls to
/// avoid a vocabulary-sized allocation).
pub fn draw_row(logits: &[f32], d: &Draw, cand: &mut Vec<(u32, u32)>) -> Option<u32> {
    let kept = kept(logits, d, cand)?;
    match d.draft {
        Some(c) if !kept.greedy => {
            // Nothing is left less the draft only when the draft holds all the mass, and then
            // it is always accepted.
            if kept.accepts(c.token, d.u) {
                Some(c.token)
            } else {
                kept.pick(c.u_residual, Some(c.token))
            }
        }
        _ => kept.pick(d.u, None),
    }
}

/// [`draw_row`] as the op and the kernel give it: 0 (a draft row: [`NO_TOKEN`]) when nothing is finite.
fn row_token(logits: &[f32], d: &Draw, cand: &mut Vec<(u32, u32)>) -> u32 {
    draw_row(logits, d, cand).unwrap_or(if d.draft.is_some() { NO_TOKEN } else { 0 })
}

/// The tokens a draw keeps, with their masses: the distribution [`draw_row`] samples from.
/// Speculative decoding reads it to accept a drafted token with its probability, and to draw
/// from what is left when it is rejected.
pub struct Kept<'a> {
    /// (order key, id) of the kept tokens, by id.
    cand: &'a [(u32, u32)],
    /// Greedy: the one kept token weighs 1 whatever its logit.
    greedy: bool,
    inv_temperature: f32,
    /// The largest logit times `inv_temperature`.
    m: f32,
    total: u64,
}

impl Kept<'_> {
    fn mass(&self, key: u32) -> u64 {
        if self.greedy {
            return 1;
        }
        (exp_det(from_key(key) * self.inv_temperature - self.m) * MASS_SCALE).round_ties_even() as u64
    }

    /// All kept mass (the denominator of every probability).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The mass of `token`, 0 when it is not kept.
    pub fn mass_of(&self, token: u32) -> u64 {
        match self.cand.binary_search_by_key(&token, |&(_, id)| id) {
            Ok(i) => self.mass(self.cand[i].0),
            Err(_) => 0,
        }
    }

    /// The probability of `token`: its mass over the kept mass (0 when it is not kept).
    pub fn prob_of(&self, token: u32) -> f64 {
        self.mass_of(token) as f64 / self.total as f64
    }

    /// The kept tokens of nonzero mass, by id, with their probabilities: a drafter hands this
    /// over as the distribution its draft came from, and verification walks it for the
    /// residual of a draft drawn from such a distribution.
    pub fn probs(&self) -> impl Iterator<Item = (u32, f64)> + '_ {
        let total = self.total as f64;
        self.cand.iter().map(move |&(key, id)| (id, self.mass(key) as f64 / total)).filter(|&(_, p)| p > 0.0)
    }

    /// Whether a uniform `u` in [0, 1) accepts `token`: with probability mass(token) / total,
    /// decided on the integer masses as a draw is.
    pub fn accepts(&self, token: u32, u: f32) -> bool {
        let x = ((u as f64 * self.total as f64).floor() as u64).min(self.total.saturating_sub(1));
        x < self.mass_of(token)
    }

    /// The token `u` draws: the first id, in id order, whose running mass exceeds floor(u M) of
    /// the kept mass M; with `exclude`, from the kept tokens less that one, renormalised (None
    /// when nothing is left).
    pub fn pick(&self, u: f32, exclude: Option<u32>) -> Option<u32> {
        let total = self.total - exclude.map_or(0, |t| self.mass_of(t));
        if total == 0 {
            return None;
        }
        let x = ((u as f64 * total as f64).floor() as u64).min(total - 1);
        let mut acc = 0u64;
        self.cand
            .iter()
            .filter(|&&(_, id)| Some(id) != exclude)
            .find(|&&(key, _)| {
                acc += self.mass(key);
                x < acc
            })
            .map(|&(_, id)| id)
    }
}

/// The distribution `d` draws from over `logits`; None when no logit is finite.
pub fn kept<'a>(logits: &[f32], d: &Draw, cand: &'a mut Vec<(u32, u32)>) -> Option<Kept<'a>> {
    cand.clear();
    cand.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (order_key(l), i as u32)));
    let &(kmax, first) = cand.iter().min_by(|a, b| in_order(a, b))?;
    if d.inv_temperature == 0.0 {
        cand.clear();
        cand.push((kmax, first));
        return Some(Kept { cand, greedy: true, inv_temperature: 0.0, m: 0.0, total: 1 });
    }
    let m = from_key(kmax) * d.inv_temperature;
    let weight = |key: u32| exp_det(from_key(key) * d.inv_temperature - m);
    let mass = |key: u32| (weight(key) * MASS_SCALE).round_ties_even() as u64;
    let sum = |c: &[(u32, u32)]| c.iter().map(|&(k, _)| mass(k)).sum::<u64>();

    let k = d.top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, in_order);
        cand.truncate(k);
    }
    if d.top_p < 1.0 {
        let target = (d.top_p as f64 * sum(cand) as f64).ceil() as u64;
        // Quickselect on mass: cand[..lo] come first in order, with mass `before` < target,
        // and the cut-off lies in cand[lo..hi].
        let (mut lo, mut hi, mut before) = (0, cand.len(), 0u64);
        while hi - lo > 64 {
            let split = (hi - lo) / 2;
            cand[lo..hi].select_nth_unstable_by(split - 1, in_order);
            let upper = sum(&cand[lo..lo + split]);
            if before + upper >= target {
                hi = lo + split;
            } else {
                before += upper;
                lo += split;
            }
        }
        cand[lo..hi].sort_unstable_by(in_order);
        let mut end = hi;
        for i in lo..hi {
            before += mass(cand[i].0);
            if before >= target {
                end = i + 1;
                break;
            }
        }
        cand.truncate(end);
    }
    if d.min_p > 0.0 {
        cand.retain(|&(key, _)| weight(key) >= d.min_p);
    }
    cand.sort_unstable_by_key(|&(_, id)| id);
    let total = sum(cand);
    Some(Kept { cand, greedy: false, inv_temperature: d.inv_temperature, m, total })
}

/// `[rows, vocab]` f32 logits and `[rows, PARAMS_PER_ROW]` f32 parameters (`Draw::to_params`)
/// -> `[rows]` u32 token ids (each [`row_token`]).
pub struct Sample;

impl Sample {
    pub fn forward(logits: &Tensor, params: &Tensor) -> Result<Tensor> {
        logits.apply_op2_no_bwd(params, &Sample)
    }
}

impl CustomOp2 for Sample {
    fn name(&self) -> &'static str {
        "sample"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, ps: &CpuStorage, pl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        if pl.shape().dims2()? != (rows, PARAMS_PER_ROW) {
            candle_core::bail!("sample: parameters {:?} for {rows} rows", pl.shape());
        }
        let x = f32_slice(s, l, "sample logits")?;
        let p = f32_slice(ps, pl, "sample parameters")?;
        let mut cand = Vec::new();
        let out = (0..rows)
            .map(|r| {
                let d = Draw::from_params(&p[r * PARAMS_PER_ROW..(r + 1) * PARAMS_PER_ROW]);
                row_token(&x[r * vocab..(r + 1) * vocab], &d, &mut cand)
            })
            .collect();
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        ps: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};

        let (rows, vocab) = l.shape().dims2()?;
        if pl.shape().dims2()? != (rows, PARAMS_PER_ROW) {
            candle_core::bail!("sample: parameters {:?} for {rows} rows", pl.shape());
        }
        let (S::F32(x), Some((a, b)), S::F32(p), Some((pa, pb))) =
            (&s.slice, l.contiguous_offsets(), &ps.slice, pl.contiguous_offsets())
        else {
            candle_core::bail!("sample: expected contiguous f32 logits and parameters")
        };
        let dev = s.device().clone();
        // SAFETY: the kernel writes one id per row.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        if rows > 0 {
            let func = super::cuda::SAMPLING.func(&dev, "sample_f32")?;
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            let (x, p) = (x.slice(a..b), p.slice(pa..pb));
            let vocab = vocab as i32;
            let mut builder = func.builder();
            builder.arg(&x).arg(&p).arg(&out).arg(&vocab);
            // SAFETY: argument types and counts match the kernel's signature.
            unsafe { builder.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32) / (1u64 << 24) as f32
    }

    fn logits(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n).map(|_| (lcg(seed) - 0.5) * 12.0).collect()
    }

    #[test]
    fn greedy_and_top_k_1_pick_the_largest_lowest_id() {
        let l = [0.5, 3.0, -1.0, 3.0, f32::NAN, f32::NEG_INFINITY];
        let mut c = Vec::new();
        assert_eq!(draw_row(&l, &Draw::greedy(), &mut c), Some(1));
        for u in [0.0, 0.3, 0.999] {
            let d = Draw { inv_temperature: 1.0, top_k: 1, u, ..Draw::greedy() };
            assert_eq!(draw_row(&l, &d, &mut c), Some(1));
        }
        assert_eq!(draw_row(&[f32::NAN, f32::INFINITY], &Draw::greedy(), &mut c), None);
    }

    /// The set of tokens drawn over a sweep of u equals the set the definitions keep, computed
    /// by a plain sort in f64; and each token's share of the sweep is its probability.
    #[test]
    fn draws_follow_the_filtered_distribution() {
        let mut seed = 7;
        let mut c = Vec::new();
        for (t, k, p, mp) in
            [(1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 50, 0.6, 0.05), (2.0, 0, 1.0, 0.1)]
        {
            let l = logits(300, &mut seed);
            let mut order: Vec<usize> = (0..l.len()).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
            if k > 0 {
                order.truncate(k);
            }
            let w: Vec<f64> = order.iter().map(|&i| ((l[i] as f64 - l[order[0]] as f64) / t).exp()).collect();
            let total: f64 = w.iter().sum();
            let mut keep = order.len();
            let mut cum = 0.0;
            for (j, wj) in w.iter().enumerate() {
                cum += wj;
                if cum >= p * total {
                    keep = j + 1;
                    break;
                }
            }
            let kept: Vec<(usize, f64)> =
                order.iter().zip(&w).take(keep).filter(|(_, &wj)| wj >= mp as f64).map(|(&i, &wj)| (i, wj)).collect();
            let kept_total: f64 = kept.iter().map(|k| k.1).sum();
            let n = 100_000;
            let mut counts = vec![0usize; l.len()];
            for s in 0..n {
                let d = Draw {
                    inv_temperature: 1.0 / t as f32,
                    top_k: k as u32,
                    top_p: p as f32,
                    min_p: mp,
                    u: (s as f32 + 0.5) / n as f32,
                    draft: None,
                };
                counts[draw_row(&l, &d, &mut c).unwrap() as usize] += 1;
            }
            for (i, &cnt) in counts.iter().enumerate() {
                let want = kept.iter().find(|k| k.0 == i).map_or(0.0, |k| k.1 / kept_total);
                assert!((cnt as f64 / n as f64 - want).abs() < 2e-4, "t={t} k={k} p={p} token {i}: {cnt} vs {want}");
            }
        }
    }

    #[test]
    fn ties_at_the_cut_off_go_by_id() {
        // Five equal logits: top-k 3 keeps the three lowest ids; top-p 0.5 of five equal
        // weights needs three of them (ceil(2.5)).
        let l = [1.0f32; 5];
        let mut c = Vec::new();
        let drawn = |d: Draw, c: &mut Vec<(u32, u32)>| {
            let mut s: Vec<u32> =
                (0..100).map(|i| draw_row(&l, &Draw { u: i as f32 / 100.0, ..d }, c).unwrap()).collect();
            s.dedup();
            s
        };
        let base = Draw { inv_temperature: 1.0, ..Draw::greedy() };
        assert_eq!(drawn(Draw { top_k: 3, ..base }, &mut c), vec![0, 1, 2]);
        assert_eq!(drawn(Draw { top_p: 0.5, ..base }, &mut c), vec![0, 1, 2]);
    }

    #[test]
    fn op_runs_each_row_with_its_parameters() {
        let mut seed = 3;
        let (rows, vocab) = (6, 97);
        let l: Vec<f32> = logits(rows * vocab, &mut seed);
        let draws: Vec<Draw> = (0..rows)
            .map(|r| Draw {
                inv_temperature: if r == 0 { 0.0 } else { 1.0 / r as f32 },
                top_k: r as u32 * 7,
                top_p: 0.9,
                min_p: 0.0,
                u: lcg(&mut seed),
                // Odd rows judge a draft: a likely token, then any.
                draft: (r % 2 == 1).then(|| DraftCheck { token: (r * 13 % vocab) as u32, u_residual: lcg(&mut seed) }),
            })
            .collect();
        let params: Vec<f32> = draws.iter().flat_map(|d| d.to_params()).collect();
        let dev = candle_core::Device::Cpu;
        let ids: Vec<u32> = Sample::forward(
            &Tensor::from_vec(l.clone(), (rows, vocab), &dev).unwrap(),
            &Tensor::from_vec(params, (rows, PARAMS_PER_ROW), &dev).unwrap(),
        )
        .unwrap()
        .to_vec1()
        .unwrap();
        let mut c = Vec::new();
        for (r, d) in draws.iter().enumerate() {
            assert_eq!(ids[r], draw_row(&l[r * vocab..(r + 1) * vocab], d, &mut c).unwrap());
        }
        let nan = Tensor::from_vec(vec![f32::NAN; 2 * vocab], (2, vocab), &dev).unwrap();
        let judged = Draw { draft: Some(DraftCheck { token: 0, u_residual: 0.5 }), ..draws[1] };
        let p: Vec<f32> = [Draw { draft: None, ..draws[1] }, judged].iter().flat_map(|d| d.to_params()).collect();
        let ids: Vec<u32> =
            Sample::forward(&nan, &Tensor::from_vec(p, (2, PARAMS_PER_ROW), &dev).unwrap()).unwrap().to_vec1().unwrap();
        assert_eq!(ids, [0, NO_TOKEN], "nothing finite: 0, and a draft row never gives its draft");
    }

    /// Over a grid of (u, u_residual), a row judging a draft gives the draft with its
    /// probability, and every token with its probability in all: rejection sampling keeps the
    /// row's distribution.
    #[test]
    fn judging_a_draft_keeps_the_distribution() {
        let mut seed = 11;
        let mut c = Vec::new();
        let l = logits(40, &mut seed);
        let base = Draw { inv_temperature: 1.0 / 0.8, top_k: 0, top_p: 0.9, min_p: 0.0, u: 0.0, draft: None };
        let n = 400;
        let grid = |d: Draw, c: &mut Vec<(u32, u32)>| {
            let mut counts = vec![0usize; l.len()];
            for i in 0..n {
                for j in 0..n {
                    let u = (i as f32 + 0.5) / n as f32;
                    let draft = d.draft.map(|dc| DraftCheck { u_residual: (j as f32 + 0.5) / n as f32, ..dc });
                    counts[draw_row(&l, &Draw { u, draft, ..d }, c).unwrap() as usize] += 1;
                }
            }
            counts
        };
        let plain = grid(base, &mut c);
        let order = {
            let mut o: Vec<usize> = (0..l.len()).collect();
            o.sort_by_key(|&i| std::cmp::Reverse(plain[i]));
            o
        };
        // The most likely token, one in the middle of the nucleus, and one outside it.
        for draft in [order[0], order[3], order[l.len() - 1]] {
            let judged =
                grid(Draw { draft: Some(DraftCheck { token: draft as u32, u_residual: 0.0 }), ..base }, &mut c);
            for t in 0..l.len() {
                let (a, b) = (judged[t] as f64 / (n * n) as f64, plain[t] as f64 / (n * n) as f64);
                assert!((a - b).abs() < 5e-3, "draft {draft}, token {t}: {a} vs {b}");
            }
        }
    }
}
