//! HF tensor names -> llama.cpp GGUF tensor names.

use crate::config::Arch;

/// The GGUF name of an HF-named tensor, or None when GGUF has no such tensor.
pub fn gguf_name(hf: &str, arch: Arch) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?; // suffix: weight | bias
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        // Gemma norms the attention output before the residual; llama's "post attention" norm
        // is the one before the MLP, which GGUF calls ffn_norm.
        "post_attention_layernorm" if arch == Arch::Gemma3 => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_layer_names_per_arch() {
        assert_eq!(gguf_name("model.layers.3.self_attn.q_proj.weight", Arch::Llama).unwrap(), "blk.3.attn_q.weight");
        assert_eq!(gguf_name("model.layers.0.self_attn.k_proj.bias", Arch::Qwen2).unwrap(), "blk.0.attn_k.bias");
        assert_eq!(
            gguf_name("model.layers.1.post_attention_layernorm.weight", Arch::Llama).unwrap(),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.1.post_attention_layernorm.weight", Arch::Gemma3).unwrap(),
            "blk.1.post_attention_norm.weight"
        );
        assert_eq!(gguf_name("model.embed_tokens.weight", Arch::Gemma3).unwrap(), "token_embd.weight");
        assert!(gguf_name("model.layers.x.foo.weight", Arch::Llama).is_none());
    }
}
