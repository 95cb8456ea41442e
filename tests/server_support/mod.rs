//! Starts the real `iris serve` binary on a free loopback port and talks HTTP/1.1 to it
//! over a plain TcpStream (no client library, so what goes over the wire is explicit).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A copy of fixture model `base` whose chat template is the real template `template`
/// (a file of tests/fixtures/templates), in a directory of its own under the system's temp.
pub fn model_with_template(base: &str, template: &str) -> PathBuf {
    // One directory per call: tests running at once may use the same pair and remove theirs.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("iris-{base}-{template}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp model dir");
    for entry in std::fs::read_dir(fixture(base)).expect("fixture dir") {
        let path = entry.expect("entry").path();
        if path.is_file() {
            std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    std::fs::copy(fixture("templates").join(template), dir.join("chat_template.jinja")).expect("template");
    dir
}

/// tiny-gemma4 as a Gemma 4 checkpoint ships for chat: the tokenizer with Gemma 4's control
/// tokens in its free ids (tests/fixtures/gemma4_template), the real chat template, and the
/// turn's end `<turn|>` among its EOS ids (not `<|tool_response>`: the server stops there on
/// its own). In a directory of its own under the system's temp.
pub fn gemma4_chat_model() -> PathBuf {
    let dir = model_with_template("tiny-gemma4", "google-gemma-4-31B-it.jinja");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("gemma4_template").join(file), dir.join(file)).expect("tokenizer");
    }
    let gen = dir.join("generation_config.json");
    let mut g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&gen).expect("read")).expect("json");
    g["eos_token_id"] = serde_json::json!([1, 946]);
    std::fs::write(&gen, g.to_string()).expect("write");
    dir
}

pub struct Server {
    child: Option<Child>,
    pub addr: String,
    pub logs: Arc<Mutex<String>>,
}

impl Server {
    /// `iris serve` on the tiny llama fixture with a small KV pool, plus `extra` flags.
    pub fn start(extra: &[&str]) -> Server {
        Self::start_model("tiny-llama", extra)
    }

    pub fn start_model(model: &str, extra: &[&str]) -> Server {
        Self::start_path(&fixture(model), extra)
    }

    pub fn start_path(model: &std::path::Path, extra: &[&str]) -> Server {
        let mut args: Vec<String> =
            vec!["serve".into(), "--model".into(), model.display().to_string(), "--port".into(), "0".into()];
        if !extra.contains(&"--kv-cache-memory") {
            args.extend(["--kv-cache-memory".to_string(), "8MiB".to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(env!("CARGO_BIN_EXE_iris"))
            .args(&args)
            .env("RUST_LOG", "iris=info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("iris binary starts");
        let stderr = child.stderr.take().expect("stderr is piped");
        let logs = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        {
            let logs = logs.clone();
            std::thread::spawn(move || {
                let mut tx = Some(tx);
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(i) = line.find("listening on http://") {
                        let rest = &line[i + "listening on http://".len()..];
                        let addr: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(addr);
                        }
                    }
                    let mut l = logs.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("server did not start; log:\n{}", logs.lock().unwrap());
            }
        };
        let server = Server { child: Some(child), addr, logs };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(r) = server.try_get("/health") {
                if r.status == 200 {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "server never became healthy; log:\n{}", server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    pub fn log(&self) -> String {
        self.logs.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("running")
    }

    pub fn try_get(&self, path: &str) -> std::io::Result<Response> {
        request(&self.addr, "GET", path, &[], b"")
    }

    pub fn get(&self, path: &str) -> Response {
        request(&self.addr, "GET", path, &[], b"").expect("GET works")
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        self.post_raw(path, &[], body.to_string().as_bytes())
    }

    pub fn post_raw(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
        request(&self.addr, "POST", path, headers, body).expect("POST works")
    }

    /// A metric's value from /metrics (the first line starting with `name`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let text = self.get("/metrics").text();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.pid();
        let ok = Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("kill runs");
        assert!(ok.success());
        self.wait(Duration::from_secs(60))
    }

    pub fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child().try_wait().expect("wait works") {
                self.child = None;
                return s;
            }
            assert!(Instant::now() < deadline, "server did not exit; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        sse_events(&self.text()).into_iter().map(|(_, d)| d).collect()
    }

    /// `(event name, data)` pairs of an SSE body (comments skipped).
    pub fn sse(&self) -> Vec<(Option<String>, String)> {
        sse_events(&self.text())
    }
}

pub fn sse_events(text: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut event = None;
        let mut data: Vec<&str> = Vec::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if !data.is_empty() {
            out.push((event, data.join("\n")));
        }
    }
    out
}

fn write_request(
    stream: &mut TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    head.push_str(&format!("Connection: close\r\nContent-Length: {}\r\n", body.len()));
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) && !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()
}

/// One HTTP/1.1 request with `Connection: close`; reads the whole response.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(300)))?;
    write_request(&mut stream, addr, method, path, headers, body)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> std::io::Result<Response> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no header end"))?;
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("no status line"))?;
    let status: u16 =
        status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("bad status"))?;
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))).collect();
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Ok(Response { status, headers, body })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size_str = String::from_utf8_lossy(&b[..nl]);
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = nl + 2;
        let stop = (start + size).min(b.len());
        out.extend_from_slice(&b[start..stop]);
        b = &b[(stop + 2).min(b.len())..];
    }
    out
}

