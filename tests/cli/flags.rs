//! Bad flags and settings: one error line, before any model is run or any port is bound.

use super::*;

#[test]
fn bad_flags() {
    let m = fixture("tiny-llama");
    let m = m.to_str().unwrap();
    expect_error(&generate_args(m, &["--dtype", "f8"]), &["--dtype", "f8"]);
    expect_error(&generate_args(m, &["--kv-cache-dtype", "int4"]), &["--kv-cache-dtype", "int4"]);
    expect_error(&generate_args(m, &["--kv-cache-dtype", "tq-k1v4"]), &["--kv-cache-dtype", "tq-k1v4", "2..=4"]);
    expect_error(&generate_args(m, &["--kv-float-window", "8"]), &["--kv-float-window", "tq-kXvY"]);
    expect_error(&generate_args(m, &["--kv-skip-layers", "0"]), &["--kv-skip-layers"]);
    let tq = ["--kv-cache-dtype", "tq-k3v4"];
    expect_error(&generate_args(m, &[&tq[..], &["--kv-skip-layers", "5"]].concat()), &["layer 5", "2 layers"]);
    expect_error(&generate_args(m, &[&tq[..], &["--kv-skip-layers", "x"]].concat()), &["--kv-skip-layers", "x"]);
    let line = expect_error(&generate_args(m, &["--kv-cache-memory", "lots"]), &["--kv-cache-memory", "lots"]);
    assert!(line.contains("not a size"), "{line}");
    expect_error(&generate_args(m, &["--kv-cache-memory", "0"]), &["--kv-cache-memory"]);
    expect_error(&generate_args(m, &["--kv-cache-memory", "1KiB"]), &["--kv-cache-memory", "block"]);
    expect_error(
        &generate_args(m, &["--kv-cache-memory", "1MiB", "--max-model-len", "100000"]),
        &["--max-model-len", "100000"],
    );
    // No GPU 99 anywhere; without --features cuda any cuda device is refused the same way.
    expect_error(&generate_args(m, &["--device", "cuda:99"]), &["--device", "cuda:99"]);
    expect_error(&generate_args(m, &["--device", "cuda:x"]), &["--device", "cuda:x"]);
    expect_error(&generate_args(m, &["--device", "tpu"]), &["--device", "tpu"]);
    expect_error(&generate_args(m, &["--block-size", "0"]), &["block"]);
    expect_error(&generate_args(m, &["--max-num-seqs", "0"]), &["max-num-seqs"]);
    expect_error(&generate_args(m, &["--temperature", "-1"]), &["temperature", "-1"]);
    expect_error(&generate_args(m, &["--repetition-penalty", "-2"]), &["repetition_penalty"]);
    expect_error(&generate_args(m, &["--top-p", "1.5"]), &["top"]);
    expect_error(&generate_args(m, &["--temperature", "nan"]), &["temperature"]);
    expect_error(&generate_args(m, &["--speculative-config", "ngram"]), &["--speculative-config", "JSON"]);
    expect_error(
        &generate_args(m, &["--speculative-config", r#"{"method": "eagle", "num_speculative_tokens": 2}"#]),
        &["--speculative-config", "eagle", "ngram"],
    );
    expect_error(
        &generate_args(m, &["--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 0}"#]),
        &["num_speculative_tokens"],
    );
    expect_error(
        &generate_args(
            m,
            &[
                &tq[..],
                &[
                    "--kv-float-window",
                    "2",
                    "--speculative-config",
                    r#"{"method": "ngram", "num_speculative_tokens": 2}"#,
                ],
            ]
            .concat(),
        ),
        &["--kv-float-window 2", "num_speculative_tokens 2"],
    );
    // The Gemma 4 assistant: a model directory is needed, must exist, and must fit the target.
    let assistant = fixture("tiny-gemma4-assistant");
    let mtp = |dir: &str| format!(r#"{{"method": "gemma4_mtp", "model": "{dir}", "num_speculative_tokens": 2}}"#);
    expect_error(
        &generate_args(m, &["--speculative-config", r#"{"method": "gemma4_mtp", "num_speculative_tokens": 2}"#]),
        &["--speculative-config", "gemma4_mtp", "model"],
    );
    // The assistant runs on the CPU only so far (a GPU build refuses it before reading it).
    expect_error(
        &generate_args(m, &["--device", "cpu", "--speculative-config", &mtp("/nonexistent/dir")]),
        &["cannot read", "gemma4_assistant"],
    );
    expect_error(
        &generate_args(m, &["--device", "cpu", "--speculative-config", &mtp(assistant.to_str().unwrap())]),
        &["Gemma 4 target"],
    );
    // Tensor parallelism: ranks that do not divide the heads, and what is not divided yet.
    expect_error(
        &generate_args(m, &["--device", "cpu", "--tensor-parallel-size", "3"]),
        &["--tensor-parallel-size 3", "heads"],
    );
    expect_error(
        &generate_args(m, &["--device", "cpu", "--tensor-parallel-size", "2", "--kv-cache-dtype", "tq-k3v4"]),
        &["--tensor-parallel-size 2", "TurboQuant"],
    );
    expect_error(&["bench", "--model", m, "--all-accepted"], &["--speculative-config"]);
    expect_error(&["bench", "--model", m, "--repeats", "0"], &["--repeats"]);
    expect_error(&["bench", "--model", m, "--batch-sizes", "0"], &["--batch-sizes"]);
    // Flags clap rejects are one line too.
    expect_error(&generate_args(m, &["--top-k", "many"]), &["--top-k", "many"]);
    expect_error(&generate_args(m, &["--max-token", "3"]), &["--max-token"]);
    expect_error(&["generate", "--model", m], &["--prompt"]);
    expect_error(&["frobnicate"], &["frobnicate"]);
}

#[test]
fn prompt_longer_than_max_model_len() {
    let m = fixture("tiny-llama");
    let m = m.to_str().unwrap();
    let long = "word ".repeat(200);
    let args = ["generate", "--model", m, "--prompt", &long, "--max-model-len", "32", "--quiet"];
    expect_error(&args, &["32"]);
}

#[test]
fn help_mentions_every_flag() {
    let out = stdout_of(&["--help"]);
    for sub in ["generate", "chat", "inspect", "bench"] {
        assert!(out.contains(sub), "iris --help should list `{sub}`:\n{out}");
    }
    let cmd = iris::cli::Cli::command();
    for sub in cmd.get_subcommands() {
        let name = sub.get_name();
        let help = stdout_of(&[name, "--help"]);
        let mut n = 0;
        for arg in sub.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            n += 1;
            assert!(help.contains(&format!("--{long}")), "`iris {name} --help` does not mention --{long}:\n{help}");
            assert!(
                arg.get_help().is_some_and(|h| !h.to_string().trim().is_empty()),
                "--{long} of `iris {name}` has no help text"
            );
        }
        assert!(n >= 1, "{name}: {n} flags");
        assert!(help.contains("--model"), "{name}:\n{help}");
    }
    assert!(stdout_of(&["--version"]).contains(env!("CARGO_PKG_VERSION")));
}

/// Issue 22: nonsense serve flags and a model that cannot be read fail at start, before the
/// server binds, with one `error:` line; logs carry no colour codes when stderr is no terminal.
#[test]
fn serve_refuses_nonsense_flags_and_a_bad_model_before_binding() {
    let tiny = fixture("tiny-llama");
    let tiny = tiny.to_str().unwrap();
    for (flags, needle) in [
        (vec!["--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
        (vec!["--max-connections", "0"], "--max-connections"),
        (vec!["--timeout-keep-alive", "0"], "--timeout-keep-alive must be a positive"),
        (vec!["--header-read-timeout", "nan"], "--header-read-timeout"),
        (vec!["--request-timeout=-1"], "--request-timeout"),
        (vec!["--shutdown-timeout=-1"], "--shutdown-timeout"),
        (vec!["--max-num-seqs", "0"], "--max-num-seqs"),
        (vec!["--allowed-origins", "evil.example"], "is not an origin"),
        (vec!["--tool-call-parser", "pythonic"], "--tool-call-parser pythonic: not one of hermes"),
        (vec!["--reasoning-parser", "gpt_oss"], "--reasoning-parser gpt_oss: not one of qwen3"),
    ] {
        let mut args = vec!["serve", "--model", tiny, "--port", "0"];
        args.extend(flags.iter().copied());
        let out = iris(&args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(err.contains(needle), "{flags:?}: {err}");
        assert!(!err.contains("listening on"), "{flags:?} bound first: {err}");
    }
    let out = iris(&["serve", "--model", "/nonexistent/model", "--port", "0"]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("/nonexistent/model") && !err.contains("listening on"), "{err}");
    assert!(!err.contains('\u{1b}'), "no ANSI colours on a pipe: {err:?}");
}

#[test]
fn serve_logs_have_no_colour_codes_on_a_pipe() {
    let tiny = fixture("tiny-llama");
    let (mut c, _cache) =
        iris_cmd(&["serve", "--model", tiny.to_str().unwrap(), "--port", "0", "--kv-cache-memory", "8MiB"]);
    c.env_remove("NO_COLOR").env("RUST_LOG", "iris=info");
    let mut child = c.spawn().expect("spawn iris");
    let stderr = child.stderr.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stderr));
    let first = lines.next().expect("a log line").expect("text");
    let _ = child.kill();
    let _ = child.wait();
    assert!(first.contains("listening on"), "{first}");
    assert!(!first.contains('\u{1b}'), "{first:?}");
}

/// `--batch-invariant` on the CPU, whose kernels are batch-invariant always: accepted, the
/// same text (the CUDA side is tests/cuda_batch_invariant.rs).
#[test]
fn batch_invariant_changes_nothing_on_the_cpu() {
    let m = fixture("tiny-llama");
    let m = m.to_str().unwrap();
    let plain = iris(&generate_args(m, &["--device", "cpu"]));
    let invariant = iris(&generate_args(m, &["--device", "cpu", "--batch-invariant"]));
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert!(invariant.status.success(), "{}", text(&invariant.stderr));
    assert_eq!(text(&plain.stdout), text(&invariant.stdout));
}

#[test]
fn limit_mm_per_prompt_is_checked_at_start() {
    let m = fixture("tiny-llama");
    let m = m.to_str().unwrap();
    expect_error(&generate_args(m, &["--limit-mm-per-prompt", "image=0"]), &["--limit-mm-per-prompt", "JSON"]);
    expect_error(&generate_args(m, &["--limit-mm-per-prompt", r#"{"video": 1}"#]), &["--limit-mm-per-prompt", "video"]);
    expect_error(&generate_args(m, &["--limit-mm-per-prompt", r#"{"images": 1}"#]), &["images", "modality"]);
    expect_error(&generate_args(m, &["--limit-mm-per-prompt", r#"{"image": -1}"#]), &["image", "-1"]);
}
