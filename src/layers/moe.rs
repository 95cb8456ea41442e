//! A mixture-of-experts MLP with DeepSeek-V3 / GLM-4.5 routing:
//!   s = sigmoid(x W_r^T)                        per token, one score per expert
//!   chosen = top_k(s + b) within the topk_group groups of best (top-2 sum of s + b)
//!   y = sum_{e in chosen} w_e MLP_e(x) + MLP_shared(x),   w = s_chosen (/ sum s_chosen) * scale
//! The correction bias b only steers the choice; the weights come from the raw scores. The
//! routing itself is `ops::moe_route` (one definition for the host and the device kernel).
//! Or with Qwen's routing (`MoeScoring::Softmax`):
//!   p = softmax(x W_r^T);  chosen = top_k(p);  w = p_chosen / sum p_chosen
//!   y = sum_{e in chosen} w_e MLP_e(x) + sigmoid(x w_g) MLP_shared(x)
//!
//! On the CPU, tokens are grouped by expert: each chosen expert runs once over the rows sent to
//! it (one matmul per active expert), never a loop over tokens or over all experts. On CUDA the
//! experts are stacked per layer at load and steps of up to `DEVICE_ROWS` rows run
//! `ops::moe_experts` (grouping, projections and the weighted sum on the device, no host round
//! trip, so decode steps can be graph-captured); larger steps (prompts) group on the host as the
//! CPU does, with one matmul per active expert over slices of the stacked weights.
//!
//! Under tensor parallelism each rank holds an even share of the routed experts, whole
//! (`parallel::Shard::experts`), and its share of the shared expert's width; every rank routes
//! every row, runs its own experts over the rows sent to them, and one all-reduce adds the
//! ranks' partial sums (routed and shared together).

use candle_core::{DType, Result, Tensor};

use super::mlp::{gated, GatedMlp};
use super::norm::RmsNorm;
use crate::config::{Activation, MoeConfig, MoeScoring};
use crate::ops::gated_act::GatedAct;
use crate::ops::moe_route::RouteConfig;
pub use crate::ops::moe_route::Routing;
use crate::parallel::Collective;
use crate::weights::{Weights, WeightsError};

/// Most rows the device kernel takes in one step: the default largest decode-graph bucket.
/// Larger steps group their rows by expert on the host, where matmuls beat row-by-row dots.
pub const DEVICE_ROWS: usize = 256;

/// The routed experts' weights (this rank's, under tensor parallelism: `Moe::held`).
enum Experts {
    /// One MLP per expert (the CPU, where GGUF experts stay quantized).
    Separate(Vec<GatedMlp>),
    /// Stacked per layer (GPUs): gate/up `[E, 2I, H]` (gate rows first), down `[E, H, I]`.
    Stacked { gate_up: Tensor, down: Tensor },
}

pub struct Moe {
    /// `[num_experts, hidden]`, f32: transformers routes in f32 whatever the model dtype.
    router: Tensor,
    /// `[num_experts]` f32, on the model's device.
    correction_bias: Tensor,
    route: RouteConfig,
    scoring: MoeScoring,
    experts: Experts,
    num_experts: usize,
    /// The routed experts `experts` holds: all of them, or a tensor-parallel rank's share.
    held: std::ops::Range<usize>,
    /// What adds up the ranks' partial outputs (tensor parallelism), once for routed and
    /// shared experts together.
    reduce: Option<Collective>,
    shared: Option<GatedMlp>,
    /// `[1, hidden]`: the shared MLP's output is scaled by `sigmoid(x w^T)` (Qwen).
    shared_gate: Option<Tensor>,
    /// One routed expert's intermediate width.
    inter: usize,
    act: Activation,
    /// Gemma 4: the router reads `rms(x) * scale / sqrt(hidden)` (`[hidden]`, the model's
    /// dtype), and each chosen weight is multiplied by its expert's scale (`[num_experts]`, f32).
    gemma: Option<GemmaRouter>,
}

struct GemmaRouter {
    norm: RmsNorm,
    scale: Tensor,
    root: f64,
    per_expert_scale: Tensor,
}

