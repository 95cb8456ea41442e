use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = iris::cli::Cli::parse();
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
