//! Mixture-of-experts routing (DeepSeek-V3 / GLM-4.5): the one definition the host and the
//! device kernel (`cuda/moe_route.cu`) share.
//!
//! For one token with router logits l and correction bias b:
//!   s = 1 / (1 + exp(-l))   (exp by [`exp_det`], so host and device get the same bits)
//!   v = s + b               steers the choice only
//!   groups: n_group equal runs of experts, each scored v_first + v_second of its two best;
//!           only the topk_group best groups stay (all of them when n_group <= topk_group)
//!   chosen: the top_k best v among the experts that stay, listed by ascending id
//!   weights: s of the chosen (divided by s_0 + s_1 + ... + 1e-20 when norm_topk_prob, summed
//!            in id order), times routed_scaling_factor
//! "Best" orders values as `f32::total_cmp`, largest first, then lower id. Every step is an
//! IEEE operation that the kernel performs identically, so the choice and the weights agree bit
//! for bit on the same logits.

use candle_core::{DType, Result, Tensor};

use crate::config::MoeConfig;
use crate::simd::exp_det;

/// The routing parameters of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteConfig {
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl From<&MoeConfig> for RouteConfig {
    fn from(c: &MoeConfig) -> Self {
        RouteConfig {
            top_k: c.top_k,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor as f32,
        }
    }
}

/// Which experts each token goes to, and with what weight, on the logits' device.
#[derive(Debug, Clone)]
pub struct Routing {
    /// `[T, top_k]` u32: token t's experts, ascending.
    pub experts: Tensor,
    /// `[T, top_k]` f32: the weight of each entry of `experts`.
    pub weights: Tensor,
}

impl Routing {
    pub fn num_tokens(&self) -> Result<usize> {
        self.experts.dim(0)
    }

    pub fn top_k(&self) -> Result<usize> {
        self.experts.dim(1)
    }

    /// The routing on the host: `(experts, weights)`, token t's at `t * top_k ..`.
    pub fn to_host(&self) -> Result<(Vec<u32>, Vec<f32>)> {
        Ok((self.experts.flatten_all()?.to_vec1()?, self.weights.flatten_all()?.to_vec1()?))
    }
}