impl Moe {
    /// `prefix` is the layer's `mlp`: `{prefix}.gate.weight`, `{prefix}.gate.e_score_correction_bias`,
    /// `{prefix}.experts.{e}.{gate,up,down}_proj`, `{prefix}.shared_experts.*` (Qwen:
    /// `{prefix}.shared_expert.*` and `{prefix}.shared_expert_gate.weight`).
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        cfg: &MoeConfig,
        act: Activation,
    ) -> std::result::Result<Self, WeightsError> {
        Self::load_parts(w, &format!("{prefix}.gate.weight"), prefix, hidden, cfg, act)
    }

    /// Gemma 4's block beside the dense MLP: `{layer}.router.{proj.weight, scale,
    /// per_expert_scale}` and `{layer}.experts.*` (`layer` is the decoder layer's prefix).
    pub fn load_gemma(
        w: &Weights,
        layer: &str,
        hidden: usize,
        eps: f64,
        cfg: &MoeConfig,
        act: Activation,
    ) -> std::result::Result<Self, WeightsError> {
        let mut moe = Self::load_parts(w, &format!("{layer}.router.proj.weight"), layer, hidden, cfg, act)?;
        moe.gemma = Some(GemmaRouter {
            norm: RmsNorm::unit(hidden, eps, w.dtype(), w.device())?,
            scale: w.dense(&format!("{layer}.router.scale"), &[hidden])?,
            root: (hidden as f64).powf(-0.5),
            per_expert_scale: w.dense_f32(&format!("{layer}.router.per_expert_scale"), &[cfg.num_experts])?,
        });
        Ok(moe)
    }

    /// The router `router` (`[experts, hidden]`) and `{prefix}.experts.*`, `{prefix}.shared_*`.
    fn load_parts(
        w: &Weights,
        router: &str,
        prefix: &str,
        hidden: usize,
        cfg: &MoeConfig,
        act: Activation,
    ) -> std::result::Result<Self, WeightsError> {
        let (e, inter) = (cfg.num_experts, cfg.intermediate_size);
        let router = w.dense_f32(router, &[e, hidden])?;
        let bias_name = format!("{prefix}.gate.e_score_correction_bias");
        let correction_bias = if w.contains(&bias_name) {
            w.dense_f32(&bias_name, &[e])?
        } else {
            Tensor::zeros(e, DType::F32, w.device())?
        };
        let held = w.shard().map_or(0..e, |s| s.experts(e));
        let experts = if w.device().is_cuda() {
            Self::load_stacked(w, prefix, hidden, held.clone(), inter)?
        } else {
            Experts::Separate(
                held.clone()
                    .map(|i| GatedMlp::load(w, &format!("{prefix}.experts.{i}"), hidden, inter, act))
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            )
        };
        let shared_name = if cfg.shared_expert_gate { "shared_expert" } else { "shared_experts" };
        let mut shared = (cfg.n_shared_experts > 0)
            .then(|| {
                let width = cfg.shared_intermediate_size;
                GatedMlp::load(w, &format!("{prefix}.{shared_name}"), hidden, width, act)
            })
            .transpose()?;
        // A rank's shared-expert output is partial too: one sum for both (the shared
        // expert's own, taken from its down projection, or a new one).
        let reduce = w
            .shard()
            .map(|s| shared.as_mut().and_then(GatedMlp::take_collective).unwrap_or(Collective::Sum(s.comm.clone())));
        let shared_gate = cfg
            .shared_expert_gate
            .then(|| w.dense(&format!("{prefix}.shared_expert_gate.weight"), &[1, hidden]))
            .transpose()?;
        let route: RouteConfig = cfg.into();
        // Routing settings the op cannot take fail the load, not the first request.
        route.check(e)?;
        Ok(Moe {
            router,
            correction_bias,
            route,
            scoring: cfg.scoring,
            experts,
            num_experts: e,
            held,
            reduce,
            shared,
            shared_gate,
            inter,
            act,
            gemma: None,
        })
    }

    /// The matrices of experts `held` stacked into one tensor each (expert `held.start` at
    /// index 0), written expert by expert into tensors made once (each expert's own copy is
    /// dropped once written, so a layer's experts are in memory once, plus one expert).
    fn load_stacked(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        held: std::ops::Range<usize>,
        inter: usize,
    ) -> std::result::Result<Experts, WeightsError> {
        let e = held.len();
        let gate_up = Tensor::zeros((e, 2 * inter, hidden), w.dtype(), w.device())?;
        let down = Tensor::zeros((e, hidden, inter), w.dtype(), w.device())?;
        for (i, expert) in held.enumerate() {
            let p = format!("{prefix}.experts.{expert}");
            let fused = format!("{p}.gate_up_proj.weight");
            let gu = if w.contains(&fused) {
                w.dense(&fused, &[2 * inter, hidden])?
            } else {
                let g = w.dense(&format!("{p}.gate_proj.weight"), &[inter, hidden])?;
                Tensor::cat(&[g, w.dense(&format!("{p}.up_proj.weight"), &[inter, hidden])?], 0)?
            };
            gate_up.slice_set(&gu.unsqueeze(0)?, 0, i)?;
            down.slice_set(&w.dense(&format!("{p}.down_proj.weight"), &[hidden, inter])?.unsqueeze(0)?, 0, i)?;
        }
        Ok(Experts::Stacked { gate_up, down })
    }

    /// Chooses each row's experts (`x`: `[T, hidden]`), on the rows' device.
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        let x = match &self.gemma {
            Some(g) => (g.norm.forward(x)?.broadcast_mul(&g.scale)? * g.root)?,
            None => x.clone(),
        };
        let logits = x.to_dtype(DType::F32)?.matmul(&self.router.t()?)?;
        match self.scoring {
            MoeScoring::SigmoidGrouped => self.route.route(&logits, &self.correction_bias),
            MoeScoring::Softmax => crate::ops::moe_route::route_softmax(&logits, self.route.top_k),
            MoeScoring::GemmaScaled => {
                let r = crate::ops::moe_route::route_softmax(&logits, self.route.top_k)?;
                let Some(g) = &self.gemma else { candle_core::bail!("moe: Gemma routing without its router scales") };
                let scale =
                    g.per_expert_scale.index_select(&r.experts.flatten_all()?, 0)?.reshape(r.weights.shape())?;
                Ok(Routing { weights: (r.weights * scale)?, experts: r.experts })
            }
        }
    }

    /// `sum_e w_e MLP_e(x) + shared(x)` for rows `x` (`[T, hidden]`) routed by `routing`.
    pub fn forward(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        let t = x.dim(0)?;
        if routing.num_tokens()? != t {
            candle_core::bail!("a routing of {} tokens for {t} rows", routing.num_tokens()?);
        }
        let routed = match self.on_device(x) {
            #[cfg(feature = "cuda")]
            Some((gate_up, down, gelu)) => crate::ops::moe_experts::MoeExperts { gelu }.forward(
                x,
                &routing.experts,
                &routing.weights,
                gate_up,
                down,
            )?,
            _ => self.grouped(x, routing)?,
        };
        let y = match (&self.shared, &self.shared_gate) {
            (Some(s), Some(g)) => {
                (routed + s.forward(x)?.broadcast_mul(&candle_nn::ops::sigmoid(&x.matmul(&g.t()?)?)?)?)?
            }
            (Some(s), None) => (routed + s.forward(x)?)?,
            (None, _) => routed,
        };
        match &self.reduce {
            Some(c) => c.apply(&y),
            None => Ok(y),
        }
    }

    /// The stacked weights and activation when the device kernel computes these rows (which
    /// takes every expert: not a tensor-parallel rank's share).
    fn on_device(&self, x: &Tensor) -> Option<(&Tensor, &Tensor, bool)> {
        if self.held.len() != self.num_experts {
            return None;
        }
        let gelu = GatedAct::for_activation(self.act)?.gelu;
        match &self.experts {
            Experts::Stacked { gate_up, down } if x.device().is_cuda() && x.dim(0).is_ok_and(|t| t <= DEVICE_ROWS) => {
                Some((gate_up, down, gelu))
            }
            _ => None,
        }
    }

    /// The routed experts with rows grouped by expert on the host (one matmul per active
    /// expert); a choice of an expert another rank holds adds zeros here.
    fn grouped(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        let (t, k) = (x.dim(0)?, routing.top_k()?);
        let (experts, weights) = routing.to_host()?;
        // Each entry (token, j) goes to its expert's batch; batches run in expert order and
        // their outputs stack into one [T * k, hidden] table.
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); self.num_experts];
        for (entry, &e) in experts.iter().enumerate() {
            by_expert
                .get_mut(e as usize)
                .ok_or_else(|| candle_core::Error::Msg(format!("expert {e} of {}", self.num_experts)))?
                .push(entry);
        }
        let device = x.device();
        let mut outputs = Vec::new();
        // Entries for experts held elsewhere read a row of zeros after the table's others.
        let elsewhere = self.held.len() != self.num_experts;
        let zero_row = elsewhere.then(|| by_expert[self.held.clone()].iter().map(Vec::len).sum::<usize>() as u32);
        let mut row_of_entry = vec![zero_row.unwrap_or(0); t * k];
        let mut next_row = 0u32;
        let held = by_expert.iter().enumerate().filter(|(e, v)| self.held.contains(e) && !v.is_empty());
        for (e, entries) in held {
            let tokens: Vec<u32> = entries.iter().map(|&i| (i / k) as u32).collect();
            let w: Vec<f32> = entries.iter().map(|&i| weights[i]).collect();
            let xs = x.index_select(&Tensor::new(tokens.as_slice(), device)?, 0)?;
            let w = Tensor::from_vec(w, (entries.len(), 1), device)?.to_dtype(x.dtype())?;
            outputs.push(self.expert(e, &xs)?.broadcast_mul(&w)?);
            for &i in entries {
                row_of_entry[i] = next_row;
                next_row += 1;
            }
        }
        if zero_row.is_some() {
            outputs.push(Tensor::zeros((1, x.dim(1)?), x.dtype(), device)?);
        }
        let table = Tensor::cat(&outputs, 0)?;
        // Token t's k outputs, in ascending expert order, summed in that order (as transformers
        // adds them expert by expert).
        table.index_select(&Tensor::new(row_of_entry.as_slice(), device)?, 0)?.reshape((t, k, x.dim(1)?))?.sum(1)
    }

    /// Expert `e`'s MLP over rows `xs` (`e` among those held).
    fn expert(&self, e: usize, xs: &Tensor) -> Result<Tensor> {
        let e = e - self.held.start;
        match &self.experts {
            Experts::Separate(mlps) => mlps[e].forward(xs),
            Experts::Stacked { gate_up, down } => {
                gated(self.act, &xs.matmul(&gate_up.get(e)?.t()?)?, self.inter)?.matmul(&down.get(e)?.t()?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::weights::SafetensorsDir;

    /// Expert i's gate and up rows and its down matrix sit at index i of the stacks.
    #[test]
    fn stacked_experts_hold_each_expert_at_its_index() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-glm4v-moe");
        let w = Weights::from_safetensors(SafetensorsDir::open(&dir).unwrap(), Device::Cpu, DType::F32);
        let (hidden, e, inter, p) = (64, 8, 32, "model.layers.1.mlp");
        let Experts::Stacked { gate_up, down } = Moe::load_stacked(&w, p, hidden, 0..e, inter).unwrap() else {
            panic!("load_stacked gives stacks")
        };
        for i in 0..e {
            let x = |name: &str, shape: &[usize]| w.dense(&format!("{p}.experts.{i}.{name}.weight"), shape).unwrap();
            let want_gu = Tensor::cat(&[x("gate_proj", &[inter, hidden]), x("up_proj", &[inter, hidden])], 0).unwrap();
            let same = |a: &Tensor, b: &Tensor| {
                let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(d, 0.0, "expert {i}");
            };
            same(&gate_up.get(i).unwrap(), &want_gu);
            same(&down.get(i).unwrap(), &x("down_proj", &[hidden, inter]));
        }
    }
}
