//! The Hub's HTTP API, as much of it as a download needs, on hyper + rustls (the connection and
//! URL pieces of `media::remote`, without its address policy: the Hub may be on any address,
//! `HF_ENDPOINT` on the loopback included).
//!
//! - `GET /api/models/{repo}/revision/{revision}?blobs=true`: the commit and the files (with
//!   sizes and LFS sha256s).
//! - `HEAD /{repo}/resolve/{commit}/{file}`: the file's ETag (`X-Linked-Etag` for LFS files:
//!   their sha256), size (`X-Linked-Size`), commit (`X-Repo-Commit`); redirects within the Hub
//!   are followed, a redirect elsewhere (a CDN) is where the file is fetched from.
//! - `GET` of that address, with `Range` to resume.
//!
//! The token goes only to the Hub's own origin, never to a CDN a redirect points to.

use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::RootCertStore;

use super::cache::{safe_etag, safe_relative};
use super::error::HubError;
use super::settings::{HubSettings, TokenSource};
use crate::media::remote::{exchange, tls_connector, AbortOnDrop, Target};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// From sending a request to its response head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(60);
/// Between two pieces of a body.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_REDIRECTS: usize = 10;
/// A listing of a repo with many thousands of files is a few MB.
const MAX_LISTING_BYTES: usize = 64 << 20;

pub struct Client {
    endpoint: String,
    token: Option<(String, TokenSource)>,
    tls: tokio_rustls::TlsConnector,
}

/// A response whose body is still to be read.
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    /// The URL that answered (after the redirects followed).
    pub url: String,
    body: Incoming,
    _conn: AbortOnDrop,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn is_redirect(&self) -> bool {
        matches!(self.status, 301 | 302 | 303 | 307 | 308)
    }

    /// The next piece of the body (`None` at its end).
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, String> {
        loop {
            let frame = match tokio::time::timeout(READ_TIMEOUT, self.body.frame()).await {
                Err(_) => return Err(format!("no data for {}s", READ_TIMEOUT.as_secs())),
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => return Err(e.to_string()),
                Ok(Some(Ok(f))) => f,
            };
            if let Ok(data) = frame.into_data() {
                return Ok(Some(data));
            }
        }
    }

    async fn bytes(mut self, max: usize) -> Result<Vec<u8>, HubError> {
        let mut out = Vec::new();
        while let Some(c) =
            self.chunk().await.map_err(|reason| HubError::Unreachable { url: self.url.clone(), reason })?
        {
            if out.len() + c.len() > max {
                return Err(HubError::BadReply { url: self.url.clone(), reason: format!("more than {max} bytes") });
            }
            out.extend_from_slice(&c);
        }
        Ok(out)
    }
}

/// A repo at one commit, as the listing gives it.
#[derive(Debug)]
pub struct Listing {
    pub commit: String,
    pub files: Vec<Sibling>,
}

#[derive(Debug, serde::Deserialize)]
pub struct Sibling {
    #[serde(rename = "rfilename")]
    pub name: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub lfs: Option<LfsInfo>,
}

#[derive(Debug, serde::Deserialize)]
pub struct LfsInfo {
    #[serde(default)]
    pub sha256: Option<String>,
    #[serde(default)]
    pub size: Option<u64>,
}

impl Listing {
    pub fn file(&self, name: &str) -> Option<&Sibling> {
        self.files.iter().find(|f| f.name == name)
    }
}

/// What a file's HEAD says.
#[derive(Debug)]
pub struct FileMeta {
    /// The blob name: `X-Linked-Etag` (an LFS file's sha256), else `ETag`, unquoted.
    pub etag: String,
    pub size: Option<u64>,
    /// Where to GET it: a CDN the Hub redirects to, or the resolve URL itself.
    pub url: String,
    /// The sha256 of an LFS file (its `X-Linked-Etag`).
    pub sha256: Option<String>,
}

