use clap::Args;

use super::args::ModelArg;
use crate::kv::{KvCacheSpec, KvDtype, TqBits, TqSpec};
use crate::loader::read_config;
use crate::models::config::LayerKind;
use crate::weights::{GgufFile, ModelLocation, SafetensorsDir};

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArg,
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let path = a.model.resolve()?;
    let (loc, cfg) = read_config(&path)?;
    // Everything that can fail is read before anything is printed.
    let format = match &loc {
        ModelLocation::Gguf(file) => {
            let g = GgufFile::open(file)?;
            let types: Vec<String> = g.dtype_histogram().iter().map(|(d, n)| format!("{d:?} x{n}")).collect();
            format!("GGUF; tensor types: {}", types.join(", "))
        }
        ModelLocation::HfDir(dir) => {
            let st = SafetensorsDir::open(dir)?;
            let mut types: Vec<(String, usize)> = Vec::new();
            for (_, dt, _) in st.summary() {
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
    println!("architecture:     {}", cfg.arch.name());
    println!("parameters:       {} ({:.1} M)", cfg.parameter_count(), cfg.parameter_count() as f64 / 1e6);
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
    println!("vocabulary:       {}", cfg.vocab_size);
    println!("context length:   {}", cfg.max_position_embeddings);
    println!("rope theta:       {}", cfg.rope.theta);
    println!("format:           {format}");
    for dt in [KvDtype::F32, KvDtype::Bf16] {
        println!("KV bytes/token:   {} ({dt})", KvCacheSpec::bytes_per_token(&cfg, dt));
    }
    for (key, value) in [(4, 4), (3, 4), (2, 3)] {
        let tq = TqSpec::new(TqBits { key, value });
        println!("KV bytes/token:   {} ({})", tq.bytes_per_token(&cfg, KvDtype::Bf16), tq.bits);
    }
    Ok(())
}