/// A streaming request left open: read some of it, then drop it to disconnect.
pub struct OpenStream {
    pub stream: TcpStream,
    pub received: Vec<u8>,
}

impl OpenStream {
    pub fn open(addr: &str, path: &str, body: &serde_json::Value) -> OpenStream {
        let mut stream = TcpStream::connect(addr).expect("connects");
        stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write_request(&mut stream, addr, "POST", path, &[], body.to_string().as_bytes()).expect("request sent");
        OpenStream { stream, received: Vec::new() }
    }

    /// Reads until the received bytes contain `needle`.
    pub fn read_until(&mut self, needle: &str) {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&self.received).contains(needle) {
            let n = self.stream.read(&mut buf).expect("reads");
            assert!(n > 0, "stream ended before `{needle}`: {}", String::from_utf8_lossy(&self.received));
            self.received.extend_from_slice(&buf[..n]);
        }
    }

    /// Reads to the end of the response.
    pub fn finish(mut self) -> Response {
        let mut rest = Vec::new();
        let _ = self.stream.read_to_end(&mut rest);
        self.received.extend(rest);
        parse_response(&self.received).expect("a complete response")
    }
}

/// Polls `cond` every 20 ms until it holds or `limit` passes.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// Standard base64 with padding (for image data URLs and Anthropic blocks).
pub fn b64(bytes: &[u8]) -> String {
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

/// A fixture's image file as a PNG data URL.
pub fn data_url(model: &str, file: &str) -> String {
    format!("data:image/png;base64,{}", b64(&std::fs::read(fixture(model).join(file)).unwrap()))
}

/// A fixture's reference.json (what transformers gave).
pub fn reference_json(model: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(model).join("reference.json")).unwrap()).unwrap()
}

/// A vision fixture case's messages with each `{"type": "image"}` part replaced by `image(file)`.
pub fn case_messages(model: &str, case: &str, image: &dyn Fn(&str) -> serde_json::Value) -> serde_json::Value {
    let r = reference_json(model);
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

/// `generated` as the server streams its text after `prompt` (so a random model's stray bytes
/// join their neighbours as they do there).
pub fn continuation_text(model: &str, prompt: &[u32], generated: &[u32]) -> String {
    let tok = iris::tokenizer::TextTokenizer::from_dir(fixture(model)).unwrap();
    let mut detok = iris::engine::IncrementalDetokenizer::new(tok.inner().clone(), prompt, true).unwrap();
    let mut text: String = generated.iter().map(|&t| detok.push(t).unwrap()).collect();
    text += &detok.finish().unwrap();
    text
}

/// A vision fixture case's greedy continuation from transformers, as text, and its prompt
/// length.
pub fn reference_case_text(model: &str, case: &str) -> (String, usize) {
    let r = reference_json(model);
    let ids = |k: &str| -> Vec<u32> {
        r["cases"][case][k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    let (prompt, generated) = (ids("input_ids"), ids("generated_ids"));
    (continuation_text(model, &prompt, &generated), prompt.len())
}