impl Client {
    pub fn new(settings: &HubSettings) -> Client {
        let roots = RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        Client { endpoint: settings.endpoint.clone(), token: settings.token.clone(), tls: tls_connector(roots) }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The commit `revision` names and the repo's files at it.
    pub async fn listing(&self, repo: &str, revision: &str) -> Result<Listing, HubError> {
        #[derive(serde::Deserialize)]
        struct Info {
            sha: Option<String>,
            #[serde(default)]
            siblings: Vec<Sibling>,
        }
        let url = format!("{}/api/models/{repo}/revision/{}?blobs=true", self.endpoint, encode(revision, false));
        let reply = self.request(Method::GET, &url, &[], true).await?;
        self.check(&reply, repo, revision, None)?;
        let url = reply.url.clone();
        let body = reply.bytes(MAX_LISTING_BYTES).await?;
        let bad = |reason: String| HubError::BadReply { url: url.clone(), reason };
        let info: Info = serde_json::from_slice(&body).map_err(|e| bad(format!("not a model listing: {e}")))?;
        let commit = info.sha.filter(|c| super::id::is_commit(c)).ok_or_else(|| bad("no commit id (`sha`)".into()))?;
        if let Some(f) = info.siblings.iter().find(|f| !safe_relative(&f.name)) {
            return Err(bad(format!("unusable file name `{}`", f.name)));
        }
        Ok(Listing { commit: commit.to_ascii_lowercase(), files: info.siblings })
    }

    /// The HEAD of `file` at `commit`.
    pub async fn file_meta(&self, repo: &str, commit: &str, file: &str) -> Result<FileMeta, HubError> {
        let url = format!("{}/{repo}/resolve/{commit}/{}", self.endpoint, encode(file, true));
        let reply = self.request(Method::HEAD, &url, &[(header::ACCEPT_ENCODING, "identity")], true).await?;
        self.check(&reply, repo, commit, Some(file))?;
        let bad = |reason: &str| HubError::BadReply { url: reply.url.clone(), reason: reason.to_string() };
        let linked = reply.header("x-linked-etag").map(unquote);
        let etag = linked.clone().or_else(|| reply.header("etag").map(unquote)).ok_or_else(|| bad("no ETag"))?;
        if !safe_etag(&etag) {
            return Err(bad("an ETag that is no usable blob name"));
        }
        let size = match reply.header("x-linked-size") {
            Some(s) => Some(s.trim().parse().map_err(|_| bad("a bad X-Linked-Size"))?),
            None if !reply.is_redirect() => reply.header("content-length").and_then(|s| s.trim().parse().ok()),
            None => None,
        };
        let url = match reply.header("location").filter(|_| reply.is_redirect()) {
            Some(loc) => parse(&reply.url)?.join(loc),
            None => reply.url.clone(),
        };
        let sha256 = linked.filter(|e| e.len() == 64 && e.bytes().all(|b| b.is_ascii_hexdigit()));
        Ok(FileMeta { etag, size, url, sha256 })
    }

    /// Sends a request, following redirects (at most 10). With `hub_only`, a redirect to another
    /// origin is returned instead of followed (the Hub's metadata is on it).
    pub async fn request(
        &self,
        method: Method,
        url: &str,
        headers: &[(HeaderName, &str)],
        hub_only: bool,
    ) -> Result<Reply, HubError> {
        let mut target = parse(url)?;
        for _ in 0..=MAX_REDIRECTS {
            let reply = self.send(method.clone(), &target, headers).await?;
            let location = reply.header("location").map(str::to_string);
            let Some(loc) = location.filter(|_| reply.is_redirect()) else { return Ok(reply) };
            let next = parse(&target.join(&loc))?;
            if hub_only && origin(&next) != origin(&target) {
                return Ok(reply);
            }
            target = next;
        }
        Err(HubError::TooManyRedirects { url: url.to_string(), max: MAX_REDIRECTS })
    }

    async fn send(&self, method: Method, t: &Target, headers: &[(HeaderName, &str)]) -> Result<Reply, HubError> {
        let unreachable = |reason: String| HubError::Unreachable { url: t.url.clone(), reason };
        let mut req = Request::builder()
            .method(method)
            .uri(t.path.as_str())
            .header(header::HOST, t.authority.as_str())
            .header(header::USER_AGENT, concat!("iris/", env!("CARGO_PKG_VERSION")));
        for (name, value) in headers {
            req = req.header(name, *value);
        }
        if let Some((token, _)) = &self.token {
            if parse(&self.endpoint).is_ok_and(|e| origin(&e) == origin(t)) {
                let value = HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| unreachable("the token is not a valid header value".into()))?;
                req = req.header(header::AUTHORIZATION, value);
            }
        }
        let req = req.body(Empty::<Bytes>::new()).map_err(|e| unreachable(e.to_string()))?;
        let connect = async {
            let tcp = TcpStream::connect((t.host.as_str(), t.port)).await.map_err(|e| unreachable(e.to_string()))?;
            if !t.https {
                return exchange(tcp, req, &t.host).await.map_err(|e| unreachable(e.to_string()));
            }
            let name = ServerName::try_from(t.host.clone()).map_err(|e| unreachable(format!("bad TLS name: {e}")))?;
            let tls = self.tls.connect(name, tcp).await.map_err(|e| unreachable(format!("TLS: {e}")))?;
            exchange(tls, req, &t.host).await.map_err(|e| unreachable(e.to_string()))
        };
        let (resp, conn) = tokio::time::timeout(CONNECT_TIMEOUT + HEAD_TIMEOUT, connect)
            .await
            .map_err(|_| unreachable("no answer in time".into()))??;
        let (parts, body) = resp.into_parts();
        Ok(Reply { status: parts.status.as_u16(), headers: parts.headers, url: t.url.clone(), body, _conn: conn })
    }

