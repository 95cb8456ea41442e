//! `iris bench --url`: load benchmark of a running OpenAI-compatible server.
//!
//! At each concurrency level, that many clients send streaming chat requests back to back
//! (a closed loop) until the level's requests are done. Every request asks for exactly
//! `max_tokens` tokens (greedy, `ignore_eos`), so levels differ only in concurrency; a request
//! counts as ok only if it streams all of them and ends with `[DONE]`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{json, Value};

/// The fixed prompt set: request `i` of every level sends `PROMPTS[i % PROMPTS.len()]`.
const PROMPTS: [&str; 16] = [
    "What is the capital of France?",
    "Explain in simple words why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "How do plants make their food? Describe photosynthesis for a ten year old.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr?",
    "Summarize the story of Cinderella in a few sentences.",
    "What are the planets of the solar system, in order from the sun?",
    "Describe a good morning routine for a student who has exams next week and wants to stay calm.",
    "How does a bicycle stay upright when it moves?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Tell me a fun fact about octopuses.",
    "Why is it important to drink water every day?",
];

/// What the load bench needs to know (from `iris bench`'s flags).
pub struct LoadBench {
    pub url: String,
    pub concurrency: Vec<usize>,
    /// Requests per level; `None`: 4 per client, at least 16.
    pub num_requests: Option<usize>,
    pub max_tokens: usize,
    pub api_key: Option<String>,
    pub timeout: Duration,
    pub json: bool,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// What one ok request measured.
struct Sample {
    ttft: Duration,
    /// Gaps between consecutive content chunks.
    itl: Vec<Duration>,
    latency: Duration,
    tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct LevelResult {
    pub concurrency: usize,
    pub requests: usize,
    pub ok: usize,
    pub failed: usize,
    pub duration_s: f64,
    /// Generated tokens of ok requests over the level's wall time.
    pub output_tok_s: f64,
    pub requests_s: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    pub latency_s_p50: f64,
    /// Failure messages and how often each happened.
    pub errors: BTreeMap<String, usize>,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    url: &'a str,
    model: &'a str,
    max_tokens: usize,
    prompts: usize,
    levels: &'a [LevelResult],
}

pub fn run(b: LoadBench) -> anyhow::Result<()> {
    anyhow::ensure!(b.max_tokens > 0, "--gen-len must be at least 1");
    anyhow::ensure!(
        !b.concurrency.is_empty() && b.concurrency.iter().all(|&c| c > 0),
        "--concurrency must be positive numbers"
    );
    anyhow::ensure!(b.num_requests != Some(0), "--num-requests must be at least 1");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run_async(b))
}

/// `http://host:port`, without a trailing `/` or `/v1`.
fn base_url(url: &str) -> anyhow::Result<String> {
    let u = url.trim().trim_end_matches('/');
    let u = u.strip_suffix("/v1").unwrap_or(u);
    if u.starts_with("https://") {
        bail!("--url {url}: https is not supported; benchmark the server over plain http");
    }
    if !u.starts_with("http://") {
        bail!("--url {url}: expected http://HOST:PORT");
    }
    u.parse::<hyper::Uri>().with_context(|| format!("--url {url} is not a valid URL"))?;
    Ok(u.to_string())
}

async fn run_async(b: LoadBench) -> anyhow::Result<()> {
    let base = base_url(&b.url)?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let model = served_model(&client, &base, b.api_key.as_deref()).await?;
    let ctx =
        Arc::new(Ctx { client, base, model, max_tokens: b.max_tokens, api_key: b.api_key.clone(), timeout: b.timeout });
    // One request first: connections, caches and thread pools warm, and a broken setup
    // fails here with its reason rather than as N failures.
    one_request(&ctx, PROMPTS[0]).await.map_err(|e| anyhow::anyhow!("the warm-up request failed: {e}"))?;
    let mut levels = Vec::new();
    for &c in &b.concurrency {
        let n = b.num_requests.unwrap_or((4 * c).max(16));
        if !b.json {
            eprintln!("concurrency {c}: {n} requests of {} tokens...", b.max_tokens);
        }
        levels.push(run_level(&ctx, c, n).await);
    }
    if b.json {
        let report = Report {
            url: &b.url,
            model: &ctx.model,
            max_tokens: b.max_tokens,
            prompts: PROMPTS.len(),
            levels: &levels,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&ctx.model, b.max_tokens, &levels);
    }
    let failed: usize = levels.iter().map(|l| l.failed).sum();
    if failed > 0 {
        let total: usize = levels.iter().map(|l| l.requests).sum();
        for l in levels.iter().filter(|l| l.failed > 0) {
            for (msg, count) in &l.errors {
                eprintln!("concurrency {}: {count} x {msg}", l.concurrency);
            }
        }
        bail!("{failed} of {total} requests failed");
    }
    Ok(())
}

struct Ctx {
    client: HttpClient,
    base: String,
    model: String,
    max_tokens: usize,
    api_key: Option<String>,
    timeout: Duration,
}

fn request(base: &str, path: &str, api_key: Option<&str>, body: Option<Value>) -> anyhow::Result<Request<Full<Bytes>>> {
    let mut r = Request::builder().uri(format!("{base}{path}"));
    if let Some(k) = api_key {
        r = r.header("authorization", format!("Bearer {k}"));
    }
    let r = match body {
        Some(v) => {
            r.method("POST").header("content-type", "application/json").body(Full::new(Bytes::from(v.to_string())))
        }
        None => r.method("GET").body(Full::new(Bytes::new())),
    };
    Ok(r?)
}

/// The first model of `GET /v1/models`.
async fn served_model(client: &HttpClient, base: &str, api_key: Option<&str>) -> anyhow::Result<String> {
    let resp = client
        .request(request(base, "/v1/models", api_key, None)?)
        .await
        .with_context(|| format!("cannot reach {base}: is the server running?"))?;
    let status = resp.status();
    let body = resp.into_body().collect().await.context("reading /v1/models")?.to_bytes();
    if !status.is_success() {
        bail!("GET {base}/v1/models answered {status}: {}", error_message(&body));
    }
    let v: Value = serde_json::from_slice(&body).context("GET /v1/models did not answer JSON")?;
    v["data"][0]["id"].as_str().map(str::to_string).context("GET /v1/models lists no model")
}

/// The `error.message` of an error body, or the body itself.
fn error_message(body: &[u8]) -> String {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    match v.as_ref().and_then(|v| v["error"]["message"].as_str()) {
        Some(m) => m.to_string(),
        None => String::from_utf8_lossy(body).chars().take(200).collect(),
    }
}

async fn run_level(ctx: &Arc<Ctx>, concurrency: usize, n: usize) -> LevelResult {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency.min(n) {
        let (ctx, next) = (ctx.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return out;
                }
                out.push(one_request(&ctx, PROMPTS[i % PROMPTS.len()]).await);
            }
        }));
    }
    let mut results = Vec::with_capacity(n);
    for t in tasks {
        match t.await {
            Ok(r) => results.extend(r),
            Err(e) => results.push(Err(format!("client task failed: {e}"))),
        }
    }
    let duration = start.elapsed().as_secs_f64();
    summarize(concurrency, results, duration)
}

