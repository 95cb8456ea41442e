//! The subcommands, end to end, on the tiny fixtures.

use super::*;

/// `IRIS_CPU_ISA` picks the CPU kernels' instruction set: unknown names and sets this CPU
/// lacks are refused in one line, `inspect` names the set in use, and every set the CPU has
/// generates the same tokens (the kernels give the same bits on all of them) from quantized
/// weights.
#[test]
fn cpu_instruction_set_override() {
    let tmp = TempDir::new("isa");
    let gguf = tmp.join("tiny-q4_1.gguf");
    write_tiny_llama_gguf_as(&gguf, GgmlDType::Q4_1);
    let m = gguf.to_str().unwrap();
    let with_isa = |isa: &str, args: &[&str]| {
        let (mut c, _cache) = iris_cmd(args);
        c.env("IRIS_CPU_ISA", isa).output().expect("run iris")
    };
    let inspect = ["inspect", "--model", m];
    let out = with_isa("sse9", &inspect);
    check_error(&out, &inspect, &["IRIS_CPU_ISA", "sse9", "avx512, avx2, neon or portable"]);
    let lacking = if cfg!(target_arch = "aarch64") { "avx2" } else { "neon" };
    let out = with_isa(lacking, &inspect);
    check_error(&out, &inspect, &["IRIS_CPU_ISA", lacking, "does not have", "portable"]);

    let out = with_isa("portable", &inspect);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("CPU kernels:      portable"), "{}", text(&out.stdout));
    let best = stdout_of(&inspect);
    let line = best.lines().find(|l| l.starts_with("CPU kernels:")).expect("inspect names the CPU kernels");
    let have: Vec<String> =
        line.split("this CPU has: ").nth(1).unwrap().trim_end_matches(')').split(", ").map(String::from).collect();
    assert!(line.contains(&format!("CPU kernels:      {} ", have[0])), "the best set by default: {line}");

    // On the CPU whatever this build has: the instruction set picks CPU kernels only.
    let gen = [
        "generate",
        "--device",
        "cpu",
        "--model",
        m,
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
        "--quiet",
    ];
    let reference = text(&with_isa("portable", &gen).stdout);
    assert!(!reference.trim().is_empty());
    for isa in &have {
        let out = with_isa(isa, &gen);
        assert!(out.status.success(), "{isa}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), reference, "{isa} generates other tokens than the portable kernels");
    }
}

#[test]
fn generate_greedy_matches_reference() {
    let dir = fixture("tiny-llama");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let prompt = reference["text_prompt"].as_str().unwrap();
    let ids: Vec<u32> =
        reference["text_generated_ids"].as_array().unwrap()[..8].iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let tok = iris::tokenizer::TextTokenizer::from_dir(&dir).unwrap();
    let expected = tok.decode(&ids, true).unwrap();

    let m = dir.to_str().unwrap();
    let args = ["generate", "--model", m, "--prompt", prompt, "--max-tokens", "8", "--temperature", "0"];
    let out = iris(&args);
    assert_no_panic(&out);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let got = text(&out.stdout);
    assert_eq!(got.strip_suffix('\n').unwrap_or(&got), expected);
    // Timing statistics go to stderr, not stdout.
    assert!(text(&out.stderr).contains("generated"), "{}", text(&out.stderr));

    let short = ["generate", "--model", m, "--prompt", "The quick", "--max-tokens", "8", "--temperature", "0"];
    let a = stdout_of(&short);
    assert!(!a.trim().is_empty(), "empty continuation");
    assert_eq!(a, stdout_of(&short), "greedy decoding must be deterministic");
}

#[test]
fn generate_chat_and_seeded_sampling() {
    let m = fixture("tiny-llama");
    let m = m.to_str().unwrap();
    let chat = ["generate", "--model", m, "--chat", "--prompt", "Hello there", "--max-tokens", "8", "-q"];
    let a = stdout_of(&chat);
    assert!(!a.trim().is_empty());
    assert_eq!(a, stdout_of(&chat));

    let sampled = |seed: &str| {
        stdout_of(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "The quick",
            "--max-tokens",
            "12",
            "--temperature",
            "1",
            "--seed",
            seed,
            "--ignore-eos",
            "-q",
        ])
    };
    let s7 = sampled("7");
    assert!(!s7.trim().is_empty());
    assert_eq!(s7, sampled("7"), "the same seed must give the same output");
    assert_ne!(s7, sampled("8"), "different seeds should (almost surely) differ");
}

