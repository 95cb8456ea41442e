//! Fetching images over http(s) (`iris serve --allow-remote-media`) without letting a client
//! reach what only the server can reach. Each hop (the URL, then every redirect) is resolved
//! here, every address it resolves to must be public (`address.rs`), and the connection goes to
//! one of those checked addresses: no second lookup happens, so a name that resolves to a public
//! address when checked and to a private one a moment later (DNS rebinding) gets nowhere. The
//! request carries the URL's host in `Host` and in TLS's SNI. One deadline covers the whole
//! fetch, redirects included, and the body is counted while it streams: past the byte limit the
//! connection is dropped.

pub mod address;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::{Bytes, Incoming};
use hyper::{header, Request, Response, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{self, RootCertStore};

/// Redirects followed before giving up.
pub const MAX_REDIRECTS: usize = 5;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FetchError {
    #[error("`{url}` is not a usable http(s) URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("cannot resolve `{host}`: {reason}")]
    Resolve { host: String, reason: String },
    #[error("refusing to fetch from `{host}`: it resolves to {addr}, a {range} address")]
    Refused { host: String, addr: IpAddr, range: &'static str },
    #[error("cannot connect to `{host}`: {reason}")]
    Connect { host: String, reason: String },
    #[error("TLS with `{host}` failed: {reason}")]
    Tls { host: String, reason: String },
    #[error("the HTTP exchange with `{host}` failed: {reason}")]
    Http { host: String, reason: String },
    #[error("`{url}` answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooManyRedirects,
    #[error("the image is larger than the limit of {max} bytes")]
    TooLarge { max: usize },
    #[error("`{url}` is `{content_type}`, not an image")]
    NotImage { url: String, content_type: String },
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
}

/// The http(s) client for image URLs.
pub struct RemoteFetcher {
    timeout: Duration,
    max_bytes: usize,
    tls: tokio_rustls::TlsConnector,
    #[cfg(test)]
    test: TestNet,
}

impl std::fmt::Debug for RemoteFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteFetcher").field("timeout", &self.timeout).field("max_bytes", &self.max_bytes).finish()
    }
}

impl RemoteFetcher {
    /// Fetches from public addresses only, trusting the Mozilla root certificates; gives up
    /// after `timeout` or past `max_bytes` of body.
    pub fn new(timeout: Duration, max_bytes: usize) -> Self {
        let roots = RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        RemoteFetcher {
            timeout,
            max_bytes,
            tls: tls_connector(roots),
            #[cfg(test)]
            test: TestNet::default(),
        }
    }

    /// The body of `url` (after redirects), at most `max_bytes`.
    pub async fn fetch(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        match tokio::time::timeout(self.timeout, self.follow(url)).await {
            Ok(r) => r,
            Err(_) => Err(FetchError::Timeout(self.timeout)),
        }
    }

    async fn follow(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let mut target = Target::parse(url)?;
        for _ in 0..=MAX_REDIRECTS {
            let (resp, _conn) = self.request(&target).await?;
            let status = resp.status();
            if status.is_redirection() {
                let location = resp.headers().get(header::LOCATION).and_then(|v| v.to_str().ok());
                match location {
                    Some(loc) if status != hyper::StatusCode::NOT_MODIFIED => {
                        target = Target::parse(&target.join(loc))?;
                        continue;
                    }
                    _ => return Err(FetchError::Status { url: target.url, status: status.as_u16() }),
                }
            }
            if !status.is_success() {
                return Err(FetchError::Status { url: target.url, status: status.as_u16() });
            }
            return self.body(&target, resp).await;
        }
        Err(FetchError::TooManyRedirects)
    }

    /// Resolves, checks and connects, then sends the GET. The second value keeps the
    /// connection task alive while the body is read (it is aborted when dropped).
    async fn request(&self, t: &Target) -> Result<(Response<Incoming>, AbortOnDrop), FetchError> {
        let addrs = self.resolve(t).await?;
        for &addr in &addrs {
            if let Some(range) = self.refused_range(addr) {
                return Err(FetchError::Refused { host: t.host.clone(), addr, range });
            }
        }
        let mut last = String::from("no address");
        let mut tcp = None;
        for &addr in &addrs {
            match TcpStream::connect(SocketAddr::new(addr, t.port)).await {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        let tcp = tcp.ok_or_else(|| FetchError::Connect { host: t.host.clone(), reason: last })?;
        let req = Request::get(t.path.as_str())
            .header(header::HOST, t.authority.as_str())
            .header(header::USER_AGENT, concat!("iris/", env!("CARGO_PKG_VERSION")))
            .header(header::ACCEPT, "image/*")
            .body(Empty::<Bytes>::new())
            .map_err(|e| FetchError::BadUrl { url: t.url.clone(), reason: e.to_string() })?;
        if !t.https {
            return exchange(tcp, req, &t.host).await;
        }
        let name = ServerName::try_from(t.host.clone())
            .map_err(|e| FetchError::BadUrl { url: t.url.clone(), reason: format!("bad TLS server name: {e}") })?;
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| FetchError::Tls { host: t.host.clone(), reason: e.to_string() })?;
        exchange(tls, req, &t.host).await
    }

    async fn resolve(&self, t: &Target) -> Result<Vec<IpAddr>, FetchError> {
        if let Ok(ip) = t.host.parse::<IpAddr>() {
            return Ok(vec![ip]);
        }
        #[cfg(test)]
        if let Some((_, ip)) = self.test.names.iter().find(|(n, _)| *n == t.host) {
            return Ok(vec![*ip]);
        }
        let failed = |reason: String| FetchError::Resolve { host: t.host.clone(), reason };
        let mut ips: Vec<IpAddr> = tokio::net::lookup_host((t.host.as_str(), t.port))
            .await
            .map_err(|e| failed(e.to_string()))?
            .map(|a| a.ip())
            .collect();
        ips.dedup();
        if ips.is_empty() {
            return Err(failed("no addresses".into()));
        }
        Ok(ips)
    }

    fn refused_range(&self, ip: IpAddr) -> Option<&'static str> {
        #[cfg(test)]
        if self.test.allowed.contains(&ip) {
            return None;
        }
        address::refused_range(ip)
    }

