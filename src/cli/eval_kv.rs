//! `iris eval-kv`: what a KV cache format costs in quality and saves in memory. Scores a text
//! teacher-forced (each chunk attends to the cached tokens before it, as in serving) with a
//! bf16 cache and with each variant: perplexity, and how often the variant's most likely next
//! token is bf16's.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Args;
use serde::Serialize;

use super::args::{parse_dtype, ModelArg};
use crate::batch::{Batch, SeqSlice};
use crate::kv::format::{parse_layer_list, resolve_layers};
use crate::kv::{KvCache, KvCacheDtype, KvCacheSpec, KvDtype, TqSpec};
use crate::models::TextModel;

#[derive(Args, Debug)]
pub struct EvalKvArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Compute dtype of dense weights and activations: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// The text to score, e.g. /usr/share/common-licenses/GPL-3.
    #[arg(long)]
    pub text: PathBuf,
    /// Score at most this many tokens of the text.
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
    /// Tokens per forward pass.
    #[arg(long, default_value_t = 128)]
    pub chunk: usize,
    /// A cache to compare with bf16 (repeatable): a --kv-cache-dtype value, optionally with
    /// /wN for a float window of N tokens, /sL,L for float layers and /plain for no key
    /// scales (--kv-key-scales none), e.g. tq-k3v4/w128/s0,-1. Default: f32, tq-k4v4,
    /// tq-k3v4, tq-k2v3, tq-k3v4/w128, tq-k2v3/w128.
    #[arg(long = "variant", allow_hyphen_values = true)]
    pub variants: Vec<String>,
    /// Print JSON instead of a markdown table.
    #[arg(long)]
    pub json: bool,
}

const DEFAULT_VARIANTS: [&str; 6] = ["f32", "tq-k4v4", "tq-k3v4", "tq-k2v3", "tq-k3v4/w128", "tq-k2v3/w128"];

/// One cache to score: its storage and quality options.
#[derive(Debug, Clone)]
struct Variant {
    label: String,
    dtype: KvCacheDtype,
    float_window: usize,
    skip_layers: Vec<i64>,
    key_scales: bool,
}

impl Variant {
    fn parse(s: &str) -> anyhow::Result<Self> {
        let mut parts = s.split('/');
        let dtype: KvCacheDtype = parts.next().unwrap_or_default().parse()?;
        let (mut float_window, mut skip_layers, mut key_scales) = (0, Vec::new(), true);
        for p in parts {
            if p == "plain" {
                key_scales = false;
            } else if let Some(n) = p.strip_prefix('w') {
                float_window = n.parse().with_context(|| format!("`{p}` in variant `{s}` is not /wN"))?;
            } else if let Some(l) = p.strip_prefix('s') {
                skip_layers = parse_layer_list(l)?;
            } else {
                bail!("`{p}` in variant `{s}`: use /wN (float window), /sL,L (float layers) or /plain");
            }
        }
        if !matches!(dtype, KvCacheDtype::TurboQuant(_)) && (float_window > 0 || !skip_layers.is_empty() || !key_scales)
        {
            bail!("variant `{s}`: /w, /s and /plain only apply to a TurboQuant cache (tq-kXvY)");
        }
        Ok(Variant { label: s.to_string(), dtype, float_window, skip_layers, key_scales })
    }
}

#[derive(Debug, Serialize)]
pub struct EvalRow {
    pub kv_cache: String,
    /// Bytes a token occupies in the paged blocks.
    pub bytes_per_token: usize,
    /// Tokens it holds in the memory of one bf16 token.
    pub capacity_vs_bf16: f64,
    pub perplexity: f64,
    /// Relative change of perplexity against bf16.
    pub perplexity_change: f64,
    /// Perplexity over the second half of the text only (every prediction there has 1,000+
    /// tokens of context, most of it beyond a float window).
    pub perplexity_second_half: f64,
    pub perplexity_second_half_change: f64,
    /// Share of positions whose most likely next token is bf16's.
    pub top1_agreement: f64,
}

/// Per-position results of scoring the text with one cache.
struct Scores {
    /// Negative log-likelihood of each next token.
    nll: Vec<f64>,
    argmax: Vec<u32>,
    bytes_per_token: usize,
}

