//! End-to-end tests of the `iris` binary: broken models and bad flags give one clear error
//! line (naming the file and tensor at fault) and a non-zero exit, never a panic; the
//! subcommands work on the tiny fixtures.

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

// ---------------------------------------------------------------------------------------------
// helpers

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

// ---------------------------------------------------------------------------------------------
// wrong or missing files

#[test]
fn model_path_does_not_exist() {
    let tmp = TempDir::new("nopath");
    let missing = tmp.join("no-such-model");
    let m = missing.to_str().unwrap();
    expect_error(&generate_args(m, &[]), &[m]);
    expect_error(&["inspect", "--model", m], &[m]);
    expect_error(&["bench", "--model", m], &[m]);
    expect_error(&["chat", "--model", m], &[m]);
}

#[test]
fn inspect_reports_total_and_active_parameters_of_a_moe_vlm() {
    // reference.json counts transformers' parameters (plus the router's correction bias) and
    // the language model's active ones: all but the 6 of 8 routed experts a token skips in each
    // MoE layer.
    let dir = fixture("tiny-glm4v-moe");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let (total, vision, active) = (
        r["n_params"].as_u64().unwrap(),
        r["n_vision_params"].as_u64().unwrap(),
        r["n_active_text_params"].as_u64().unwrap(),
    );
    let out = iris(&["inspect", "--model", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let line =
        |key: &str| stdout.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{stdout}")).to_string();
    let params = line("parameters:");
    assert!(params.contains(&format!(" {total} (")), "{params} vs {total}");
    assert!(params.contains(&format!("language model {}, vision tower {vision}", total - vision)), "{params}");
    let act = line("active per token:");
    assert!(
        act.contains(&format!(" {active} (")) && act.contains("2 of 8 routed experts, 1 shared"),
        "{act} vs {active}"
    );
    assert!(line("architecture:").contains("glm4v_moe"));
}

#[test]
fn directory_without_config_or_gguf() {
    let tmp = TempDir::new("empty");
    std::fs::write(tmp.join("README.md"), "nothing here").unwrap();
    let line = expect_error(&generate_args(tmp.arg(), &[]), &[tmp.arg()]);
    assert!(line.contains("config.json"), "{line}");
    expect_error(&["inspect", "--model", tmp.arg()], &[tmp.arg(), "config.json"]);
}

#[test]
fn garbage_gguf_file() {
    let tmp = TempDir::new("garbage");
    let f = tmp.join("model.gguf");
    let bytes: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(&f, bytes).unwrap();
    let p = f.to_str().unwrap();
    expect_error(&generate_args(p, &[]), &[p, "GGUF"]);
    expect_error(&["inspect", "--model", p], &[p, "GGUF"]);
    // A directory holding that one file resolves to it.
    expect_error(&["inspect", "--model", tmp.arg()], &[p]);
}

#[test]
fn truncated_gguf() {
    let tmp = TempDir::new("gguf");
    let f = tmp.join("tiny.gguf");
    write_tiny_llama_gguf(&f);
    let p = f.to_str().unwrap();
    // The intact file loads and generates.
    let out = iris(&generate_args(p, &["--temperature", "0"]));
    assert_no_panic(&out);
    assert!(out.status.success(), "intact GGUF: {}", text(&out.stderr));
    let len = std::fs::metadata(&f).unwrap().len();

    // Cut inside the tensor data: the error names the file and a tensor.
    truncate(&f, len - 1000);
    let line = expect_error(&generate_args(p, &[]), &[p, "tensor `"]);
    assert!(line.contains("truncated") || line.contains("remaining"), "{line}");

    // Cut inside the metadata: the header cannot be read.
    truncate(&f, 100);
    expect_error(&generate_args(p, &[]), &[p, "GGUF"]);
    expect_error(&["inspect", "--model", p], &[p, "GGUF"]);
    truncate(&f, 0);
    expect_error(&["inspect", "--model", p], &[p]);
}

#[test]
fn gguf_unknown_architecture() {
    let tmp = TempDir::new("gguf-arch");
    let f = tmp.join("m.gguf");
    let arch = Value::String("mamba".into());
    let mut file = std::fs::File::create(&f).unwrap();
    gguf_file::write(&mut file, &[("general.architecture", &arch)], &[]).unwrap();
    drop(file);
    let p = f.to_str().unwrap();
    expect_error(&generate_args(p, &[]), &[p, "mamba"]);
    expect_error(&["inspect", "--model", p], &[p, "mamba"]);
}

#[test]
fn config_invalid_json() {
    let m = copy_fixture("tiny-llama");
    std::fs::write(m.join("config.json"), "{ \"model_type\": \"llama\", ").unwrap();
    let cfg = m.join("config.json");
    let c = cfg.to_str().unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[c, "JSON"]);
    expect_error(&["inspect", "--model", m.arg()], &[c, "JSON"]);
}

fn edit_config(m: &TempDir, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = m.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// A vision-language checkpoint whose parts disagree: the vision tower's output width against
/// the language model's, the image processor's patches against the tower's. One error naming
/// the file and both values, for every VLM family.
#[test]
fn vision_config_mismatches() {
    for name in ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-glm4v", "tiny-glm4v-moe"] {
        let m = copy_fixture(name);
        let cfg = m.join("config.json");
        // Qwen2-VL names the merger's output `hidden_size`; the others `out_hidden_size`.
        let out_field = if name == "tiny-qwen2-vl" { "hidden_size" } else { "out_hidden_size" };
        edit_config(&m, |c| {
            c["vision_config"][out_field] = serde_json::json!(48);
        });
        let line = expect_error(&generate_args(m.arg(), &[]), &[cfg.to_str().unwrap(), "48"]);
        assert!(line.contains("language model takes"), "{name}: {line}");

        let m = copy_fixture(name);
        let pre = m.join("preprocessor_config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&pre).unwrap()).unwrap();
        v["patch_size"] = serde_json::json!(16);
        std::fs::write(&pre, v.to_string()).unwrap();
        expect_error(&generate_args(m.arg(), &[]), &[pre.to_str().unwrap(), "patch 16"]);
    }
}

#[test]
fn config_unknown_architecture() {
    let m = copy_fixture("tiny-llama");
    edit_config(&m, |c| {
        c.insert("model_type".into(), "mamba".into());
    });
    let cfg = m.join("config.json");
    let c = cfg.to_str().unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[c, "mamba", "architecture"]);
    expect_error(&["inspect", "--model", m.arg()], &[c, "mamba"]);
}

#[test]
fn config_missing_or_bad_fields() {
    let m = copy_fixture("tiny-llama");
    let cfg = m.join("config.json");
    let c = cfg.to_str().unwrap();
    edit_config(&m, |c| {
        c.remove("hidden_size");
    });
    expect_error(&generate_args(m.arg(), &[]), &[c, "hidden_size"]);
    expect_error(&["inspect", "--model", m.arg()], &[c, "hidden_size"]);

    // Values that would divide by zero or leave no layers.
    for (field, value) in [
        ("num_attention_heads", serde_json::json!(0)),
        ("num_key_value_heads", serde_json::json!(3)),
        ("num_hidden_layers", serde_json::json!(0)),
        ("vocab_size", serde_json::json!(0)),
        ("head_dim", serde_json::json!(0)),
        ("hidden_size", serde_json::json!("64")),
    ] {
        let m = copy_fixture("tiny-llama");
        let cfg = m.join("config.json");
        edit_config(&m, |c| {
            c.insert(field.into(), value.clone());
        });
        let line = expect_error(&generate_args(m.arg(), &[]), &[cfg.to_str().unwrap()]);
        assert!(line.contains(field), "{field}={value}: {line}");
        expect_error(&["inspect", "--model", m.arg()], &[cfg.to_str().unwrap(), field]);
    }
}

#[test]
fn truncated_safetensors() {
    let m = copy_fixture("tiny-llama");
    let st = m.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    truncate(&st, len / 2);
    let s = st.to_str().unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[s, "truncated"]);
    expect_error(&["inspect", "--model", m.arg()], &[s]);
    // Cut inside the header.
    truncate(&st, 20);
    expect_error(&generate_args(m.arg(), &[]), &[s]);
    truncate(&st, 3);
    expect_error(&generate_args(m.arg(), &[]), &[s]);
}

