//! Wrong or missing model files: one error line naming the file (and tensor) at fault.

use super::*;

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
    // reference.json counts transformers' parameters (GLM: plus the router's correction bias)
    // and the language model's active ones: all but the 6 of 8 routed experts a token skips in
    // each MoE layer.
    check_inspect_moe_vlm("tiny-glm4v-moe", "glm4v_moe");
    check_inspect_moe_vlm("tiny-qwen3.5-moe-vl", "qwen3_5_moe");
}

fn check_inspect_moe_vlm(name: &str, arch: &str) {
    let dir = fixture(name);
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
    assert!(line("architecture:").contains(arch), "{name}");
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
