//! The text model's hyper-parameters, as the model code reads them, and what they imply
//! (attention scale, rotary settings and window per layer, parameter counts).

/// Model families iris implements. Names follow HF's `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen2-VL's language model: Qwen2 with multimodal rotary embeddings (M-RoPE).
    Qwen2Vl,
    /// Qwen2.5-VL: the same language model; the vision tower differs.
    Qwen25Vl,
    /// GLM-4.1V: dense layers with four norms each, interleaved partial M-RoPE.
    Glm4v,
    /// GLM-4.5V / GLM-4.6V: dense then mixture-of-experts layers, rotate-half partial M-RoPE.
    Glm4vMoe,
    /// Qwen3.5: Gated DeltaNet layers (a recurrent state per sequence) with every
    /// `full_attention_interval`-th layer gated full attention; (1+w) RMSNorms.
    Qwen35,
    /// Qwen3.5-MoE: the same layers with a mixture of experts (softmax router, shared expert) in
    /// every layer.
    Qwen35Moe,
    /// Gemma 4 (text, or the language model of the VLM): plain-w norms, q/k/v norms with
    /// attention scale 1, wider heads on the full layers, per-layer embeddings, KV sharing,
    /// an optional mixture of experts beside the dense MLP.
    Gemma4,
}

impl Arch {
    pub fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "llama" | "smollm" | "mistral" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3_text" | "gemma3" => Some(Arch::Gemma3),
            "qwen2_vl" | "qwen2_vl_text" => Some(Arch::Qwen2Vl),
            "qwen2_5_vl" | "qwen2_5_vl_text" => Some(Arch::Qwen25Vl),
            "glm4v" | "glm4v_text" | "glm46v" => Some(Arch::Glm4v),
            "glm4v_moe" | "glm4v_moe_text" => Some(Arch::Glm4vMoe),
            "qwen3_5" | "qwen3_5_text" => Some(Arch::Qwen35),
            "qwen3_5_moe" | "qwen3_5_moe_text" => Some(Arch::Qwen35Moe),
            // The unified 12B family's language model is Gemma 4's without per-layer inputs.
            "gemma4" | "gemma4_text" | "gemma4_unified" | "gemma4_unified_text" => Some(Arch::Gemma4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3_text",
            Arch::Qwen2Vl => "qwen2_vl",
            Arch::Qwen25Vl => "qwen2_5_vl",
            Arch::Glm4v => "glm4v",
            Arch::Glm4vMoe => "glm4v_moe",
            Arch::Qwen35 => "qwen3_5",
            Arch::Qwen35Moe => "qwen3_5_moe",
            Arch::Gemma4 => "gemma4",
        }
    }

    /// Vision-language models, whose top-level `model_type` names the whole model.
    pub fn is_vision_language(self) -> bool {
        matches!(self, Arch::Qwen2Vl | Arch::Qwen25Vl | Arch::Glm4v | Arch::Glm4vMoe)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Silu,
    GeluTanh,
    /// Exact GELU, `x * Phi(x)` (PyTorch's `nn.GELU()`).
    Gelu,
    /// `x * sigmoid(1.702 x)` (CLIP-style vision towers).
    QuickGelu,
}

impl Activation {
    /// HF's `hidden_act` names.
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(Activation::GeluTanh),
            "gelu" => Some(Activation::Gelu),
            "quick_gelu" => Some(Activation::QuickGelu),
            _ => None,
        }
    }
}

/// Whether a layer attends to the whole context or a sliding window of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Full,
    Sliding,
    /// Linear attention (Gated DeltaNet): no KV cache, a fixed recurrent state per sequence.
    Linear,
}

