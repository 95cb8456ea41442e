//! Checks that a parsed config describes a model the code can run, whatever it was read from.

use super::error::ConfigError::{self, Invalid};
use super::text::{LayerKind, LinearAttnConfig, MoeConfig, TextConfig};

impl TextConfig {
    /// Rejects values the model code cannot run with (zero sizes, heads that do not group),
    /// naming the HF config field at fault.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("rotary dimensions (head_dim x partial_rotary_factor)", self.rotary_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(Invalid(format!("`{field}` must be positive")));
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(Invalid(format!(
                "`num_attention_heads` ({}) is not a multiple of `num_key_value_heads` ({})",
                self.num_heads, self.num_kv_heads
            )));
        }
        if self.layer_kinds.len() != self.num_layers {
            return Err(Invalid(format!(
                "{} layer types for `num_hidden_layers` {}",
                self.layer_kinds.len(),
                self.num_layers
            )));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(Invalid(format!("`rms_norm_eps` must be a finite number >= 0, got {}", self.rms_norm_eps)));
        }
        for rope in std::iter::once(&self.rope).chain(self.rope_local.as_ref()) {
            if !(rope.theta.is_finite() && rope.theta > 0.0) {
                return Err(Invalid(format!("`rope_theta` must be positive, got {}", rope.theta)));
            }
            if let Some(sections) = &rope.mrope_section {
                if sections.len() != 3 || sections.iter().sum::<usize>() != self.rotary_dim / 2 {
                    return Err(Invalid(format!(
                        "`mrope_section` {sections:?} must have 3 entries summing to the rotary frequencies, {}",
                        self.rotary_dim / 2
                    )));
                }
            }
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(Invalid(format!(
                "{} rotary dimensions do not fit heads of {}",
                self.rotary_dim, self.head_dim
            )));
        }
        if let Some(m) = &self.moe {
            m.validate(self.num_layers)?;
        }
        let has_linear = self.layer_kinds.contains(&LayerKind::Linear);
        match &self.linear_attn {
            Some(l) => l.validate()?,
            None if has_linear => return Err(Invalid("linear-attention layers need the `linear_*` sizes".into())),
            None => {}
        }
        if self.arch.is_vision_language() && self.rope.mrope_section.is_none() {
            return Err(Invalid("a vision-language model needs `mrope_section` in its rotary settings".into()));
        }
        if self.sliding_window == Some(0) {
            return Err(Invalid("`sliding_window` must be positive".into()));
        }
        Ok(())
    }
}

impl LinearAttnConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("linear_num_key_heads", self.num_key_heads),
            ("linear_num_value_heads", self.num_value_heads),
            ("linear_key_head_dim", self.key_head_dim),
            ("linear_value_head_dim", self.value_head_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
        ] {
            if v == 0 {
                return Err(Invalid(format!("`{field}` must be positive")));
            }
        }
        if !self.num_value_heads.is_multiple_of(self.num_key_heads) {
            return Err(Invalid(format!(
                "`linear_num_value_heads` ({}) is not a multiple of `linear_num_key_heads` ({})",
                self.num_value_heads, self.num_key_heads
            )));
        }
        Ok(())
    }
}

impl MoeConfig {
    fn validate(&self, num_layers: usize) -> Result<(), ConfigError> {
        for (field, v) in [
            ("n_routed_experts", self.num_experts),
            ("num_experts_per_tok", self.top_k),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("moe_intermediate_size", self.intermediate_size),
        ] {
            if v == 0 {
                return Err(Invalid(format!("`{field}` must be positive")));
            }
        }
        if !self.num_experts.is_multiple_of(self.n_group) {
            return Err(Invalid(format!(
                "{} experts do not split into `n_group` {} groups",
                self.num_experts, self.n_group
            )));
        }
        if self.topk_group > self.n_group {
            return Err(Invalid(format!("`topk_group` {} is more than `n_group` {}", self.topk_group, self.n_group)));
        }
        // A group's score is the sum of its two best experts.
        if self.n_group > 1 && self.num_experts / self.n_group < 2 {
            return Err(Invalid("grouped routing needs at least 2 experts per group".into()));
        }
        if self.top_k > self.topk_group * (self.num_experts / self.n_group) {
            return Err(Invalid(format!(
                "`num_experts_per_tok` {} is more than the {} experts of `topk_group` groups",
                self.top_k,
                self.topk_group * (self.num_experts / self.n_group)
            )));
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(Invalid("`routed_scaling_factor` must be a finite number".into()));
        }
        if self.first_k_dense_replace > num_layers {
            return Err(Invalid(format!(
                "`first_k_dense_replace` {} is more than the {num_layers} layers",
                self.first_k_dense_replace
            )));
        }
        Ok(())
    }
}