fn summarize(concurrency: usize, results: Vec<Result<Sample, String>>, duration: f64) -> LevelResult {
    let mut errors = BTreeMap::new();
    let (mut ttft, mut itl, mut latency, mut tokens) = (Vec::new(), Vec::new(), Vec::new(), 0);
    let requests = results.len();
    for r in results {
        match r {
            Ok(s) => {
                ttft.push(s.ttft.as_secs_f64() * 1e3);
                itl.extend(s.itl.iter().map(|d| d.as_secs_f64() * 1e3));
                latency.push(s.latency.as_secs_f64());
                tokens += s.tokens;
            }
            Err(e) => *errors.entry(e).or_insert(0) += 1,
        }
    }
    let ok = ttft.len();
    LevelResult {
        concurrency,
        requests,
        ok,
        failed: requests - ok,
        duration_s: duration,
        output_tok_s: tokens as f64 / duration,
        requests_s: ok as f64 / duration,
        ttft_ms_p50: percentile(&mut ttft, 50.0),
        ttft_ms_p99: percentile(&mut ttft, 99.0),
        itl_ms_p50: percentile(&mut itl, 50.0),
        itl_ms_p99: percentile(&mut itl, 99.0),
        latency_s_p50: percentile(&mut latency, 50.0),
        errors,
    }
}