/// How rotary pairs are laid out in a head: HF's `rotate_half` (first half with second half)
/// or adjacent pairs. llama.cpp permutes llama q/k weights so that adjacent pairs apply; using
/// the interleaved form on those weights is the same math without un-permuting quantized data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    Half,
    Interleaved,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: f64,
    },
    /// Gemma 4's full layers: frequencies over the whole head, `theta^(-2i / head_dim)`, for the
    /// first `fraction * head_dim / 2` pairs and 0 (no turn) for the rest, all divided by `factor`.
    Proportional {
        fraction: f64,
        factor: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// M-RoPE: how many rotary frequencies (from the first) follow the temporal, height and
    /// width position of a token; their sum is `rotary_dim / 2`.
    pub mrope_section: Option<Vec<usize>>,
    /// M-RoPE layout. Chunked (Qwen2-VL, GLM-4.xV): the sections lie end to end, the first
    /// `s_t` frequencies follow t, the next `s_h` h, the rest w. Interleaved (Qwen3.5): the
    /// frequencies take t, h, w in turn (`j % 3`) while the h and w sections last
    /// (`j < 3 * s_h`, `j < 3 * s_w`), and t after that.
    pub mrope_interleaved: bool,
}

/// How a mixture of experts scores its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeScoring {
    /// DeepSeek-V3 / GLM-4.5: sigmoid scores, a correction bias that only steers the choice,
    /// experts chosen within the best groups.
    SigmoidGrouped,
    /// Qwen: softmax over all experts, the top k renormalised to sum to 1.
    Softmax,
    /// Gemma 4: the router reads `rms(x) * scale / sqrt(hidden)`, then as `Softmax`, each
    /// chosen weight times its expert's `per_expert_scale`; no shared expert (the layer's dense
    /// MLP runs beside the experts instead).
    GemmaScaled,
}

/// A mixture-of-experts MLP: routed experts chosen per token as `scoring` says, plus shared
/// experts every token runs.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub scoring: MoeScoring,
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Experts split into this many equal groups; a token's experts come from `topk_group` of them.
    pub n_group: usize,
    pub topk_group: usize,
    /// Width of one routed expert's MLP.
    pub intermediate_size: usize,
    /// Always-on experts, run as one MLP `n_shared_experts` times as wide.
    pub n_shared_experts: usize,
    /// Width of that shared MLP (GLM: `n_shared_experts * intermediate_size`; Qwen:
    /// `shared_expert_intermediate_size`).
    pub shared_intermediate_size: usize,
    /// The shared MLP's output is scaled by `sigmoid(x w_gate)` (Qwen's `shared_expert_gate`).
    pub shared_expert_gate: bool,
    /// The chosen experts' weights are divided by their sum.
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    /// Layers before this one use a dense MLP of `intermediate_size`.
    pub first_k_dense_replace: usize,
}

impl MoeConfig {
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }
}

/// Gated DeltaNet layers' sizes (Qwen3.5's `linear_*` fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearAttnConfig {
    pub num_key_heads: usize,
    /// A multiple of `num_key_heads`: consecutive value heads share a key head.
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// Width of the causal depthwise convolution over time.
    pub conv_kernel: usize,
}

impl LinearAttnConfig {
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// f32 values of one sequence's state in one layer: the convolution's last `conv_kernel - 1`
    /// inputs (`[K - 1, conv_dim]`, oldest row first), then the delta rule's `[value heads, key
    /// dim, value dim]` matrix.
    pub fn state_len(&self) -> (usize, usize) {
        ((self.conv_kernel - 1) * self.conv_dim(), self.num_value_heads * self.key_head_dim * self.value_head_dim)
    }

    /// Bytes of one sequence's state in one layer (kept in f32).
    pub fn state_bytes(&self) -> usize {
        let (conv, ssm) = self.state_len();
        4 * (conv + ssm)
    }
}

/// One attention layer's keys and values: heads and their width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Gemma 4's per-layer embeddings (PLE): a second token table `[vocab, layers * dim]` whose
/// slice for layer l, mixed with a projection of the input embedding, feeds a residual gate
/// at the end of layer l.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerLayerInput {
    pub dim: usize,
    pub vocab: usize,
    /// The token whose table row image tokens take.
    pub pad_token_id: u32,
}

