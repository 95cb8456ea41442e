//! The official Python SDKs (openai, anthropic) against the real server: runs
//! tests/python/test_sdk.py with the interpreter named by IRIS_TEST_PYTHON (.ci/run makes a
//! venv with both SDKs and sets it), else `python3` if it has both SDKs. Without them the test
//! is skipped, saying why — except under CI=true, where it fails unless .ci/run said why
//! (IRIS_SDK_SKIP_REASON: pip could not install them).

mod server_support;

use std::process::Command;

use server_support::Server;

fn python() -> Option<String> {
    if let Ok(p) = std::env::var("IRIS_TEST_PYTHON") {
        return Some(p);
    }
    let ok = Command::new("python3")
        .args(["-c", "import openai, anthropic, jsonschema"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    ok.then(|| "python3".to_string())
}

/// The interpreter with the SDKs, or `None` when the test is to be skipped (said why).
fn sdk_python() -> Option<String> {
    let Some(py) = python() else {
        let msg = "the openai, anthropic and jsonschema Python packages are not installed: set IRIS_TEST_PYTHON to a \
                   python that has them (.ci/run does)";
        if let Ok(reason) = std::env::var("IRIS_SDK_SKIP_REASON") {
            eprintln!("skipped: {reason}");
            return None;
        }
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{msg}");
        }
        eprintln!("skipped: {msg}");
        return None;
    };
    Some(py)
}

#[test]
fn official_python_sdks() {
    let Some(py) = sdk_python() else { return };
    let s = Server::start(&["--api-key", "test-key", "--served-model-name", "tiny-llama"]);
    run_script(&py, "test_sdk.py", &s, "tiny-llama", &[]);
}

/// `iris serve` on the tiny Qwen3 fixture with Qwen3.5's real chat template, its XML tool
/// format and its thinking; the model directory (to remove) and its EOS id.
fn qwen35_server() -> (Server, std::path::PathBuf, String) {
    let model = server_support::model_with_template("tiny-qwen3", "Qwen3.5-4B.jinja");
    let s = Server::start_path(
        &model,
        &[
            "--api-key",
            "test-key",
            "--served-model-name",
            "tiny-qwen3",
            "claude-*",
            "--tool-call-parser",
            "qwen3_xml",
            "--enable-auto-tool-choice",
            "--reasoning-parser",
            "qwen3",
        ],
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("generation_config.json")).expect("config"))
            .expect("json");
    let eos = match &config["eos_token_id"] {
        serde_json::Value::Array(ids) => ids[0].clone(),
        id => id.clone(),
    };
    (s, model, eos.to_string())
}

/// Runs one of tests/python/ against `s`, serving `model`, with `env` set as well.
fn run_script(py: &str, script: &str, s: &Server, model: &str, env: &[(&str, &str)]) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(script);
    let out = Command::new(py)
        .arg(&script)
        .arg("-v")
        .env("IRIS_BASE_URL", format!("http://{}", s.addr))
        .env("IRIS_API_KEY", "test-key")
        .env("IRIS_MODEL", model)
        .envs(env.iter().copied())
        .output()
        .expect("python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "{} {env:?} failed:\n{stderr}\nserver log:\n{}", script.display(), s.log());
}

/// Tool round trips and forced calls through both SDKs (tests/python/test_sdk_tools.py).
#[test]
fn official_python_sdks_tools() {
    let Some(py) = sdk_python() else { return };
    let (s, model, _) = qwen35_server();
    run_script(&py, "test_sdk_tools.py", &s, "tiny-qwen3", &[]);
    drop(s);
    let _ = std::fs::remove_dir_all(&model);
}

/// The same through Gemma 4's format (tiny Gemma 4 with Gemma 4's tokenizer and template; the
/// tool and reasoning parsers read from the template): calls in `<|tool_call>call:f{..}` with
/// Gemma's quote tokens, held to the schemas in Gemma's syntax.
#[test]
fn official_python_sdks_tools_gemma4() {
    let Some(py) = sdk_python() else { return };
    let model = server_support::gemma4_chat_model();
    let s = Server::start_path(
        &model,
        &["--api-key", "test-key", "--served-model-name", "tiny-gemma4", "claude-*", "--enable-auto-tool-choice"],
    );
    run_script(&py, "test_sdk_tools.py", &s, "tiny-gemma4", &[]);
    drop(s);
    let _ = std::fs::remove_dir_all(&model);
}

/// The Responses API through the OpenAI SDK (tests/python/test_sdk_responses.py): create,
/// stream, previous_response_id, a function tool round trip.
#[test]
fn official_python_sdk_responses() {
    let Some(py) = sdk_python() else { return };
    let (s, model, eos) = qwen35_server();
    run_script(&py, "test_sdk_responses.py", &s, "tiny-qwen3", &[("IRIS_EOS_ID", &eos)]);
    drop(s);
    let _ = std::fs::remove_dir_all(&model);
}

/// Structured outputs through the OpenAI SDK (tests/python/test_sdk_structured.py): 100 seeds
/// at temperature 1 validated with `jsonschema`, without and with n-gram speculation.
#[test]
fn official_python_sdk_structured_outputs() {
    let Some(py) = sdk_python() else { return };
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}"#;
    for (extra, speculating) in [(None, "0"), (Some(spec), "1")] {
        let mut args = vec!["--api-key", "test-key", "--served-model-name", "tiny-llama"];
        if let Some(s) = extra {
            args.extend(["--speculative-config", s]);
        }
        let s = Server::start(&args);
        run_script(&py, "test_sdk_structured.py", &s, "tiny-llama", &[("IRIS_EXPECT_SPECULATION", speculating)]);
    }
}
