//! Images through `iris serve` on the tiny Qwen2-VL fixture: OpenAI `image_url` data URLs and
//! Anthropic base64 blocks give transformers' greedy continuation; `file://` URLs only under
//! --allowed-local-media-path; every bad image input gets a 400.

mod server_support;

use serde_json::{json, Value};
use server_support::{fixture, Server};

const MODEL: &str = "tiny-qwen2-vl";

fn b64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            out.push(if i <= c.len() { T[(n >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

fn data_url(file: &str) -> String {
    format!("data:image/png;base64,{}", b64(&std::fs::read(fixture(MODEL).join(file)).unwrap()))
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(MODEL).join("reference.json")).unwrap()).unwrap()
}

/// The case's messages with each `{"type": "image"}` part replaced by `image(file)`.
fn messages(case: &str, image: &dyn Fn(&str) -> Value) -> Value {
    let r = reference();
    let files: Vec<String> =
        r["cases"][case]["images"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
    let mut next = files.iter();
    let mut msgs = r["cases"][case]["messages"].clone();
    for m in msgs.as_array_mut().unwrap() {
        if let Some(parts) = m["content"].as_array_mut() {
            for p in parts.iter_mut().filter(|p| p["type"] == "image") {
                *p = image(next.next().unwrap());
            }
        }
    }
    msgs
}

/// transformers' greedy continuation as text, and the prompt length.
fn expected(case: &str) -> (String, usize) {
    let r = reference();
    let ids: Vec<u32> =
        r["cases"][case]["generated_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let tok = iris::tokenizer::TextTokenizer::from_dir(fixture(MODEL)).unwrap();
    (tok.decode(&ids, true).unwrap(), r["cases"][case]["input_ids"].as_array().unwrap().len())
}

fn openai_part(file: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": data_url(file)}})
}

fn chat(server: &Server, msgs: Value) -> server_support::Response {
    server.post(
        "/v1/chat/completions",
        &json!({"messages": msgs, "temperature": 0, "max_tokens": 10, "ignore_eos": true}),
    )
}

#[test]
fn openai_and_anthropic_images_give_the_reference_continuation() {
    let server = Server::start_model(MODEL, &[]);
    for case in ["single", "nonsquare", "multi"] {
        let r = chat(&server, messages(case, &openai_part));
        assert_eq!(r.status, 200, "{case}: {}", r.text());
        let v = r.json();
        let (text, prompt_len) = expected(case);
        assert_eq!(v["choices"][0]["message"]["content"], text, "{case}");
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len, "{case}: prompt tokens after expanding the images");
    }
    // Anthropic: the same single-image request as a base64 block.
    let block = |file: &str| {
        let bytes = std::fs::read(fixture(MODEL).join(file)).unwrap();
        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&bytes)}})
    };
    let r = server.post(
        "/v1/messages",
        &json!({"messages": messages("single", &block), "max_tokens": 10, "temperature": 0, "top_k": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let (text, prompt_len) = expected("single");
    // Anthropic's API has no ignore_eos: compare up to where the reference stops.
    let got = v["content"][0]["text"].as_str().unwrap();
    assert!(text.starts_with(got) && !got.is_empty(), "anthropic: {got:?} vs {text:?}");
    assert_eq!(v["usage"]["input_tokens"], prompt_len);
}

#[test]
fn local_files_only_under_the_allowed_directory() {
    let dir = fixture(MODEL);
    let server = Server::start_model(MODEL, &["--allowed-local-media-path", dir.to_str().unwrap()]);
    let file_part =
        |file: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}", dir.join(file).display())}});
    let r = chat(&server, messages("single", &file_part));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], expected("single").0);
    // `..` out of the directory, and a file that is not an image.
    let outside = |_: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}/../../../Cargo.toml", dir.display())}});
    let r = chat(&server, messages("single", &outside));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("outside the allowed media directory"), "{}", r.text());
    let not_image = |_: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}", dir.join("config.json").display())}});
    let r = chat(&server, messages("single", &not_image));
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn bad_images_are_400s() {
    let server = Server::start_model(MODEL, &["--max-image-pixels", "3000"]);
    let cases: Vec<(&str, Value)> = vec![
        ("not base64", json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}})),
        (
            "not an image",
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(b"hello world"))}}),
        ),
        (
            "truncated",
            json!({"type": "image_url", "image_url": {"url": data_url("image_square.png")[..200].to_string()}}),
        ),
        ("too many pixels (120x72 > 3000)", openai_part("image_120x72.png")),
        ("remote", json!({"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}})),
        ("file without the flag", json!({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}})),
        ("no url", json!({"type": "image_url", "image_url": {}})),
    ];
    for (what, part) in cases {
        let msgs = json!([{"role": "user", "content": [part, {"type": "text", "text": "Describe this image."}]}]);
        let r = chat(&server, msgs);
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let e = &r.json()["error"];
        assert!(e["param"].as_str().unwrap().starts_with("messages[0].content[0]"), "{what}: {e}");
    }
    // A model without a vision tower refuses images.
    let text_only = Server::start_model("tiny-llama", &[]);
    let r =
        chat(&text_only, json!([{"role": "user", "content": [openai_part_small(), {"type": "text", "text": "hi"}]}]));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("does not accept images"), "{}", r.text());
    // The server keeps serving after all of that.
    assert_eq!(chat(&server, json!([{"role": "user", "content": "hello"}])).status, 200);
}

fn openai_part_small() -> Value {
    openai_part("image_20x30.png")
}

/// The official Python SDKs (see tests/server_sdk.rs for how the interpreter is found).
#[test]
fn official_python_sdks_send_images() {
    let Some(py) = std::env::var("IRIS_TEST_PYTHON").ok() else {
        if let Ok(reason) = std::env::var("IRIS_SDK_SKIP_REASON") {
            eprintln!("skipped: {reason}");
            return;
        }
        assert!(std::env::var("CI").map_or(true, |v| v != "true"), "IRIS_TEST_PYTHON is not set");
        eprintln!("skipped: set IRIS_TEST_PYTHON to a python with the openai and anthropic packages");
        return;
    };
    let server = Server::start_model(MODEL, &["--served-model-name", "tiny-qwen2-vl"]);
    let r = reference();
    let question = r["cases"]["single"]["messages"][0]["content"][1]["text"].as_str().unwrap().to_string();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_sdk_vision.py");
    let out = std::process::Command::new(&py)
        .arg(&script)
        .arg("-v")
        .env("IRIS_BASE_URL", format!("http://{}", server.addr))
        .env("IRIS_IMAGE", fixture(MODEL).join("image_square.png"))
        .env("IRIS_QUESTION", question)
        .env("IRIS_EXPECTED", expected("single").0)
        .output()
        .expect("python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SDK vision tests failed:\n{stderr}\nserver log:\n{}", server.log());
}
