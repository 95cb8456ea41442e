//! Images through `iris serve` on the tiny Qwen2-VL, GLM-4.6V-style (glm4v_moe), Gemma 4 and
//! Qwen3.5 / Qwen3.5-MoE fixtures:
//! OpenAI `image_url` data URLs and Anthropic base64 blocks give transformers' greedy
//! continuation; `/tokenize` and `count_tokens` count image tokens as the engine runs them;
//! `file://` URLs only under --allowed-local-media-path; http(s) URLs only with
//! --allow-remote-media and never to a local address; every bad image input gets a 400.

mod server_support;

use serde_json::{json, Value};
use server_support::{b64, case_messages, data_url, fixture, reference_case_text, reference_json, Server};

const MODEL: &str = "tiny-qwen2-vl";

fn openai_part(file: &str) -> Value {
    openai_part_of(MODEL, file)
}

fn openai_part_of(model: &str, file: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": data_url(model, file)}})
}

fn chat(server: &Server, msgs: Value) -> server_support::Response {
    server.post(
        "/v1/chat/completions",
        &json!({"messages": msgs, "temperature": 0, "max_tokens": 10, "ignore_eos": true}),
    )
}

/// Every image case through the OpenAI API, and the single-image case through the Anthropic
/// API, give transformers' greedy continuation.
fn check_reference_continuations(model: &str) {
    let server = Server::start_model(model, &[]);
    for case in ["single", "nonsquare", "multi"] {
        let r = chat(&server, case_messages(model, case, &|f: &str| openai_part_of(model, f)));
        assert_eq!(r.status, 200, "{model} {case}: {}", r.text());
        let v = r.json();
        let (text, prompt_len) = reference_case_text(model, case);
        assert_eq!(v["choices"][0]["message"]["content"], text, "{model} {case}");
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len, "{model} {case}: prompt tokens after expanding the images");
    }
    // Anthropic: the same single-image request as a base64 block; its system message goes in
    // the `system` field.
    let block = |file: &str| {
        let bytes = std::fs::read(fixture(model).join(file)).unwrap();
        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&bytes)}})
    };
    let mut msgs = case_messages(model, "single", &block);
    let mut body = json!({"max_tokens": 10, "temperature": 0, "top_k": 1});
    if msgs[0]["role"] == "system" {
        body["system"] = msgs[0]["content"].clone();
        msgs.as_array_mut().unwrap().remove(0);
    }
    body["messages"] = msgs;
    let r = server.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{model}: {}", r.text());
    let v = r.json();
    let (text, prompt_len) = reference_case_text(model, "single");
    // Anthropic's API has no ignore_eos: compare up to where the reference stops.
    let got = v["content"][0]["text"].as_str().unwrap();
    assert!(text.starts_with(got) && !got.is_empty(), "{model} anthropic: {got:?} vs {text:?}");
    assert_eq!(anthropic_prompt_tokens(&v["usage"]), prompt_len as u64, "{model}");
}

#[test]
fn openai_and_anthropic_images_give_the_reference_continuation() {
    check_reference_continuations(MODEL);
}

#[test]
fn glm4v_moe_images_give_the_reference_continuation() {
    check_reference_continuations("tiny-glm4v-moe");
}

#[test]
fn gemma4_images_give_the_reference_continuation() {
    check_reference_continuations("tiny-gemma4");
}

#[test]
fn qwen35_images_give_the_reference_continuation() {
    check_reference_continuations("tiny-qwen3.5-vl");
}

#[test]
fn qwen35_moe_images_give_the_reference_continuation() {
    check_reference_continuations("tiny-qwen3.5-moe-vl");
}

