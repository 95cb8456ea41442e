//! The `iris` command line.

mod admission_bench;
mod args;
mod bench;
mod chat;
mod conversation_bench;
mod eval_kv;
mod generate;
mod image_bench;
mod inspect;
mod load_bench;
mod serve;
mod session;
mod stats;

use clap::{Parser, Subcommand};

pub use args::{EngineArgs, ModelArg, ResolvedModel, SamplingArgs};

#[derive(Parser, Debug)]
#[command(name = "iris", version, about = "Inference engine and server for LLMs and vision-language models")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log more (repeat for more detail). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a continuation of one prompt and stream it to stdout.
    Generate(generate::GenerateArgs),
    /// Chat with a model in the terminal (multi-turn).
    Chat(chat::ChatArgs),
    /// Show a model's architecture, size, quantization and KV cache cost.
    Inspect(inspect::InspectArgs),
    /// Serve the OpenAI and Anthropic HTTP APIs.
    Serve(serve::ServeArgs),
    /// Measure prefill and decode throughput and time to first token (in-process; on
    /// vision-language models also the vision tower per image and an image prompt's time to
    /// first token), or load a running server with concurrent streams (--url).
    Bench(bench::BenchArgs),
    /// Score a text with quantized KV caches against a bf16 one: perplexity, top-1 agreement.
    EvalKv(eval_kv::EvalKvArgs),
}

pub fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "iris=info",
        1 => "iris=debug",
        _ => "iris=trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colours only for a terminal: a log file or a pipe gets plain text (NO_COLOR too).
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(ansi)
        .try_init();
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    // An unusable IRIS_CPU_ISA is refused before anything loads (the kernels would otherwise
    // fall back to the best set silently).
    let isa = crate::simd::Isa::from_env()?;
    tracing::debug!("CPU kernels: {}", isa.name());
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(a),
        Command::EvalKv(a) => eval_kv::run(a),
    }
}