/// What Gemma 4 adds to a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Gemma4Layers {
    pub per_layer_input: Option<PerLayerInput>,
    /// KV-sharing layers' MLPs are twice `intermediate_size` wide.
    pub double_wide_mlp: bool,
    /// Full-attention layers have no `v_proj`: the values are the key projection (before
    /// `k_norm`).
    pub k_eq_v: bool,
    /// `use_bidirectional_attention: "vision"` (26B, 31B): on sliding layers an image's tokens
    /// see the whole image, later ones included.
    pub vision_bidirectional: bool,
}

#[derive(Debug, Clone)]
pub struct TextConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that rotary embeddings turn (`head_dim` unless the
    /// model uses partial rotary, `partial_rotary_factor`).
    pub rotary_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub activation: Activation,
    /// Rotary settings of full-attention layers.
    pub rope: RopeConfig,
    /// Rotary settings of sliding-window layers (Gemma 3 uses a smaller base there).
    pub rope_local: Option<RopeConfig>,
    pub rope_layout: RopeLayout,
    pub sliding_window: Option<usize>,
    pub layer_kinds: Vec<LayerKind>,
    /// Softmax scale is `query_pre_attn_scalar^-0.5` (Gemma) instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub moe: Option<MoeConfig>,
    /// The linear-attention layers' sizes, for a hybrid model (`LayerKind::Linear` layers).
    pub linear_attn: Option<LinearAttnConfig>,
    /// Each layer's key/value geometry where the layers differ (Gemma 4's full layers have
    /// wider heads and may have fewer of them); empty when every layer has `num_kv_heads` x
    /// `head_dim`.
    pub layer_kv: Vec<KvShape>,
    /// KV sharing (Gemma 4): `kv_source[l] = Some(s)` when layer l stores no keys or values and
    /// attends over layer s's; empty when no layer shares.
    pub kv_source: Vec<Option<usize>>,
    pub gemma4: Option<Gemma4Layers>,
    /// MTP (multi-token prediction) layers the model runs as a drafter, after its decoder
    /// layers: the checkpoint's `mtp_num_hidden_layers` / `num_nextn_predict_layers` when
    /// parsed; the loader keeps it only when MTP drafting is asked for (else 0: no weights
    /// loaded, no cache). Each has a paged KV cache layer of its own, numbered from
    /// `num_layers` on.
    pub mtp_layers: usize,
}

impl TextConfig {
    /// Layers with a KV cache (every one but the linear-attention layers).
    pub fn attention_layers(&self) -> Vec<usize> {
        (0..self.num_layers).filter(|&l| self.layer_kinds[l] != LayerKind::Linear).collect()
    }

    /// Attention layers that keep keys and values of their own (all but the KV-sharing ones),
    /// the MTP layers' last.
    pub fn cache_layers(&self) -> Vec<usize> {
        let own = self.attention_layers().into_iter().filter(|&l| self.kv_source(l).is_none());
        own.chain(self.num_layers..self.num_cache_layers()).collect()
    }

    /// Layers the KV memory is indexed by: the decoder layers, then the MTP layers.
    pub fn num_cache_layers(&self) -> usize {
        self.num_layers + self.mtp_layers
    }

