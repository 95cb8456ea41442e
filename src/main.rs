use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;

fn main() -> ExitCode {
    let cli = match iris::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    iris::cli::init_logging(cli.verbose);
    match iris::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, no backtrace: the error chain already names the file or flag at fault.
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !msg.contains(&c) {
                    msg.push_str(": ");
                    msg.push_str(&c);
                }
            }
            eprintln!("error: {}", msg.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

/// Bad command lines get one `error:` line too (clap's usage and hints are dropped; `--help`
/// has them). Help, version and a missing subcommand print as clap does.
fn usage_error(e: clap::Error) -> ExitCode {
    if !e.use_stderr() || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        e.exit();
    }
    let rendered = e.render().to_string();
    let mut msg = String::new();
    for line in rendered.lines().map(str::trim) {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if line.is_empty() {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(if line.starts_with("tip:") { "; " } else { " " });
        }
        msg.push_str(line);
    }
    if !msg.starts_with("error:") {
        msg.insert_str(0, "error: ");
    }
    eprintln!("{msg}");
    ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2))
}