/// A hybrid model (Qwen3.5's Gated DeltaNet layers) speculates on the CPU, its recurrent
/// state rolled back after rejected drafts: the same greedy text as without speculation.
#[test]
fn hybrid_model_generates_the_same_with_speculation() {
    let m = fixture("tiny-qwen3.5");
    let m = m.to_str().unwrap();
    let prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the";
    let run = |extra: &[&str]| {
        let base = ["generate", "--model", m, "--device", "cpu", "--prompt", prompt, "--max-tokens", "24"];
        stdout_of(&[&base[..], &["--temperature", "0", "--ignore-eos", "-q"], extra].concat())
    };
    let plain = run(&[]);
    assert!(!plain.trim().is_empty(), "empty continuation");
    for k in ["1", "3"] {
        let spec = format!(r#"{{"method": "ngram", "num_speculative_tokens": {k}}}"#);
        assert_eq!(run(&["--speculative-config", &spec]), plain, "K={k}");
    }
}

#[test]
fn generate_from_gguf_default_dir() {
    // A directory holding exactly one .gguf resolves to it.
    let tmp = TempDir::new("gguf-dir");
    write_tiny_llama_gguf(&tmp.join("tiny.gguf"));
    let out = stdout_of(&["generate", "--model", tmp.arg(), "--prompt", "The quick", "--max-tokens", "4", "-q"]);
    assert!(!out.trim().is_empty());
    let inspect = stdout_of(&["inspect", "--model", tmp.arg()]);
    assert!(inspect.contains("GGUF"), "{inspect}");
}

#[test]
fn inspect_reports_architecture_parameters_and_kv() {
    let dir = fixture("tiny-qwen3");
    let out = stdout_of(&["inspect", "--model", dir.to_str().unwrap()]);
    // Expected numbers from the files themselves.
    let mut params = 0u64;
    let mut n_files = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("model-") && name.ends_with(".safetensors") {
            n_files += 1;
            for (_, info) in safetensors_header(&p) {
                params += info["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product::<u64>();
            }
        }
    }
    assert_eq!(n_files, 3);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let c = |k: &str| cfg[k].as_u64().unwrap();
    let kv_f32 = c("num_hidden_layers") * 2 * c("num_key_value_heads") * c("head_dim") * 4;

    let line = |key: &str| {
        out.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no `{key}` line in:\n{out}")).to_string()
    };
    assert!(line("architecture:").contains("qwen3"), "{out}");
    let p = line("parameters:");
    let count: u64 = p.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(count, params, "{out}");
    let kv: Vec<String> = out.lines().filter(|l| l.starts_with("KV bytes/token:")).map(String::from).collect();
    assert!(kv.iter().any(|l| l.contains(&format!(" {kv_f32} (f32)"))), "{out}");
    assert!(kv.iter().any(|l| l.contains(&format!(" {} (bf16)", kv_f32 / 2))), "{out}");
    assert!(line("format:").contains("3 files"), "{out}");

    // Every fixture's parameter count matches its files (tied embeddings counted once).
    for name in ["tiny-llama", "tiny-qwen2", "tiny-gemma3"] {
        let dir = fixture(name);
        let out = stdout_of(&["inspect", "--model", dir.to_str().unwrap()]);
        let expected: u64 = safetensors_header(&dir.join("model.safetensors"))
            .values()
            .map(|i| i["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product::<u64>())
            .sum();
        let p = out.lines().find(|l| l.starts_with("parameters:")).unwrap();
        let count: u64 = p.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert_eq!(count, expected, "{name}:\n{out}");
    }
}

/// A TurboQuant cache with a float window and a float layer generates (on the CPU: the only
/// device TurboQuant runs on so far), and `eval-kv`
/// prints its table.
#[test]
fn turboquant_cache_generates_and_evaluates() {
    let m = fixture("tiny-llama");
    let m = m.to_str().unwrap();
    let args = ["--device", "cpu", "--kv-cache-dtype", "tq-k3v4", "--kv-float-window", "4", "--kv-skip-layers", "-1"];
    let out = iris(&generate_args(m, &args));
    assert_no_panic(&out);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let text_file = std::env::temp_dir().join(format!("iris-eval-kv-{}.txt", std::process::id()));
    std::fs::write(&text_file, "The quick brown fox jumps over the lazy dog. ".repeat(8)).unwrap();
    let table = stdout_of(&[
        "eval-kv",
        "--model",
        m,
        "--text",
        text_file.to_str().unwrap(),
        "--chunk",
        "7",
        "--variant",
        "tq-k4v4",
        "--variant",
        "tq-k2v3/w8/s0",
    ]);
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| KV")).collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert!(rows[0].starts_with("| bf16 | 256 | 1.00x |"), "{table}");
    assert!(rows[1].starts_with("| tq-k4v4 | 96 | 2.67x |"), "{table}");
    expect_error(&["eval-kv", "--model", m, "--text", "/nonexistent"], &["--text", "/nonexistent"]);
    let bad = ["eval-kv", "--model", m, "--text", text_file.to_str().unwrap(), "--variant", "bf16/w4"];
    expect_error(&bad, &["bf16/w4"]);
    std::fs::remove_file(&text_file).ok();
}

#[test]
fn chat_through_stdin() {
    let m = fixture("tiny-llama");
    let args = ["chat", "--model", m.to_str().unwrap(), "--max-tokens", "6"];
    let out = iris_with_stdin(&args, "hello\n/reset\nhi\n/exit\n");
    assert_no_panic(&out);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.matches("> ").count() >= 3, "prompts: {stdout:?}");
    assert!(text(&out.stderr).contains("reset"), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("error"), "{}", text(&out.stderr));

    // End of input without /exit also ends cleanly.
    let out = iris_with_stdin(&args, "hello\n");
    assert_no_panic(&out);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn bench_json() {
    let m = fixture("tiny-llama");
    let args = [
        "bench",
        "--model",
        m.to_str().unwrap(),
        "--batch-sizes",
        "1,2",
        "--prompt-len",
        "8",
        "--gen-len",
        "4",
        "--repeats",
        "1",
        "--json",
    ];
    let out = stdout_of(&args);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"));
    let rows = v["rows"].as_array().expect("an array of rows");
    assert_eq!(rows.len(), 2, "{out}");
    assert!(v["image"].is_null(), "a text model has no image benchmark: {out}");
    for (row, batch) in rows.iter().zip([1, 2]) {
        assert_eq!(row["batch"], batch);
        assert_eq!(row["prompt_len"], 8);
        assert_eq!(row["gen_len"], 4);
        for k in ["prefill_tok_s", "ttft_ms", "decode_tok_s", "total_tok_s"] {
            let x = row[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {out}"));
            assert!(x.is_finite() && x > 0.0, "{k} = {x}: {out}");
        }
    }
    // The table form too.
    let args_table: Vec<&str> = args[..args.len() - 1].to_vec();
    let table = stdout_of(&args_table);
    assert!(table.starts_with("| batch"), "{table}");
    assert_eq!(table.lines().count(), 4, "{table}");
    // --image needs a vision-language model.
    let img = fixture("tiny-qwen2-vl").join("image_square.png");
    expect_error(&["bench", "--model", m.to_str().unwrap(), "--image", img.to_str().unwrap()], &["images"]);
}

#[test]
fn bench_reports_the_vision_tower_and_image_ttft() {
    for model in ["tiny-qwen2-vl", "tiny-qwen2.5-vl"] {
        let m = fixture(model);
        let image = m.join("image_70x90.png");
        let base = ["bench", "--model", m.to_str().unwrap(), "--batch-sizes", "1", "--prompt-len", "8"];
        let base = [&base[..], &["--gen-len", "2", "--repeats", "2"]].concat();
        // A generated image (the default size, 448x448), and a file.
        for (extra, size, tokens) in [
            (vec![], (448, 448), None),
            (vec!["--image-size", "300x200"], (300, 200), None),
            // 90 wide, 70 high; transformers' processor: grid [1, 4, 6] -> 24 / (2 x 2) tokens.
            (vec!["--image", image.to_str().unwrap()], (90, 70), Some(6)),
        ] {
            let args = [&base[..], &extra[..], &["--json"]].concat();
            let out = stdout_of(&args);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"));
            let i = &v["image"];
            assert_eq!((i["width"].as_u64(), i["height"].as_u64()), (Some(size.0), Some(size.1)), "{out}");
            let n = i["image_tokens"].as_u64().expect("image_tokens");
            if let Some(t) = tokens {
                assert_eq!(n, t, "{model}: {out}");
            }
            assert!(n > 0 && i["prompt_len"].as_u64().unwrap() > n, "{out}");
            for k in ["preprocess_ms", "vision_ms_per_image", "ttft_ms"] {
                let x = i[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {out}"));
                assert!(x.is_finite() && x > 0.0, "{model}: {k} = {x}: {out}");
            }
            assert_eq!(v["rows"].as_array().map(Vec::len), Some(1), "{out}");
        }
        let table = stdout_of(&base);
        assert!(table.contains("| vision ms/image |") && table.contains("| 448x448 |"), "{table}");
    }
    let m = fixture("tiny-qwen2-vl");
    expect_error(&["bench", "--model", m.to_str().unwrap(), "--image-size", "448"], &["--image-size"]);
    expect_error(&["bench", "--model", m.to_str().unwrap(), "--image", "/nonexistent.png"], &["/nonexistent.png"]);
}

/// `--conversation-turns`: each turn's prompt grows by the user message and the answer, the
/// cache holds all but the turn's last partial block and its new tokens, and every time is
/// measured; with `--conversation-image` the first turn opens with the image's tokens.
#[test]
fn bench_conversation_with_and_without_an_image() {
    let (user, answer) = (16, 4);
    for (model, image) in [("tiny-llama", false), ("tiny-qwen2.5-vl", true)] {
        let m = fixture(model);
        let mut args = vec!["bench", "--model", m.to_str().unwrap(), "--conversation-turns", "3", "--prompt-len", "16"];
        args.extend(["--gen-len", "4", "--repeats", "1", "--block-size", "4", "--json"]);
        if image {
            args.push("--conversation-image");
        }
        let out = stdout_of(&args);
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"));
        assert_eq!(rows.len(), 3, "{out}");
        let len = |i: usize| rows[i]["prompt_len"].as_u64().unwrap() as usize;
        let cached = |i: usize| rows[i]["cached"].as_u64().unwrap() as usize;
        // A text conversation starts with the user's text; an image one with its image prompt.
        assert_eq!(len(0) == user, !image, "{model}: {out}");
        for t in 1..3 {
            assert_eq!(len(t), len(t - 1) + answer + user, "{model}: {out}");
            // Everything before the last turn's answer's last token, to whole blocks, less
            // what must be computed.
            assert!(cached(t) > cached(t - 1) && cached(t) + user + 4 + 8 >= len(t), "{model} turn {t}: {out}");
        }
        for r in &rows {
            for k in ["ttft_on_ms", "ttft_off_ms", "ttft_new_alone_ms"] {
                let x = r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {out}"));
                assert!(x.is_finite() && x > 0.0, "{model}: {k} = {x}: {out}");
            }
        }
    }
    let m = fixture("tiny-llama");
    expect_error(
        &["bench", "--model", m.to_str().unwrap(), "--conversation-turns", "2", "--conversation-image"],
        &["vision-language"],
    );
}

/// `--admit-prompt-len`: the streams' latencies before and while a long prompt is admitted,
/// which takes as many steps as its chunks (the threshold cuts it into more).
#[test]
fn bench_admission_of_a_long_prompt() {
    let m = fixture("tiny-llama");
    let run = |threshold: &str| -> serde_json::Value {
        let args = ["bench", "--model", m.to_str().unwrap(), "--admit-prompt-len", "600", "--streams", "3"];
        let more = ["--prompt-len", "12", "--gen-len", "5", "--max-num-batched-tokens", "200"];
        let args = [&args[..], &more[..], &["--long-prefill-token-threshold", threshold, "--json"]].concat();
        let out = stdout_of(&args);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"))
    };
    for (threshold, chunk) in [("0", 197), ("50", 50)] {
        let v = run(threshold);
        assert_eq!(v["streams"], 3, "{v}");
        assert_eq!(v["admitted_prompt_len"], 600, "{v}");
        // The streams' decodes take 3 of the step's 200 tokens; the rest (or the threshold) go
        // to the prompt, whose last step also samples its token.
        let steps = v["admission_steps"].as_u64().unwrap() as usize;
        assert_eq!(steps, 600usize.div_ceil(chunk), "threshold {threshold}: {v}");
        assert_eq!(v["steady"]["gaps"], 3 * 5, "{v}");
        assert_eq!(v["admitting"]["gaps"].as_u64().unwrap() as usize, 3 * steps, "{v}");
        for phase in ["steady", "admitting"] {
            for k in ["median_ms", "p99_ms", "max_ms"] {
                let x = v[phase][k].as_f64().unwrap_or_else(|| panic!("{phase}.{k}: {v}"));
                assert!(x.is_finite() && x > 0.0, "{phase}.{k} = {x}");
            }
        }
    }
    expect_error(&["bench", "--model", m.to_str().unwrap(), "--admit-prompt-len", "100000"], &["--max-model-len"]);
}

#[test]
fn inspect_load_reports_the_bytes_held_by_part() {
    let dir = fixture("tiny-qwen2-vl");
    let m = dir.to_str().unwrap();
    // At f32 every weight of the checkpoint is held as 4 bytes (tied embeddings: once).
    let (mut text, mut vision) = (0u64, 0u64);
    for (name, info) in safetensors_header(&dir.join("model.safetensors")) {
        let n: u64 = info["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product();
        *if name.starts_with("visual.") { &mut vision } else { &mut text } += 4 * n;
    }
    let held = |extra: &[&str]| -> String {
        let out = stdout_of(&[&["inspect", "--model", m, "--load"][..], extra].concat());
        out.lines().find(|l| l.starts_with("held when loaded:")).unwrap_or_else(|| panic!("{out}")).to_string()
    };
    assert_eq!(
        held(&[]),
        format!("held when loaded: {} bytes (f32): text model {text}, vision tower {vision}", text + vision)
    );
    assert_eq!(
        held(&["--limit-mm-per-prompt", r#"{"image": 0}"#]),
        format!("held when loaded: {text} bytes (f32): text model {text}, vision tower 0")
    );
}