    /// What layer `layer` mixes tokens with; an MTP layer (past the decoder's) attends fully.
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        self.layer_kinds.get(layer).copied().unwrap_or(LayerKind::Full)
    }

    /// Whether cache layer `layer` is an MTP layer's (a drafter's: its keys stay in floats).
    pub fn is_mtp_layer(&self, layer: usize) -> bool {
        layer >= self.num_layers
    }

    /// The layer whose keys and values layer `layer` attends over, when it keeps none itself.
    pub fn kv_source(&self, layer: usize) -> Option<usize> {
        self.kv_source.get(layer).copied().flatten()
    }

    /// Layer `layer`'s key/value heads and head width.
    pub fn kv_shape(&self, layer: usize) -> KvShape {
        self.layer_kv
            .get(layer)
            .copied()
            .unwrap_or(KvShape { num_kv_heads: self.num_kv_heads, head_dim: self.head_dim })
    }

    /// Whether an image's tokens attend to the whole image (on the layers `image_sees_whole`
    /// names), so a prompt chunk must hold an image whole.
    pub fn images_attend_both_ways(&self) -> bool {
        self.gemma4.is_some_and(|g| g.vision_bidirectional)
    }

    /// Whether layer `layer`'s image tokens see their whole image (Gemma 4's sliding layers,
    /// when `images_attend_both_ways`).
    pub fn image_sees_whole(&self, layer: usize) -> bool {
        self.images_attend_both_ways() && self.layer_kind(layer) == LayerKind::Sliding
    }

    /// Layers with a recurrent state per sequence instead of a KV cache.
    pub fn linear_layers(&self) -> Vec<usize> {
        (0..self.num_layers).filter(|&l| self.layer_kinds[l] == LayerKind::Linear).collect()
    }

    /// Bytes of one sequence's recurrent state over all linear-attention layers (0 without them).
    pub fn state_bytes_per_sequence(&self) -> usize {
        self.linear_attn.as_ref().map_or(0, |l| l.state_bytes() * self.linear_layers().len())
    }

    pub fn attention_scale(&self) -> f64 {
        self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64).powf(-0.5)
    }

    pub fn rope_for(&self, layer: usize) -> &RopeConfig {
        match (self.layer_kinds[layer], &self.rope_local) {
            (LayerKind::Sliding, Some(local)) => local,
            _ => &self.rope,
        }
    }

    pub fn window_for(&self, layer: usize) -> Option<usize> {
        match self.layer_kind(layer) {
            LayerKind::Sliding => self.sliding_window,
            LayerKind::Full | LayerKind::Linear => None,
        }
    }

    /// Parameters of the text model (embedding counted once when tied).
    pub fn parameter_count(&self) -> u64 {
        self.parameter_counts().0
    }

    /// Parameters one token computes with: all of them but the routed experts it is not sent to.
    pub fn active_parameter_count(&self) -> u64 {
        self.parameter_counts().1
    }

    /// (total, active per token).
    fn parameter_counts(&self) -> (u64, u64) {
        if let Some(g) = &self.gemma4 {
            return self.gemma4_parameter_counts(g);
        }
        let (h, i, v) = (self.hidden_size as u64, self.intermediate_size as u64, self.vocab_size as u64);
        let (q, kv) = ((self.num_heads * self.head_dim) as u64, (self.num_kv_heads * self.head_dim) as u64);
        // Qwen3.5's q_proj also gives each head's output gate.
        let gated = matches!(self.arch, Arch::Qwen35 | Arch::Qwen35Moe);
        let mut attn = h * q * if gated { 2 } else { 1 } + 2 * h * kv + q * h;
        if self.attention_bias {
            attn += q + 2 * kv;
        }
        let mut norms = 2 * h;
        let qk_norms = 2 * self.head_dim as u64;
        // in_proj_qkv, in_proj_z, in_proj_b and _a, the convolution, dt_bias and A_log, the
        // gated norm, out_proj.
        let linear = self.linear_attn.as_ref().map_or(0, |l| {
            let (c, vd, hv, kk) = (l.conv_dim() as u64, l.value_dim() as u64, l.num_value_heads as u64, l.conv_kernel);
            h * c + h * vd + 2 * h * hv + c * kk as u64 + 2 * hv + l.value_head_dim as u64 + vd * h
        });
        match self.arch {
            Arch::Qwen3 => norms += qk_norms,
            Arch::Gemma3 => norms += 2 * h + 2 * self.head_dim as u64,
            // GLM-4.1V also normalises the attention and MLP outputs.
            Arch::Glm4v => norms += 2 * h,
            _ => {}
        }
        let (mut total, mut active) = (0, 0);
        for layer in 0..self.num_layers {
            let (t, a) = match &self.moe {
                Some(m) if m.is_moe_layer(layer) => {
                    let (e, k, mi) = (m.num_experts as u64, m.top_k as u64, m.intermediate_size as u64);
                    let bias = if m.scoring == MoeScoring::SigmoidGrouped { e } else { 0 };
                    let shared_gate = if m.shared_expert_gate { h } else { 0 };
                    let always = e * h + bias + 3 * h * m.shared_intermediate_size as u64 + shared_gate;
                    (always + e * 3 * h * mi, always + k * 3 * h * mi)
                }
                _ => (3 * h * i, 3 * h * i),
            };
            let mixer = match self.layer_kinds[layer] {
                LayerKind::Linear => linear,
                _ if gated => attn + qk_norms,
                _ => attn,
            };
            total += mixer + norms + t;
            active += mixer + norms + a;
        }
        let embed = v * h * if self.tie_word_embeddings { 1 } else { 2 };
        (total + embed + h, active + embed + h)
    }
}