/// Linear interpolation between the closest ranks (numpy's default); NaN when empty.
fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let pos = p / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// One streaming chat request, timed; `Err` says why it does not count.
async fn one_request(ctx: &Ctx, prompt: &str) -> Result<Sample, String> {
    match tokio::time::timeout(ctx.timeout, stream_chat(ctx, prompt)).await {
        Ok(r) => r,
        Err(_) => Err(format!("no complete answer within {:?}", ctx.timeout)),
    }
}

async fn stream_chat(ctx: &Ctx, prompt: &str) -> Result<Sample, String> {
    let body = json!({
        "model": ctx.model,
        "messages": [{ "role": "user", "content": prompt }],
        "max_tokens": ctx.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    let req =
        request(&ctx.base, "/v1/chat/completions", ctx.api_key.as_deref(), Some(body)).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let resp = ctx.client.request(req).await.map_err(|e| format!("request failed: {e}"))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        return Err(format!("HTTP {}: {}", status.as_u16(), error_message(&bytes)));
    }
    let mut sse = SseReader::default();
    let (mut first, mut last, mut itl) = (None, None, Vec::new());
    let (mut usage_tokens, mut done) = (None, false);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("stream broken: {e}"))?;
        let Some(data) = frame.data_ref() else { continue };
        let now = Instant::now();
        for payload in sse.push(data) {
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(&payload).map_err(|e| format!("bad chunk ({e}): {payload}"))?;
            if let Some(e) = v.get("error") {
                return Err(format!("error in stream: {}", e["message"].as_str().unwrap_or("(no message)")));
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage_tokens = Some(n as usize);
            }
            let has_text = v["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty());
            if has_text {
                match last {
                    None => first = Some(now - start),
                    Some(t) => itl.push(now - t),
                }
                last = Some(now);
            }
        }
    }
    let latency = start.elapsed();
    if !done {
        return Err("the stream ended without [DONE]".into());
    }
    let Some(ttft) = first else { return Err("no text was streamed".into()) };
    match usage_tokens {
        Some(n) if n == ctx.max_tokens => Ok(Sample { ttft, itl, latency, tokens: n }),
        Some(n) => Err(format!("generated {n} tokens instead of {}", ctx.max_tokens)),
        None => Err("the stream has no usage chunk".into()),
    }
}

/// Splits an SSE byte stream into the `data` payloads of its events.
#[derive(Default)]
struct SseReader {
    buf: Vec<u8>,
}

impl SseReader {
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend(bytes.iter().filter(|&&b| b != b'\r'));
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

fn print_table(model: &str, max_tokens: usize, levels: &[LevelResult]) {
    println!("model `{model}`, {max_tokens} tokens per request (greedy, ignore_eos), streaming chat");
    println!(
        "| streams | requests | ok | failed | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | latency p50 s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for l in levels {
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {:.2} |",
            l.concurrency,
            l.requests,
            l.ok,
            l.failed,
            l.output_tok_s,
            l.requests_s,
            l.ttft_ms_p50,
            l.ttft_ms_p99,
            l.itl_ms_p50,
            l.itl_ms_p99,
            l.latency_s_p50
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let mut v = vec![4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&mut v, 50.0), 2.5);
        assert_eq!(percentile(&mut v, 0.0), 1.0);
        assert_eq!(percentile(&mut v, 100.0), 4.0);
        assert!((percentile(&mut v, 99.0) - 3.97).abs() < 1e-12);
        assert!(percentile(&mut [], 50.0).is_nan());
    }

    #[test]
    fn sse_events_split_across_reads() {
        let mut r = SseReader::default();
        assert!(r.push(b"data: {\"a\":").is_empty());
        assert_eq!(r.push(b"1}\n\n: keep-alive\n\ndata: [DONE]\r\n\r\n"), vec!["{\"a\":1}", "[DONE]"]);
    }

    #[test]
    fn base_urls() {
        assert_eq!(base_url("http://127.0.0.1:8000/v1/").unwrap(), "http://127.0.0.1:8000");
        assert_eq!(base_url("http://localhost:8000").unwrap(), "http://localhost:8000");
        assert!(base_url("https://x").is_err());
        assert!(base_url("127.0.0.1:8000").is_err());
    }
}
