use anyhow::Context;
use clap::Args;

use super::args::ModelArg;
use crate::config::LayerKind;
use crate::kv::{KvCacheSpec, KvDtype, TqBits, TqSpec};
use crate::loader::{load_model_parts, mlx_quantization, read_config};
use crate::simd::Isa;
use crate::weights::{footprint, GgufFile, ModelLocation, SafetensorsDir};

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Also load the weights (on the CPU) and print the bytes the loaded model holds, text
    /// model and vision tower apart: what `serve` holds with the same --dtype and
    /// --limit-mm-per-prompt (dense weights widened to the dtype, quantized ones as they are).
    #[arg(long)]
    pub load: bool,
    /// With --load: the dtype dense weights are converted to (f32, bf16 or f16).
    #[arg(long, default_value = "f32", requires = "load")]
    pub dtype: String,
    /// With --load: as `serve` takes it; '{"image": 0}' leaves the vision tower out.
    #[arg(long, requires = "load")]
    pub limit_mm_per_prompt: Option<String>,
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let model = a.model.resolve()?;
    let path = model.path;
    let (loc, cfg) = read_config(&path)?;
    // Everything that can fail is read before anything is printed.
    let held = if a.load {
        let dtype = super::args::parse_dtype(&a.dtype).with_context(|| format!("--dtype {}", a.dtype))?;
        let images = a.limit_mm_per_prompt.as_deref().map(crate::engine::mm_limit::parse).transpose()?.flatten();
        let tok = model.tokenizer.as_deref();
        let loaded = load_model_parts(&path, tok, &candle_core::Device::Cpu, dtype, None, images != Some(0))?;
        Some((loaded.held, a.dtype.clone()))
    } else {
        None
    };
    let mut vision_params = 0u64;
    let shares;
    let format = match &loc {
        ModelLocation::Gguf(file) => {
            let g = GgufFile::open(file)?;
            shares = footprint::of_gguf(&g);
            let types: Vec<String> = g.dtype_histogram().iter().map(|(d, n)| format!("{d:?} x{n}")).collect();
            format!("GGUF; tensor types: {}", types.join(", "))
        }
        ModelLocation::HfDir(dir) => {
            let st = SafetensorsDir::open(dir)?;
            shares = footprint::of_safetensors(&st, mlx_quantization(&dir.join("config.json"))?.as_ref());
            let summary = st.summary();
            // The vision tower's size is read off its stored tensors (its shape varies too
            // much between families to count from the config).
            const TOWER: [&str; 6] = [
                "visual.",
                "model.visual.",
                "vision_tower.",
                "model.vision_tower.",
                "embed_vision.",
                "model.embed_vision.",
            ];
            vision_params = summary
                .iter()
                .filter(|(name, _, _)| TOWER.iter().any(|p| name.starts_with(p)))
                .map(|(_, _, shape)| shape.iter().product::<usize>() as u64)
                .sum();
            let mut types: Vec<(String, usize)> = Vec::new();
            for (_, dt, _) in summary {
                match types.iter_mut().find(|(d, _)| *d == dt) {
                    Some((_, n)) => *n += 1,
                    None => types.push((dt, 1)),
                }
            }
            let types: Vec<String> = types.iter().map(|(d, n)| format!("{d} x{n}")).collect();
            format!("safetensors ({} files); tensor dtypes: {}", st.files().len(), types.join(", "))
        }
    };
    println!("model:            {}", path.display());
    if let Some(t) = &model.tokenizer {
        println!("tokenizer:        {}", t.display());
    }
    println!("architecture:     {}", cfg.arch.name());
    let millions = |n: u64| n as f64 / 1e6;
    let text_params = cfg.parameter_count();
    let total = text_params + vision_params;
    if vision_params > 0 {
        println!(
            "parameters:       {total} ({:.1} M): language model {text_params}, vision tower {vision_params}",
            millions(total)
        );
    } else {
        println!("parameters:       {total} ({:.1} M)", millions(total));
    }
    if let Some(moe) = &cfg.moe {
        let active = cfg.active_parameter_count();
        println!(
            "active per token: {active} ({:.1} M) of the language model: {} of {} routed experts, {} shared",
            millions(active),
            moe.top_k,
            moe.num_experts,
            moe.n_shared_experts
        );
    }
    println!(
        "layers:           {} (hidden {}, intermediate {}, {} heads, {} kv heads, head dim {})",
        cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    );
    let sliding = cfg.layer_kinds.iter().filter(|k| **k == LayerKind::Sliding).count();
    if sliding > 0 {
        println!(
            "attention:        {} sliding-window layers (window {}), {} global",
            sliding,
            cfg.sliding_window.unwrap_or(0),
            cfg.num_layers - sliding
        );
    }
    // Layers whose keys and values differ from the first line's (Gemma 4's global layers).
    let mut shapes: Vec<(LayerKind, crate::config::KvShape, usize)> = Vec::new();
    for l in 0..cfg.num_layers {
        let (kind, shape) = (cfg.layer_kinds[l], cfg.kv_shape(l));
        if (shape.num_kv_heads, shape.head_dim) == (cfg.num_kv_heads, cfg.head_dim) {
            continue;
        }
        match shapes.iter_mut().find(|(k, s, _)| (*k, *s) == (kind, shape)) {
            Some((_, _, n)) => *n += 1,
            None => shapes.push((kind, shape, 1)),
        }
    }
    for (kind, shape, n) in shapes {
        let kind = if kind == LayerKind::Full { "global" } else { "other" };
        println!("                  {n} {kind} layers: {} kv heads, head dim {}", shape.num_kv_heads, shape.head_dim);
    }
    let sharing = (0..cfg.num_layers).filter(|&l| cfg.kv_source(l).is_some()).count();
    if sharing > 0 {
        println!(
            "kv sharing:       the last {sharing} layers attend over earlier layers' keys and values; {} of {} layers keep a cache",
            cfg.cache_layers().len(),
            cfg.num_layers
        );
    }
    if let Some(l) = &cfg.linear_attn {
        println!(
            "linear attention: {} Gated DeltaNet layers ({} key / {} value heads of {} / {}, conv {}), {} attention",
            cfg.linear_layers().len(),
            l.num_key_heads,
            l.num_value_heads,
            l.key_head_dim,
            l.value_head_dim,
            l.conv_kernel,
            cfg.attention_layers().len()
        );
    }
    println!("vocabulary:       {}", cfg.vocab_size);
    println!("context length:   {}", cfg.max_position_embeddings);
    println!("rope theta:       {}", cfg.rope.theta);
    println!("format:           {format}");
    let (bytes, weights) = shares.iter().fold((0, 0), |(b, w), s| (b + s.bytes, w + s.weights));
    println!(
        "weight bytes:     {bytes} as stored ({:.2} bits per weight over {weights} weights)",
        8.0 * bytes as f64 / weights.max(1) as f64
    );
    for s in &shares {
        println!(
            "  {:<22} {:>6.2} bits/weight, {} tensors, {} weights, {} bytes",
            s.format,
            s.bits_per_weight(),
            s.tensors,
            s.weights,
            s.bytes
        );
    }
    if let Some((held, dtype)) = held {
        println!(
            "held when loaded: {} bytes ({dtype}): text model {}, vision tower {}",
            held.total(),
            held.text,
            held.vision
        );
    }
    for dt in [KvDtype::F32, KvDtype::Bf16] {
        println!("KV bytes/token:   {} ({dt})", KvCacheSpec::bytes_per_token(&cfg, dt));
    }
    for (key, value) in [(4, 4), (3, 4), (2, 3)] {
        let tq = TqSpec::new(TqBits { key, value });
        println!("KV bytes/token:   {} ({})", tq.bytes_per_token(&cfg, KvDtype::Bf16), tq.bits);
    }
    if cfg.state_bytes_per_sequence() > 0 {
        // Fixed per running sequence, whatever its length (f32).
        println!("state bytes/seq:  {} (f32, linear-attention layers)", cfg.state_bytes_per_sequence());
    }
    println!("{}", cpu_kernels_line());
    Ok(())
}

/// The CPU kernels' instruction set, and those this CPU has.
pub fn cpu_kernels_line() -> String {
    let have: Vec<&str> = Isa::available().iter().map(|i| i.name()).collect();
    format!("CPU kernels:      {} (this CPU has: {})", Isa::active().name(), have.join(", "))
}