impl TextConfig {
    /// Gemma 4's layers differ one from the next (head widths, shared K/V, double-wide MLPs),
    /// so they are counted one by one.
    fn gemma4_parameter_counts(&self, g: &Gemma4Layers) -> (u64, u64) {
        let (h, i, v, nh) =
            (self.hidden_size as u64, self.intermediate_size as u64, self.vocab_size as u64, self.num_heads as u64);
        let (mut total, mut active) = (0, 0);
        for layer in 0..self.num_layers {
            let KvShape { num_kv_heads, head_dim } = self.kv_shape(layer);
            let (kvh, d) = (num_kv_heads as u64, head_dim as u64);
            let shared = self.kv_source(layer).is_some();
            // q_proj, o_proj, q_norm; k_proj, v_proj and k_norm where the layer keeps K/V.
            let mut attn = 2 * h * nh * d + d;
            if !shared {
                let values = !(g.k_eq_v && self.layer_kinds[layer] == LayerKind::Full);
                attn += h * kvh * d * if values { 2 } else { 1 } + d;
            }
            let width = if g.double_wide_mlp && shared { 2 * i } else { i };
            let mut common = attn + 4 * h + 3 * h * width;
            if let Some(p) = g.per_layer_input {
                common += 2 * h * p.dim as u64 + h;
            }
            let (mut t, mut a) = (common, common);
            if let Some(m) = &self.moe {
                let (e, k, mi) = (m.num_experts as u64, m.top_k as u64, m.intermediate_size as u64);
                // The router's projection, scale and per-expert scale; three more norms.
                let always = e * h + h + e + 3 * h;
                t += always + e * 3 * h * mi;
                a += always + k * 3 * h * mi;
            }
            total += t;
            active += a;
        }
        let mut embed = v * h * if self.tie_word_embeddings { 1 } else { 2 } + h;
        if let Some(p) = g.per_layer_input {
            let lp = (self.num_layers * p.dim) as u64;
            embed += p.vocab as u64 * lp + h * lp + p.dim as u64;
        }
        (total + embed, active + embed)
    }
}

/// Gemma 3 without `layer_types`: every `pattern`-th layer is global, the others slide.
pub fn gemma_layer_pattern(num_layers: usize, pattern: usize) -> Vec<LayerKind> {
    (0..num_layers)
        .map(|i| if pattern > 0 && (i + 1) % pattern == 0 { LayerKind::Full } else { LayerKind::Sliding })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_pattern_marks_every_sixth_global() {
        let k = gemma_layer_pattern(12, 6);
        assert_eq!(k.iter().filter(|k| **k == LayerKind::Full).count(), 2);
        assert_eq!(k[5], LayerKind::Full);
        assert_eq!(k[11], LayerKind::Full);
    }
}