fn score(
    model: &dyn TextModel,
    tokens: &[u32],
    v: &Variant,
    key_scales: &[Vec<f32>],
    compute: DType,
    chunk: usize,
) -> anyhow::Result<Scores> {
    let cfg = model.config();
    let dev = Device::Cpu;
    let auto = KvDtype::from_dtype(compute).unwrap_or(KvDtype::F32);
    let (float, tq) = match v.dtype {
        KvCacheDtype::Auto => (auto, None),
        KvCacheDtype::Float(d) => (d, None),
        KvCacheDtype::TurboQuant(bits) => {
            let skip_layers = resolve_layers(&v.skip_layers, cfg.num_layers)?;
            let key_scales = if v.key_scales { key_scales.to_vec() } else { Vec::new() };
            (auto, Some(TqSpec { bits, skip_layers, float_window: v.float_window, window_rings: 1, key_scales }))
        }
    };
    let bytes_per_token = match &tq {
        Some(t) => t.bytes_per_token(cfg, float),
        None => KvCacheSpec::bytes_per_token(cfg, float),
    };
    let bs = 16;
    let spec = KvCacheSpec { block_size: bs, num_blocks: tokens.len().div_ceil(bs), dtype: float };
    let kv = KvCache::build(cfg, spec, tq.as_ref(), 1, &dev)?;
    let table: Vec<u32> = (0..spec.num_blocks as u32).collect();
    let (mut nll, mut argmax) = (Vec::with_capacity(tokens.len()), Vec::with_capacity(tokens.len()));
    let mut start = 0;
    while start < tokens.len() {
        let n = chunk.min(tokens.len() - start);
        let seq = SeqSlice { q_start: 0, q_len: n, context_len: start + n, block_table: table.clone() };
        // Built on the host and moved once its metadata is whole (one upload per chunk).
        let mut batch = Batch::from_tokens(&Device::Cpu, bs, vec![seq], &tokens[start..start + n])?;
        if v.float_window > 0 {
            batch.attn.set_float_window(v.float_window, vec![0])?;
        }
        batch.to_device(&dev)?;
        let logits: Vec<Vec<f32>> = model.logits(&model.forward(&batch, &kv, None)?)?.to_vec2()?;
        for (i, row) in logits.iter().enumerate() {
            let (best, max) =
                row.iter().enumerate().fold((0, f32::NEG_INFINITY), |a, (j, &x)| if x > a.1 { (j, x) } else { a });
            argmax.push(best as u32);
            if let Some(&next) = tokens.get(start + i + 1) {
                let lse = max as f64 + row.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln();
                nll.push(lse - row[next as usize] as f64);
            }
        }
        start += n;
    }
    // The last position predicts past the text: not scored.
    argmax.pop();
    Ok(Scores { nll, argmax, bytes_per_token })
}

pub fn run(a: EvalKvArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.chunk > 0 && a.max_tokens > 1, "--chunk must be positive and --max-tokens above 1");
    let dtype = parse_dtype(&a.dtype).with_context(|| format!("--dtype {}", a.dtype))?;
    let names: Vec<String> = if a.variants.is_empty() {
        DEFAULT_VARIANTS.iter().map(|s| s.to_string()).collect()
    } else {
        a.variants.clone()
    };
    let variants = names
        .iter()
        .map(|s| Variant::parse(s).with_context(|| format!("--variant {s}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let text = std::fs::read_to_string(&a.text).with_context(|| format!("--text {}", a.text.display()))?;
    let model = a.model.resolve()?;
    let path = model.path;
    let loaded = crate::loader::load_with(&path, model.tokenizer.as_deref(), &Device::Cpu, dtype)
        .with_context(|| format!("cannot load {}", path.display()))?;
    let mut tokens = loaded.tokenizer.encode(&text, true)?;
    tokens.truncate(a.max_tokens);
    anyhow::ensure!(tokens.len() > 1, "--text {}: fewer than 2 tokens to score", a.text.display());
    let model = loaded.model.as_ref();
    let key_scales = crate::engine::calibrate::key_scales(model, &loaded.tokenizer, &Device::Cpu)?;
    let bf16 = Variant::parse("bf16")?;
    let base = score(model, &tokens, &bf16, &key_scales, dtype, a.chunk)?;
    // Perplexity over all scored positions, and over the second half.
    let ppl = |nll: &[f64]| {
        let half = &nll[nll.len() / 2..];
        ((nll.iter().sum::<f64>() / nll.len() as f64).exp(), (half.iter().sum::<f64>() / half.len() as f64).exp())
    };
    let (base_ppl, base_half) = ppl(&base.nll);
    let mut rows = Vec::new();
    for v in std::iter::once(&bf16).chain(&variants) {
        // The first row is the baseline itself.
        let scored;
        let s = if rows.is_empty() {
            &base
        } else {
            scored = score(model, &tokens, v, &key_scales, dtype, a.chunk)?;
            &scored
        };
        let (p, h) = ppl(&s.nll);
        let same = s.argmax.iter().zip(&base.argmax).filter(|(x, y)| x == y).count();
        rows.push(EvalRow {
            kv_cache: v.label.clone(),
            bytes_per_token: s.bytes_per_token,
            capacity_vs_bf16: base.bytes_per_token as f64 / s.bytes_per_token as f64,
            perplexity: p,
            perplexity_change: p / base_ppl - 1.0,
            perplexity_second_half: h,
            perplexity_second_half_change: h / base_half - 1.0,
            top1_agreement: same as f64 / base.argmax.len() as f64,
        });
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("Model `{}`, {} tokens of `{}`, chunks of {}.\n", path.display(), tokens.len(), a.text.display(), a.chunk);
    println!(
        "| KV cache | bytes/token | capacity vs bf16 | perplexity | vs bf16 | 2nd half | vs bf16 | top-1 agreement with bf16 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2}x | {:.4} | {:+.2}% | {:.4} | {:+.2}% | {:.2}% |",
            r.kv_cache,
            r.bytes_per_token,
            r.capacity_vs_bf16,
            r.perplexity,
            r.perplexity_change * 100.0,
            r.perplexity_second_half,
            r.perplexity_second_half_change * 100.0,
            r.top1_agreement * 100.0
        );
    }
    Ok(())
}