#[test]
fn local_files_only_under_the_allowed_directory() {
    let dir = fixture(MODEL);
    let server = Server::start_model(MODEL, &["--allowed-local-media-path", dir.to_str().unwrap()]);
    let file_part =
        |file: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}", dir.join(file).display())}});
    let r = chat(&server, case_messages(MODEL, "single", &file_part));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], reference_case_text(MODEL, "single").0);
    // `..` out of the directory, and a file that is not an image.
    let outside = |_: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}/../../../Cargo.toml", dir.display())}});
    let r = chat(&server, case_messages(MODEL, "single", &outside));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("not a file under the allowed media directory"), "{}", r.text());
    // Whether a file outside exists is not revealed: a missing one gets the same answer.
    let error_of = |r: &server_support::Response| r.json()["error"]["message"].as_str().unwrap().to_string();
    let missing = |_: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}/../../../no-such-file", dir.display())}});
    let r2 = chat(&server, case_messages(MODEL, "single", &missing));
    assert_eq!(r2.status, 400, "{}", r2.text());
    assert_eq!(error_of(&r2).replace("no-such-file", "Cargo.toml"), error_of(&r), "{}", r2.text());
    // RFC 8089: `file://localhost/`, a scheme in capitals, percent-escapes.
    let path = dir.join("image_square.png").display().to_string();
    for url in
        [format!("file://localhost{path}"), format!("FILE://{path}"), format!("file://{}", path.replace('_', "%5F"))]
    {
        let part = |_: &str| json!({"type": "image_url", "image_url": {"url": url.clone()}});
        let r = chat(&server, case_messages(MODEL, "single", &part));
        assert_eq!(r.status, 200, "{url}: {}", r.text());
    }
    let not_image = |_: &str| json!({"type": "image_url", "image_url": {"url": format!("file://{}", dir.join("config.json").display())}});
    let r = chat(&server, case_messages(MODEL, "single", &not_image));
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
            json!({"type": "image_url", "image_url": {"url": data_url(MODEL, "image_square.png")[..200].to_string()}}),
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

fn anthropic_block_of(model: &str, file: &str) -> Value {
    let bytes = std::fs::read(fixture(model).join(file)).unwrap();
    json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&bytes)}})
}

#[test]
fn tokenize_and_count_tokens_count_the_image_tokens() {
    for model in [MODEL, "tiny-glm4v-moe"] {
        let server = Server::start_model(model, &[]);
        let r = reference_json(model);
        for case in ["single", "nonsquare", "multi"] {
            // transformers' processor: the prompt with each image's tokens expanded to its grid.
            let want: Vec<u64> =
                r["cases"][case]["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            let msgs = case_messages(model, case, &|f: &str| openai_part_of(model, f));
            let t = server.post("/tokenize", &json!({ "messages": msgs }));
            assert_eq!(t.status, 200, "{model} {case}: {}", t.text());
            let t = t.json();
            let tokens: Vec<u64> = t["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            assert_eq!(tokens, want, "{model} {case}: /tokenize vs the processor's input_ids");
            assert_eq!(t["count"], want.len(), "{model} {case}");
            // The engine's own prompt for the same request.
            let used = chat(&server, msgs).json()["usage"]["prompt_tokens"].clone();
            assert_eq!(t["count"], used, "{model} {case}: /tokenize vs the prompt the engine ran");

            // Anthropic: the system message goes in `system`.
            let mut msgs = case_messages(model, case, &|f: &str| anthropic_block_of(model, f));
            let mut body = json!({});
            if msgs[0]["role"] == "system" {
                body["system"] = msgs[0]["content"].clone();
                msgs.as_array_mut().unwrap().remove(0);
            }
            body["messages"] = msgs;
            let c = server.post("/v1/messages/count_tokens", &body);
            assert_eq!(c.status, 200, "{model} {case}: {}", c.text());
            assert_eq!(c.json()["input_tokens"], want.len(), "{model} {case}: count_tokens");
            body["max_tokens"] = json!(1);
            let m = server.post("/v1/messages", &body);
            assert_eq!(anthropic_prompt_tokens(&m.json()["usage"]), want.len() as u64, "{model} {case}: /v1/messages");
        }
    }
    // Bad images are 400s here too.
    let server = Server::start_model(MODEL, &[]);
    let bad =
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]);
    assert_eq!(server.post("/tokenize", &json!({ "messages": bad })).status, 400);
}

