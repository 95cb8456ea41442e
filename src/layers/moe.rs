//! A mixture-of-experts MLP with DeepSeek-V3 / GLM-4.5 routing:
//!   s = sigmoid(x W_r^T)                        per token, one score per expert
//!   chosen = top_k(s + b) within the topk_group groups of best (top-2 sum of s + b)
//!   y = sum_{e in chosen} w_e MLP_e(x) + MLP_shared(x),   w = s_chosen (/ sum s_chosen) * scale
//! The correction bias b only steers the choice; the weights come from the raw scores.
//!
//! Tokens are grouped by expert: each chosen expert runs once over the rows sent to it (one
//! matmul per active expert), never a loop over tokens or over all experts.

use candle_core::{DType, Device, Result, Tensor};

use super::mlp::GatedMlp;
use crate::models::config::{Activation, MoeConfig};
use crate::weights::{Weights, WeightsError};

/// Which experts each token goes to, and with what weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// `[T * top_k]`: token t's experts at `t * top_k ..`, ascending.
    pub experts: Vec<u32>,
    /// The weight of each entry of `experts`.
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn num_tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }

    /// The chosen experts as a `[T, top_k]` u32 tensor.
    pub fn experts_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_slice(&self.experts, (self.num_tokens(), self.top_k), device)
    }
}

pub struct Moe {
    /// `[num_experts, hidden]`, f32: transformers routes in f32 whatever the model dtype.
    router: Tensor,
    correction_bias: Vec<f32>,
    experts: Vec<GatedMlp>,
    shared: Option<GatedMlp>,
    cfg: MoeConfig,
}

