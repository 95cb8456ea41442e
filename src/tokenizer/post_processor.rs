//! The `bos $A eos` post-processor transformers builds when a tokenizer adds BOS/EOS itself.

use tokenizers::processors::template::TemplateProcessing;

/// `bos? $A eos?` for single sequences and the same around `$B` for pairs. `bos`/`eos` are
/// (token, id) when that token is to be added.
pub fn bos_eos_processor(bos: Option<(String, u32)>, eos: Option<(String, u32)>) -> Result<TemplateProcessing, String> {
    let template = |seq: &str, type_id: u32| {
        let mut parts = Vec::new();
        if let Some((t, _)) = &bos {
            parts.push(format!("{t}:{type_id}"));
        }
        parts.push(format!("{seq}:{type_id}"));
        if let Some((t, _)) = &eos {
            parts.push(format!("{t}:{type_id}"));
        }
        parts.join(" ")
    };
    let single = template("$A", 0);
    let pair = format!("{single} {}", template("$B", 1));
    let specials: Vec<(String, u32)> = bos.iter().chain(eos.iter()).cloned().collect();
    TemplateProcessing::builder()
        .try_single(single)
        .map_err(|e| e.to_string())?
        .try_pair(pair)
        .map_err(|e| e.to_string())?
        .special_tokens(specials)
        .build()
        .map_err(|e| e.to_string())
}
