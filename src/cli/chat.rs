use std::io::{BufRead, Write};

use clap::Args;

use super::args::{EngineArgs, SamplingArgs};
use super::session::{open_engine, run_one};
use crate::tokenizer::ChatMessage;

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System prompt for the conversation.
    #[arg(long)]
    pub system: Option<String>,
}

/// A terminal conversation: each line is a user turn; `/reset` starts over, `/exit` or
/// end of input quits.
pub fn run(a: ChatArgs) -> anyhow::Result<()> {
    let (mut engine, _) = open_engine(&a.engine)?;
    let tok = engine.tokenizer().clone();
    let fresh = || -> Vec<ChatMessage> { a.system.iter().map(|s| ChatMessage::text("system", s)).collect() };
    let mut messages = fresh();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    eprintln!("chat: type a message; /reset starts over, /exit quits");
    loop {
        write!(stdout, "> ")?;
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(stdout)?;
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                messages = fresh();
                eprintln!("(conversation reset)");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::text("user", line));
        let prompt = match tok.encode_chat(&messages, true) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e}");
                messages.pop();
                continue;
            }
        };
        let mut reply = Vec::new();
        let mut tee = Tee { a: &mut stdout, b: &mut reply };
        match run_one(&mut engine, prompt, a.sampling.params(), &mut tee) {
            Ok(_) => {
                writeln!(stdout)?;
                messages.push(ChatMessage::text("assistant", String::from_utf8_lossy(&reply).into_owned()));
            }
            Err(e) => {
                eprintln!("\nerror: {e}");
                messages.pop();
            }
        }
    }
}

/// Writes to two sinks: the terminal and the transcript.
struct Tee<'a> {
    a: &'a mut dyn Write,
    b: &'a mut Vec<u8>,
}

impl Write for Tee<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.a.write_all(buf)?;
        self.b.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.a.flush()
    }
}
