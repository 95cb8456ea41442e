//! A stand-in for the Hugging Face Hub on the loopback, speaking the part of its HTTP API that
//! downloads use (what iris and Python's huggingface_hub ask), for fixture repos:
//!
//! - `GET /api/models/{repo}/revision/{rev}`: the commit (`sha`) and `siblings` (names, sizes,
//!   blob ids, LFS sha256s).
//! - `HEAD|GET /{repo}/resolve/{rev}/{file}`: a plain file answers itself (`ETag`,
//!   `X-Repo-Commit`); an LFS file redirects (302) to the "CDN", a second listener (another
//!   origin), with `X-Linked-Etag` (its sha256), `X-Linked-Size`, `X-Repo-Commit`.
//! - the CDN: `HEAD|GET /lfs/{sha256}`, with `Range: bytes=N-` (206, `Content-Range`), and, when
//!   asked, a connection cut after some bytes of the next GET.
//! - a missing repo is a 404 (`X-Error-Code: RepoNotFound`), a missing revision or file too
//!   (`RevisionNotFound`, `EntryNotFound`); a gated repo's files need its token (401 without
//!   one, 403 with another, `X-Error-Code: GatedRepo`).
//!
//! Every request is logged (which server, method, path, headers), so tests can count them.
//! One thread per connection, one request per connection (`Connection: close`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

pub struct RepoFile {
    pub name: String,
    pub data: Vec<u8>,
    /// Served as an LFS file: through the CDN, with its sha256 as the linked ETag.
    pub lfs: bool,
}

impl RepoFile {
    pub fn sha256(&self) -> String {
        hex(&Sha256::digest(&self.data))
    }

    /// What a plain file's ETag stands for (git's blob id on the real Hub).
    fn oid(&self) -> String {
        self.sha256()[..40].to_string()
    }
}

pub struct Repo {
    pub id: String,
    pub commit: String,
    pub files: Vec<RepoFile>,
    /// A gated repo's files need `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Logged {
    /// `hub` or `cdn`.
    pub server: &'static str,
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Logged {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct State {
    repos: Mutex<Vec<Repo>>,
    log: Mutex<Vec<Logged>>,
    /// Cut the next CDN GET of this sha256 after this many body bytes.
    cut: Mutex<Option<(String, usize)>>,
    stop: AtomicBool,
}

pub struct FakeHub {
    pub url: String,
    pub cdn: String,
    state: Arc<State>,
}

impl FakeHub {
    pub fn start(repos: Vec<Repo>) -> FakeHub {
        let state = Arc::new(State { repos: Mutex::new(repos), ..Default::default() });
        let cdn = listen(state.clone(), "cdn", None);
        let url = listen(state.clone(), "hub", Some(cdn.clone()));
        FakeHub { url, cdn, state }
    }

    pub fn log(&self) -> Vec<Logged> {
        self.state.log.lock().unwrap().clone()
    }

    pub fn clear_log(&self) {
        self.state.log.lock().unwrap().clear();
    }

    /// Cuts the connection of the next CDN GET of the file with this sha256 after `after` bytes.
    pub fn cut_next_get(&self, sha256: &str, after: usize) {
        *self.state.cut.lock().unwrap() = Some((sha256.to_string(), after));
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        for url in [&self.url, &self.cdn] {
            let _ = TcpStream::connect(url.trim_start_matches("http://"));
        }
    }
}

fn listen(state: Arc<State>, server: &'static str, cdn: Option<String>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake hub");
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if state.stop.load(Ordering::SeqCst) {
                break;
            }
            let Ok(conn) = conn else { continue };
            let (state, cdn) = (state.clone(), cdn.clone());
            std::thread::spawn(move || {
                let _ = handle(conn, &state, server, cdn.as_deref());
            });
        }
    });
    url
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send only this many body bytes, then cut the connection.
    cut_after: Option<usize>,
}

impl Reply {
    fn new(status: u16) -> Reply {
        Reply { status, headers: vec![], body: vec![], cut_after: None }
    }

    fn header(mut self, name: &str, value: impl Into<String>) -> Reply {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    fn error(status: u16, code: &str) -> Reply {
        let body = format!("{{\"error\": \"{code}\"}}").into_bytes();
        Reply { body, ..Reply::new(status).header("X-Error-Code", code).header("Content-Type", "application/json") }
    }
}

fn handle(conn: TcpStream, state: &State, server: &'static str, cdn: Option<&str>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.push((n.trim().to_string(), v.trim().to_string()));
        }
    }
    let logged = Logged { server, method: method.clone(), path: target.clone(), headers };
    state.log.lock().unwrap().push(logged.clone());
    let reply = match cdn {
        Some(cdn) => hub_reply(state, &logged, cdn),
        None => cdn_reply(state, &logged),
    };
    write_reply(conn, &method, reply)
}