    /// The error an answer of the Hub stands for, if any (the Hub's `X-Error-Code` tells a
    /// missing repo, revision or file, and a gated repo, apart).
    pub fn check(&self, reply: &Reply, repo: &str, revision: &str, file: Option<&str>) -> Result<(), HubError> {
        let code = reply.header("x-error-code").unwrap_or("");
        let page = format!("{}/{repo}", self.endpoint);
        let (repo_s, status) = (repo.to_string(), reply.status);
        let not_found = || HubError::RepoNotFound {
            repo: repo_s.clone(),
            endpoint: self.endpoint.clone(),
            status,
            hint: if self.token.is_none() { "; a private repo needs HF_TOKEN" } else { "" },
        };
        match status {
            200..=399 => Ok(()),
            401 | 403 if code == "RepoNotFound" => Err(not_found()),
            401 | 403 => Err(match &self.token {
                None => HubError::GatedNoToken { repo: repo_s, status, page },
                Some((_, source)) => {
                    HubError::GatedDenied { repo: repo_s, status, page, source_name: source.describe() }
                }
            }),
            404 if code == "RevisionNotFound" => Err(HubError::RevisionNotFound {
                repo: repo_s,
                revision: revision.to_string(),
                endpoint: self.endpoint.clone(),
            }),
            404 => match file {
                Some(f) if code != "RepoNotFound" => {
                    Err(HubError::EntryNotFound { repo: repo_s, revision: revision.to_string(), file: f.to_string() })
                }
                _ => Err(not_found()),
            },
            _ => Err(HubError::Status { url: reply.url.clone(), status }),
        }
    }
}

fn parse(url: &str) -> Result<Target, HubError> {
    Target::parse(url).map_err(|e| HubError::BadReply { url: url.to_string(), reason: e.to_string() })
}

fn origin(t: &Target) -> (bool, &str, u16) {
    (t.https, t.host.as_str(), t.port)
}

/// `"abc"`, `W/"abc"` -> `abc`.
fn unquote(etag: &str) -> String {
    etag.trim().trim_start_matches("W/").trim_matches('"').to_string()
}

/// Percent-encodes a revision (`/` too: `refs/pr/1` is one path segment) or a file path.
pub fn encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_revisions_and_paths() {
        assert_eq!(encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(encode("sub dir/a+b.gguf", true), "sub%20dir/a%2Bb.gguf");
        assert_eq!(unquote("W/\"abc\""), "abc");
        assert_eq!(unquote("\"0123\""), "0123");
    }
}