/// Qwen's routing, on the host: p = softmax(logits) per row (`[T, E]` f32), the `top_k`
/// largest p (larger first, then lower id), weights p / (sum of the chosen p, added largest
/// first, as transformers adds its top-k values); returned by ascending expert id.
pub fn route_softmax(logits: &Tensor, top_k: usize) -> Result<Routing> {
    let (t, e) = logits.dims2()?;
    if top_k == 0 || top_k > e {
        candle_core::bail!("moe-route: top {top_k} of {e} experts");
    }
    let device = logits.device().clone();
    let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_device(&candle_core::Device::Cpu)?.to_vec2()?;
    let (mut experts, mut weights) = (Vec::with_capacity(t * top_k), Vec::with_capacity(t * top_k));
    for row in &rows {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|&l| (l - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let total: f32 = chosen.iter().map(|&i| exps[i] / sum).sum();
        let mut picked: Vec<(u32, f32)> = chosen.iter().map(|&i| (i as u32, exps[i] / sum / total)).collect();
        picked.sort_by_key(|&(i, _)| i);
        experts.extend(picked.iter().map(|p| p.0));
        weights.extend(picked.iter().map(|p| p.1));
    }
    Ok(Routing {
        experts: Tensor::from_vec(experts, (t, top_k), &device)?,
        weights: Tensor::from_vec(weights, (t, top_k), &device)?,
    })
}

pub fn sigmoid(l: f32) -> f32 {
    1.0 / (1.0 + exp_det(-l))
}

impl RouteConfig {
    /// What the kernel can take besides what `MoeConfig` validation already guarantees: at most
    /// 32 experts per token and 32 groups, groups of at least 2 when groups are chosen.
    pub(crate) fn check(&self, num_experts: usize) -> Result<()> {
        let (e, g) = (num_experts, self.n_group);
        if g == 0 || e % g != 0 || self.top_k == 0 || self.top_k > e || self.topk_group == 0 {
            candle_core::bail!("moe-route: {e} experts, {g} groups, top {} of {} groups", self.top_k, self.topk_group);
        }
        if g > self.topk_group && e / g < 2 {
            candle_core::bail!("moe-route: grouped routing needs at least 2 experts per group");
        }
        if self.top_k > 32 || g > 32 {
            candle_core::bail!("moe-route: at most 32 experts per token and 32 groups (got {} and {g})", self.top_k);
        }
        Ok(())
    }

    /// The reference: one token's experts (ascending) and weights from its router logits,
    /// appended to `experts` and `weights`.
    pub fn route_row(&self, logits: &[f32], bias: &[f32], experts: &mut Vec<u32>, weights: &mut Vec<f32>) {
        let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
        let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let chosen = self.choose(&biased);
        let mut sum = 1.0f32;
        if self.norm_topk_prob {
            sum = chosen[1..].iter().fold(scores[chosen[0]], |acc, &e| acc + scores[e]) + 1e-20;
        }
        for &e in &chosen {
            let w = if self.norm_topk_prob { scores[e] / sum } else { scores[e] };
            experts.push(e as u32);
            weights.push(w * self.routed_scaling_factor);
        }
    }

    /// The `top_k` experts (ascending) of one token from its biased scores.
    fn choose(&self, biased: &[f32]) -> Vec<usize> {
        let per_group = biased.len() / self.n_group;
        let mut allowed = vec![self.n_group <= self.topk_group; self.n_group];
        if !allowed[0] {
            let group_score = |g: usize| {
                let best = top_indices(&biased[g * per_group..(g + 1) * per_group], 2);
                biased[g * per_group + best[0]] + biased[g * per_group + best[1]]
            };
            let groups: Vec<f32> = (0..self.n_group).map(group_score).collect();
            for g in top_indices(&groups, self.topk_group) {
                allowed[g] = true;
            }
        }
        let masked: Vec<f32> = biased
            .iter()
            .enumerate()
            .map(|(e, &v)| if allowed[e / per_group] { v } else { f32::NEG_INFINITY })
            .collect();
        let mut chosen = top_indices(&masked, self.top_k);
        chosen.sort_unstable();
        chosen
    }

    /// Routes every row of `logits` (`[T, E]` f32) with correction bias `bias` (`[E]` f32, on
    /// the same device): on CUDA by the kernel, elsewhere by [`Self::route_row`].
    pub fn route(&self, logits: &Tensor, bias: &Tensor) -> Result<Routing> {
        let (t, e) = logits.dims2()?;
        if bias.dims() != [e] || logits.dtype() != DType::F32 || bias.dtype() != DType::F32 {
            candle_core::bail!(
                "moe-route: f32 logits [T, E] and bias [E], got {:?} and {:?}",
                logits.shape(),
                bias.shape()
            );
        }
        self.check(e)?;
        match logits.device() {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => self.route_cuda(&logits.contiguous()?, &bias.contiguous()?, t, e),
            device => {
                let (l, b) = (logits.flatten_all()?.to_vec1::<f32>()?, bias.to_vec1::<f32>()?);
                let (mut experts, mut weights) =
                    (Vec::with_capacity(t * self.top_k), Vec::with_capacity(t * self.top_k));
                for row in l.chunks_exact(e.max(1)) {
                    self.route_row(row, &b, &mut experts, &mut weights);
                }
                Ok(Routing {
                    experts: Tensor::from_vec(experts, (t, self.top_k), device)?,
                    weights: Tensor::from_vec(weights, (t, self.top_k), device)?,
                })
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn route_cuda(&self, logits: &Tensor, bias: &Tensor, t: usize, e: usize) -> Result<Routing> {
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaStorage, WrapErr};
        use candle_core::op::BackpropOp;
        use candle_core::Storage;

        /// Tokens per block (one warp each; `ROUTE_WARPS` in the kernel).
        const WARPS: usize = 4;
        let shared = WARPS * 2 * e * 4;
        if shared > 48 * 1024 {
            candle_core::bail!("moe-route: {e} experts is more than the kernel holds (1536)");
        }
        let dev = logits.device().as_cuda_device()?.clone();
        let k = self.top_k;
        // SAFETY: the kernel writes all t * k entries of both.
        let experts = unsafe { dev.alloc::<u32>(t * k)? };
        let weights = unsafe { dev.alloc::<f32>(t * k)? };
        if t > 0 {
            let (ls, ll) = logits.storage_and_layout();
            let (bs, bl) = bias.storage_and_layout();
            let (Storage::Cuda(ls), Storage::Cuda(bs)) = (&*ls, &*bs) else {
                candle_core::bail!("moe-route: logits and bias must be on the CUDA device")
            };
            let l = ls.as_cuda_slice::<f32>()?.slice(ll.start_offset()..ll.start_offset() + t * e);
            let b = bs.as_cuda_slice::<f32>()?.slice(bl.start_offset()..bl.start_offset() + e);
            let func = super::cuda::MOE_ROUTE.func(&dev, "moe_route")?;
            let cfg = LaunchConfig {
                grid_dim: (t.div_ceil(WARPS) as u32, 1, 1),
                block_dim: (32 * WARPS as u32, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            let ints = [t as i32, e as i32, self.n_group as i32, self.topk_group as i32, k as i32];
            let norm = self.norm_topk_prob as i32;
            let mut builder = func.builder();
            builder.arg(&l).arg(&b).arg(&experts).arg(&weights);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&norm).arg(&self.routed_scaling_factor);
            // SAFETY: argument types and counts match the kernel's signature; shapes were checked.
            unsafe { builder.launch(cfg) }.w()?;
        }
        let wrap = |s: CudaStorage| Tensor::from_storage(Storage::Cuda(s), (t, k), BackpropOp::none(), false);
        Ok(Routing {
            experts: wrap(CudaStorage::wrap_cuda_slice(experts, dev.clone())),
            weights: wrap(CudaStorage::wrap_cuda_slice(weights, dev)),
        })
    }
}

/// Indices of the `n` largest values, largest first (earlier index first among equals).
fn top_indices(values: &[f32], n: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(n);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(n_group: usize, topk_group: usize, top_k: usize) -> RouteConfig {
        RouteConfig { top_k, n_group, topk_group, norm_topk_prob: true, routed_scaling_factor: 1.0 }
    }

    /// Qwen's routing: the two largest softmax probabilities, renormalised to sum to 1, listed
    /// by ascending expert; a tie goes to the lower id.
    #[test]
    fn softmax_routing_takes_the_top_k_and_renormalises() {
        let logits = Tensor::new(&[[0.0f32, 2.0, -1.0, 1.0], [3.0, 0.5, 3.0, 0.0]], &candle_core::Device::Cpu).unwrap();
        let r = route_softmax(&logits, 2).unwrap();
        let (experts, weights) = r.to_host().unwrap();
        assert_eq!(experts, vec![1, 3, 0, 2]);
        let e = std::f32::consts::E;
        assert!((weights[0] - e / (e + 1.0)).abs() < 1e-6 && (weights[1] - 1.0 / (e + 1.0)).abs() < 1e-6);
        assert!((weights[2] - 0.5).abs() < 1e-6 && (weights[3] - 0.5).abs() < 1e-6);
        assert!(route_softmax(&logits, 5).is_err());
    }

    #[test]
    fn groups_restrict_the_choice_and_bias_only_steers_it() {
        // Groups of 2 score 0.95, 1.2, 1.4, 0: the best expert (0) sits in a weak group.
        let scores = [0.95, 0.0, 0.6, 0.6, 0.7, 0.7, 0.0, 0.0];
        assert_eq!(cfg(1, 1, 2).choose(&scores), vec![0, 4]);
        assert_eq!(cfg(4, 2, 2).choose(&scores), vec![4, 5]);
        assert_eq!(cfg(4, 3, 3).choose(&scores), vec![0, 4, 5]);
        // A bias that lifts expert 6 lifts its group too; the weight stays its raw score.
        let logits = [3.0, -9.0, 0.4, 0.4, 0.8, 0.8, -1.0, -9.0];
        let mut bias = vec![0.0; 8];
        bias[6] = 2.0;
        let (mut e, mut w) = (Vec::new(), Vec::new());
        RouteConfig { norm_topk_prob: false, routed_scaling_factor: 2.5, ..cfg(4, 1, 1) }
            .route_row(&logits, &bias, &mut e, &mut w);
        assert_eq!(e, vec![6]);
        assert_eq!(w, vec![sigmoid(-1.0) * 2.5]);
    }

    #[test]
    fn sigmoid_is_close_to_the_exact_one_over_the_whole_range() {
        for i in -2000..=2000 {
            let l = i as f32 * 0.05;
            let exact = 1.0 / (1.0 + (-(l as f64)).exp());
            let got = sigmoid(l) as f64;
            assert!((got - exact).abs() <= 1e-6 * exact + 1e-38, "sigmoid({l}) = {got}, exact {exact}");
        }
        assert_eq!((sigmoid(f32::INFINITY), sigmoid(f32::NEG_INFINITY)), (1.0, 0.0));
    }
}