#[test]
fn remote_urls_need_the_flag_and_never_reach_local_addresses() {
    let remote = |url: &str| json!({"type": "image_url", "image_url": {"url": url}});
    let remote_block = |url: &str| json!({"type": "image", "source": {"type": "url", "url": url}});
    let ask =
        |part: Value| json!([{"role": "user", "content": [part, {"type": "text", "text": "Describe this image."}]}]);

    let server = Server::start_model(MODEL, &[]);
    let r = chat(&server, ask(remote("https://example.com/cat.png")));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("--allow-remote-media"), "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "messages[0].content[0].image_url.url");
    let m = server
        .post("/v1/messages", &json!({"messages": ask(remote_block("https://example.com/cat.png")), "max_tokens": 4}));
    assert_eq!(m.status, 400, "{}", m.text());
    assert!(m.text().contains("--allow-remote-media"), "{}", m.text());
    drop(server);

    // With the flag, a server on 127.0.0.1 is still out of reach, by address or by name.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = Server::start_model(MODEL, &["--allow-remote-media"]);
    for url in [format!("http://127.0.0.1:{port}/cat.png"), format!("http://localhost:{port}/cat.png")] {
        let r = chat(&server, ask(remote(&url)));
        assert_eq!(r.status, 400, "{url}: {}", r.text());
        let e = &r.json()["error"];
        // What a name resolves to stays in the log (an address the client wrote is named).
        let m = e["message"].as_str().unwrap();
        if url.contains("localhost") {
            assert!(m.contains("not a public address") && !m.contains("127.0.0.1") && !m.contains("loopback"), "{e}");
        } else {
            assert!(m.contains("loopback"), "{url}: {e}");
        }
        assert_eq!(e["param"], "messages[0].content[0].image_url.url");
        let m = server.post("/v1/messages", &json!({"messages": ask(remote_block(&url)), "max_tokens": 4}));
        assert_eq!(m.status, 400, "{url}: {}", m.text());
        let t = server.post("/tokenize", &json!({"messages": ask(remote(&url))}));
        assert_eq!(t.status, 400, "{url}: {}", t.text());
    }
    let r = chat(&server, ask(remote("http://169.254.169.254/latest/meta-data/")));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("link-local"), "{}", r.text());
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the server connected to the local listener"
    );
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
    let r = reference_json(MODEL);
    let question = r["cases"]["single"]["messages"][0]["content"][1]["text"].as_str().unwrap().to_string();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_sdk_vision.py");
    let out = std::process::Command::new(&py)
        .arg(&script)
        .arg("-v")
        .env("IRIS_BASE_URL", format!("http://{}", server.addr))
        .env("IRIS_IMAGE", fixture(MODEL).join("image_square.png"))
        .env("IRIS_QUESTION", question)
        .env("IRIS_EXPECTED", reference_case_text(MODEL, "single").0)
        .output()
        .expect("python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SDK vision tests failed:\n{stderr}\nserver log:\n{}", server.log());
}

/// An Anthropic reply's whole prompt: computed (`input_tokens`) and read from the prefix cache.
fn anthropic_prompt_tokens(usage: &serde_json::Value) -> u64 {
    usage["input_tokens"].as_u64().unwrap_or(0) + usage["cache_read_input_tokens"].as_u64().unwrap_or(0)
}

/// `--limit-mm-per-prompt` (vLLM's flag): at image 0 the tower is not loaded and images get a
/// 400 naming the flag (OpenAI and Anthropic bodies) while text is served; at image N a
/// request with more than N images gets a 400 naming the limit, one with N is served.
#[test]
fn limit_mm_per_prompt_refuses_images_past_the_limit() {
    let server = Server::start_model(MODEL, &["--limit-mm-per-prompt", r#"{"image": 0}"#]);
    assert!(server.log().contains("no vision tower loaded"), "{}", server.log());
    let r = chat(&server, case_messages(MODEL, "single", &openai_part));
    assert_eq!(r.status, 400, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["type"], "invalid_request_error", "{}", r.text());
    assert!(e["message"].as_str().unwrap().contains("--limit-mm-per-prompt image 0"), "{}", r.text());
    let mut msgs = case_messages(MODEL, "single", &|f: &str| anthropic_block_of(MODEL, f));
    msgs.as_array_mut().unwrap().retain(|m| m["role"] != "system");
    let m = server.post("/v1/messages", &json!({"messages": msgs, "max_tokens": 4}));
    assert_eq!(m.status, 400, "{}", m.text());
    let v = m.json();
    assert_eq!((&v["type"], &v["error"]["type"]), (&json!("error"), &json!("invalid_request_error")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--limit-mm-per-prompt image 0"), "{v}");
    assert_eq!(chat(&server, json!([{"role": "user", "content": "hello"}])).status, 200);
    drop(server);

    let server = Server::start_model(MODEL, &["--limit-mm-per-prompt", r#"{"image": 1}"#]);
    // The startup log gives the bytes held, the tower's apart (none at image 0, above).
    assert!(server.log().contains("vision tower"), "{}", server.log());
    let many = case_messages(MODEL, "multi", &openai_part);
    let n = many.to_string().matches(r#""type":"image_url""#).count();
    assert!(n > 1, "the multi case has {n} images");
    let r = chat(&server, many);
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("at most 1 image") && msg.contains(&format!("this request has {n}")), "{msg}");
    assert_eq!(chat(&server, case_messages(MODEL, "single", &openai_part)).status, 200);
}
