//! End-to-end tests of the `iris` binary: broken models and bad flags give one clear error
//! line (naming the file and tensor at fault) and a non-zero exit, never a panic; the
//! subcommands work on the tiny fixtures. One test binary: the helpers here, the cases by
//! what they break or run (broken_models.rs, flags.rs, commands.rs; hub.rs: Hugging Face ids
//! against fake_hub.rs).

mod broken_models;
mod commands;
mod fake_hub;
mod flags;
mod hub;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use clap::CommandFactory;
use iris::config::Arch;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("iris-cli-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of a fixture model directory (without the reference files).
fn copy_fixture(name: &str) -> TempDir {
    let dst = TempDir::new(name);
    for e in std::fs::read_dir(fixture(name)).expect("read fixture") {
        let p = e.expect("entry").path();
        let fname = p.file_name().unwrap().to_string_lossy().to_string();
        if fname.starts_with("reference") {
            continue;
        }
        std::fs::copy(&p, dst.join(&fname)).expect("copy fixture file");
    }
    dst
}

fn iris_cmd(args: &[&str]) -> (Command, TempDir) {
    let cache = TempDir::new("cache");
    let mut c = Command::new(env!("CARGO_BIN_EXE_iris"));
    c.args(args)
        .env("IRIS_CACHE", cache.path())
        .env_remove("IRIS_MODEL")
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    (c, cache)
}

fn iris(args: &[&str]) -> Output {
    let (mut c, _cache) = iris_cmd(args);
    c.output().expect("run iris")
}

fn iris_with_stdin(args: &[&str], input: &str) -> Output {
    let (mut c, _cache) = iris_cmd(args);
    c.stdin(Stdio::piped());
    let mut child = c.spawn().expect("spawn iris");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write stdin");
    child.wait_with_output().expect("wait iris")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_no_panic(out: &Output) {
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "iris panicked:\n{stderr}");
    assert_ne!(out.status.code(), Some(101), "exit code 101 is a panic:\n{stderr}");
}

/// Runs iris, expecting failure with exactly one `error:` line on stderr that contains
/// every string of `must_name`. Returns that line.
fn expect_error(args: &[&str], must_name: &[&str]) -> String {
    let out = iris(args);
    check_error(&out, args, must_name)
}

fn check_error(out: &Output, args: &[&str], must_name: &[&str]) -> String {
    let stderr = text(&out.stderr);
    assert_no_panic(out);
    assert!(!out.status.success(), "iris {args:?} succeeded; stderr:\n{stderr}");
    assert!(out.status.code().is_some(), "iris {args:?} was killed by a signal; stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "iris {args:?}: stderr must be one line, got:\n{stderr}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "iris {args:?}: stderr must start with `error: `, got:\n{stderr}");
    for s in must_name {
        assert!(line.contains(s), "iris {args:?}: error should name `{s}`:\n{line}");
    }
    line.to_string()
}

fn generate_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["generate", "--model", model, "--prompt", "The quick", "--max-tokens", "4", "--quiet"];
    v.extend_from_slice(extra);
    v
}

/// The safetensors header: (tensor name -> (dtype, shape, data byte range)).
fn safetensors_header(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(path).expect("read safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header json");
    let mut map = json.as_object().expect("header object").clone();
    map.remove("__metadata__");
    map
}

fn rewrite_safetensors(path: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let mut tensors = candle_core::safetensors::load(path, &Device::Cpu).expect("load safetensors");
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, path).expect("save safetensors");
}

/// tiny-llama as a GGUF file (F32 tensors under llama.cpp names, gpt2 tokenizer metadata).
fn write_tiny_llama_gguf(path: &Path) {
    write_tiny_llama_gguf_as(path, GgmlDType::F32)
}

/// tiny-llama as a GGUF file with its matrices as `dt` (norms stay F32).
fn write_tiny_llama_gguf_as(path: &Path, dt: GgmlDType) {
    let dir = fixture("tiny-llama");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    let u = |k: &str| Value::U32(cfg[k].as_u64().unwrap() as u32);

    let mut vocab: Vec<(String, u64)> =
        tok["model"]["vocab"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap())).collect();
    for t in tok["added_tokens"].as_array().unwrap() {
        let (c, id) = (t["content"].as_str().unwrap().to_string(), t["id"].as_u64().unwrap());
        if !vocab.iter().any(|(_, i)| *i == id) {
            vocab.push((c, id));
        }
    }
    vocab.sort_by_key(|(_, id)| *id);
    let tokens: Vec<Value> = vocab.iter().map(|(t, _)| Value::String(t.clone())).collect();
    let merges: Vec<Value> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::Array(p) => {
                Value::String(format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()))
            }
            s => Value::String(s.as_str().unwrap().to_string()),
        })
        .collect();
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.embedding_length", u("hidden_size")),
        ("llama.feed_forward_length", u("intermediate_size")),
        ("llama.block_count", u("num_hidden_layers")),
        ("llama.attention.head_count", u("num_attention_heads")),
        ("llama.attention.head_count_kv", u("num_key_value_heads")),
        ("llama.attention.key_length", u("head_dim")),
        ("llama.context_length", u("max_position_embeddings")),
        ("llama.vocab_size", u("vocab_size")),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.merges", Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    let st = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = st.keys().collect();
    names.sort();
    let mut qs: Vec<(String, QTensor)> = Vec::new();
    for n in names {
        let g = iris::weights::gguf_name(n, Arch::Llama).unwrap_or_else(|| panic!("no gguf name for {n}"));
        let t = &st[n];
        let matrix = t.rank() == 2 && t.dims()[1] % dt.block_size() == 0;
        qs.push((g, QTensor::quantize(t, if matrix { dt } else { GgmlDType::F32 }).unwrap()));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let q_refs: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &q_refs).unwrap();
}

fn truncate(path: &Path, len: u64) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

fn stdout_of(args: &[&str]) -> String {
    let out = iris(args);
    assert_no_panic(&out);
    assert!(out.status.success(), "iris {args:?} failed:\n{}", text(&out.stderr));
    text(&out.stdout)
}
