use clap::Args;

use super::args::{EngineArgs, SamplingArgs};
use super::session::{open_engine, print_stats, run_one};
use crate::tokenizer::ChatMessage;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Do not print timing statistics to stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let (mut engine, _) = open_engine(&a.engine)?;
    let tok = engine.tokenizer().clone();
    let prompt = if a.chat {
        tok.encode_chat(&[ChatMessage::text("user", &a.prompt)], true)?
    } else {
        tok.encode(&a.prompt, true)?
    };
    let mut stdout = std::io::stdout();
    let stats = run_one(&mut engine, prompt, a.sampling.params(), &mut stdout)?;
    println!();
    if !a.quiet {
        print_stats(&stats);
    }
    Ok(())
}