    async fn body(&self, t: &Target, resp: Response<Incoming>) -> Result<Vec<u8>, FetchError> {
        let too_large = FetchError::TooLarge { max: self.max_bytes };
        if let Some(ct) = resp.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) {
            let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
            // Some servers label every file octet-stream; the decoder still checks the bytes.
            if !media.starts_with("image/") && !media.ends_with("/octet-stream") {
                return Err(FetchError::NotImage { url: t.url.clone(), content_type: ct.to_string() });
            }
        }
        let declared = resp.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_bytes as u64) {
            return Err(too_large);
        }
        let mut body = resp.into_body();
        let mut out = Vec::with_capacity(declared.unwrap_or(0) as usize);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| FetchError::Http { host: t.host.clone(), reason: e.to_string() })?;
            if let Ok(data) = frame.into_data() {
                if out.len() + data.len() > self.max_bytes {
                    return Err(too_large);
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    }
}

/// A TLS client over `roots` (rustls, ring), speaking HTTP/1.1; the hub client uses it too.
pub(crate) fn tls_connector(roots: RootCertStore) -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

/// Aborts the connection task when the exchange is over (or abandoned).
pub(crate) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sends `req` over `io` (HTTP/1.1) and returns the response head; the body streams while the
/// second value lives.
pub(crate) async fn exchange<IO>(
    io: IO,
    req: Request<Empty<Bytes>>,
    host: &str,
) -> Result<(Response<Incoming>, AbortOnDrop), FetchError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let failed = |e: hyper::Error| FetchError::Http { host: host.to_string(), reason: e.to_string() };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.map_err(failed)?;
    let task = AbortOnDrop(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let resp = sender.send_request(req).await.map_err(failed)?;
    Ok((resp, task))
}

/// One hop's URL, split into what the connection needs (the hub client's too).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Target {
    pub(crate) url: String,
    pub(crate) https: bool,
    /// Name or IP literal (without IPv6 brackets): what is resolved, and the TLS server name.
    pub(crate) host: String,
    pub(crate) port: u16,
    /// `host[:port]` as written in the URL: the `Host` header.
    pub(crate) authority: String,
    /// Path and query.
    pub(crate) path: String,
}

impl Target {
    pub(crate) fn parse(url: &str) -> Result<Target, FetchError> {
        let bad = |reason: &str| FetchError::BadUrl { url: url.to_string(), reason: reason.to_string() };
        // The fragment never goes to the server.
        let without_fragment = url.split('#').next().unwrap_or(url);
        let uri: Uri = without_fragment.parse().map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        let https = match uri.scheme_str().map(str::to_ascii_lowercase).as_deref() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(bad("only http and https URLs can be fetched")),
        };
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not accepted"));
        }
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Target {
            url: url.to_string(),
            https,
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            authority: authority.as_str().to_string(),
            host,
            path: uri.path_and_query().map_or("/", |p| p.as_str()).to_string(),
        })
    }

    /// A `Location` header's URL, resolved against this one.
    pub(crate) fn join(&self, location: &str) -> String {
        let scheme = if self.https { "https" } else { "http" };
        let lower = location.to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") || lower.contains("://") {
            location.to_string()
        } else if let Some(rest) = location.strip_prefix("//") {
            format!("{scheme}://{rest}")
        } else if location.starts_with('/') {
            format!("{scheme}://{}{location}", self.authority)
        } else {
            let path = self.path.split('?').next().unwrap_or("/");
            let dir = &path[..path.rfind('/').map_or(0, |i| i + 1)];
            format!("{scheme}://{}{}{location}", self.authority, if dir.is_empty() { "/" } else { dir })
        }
    }
}

/// What the tests may change: addresses allowed despite the policy (the local test servers)
/// and names resolved without DNS. Compiled only into test builds, so a release server has no
/// way to reach a refused address.
#[cfg(test)]
#[derive(Default)]
struct TestNet {
    allowed: Vec<IpAddr>,
    names: Vec<(String, IpAddr)>,
}

#[cfg(test)]
impl RemoteFetcher {
    fn for_test(timeout: Duration, max_bytes: usize, test: TestNet, roots: Option<RootCertStore>) -> Self {
        let mut f = RemoteFetcher::new(timeout, max_bytes);
        f.test = test;
        if let Some(roots) = roots {
            f.tls = tls_connector(roots);
        }
        f
    }
}

#[cfg(test)]
mod tests;