fn hub_reply(state: &State, req: &Logged, cdn: &str) -> Reply {
    let path = req.path.split('?').next().unwrap_or("");
    let repos = state.repos.lock().unwrap();
    if let Some(rest) = path.strip_prefix("/api/models/") {
        // {org}/{name}/revision/{rev}
        let segs: Vec<&str> = rest.split('/').collect();
        if segs.len() != 4 || segs[2] != "revision" {
            return Reply::error(404, "NotFound");
        }
        let Some(repo) = repos.iter().find(|r| r.id == format!("{}/{}", segs[0], segs[1])) else {
            return Reply::error(404, "RepoNotFound");
        };
        if !revision_ok(repo, &decode(segs[3])) {
            return Reply::error(404, "RevisionNotFound");
        }
        let siblings: Vec<serde_json::Value> = repo
            .files
            .iter()
            .map(|f| {
                let mut s = serde_json::json!({"rfilename": f.name, "size": f.data.len(), "blobId": f.oid()});
                if f.lfs {
                    s["lfs"] = serde_json::json!({"sha256": f.sha256(), "size": f.data.len(), "pointerSize": 134});
                }
                s
            })
            .collect();
        let body = serde_json::json!({"id": repo.id, "sha": repo.commit, "siblings": siblings}).to_string();
        return Reply { body: body.into_bytes(), ..Reply::new(200).header("Content-Type", "application/json") };
    }
    // /{org}/{name}/resolve/{rev}/{file...}
    let segs: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if segs.len() != 5 || segs[2] != "resolve" {
        return Reply::error(404, "NotFound");
    }
    let Some(repo) = repos.iter().find(|r| r.id == format!("{}/{}", segs[0], segs[1])) else {
        return Reply::error(404, "RepoNotFound");
    };
    if !revision_ok(repo, &decode(segs[3])) {
        return Reply::error(404, "RevisionNotFound");
    }
    if let Some(token) = &repo.token {
        match req.header("authorization") {
            None => return Reply::error(401, "GatedRepo"),
            Some(a) if a != format!("Bearer {token}") => return Reply::error(403, "GatedRepo"),
            Some(_) => {}
        }
    }
    let name = decode(segs[4]);
    let Some(file) = repo.files.iter().find(|f| f.name == name) else {
        return Reply::error(404, "EntryNotFound").header("X-Repo-Commit", repo.commit.clone());
    };
    if file.lfs {
        return Reply::new(302)
            .header("Location", format!("{cdn}/lfs/{}", file.sha256()))
            .header("X-Repo-Commit", repo.commit.clone())
            .header("X-Linked-Etag", format!("\"{}\"", file.sha256()))
            .header("X-Linked-Size", file.data.len().to_string())
            .header("ETag", format!("\"{}\"", file.oid()));
    }
    Reply { body: file.data.clone(), ..Reply::new(200) }
        .header("ETag", format!("\"{}\"", file.oid()))
        .header("X-Repo-Commit", repo.commit.clone())
}

fn cdn_reply(state: &State, req: &Logged) -> Reply {
    let Some(sha) = req.path.strip_prefix("/lfs/") else { return Reply::new(404) };
    let repos = state.repos.lock().unwrap();
    let Some(file) = repos.iter().flat_map(|r| &r.files).find(|f| f.lfs && f.sha256() == sha) else {
        return Reply::new(404);
    };
    let len = file.data.len();
    let start = match req.header("range") {
        Some(r) => {
            match r.strip_prefix("bytes=").and_then(|r| r.strip_suffix('-')).and_then(|s| s.parse::<usize>().ok()) {
                Some(s) if s < len => Some(s),
                _ => return Reply::new(416).header("Content-Range", format!("bytes */{len}")),
            }
        }
        None => None,
    };
    let mut reply = match start {
        Some(s) => Reply { body: file.data[s..].to_vec(), ..Reply::new(206) }
            .header("Content-Range", format!("bytes {s}-{}/{len}", len - 1)),
        None => Reply { body: file.data.clone(), ..Reply::new(200) },
    };
    reply = reply.header("ETag", format!("\"{sha}\"")).header("Accept-Ranges", "bytes");
    if req.method == "GET" {
        let mut cut = state.cut.lock().unwrap();
        if cut.as_ref().is_some_and(|(s, _)| s == sha) {
            reply.cut_after = cut.take().map(|(_, n)| n);
        }
    }
    reply
}

fn revision_ok(repo: &Repo, rev: &str) -> bool {
    rev == "main" || rev == repo.commit
}

fn write_reply(mut conn: TcpStream, method: &str, r: Reply) -> std::io::Result<()> {
    let reason = match r.status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Other",
    };
    let mut head =
        format!("HTTP/1.1 {} {reason}\r\nConnection: close\r\nContent-Length: {}\r\n", r.status, r.body.len());
    for (n, v) in &r.headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes())?;
    if method != "HEAD" {
        match r.cut_after {
            Some(n) => {
                conn.write_all(&r.body[..n.min(r.body.len())])?;
                conn.flush()?;
                let _ = conn.shutdown(Shutdown::Both);
                return Ok(());
            }
            None => conn.write_all(&r.body)?,
        }
    }
    conn.flush()?;
    let _ = conn.shutdown(Shutdown::Write);
    // Let the client close first (its last bytes must not meet a reset).
    conn.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut sink = [0u8; 256];
    let _ = conn.read(&mut sink);
    Ok(())
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