impl Moe {
    /// `prefix` is the layer's `mlp`: `{prefix}.gate.weight`, `{prefix}.gate.e_score_correction_bias`,
    /// `{prefix}.experts.{e}.{gate,up,down}_proj`, `{prefix}.shared_experts.*`.
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        cfg: &MoeConfig,
        act: Activation,
    ) -> std::result::Result<Self, WeightsError> {
        let e = cfg.num_experts;
        let router = w.dense_f32(&format!("{prefix}.gate.weight"), &[e, hidden])?;
        let bias_name = format!("{prefix}.gate.e_score_correction_bias");
        let correction_bias =
            if w.contains(&bias_name) { w.dense_f32(&bias_name, &[e])?.to_vec1::<f32>()? } else { vec![0.0; e] };
        let experts = (0..e)
            .map(|i| GatedMlp::load(w, &format!("{prefix}.experts.{i}"), hidden, cfg.intermediate_size, act))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let shared = (cfg.n_shared_experts > 0)
            .then(|| {
                let width = cfg.intermediate_size * cfg.n_shared_experts;
                GatedMlp::load(w, &format!("{prefix}.shared_experts"), hidden, width, act)
            })
            .transpose()?;
        Ok(Moe { router, correction_bias, experts, shared, cfg: cfg.clone() })
    }

    /// Chooses each row's experts (`x`: `[T, hidden]`).
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits: Vec<Vec<f32>> = x.to_dtype(DType::F32)?.matmul(&self.router.t()?)?.to_vec2()?;
        let k = self.cfg.top_k;
        let mut routing = Routing { top_k: k, experts: Vec::with_capacity(logits.len() * k), weights: Vec::new() };
        for row in &logits {
            let scores: Vec<f32> = row.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
            let chosen = self.choose(&scores);
            let mut w: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
            if self.cfg.norm_topk_prob {
                let sum = w.iter().sum::<f32>() + 1e-20;
                w.iter_mut().for_each(|v| *v /= sum);
            }
            let scale = self.cfg.routed_scaling_factor as f32;
            routing.experts.extend(chosen.iter().map(|&e| e as u32));
            routing.weights.extend(w.iter().map(|v| v * scale));
        }
        Ok(routing)
    }

    /// The `top_k` experts (ascending) of one token from its sigmoid scores.
    fn choose(&self, scores: &[f32]) -> Vec<usize> {
        let biased: Vec<f32> = scores.iter().zip(&self.correction_bias).map(|(s, b)| s + b).collect();
        let per_group = biased.len() / self.cfg.n_group;
        let mut allowed = vec![self.cfg.n_group <= self.cfg.topk_group; self.cfg.n_group];
        if !allowed[0] {
            // A group scores the sum of its two best experts.
            let group_score = |g: usize| {
                top_indices(&biased[g * per_group..(g + 1) * per_group], 2)
                    .iter()
                    .map(|&i| biased[g * per_group + i])
                    .sum::<f32>()
            };
            let groups: Vec<f32> = (0..self.cfg.n_group).map(group_score).collect();
            for g in top_indices(&groups, self.cfg.topk_group) {
                allowed[g] = true;
            }
        }
        let masked: Vec<f32> = biased
            .iter()
            .enumerate()
            .map(|(e, &v)| if allowed[e / per_group] { v } else { f32::NEG_INFINITY })
            .collect();
        let mut chosen = top_indices(&masked, self.cfg.top_k);
        chosen.sort_unstable();
        chosen
    }

    /// `sum_e w_e MLP_e(x) + shared(x)` for rows `x` (`[T, hidden]`) routed by `routing`.
    pub fn forward(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        let (t, k) = (x.dim(0)?, routing.top_k);
        if routing.num_tokens() != t {
            candle_core::bail!("a routing of {} tokens for {t} rows", routing.num_tokens());
        }
        // Each entry (token, j) goes to its expert's batch; batches run in expert order and
        // their outputs stack into one [T * k, hidden] table.
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
        for (entry, &e) in routing.experts.iter().enumerate() {
            by_expert
                .get_mut(e as usize)
                .ok_or_else(|| candle_core::Error::Msg(format!("expert {e} of {}", self.experts.len())))?
                .push(entry);
        }
        let device = x.device();
        let mut row_of_entry = vec![0u32; t * k];
        let mut outputs = Vec::new();
        let mut next_row = 0u32;
        for (e, entries) in by_expert.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
            let tokens: Vec<u32> = entries.iter().map(|&i| (i / k) as u32).collect();
            let weights: Vec<f32> = entries.iter().map(|&i| routing.weights[i]).collect();
            let xs = x.index_select(&Tensor::new(tokens.as_slice(), device)?, 0)?;
            let w = Tensor::from_vec(weights, (entries.len(), 1), device)?.to_dtype(x.dtype())?;
            outputs.push(self.experts[e].forward(&xs)?.broadcast_mul(&w)?);
            for &i in entries {
                row_of_entry[i] = next_row;
                next_row += 1;
            }
        }
        let table = Tensor::cat(&outputs, 0)?;
        // Token t's k outputs, in ascending expert order, summed in that order (as transformers
        // adds them expert by expert).
        let routed = table
            .index_select(&Tensor::new(row_of_entry.as_slice(), device)?, 0)?
            .reshape((t, k, x.dim(1)?))?
            .sum(1)?;
        match &self.shared {
            Some(s) => routed + s.forward(x)?,
            None => Ok(routed),
        }
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

    fn moe_with(cfg: MoeConfig, bias: Vec<f32>) -> Moe {
        Moe {
            router: Tensor::zeros((cfg.num_experts, 1), DType::F32, &Device::Cpu).unwrap(),
            correction_bias: bias,
            experts: Vec::new(),
            shared: None,
            cfg,
        }
    }

    fn cfg(n_group: usize, topk_group: usize, top_k: usize) -> MoeConfig {
        MoeConfig {
            num_experts: 8,
            top_k,
            n_group,
            topk_group,
            intermediate_size: 1,
            n_shared_experts: 0,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            first_k_dense_replace: 0,
        }
    }

    #[test]
    fn groups_restrict_the_choice_and_bias_only_steers_it() {
        // Groups of 2 score 0.95, 1.2, 1.4, 0: the best expert (0) sits in a weak group.
        let scores = [0.95, 0.0, 0.6, 0.6, 0.7, 0.7, 0.0, 0.0];
        assert_eq!(moe_with(cfg(1, 1, 2), vec![0.0; 8]).choose(&scores), vec![0, 4]);
        assert_eq!(moe_with(cfg(4, 2, 2), vec![0.0; 8]).choose(&scores), vec![4, 5]);
        assert_eq!(moe_with(cfg(4, 3, 3), vec![0.0; 8]).choose(&scores), vec![0, 4, 5]);
        // A bias that lifts expert 6 lifts its group too.
        let mut bias = vec![0.0; 8];
        bias[6] = 2.0;
        assert_eq!(moe_with(cfg(4, 1, 1), bias).choose(&scores), vec![6]);
    }
}