#[test]
fn truncated_shard() {
    let m = copy_fixture("tiny-qwen3");
    let shard = m.join("model-00002-of-00003.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    truncate(&shard, len - 10);
    expect_error(&generate_args(m.arg(), &[]), &[shard.to_str().unwrap()]);
}

#[test]
fn missing_shard() {
    let m = copy_fixture("tiny-qwen3");
    let shard = m.join("model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let line = expect_error(&generate_args(m.arg(), &[]), &[shard.to_str().unwrap()]);
    assert!(line.contains("model.safetensors.index.json"), "should say which index lists it: {line}");
    expect_error(&["inspect", "--model", m.arg()], &[shard.to_str().unwrap()]);
    // Nothing half-printed before the error.
    assert_eq!(text(&iris(&["inspect", "--model", m.arg()]).stdout), "");
}

#[test]
fn index_names_tensor_missing_from_its_shard() {
    // The index routes a tensor to a shard that does not hold it.
    let m = copy_fixture("tiny-qwen3");
    let index = m.join("model.safetensors.index.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let shard_name = v["weight_map"]["model.norm.weight"].as_str().unwrap().to_string();
    let shard = m.join(&shard_name);
    rewrite_safetensors(&shard, |t| {
        t.remove("model.norm.weight");
    });
    expect_error(&generate_args(m.arg(), &[]), &["model.norm.weight", m.arg()]);
}

#[test]
fn no_safetensors_files() {
    let m = copy_fixture("tiny-llama");
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[m.arg(), "safetensors"]);
}

#[test]
fn missing_tensor() {
    let m = copy_fixture("tiny-llama");
    let st = m.join("model.safetensors");
    rewrite_safetensors(&st, |t| {
        t.remove("model.norm.weight").expect("fixture has model.norm.weight");
    });
    expect_error(&generate_args(m.arg(), &[]), &[m.arg(), "model.norm.weight", "not found"]);
}

#[test]
fn tensor_with_wrong_shape() {
    let m = copy_fixture("tiny-llama");
    let st = m.join("model.safetensors");
    rewrite_safetensors(&st, |t| {
        t.insert("model.norm.weight".into(), Tensor::ones(63, candle_core::DType::F32, &Device::Cpu).unwrap());
    });
    // The file holding the tensor is named, with the tensor and both shapes.
    let line = expect_error(&generate_args(m.arg(), &[]), &[st.to_str().unwrap(), "model.norm.weight", "63", "64"]);
    assert!(!line.contains("panicked"));

    // A matrix with a wrong dimension, in a sharded model.
    let m = copy_fixture("tiny-qwen3");
    let index = m.join("model.safetensors.index.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let name = "model.layers.1.self_attn.k_proj.weight";
    let shard = m.join(v["weight_map"][name].as_str().unwrap());
    rewrite_safetensors(&shard, |t| {
        t.insert(name.into(), Tensor::zeros((32, 60), candle_core::DType::F32, &Device::Cpu).unwrap());
    });
    expect_error(&generate_args(m.arg(), &[]), &[shard.to_str().unwrap(), name, "[32, 60]"]);
}

#[test]
fn tensor_with_unsupported_dtype() {
    let m = copy_fixture("tiny-llama");
    let st = m.join("model.safetensors");
    rewrite_safetensors(&st, |t| {
        let w = t["model.norm.weight"].to_dtype(candle_core::DType::U8).unwrap();
        t.insert("model.norm.weight".into(), w);
    });
    let out = iris(&generate_args(m.arg(), &[]));
    // u8 weights either load (converted) or fail cleanly naming the tensor.
    assert_no_panic(&out);
    if !out.status.success() {
        check_error(&out, &[], &["model.norm.weight"]);
    }
}

#[test]
fn tokenizer_missing_or_corrupt() {
    let m = copy_fixture("tiny-llama");
    let tok = m.join("tokenizer.json");
    let t = tok.to_str().unwrap();
    std::fs::write(&tok, "{\"version\": \"1.0\", \"model\": ").unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[t]);
    std::fs::write(&tok, "{\"version\": \"1.0\"}").unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[t]);
    std::fs::remove_file(&tok).unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[t]);

    let m = copy_fixture("tiny-llama");
    let tc = m.join("tokenizer_config.json");
    std::fs::write(&tc, "not json").unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[tc.to_str().unwrap()]);

    let m = copy_fixture("tiny-llama");
    let j = m.join("chat_template.jinja");
    std::fs::write(&j, "{% for m in messages %}{{ m.content ").unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[j.to_str().unwrap()]);
    // `{%}` once made the `{% generation %}` rewrite slice backwards.
    std::fs::write(&j, "{%}").unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[j.to_str().unwrap()]);
}

#[test]
fn generation_config_invalid_json() {
    let m = copy_fixture("tiny-llama");
    let g = m.join("generation_config.json");
    std::fs::write(&g, "{ oops").unwrap();
    expect_error(&generate_args(m.arg(), &[]), &[g.to_str().unwrap()]);
}

// ---------------------------------------------------------------------------------------------
// bad flags

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

// ---------------------------------------------------------------------------------------------
// the subcommands, end to end

fn stdout_of(args: &[&str]) -> String {
    let out = iris(args);
    assert_no_panic(&out);
    assert!(out.status.success(), "iris {args:?} failed:\n{}", text(&out.stderr));
    text(&out.stdout)
}

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

    let gen = [
        "generate",
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
