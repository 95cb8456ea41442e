//! The fetcher against local HTTP and HTTPS servers on 127.0.0.1: refused by the production
//! fetcher; through the test-only constructor (which allows exactly 127.0.0.1), the success
//! path, redirects (each hop checked), limits, errors, Host and SNI.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::rustls;

use super::*;

const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const IMAGE: &[u8] = b"\x89PNG\r\n\x1a\n not really a png, the fetcher does not decode";
const LIMIT: usize = 4096;

/// What the server saw of one request.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    path: String,
    host: String,
    sni: Option<String>,
}

struct TestServer {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl TestServer {
    async fn start(tls: Option<tokio_rustls::TlsAcceptor>) -> TestServer {
        let listener = TcpListener::bind((LOCAL, 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let (log, tls) = (log.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        None => serve(tcp, None, port, log).await,
                        Some(acceptor) => {
                            let Ok(s) = acceptor.accept(tcp).await else { return };
                            let sni = s.get_ref().1.server_name().map(str::to_string);
                            serve(s, sni, port, log).await
                        }
                    }
                });
            }
        });
        TestServer { port, seen }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    sni: Option<String>,
    port: u16,
    log: Arc<Mutex<Vec<Seen>>>,
) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let path = head.split(' ').nth(1).unwrap_or("").to_string();
    let host = head
        .lines()
        .find_map(|l| l.strip_prefix("host: ").or_else(|| l.strip_prefix("Host: ")))
        .unwrap_or("")
        .to_string();
    log.lock().unwrap().push(Seen { path: path.clone(), host, sni });
    let reply = |status: &str, headers: &str, body: &[u8]| {
        let mut r =
            format!("HTTP/1.1 {status}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n", body.len())
                .into_bytes();
        r.extend_from_slice(body);
        r
    };
    let redirect = |to: String| reply("302 Found", &format!("location: {to}\r\n"), b"");
    let out = match path.as_str() {
        "/img.png" | "/dir/img.png" => reply("200 OK", "content-type: image/png\r\n", IMAGE),
        "/octet" => reply("200 OK", "content-type: application/octet-stream\r\n", IMAGE),
        "/hop/3" => redirect("/hop/2".into()),
        "/hop/2" => redirect(format!("http://127.0.0.1:{port}/hop/1")),
        "/hop/1" => redirect("/img.png".into()),
        "/dir/relative" => redirect("img.png".into()),
        "/loop" => redirect("/loop".into()),
        "/to-private" => redirect("http://10.255.255.1/img.png".into()),
        "/to-ipv6-loopback" => redirect(format!("http://[::1]:{port}/img.png")),
        "/to-file" => redirect("file:///etc/passwd".into()),
        "/missing" => reply("404 Not Found", "", b"no"),
        "/html" => reply("200 OK", "content-type: text/html; charset=utf-8\r\n", b"<html></html>"),
        "/big" => reply("200 OK", "content-type: image/png\r\n", &vec![0u8; LIMIT + 1]),
        "/endless" => {
            // Chunked, no length: only counting the bytes as they come stops this.
            let _ =
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ntransfer-encoding: chunked\r\n\r\n").await;
            let chunk = format!("400\r\n{}\r\n", "x".repeat(0x400));
            for _ in 0..1_000_000 {
                if s.write_all(chunk.as_bytes()).await.is_err() {
                    return;
                }
            }
            return;
        }
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            return;
        }
        _ => reply("500 Internal Server Error", "", b""),
    };
    let _ = s.write_all(&out).await;
    let _ = s.shutdown().await;
}

fn test_fetcher() -> RemoteFetcher {
    let net = TestNet { allowed: vec![LOCAL], names: vec![("images.test".into(), LOCAL)] };
    RemoteFetcher::for_test(Duration::from_secs(5), LIMIT, net, None)
}

#[tokio::test]
async fn the_production_fetcher_refuses_a_local_server_without_connecting() {
    let server = TestServer::start(None).await;
    let f = RemoteFetcher::new(Duration::from_secs(5), LIMIT);
    let err = f.fetch(&server.url("/img.png")).await.unwrap_err();
    assert!(matches!(err, FetchError::Refused { addr, range: "loopback", .. } if addr == LOCAL), "{err}");
    for url in [
        format!("http://localhost:{}/img.png", server.port),
        format!("http://[::1]:{}/img.png", server.port),
        format!("http://[::ffff:127.0.0.1]:{}/img.png", server.port),
        format!("http://2130706433:{}/img.png", server.port), // 127.0.0.1 as one number
        format!("http://0.0.0.0:{}/img.png", server.port),
    ] {
        let err = f.fetch(&url).await.unwrap_err();
        assert!(matches!(err, FetchError::Refused { .. }), "{url}: {err}");
    }
    assert_eq!(server.seen(), vec![], "the server must never have been asked");
}

#[tokio::test]
async fn localhost_resolves_only_to_refused_addresses() {
    let f = RemoteFetcher::new(Duration::from_secs(5), LIMIT);
    let err = f.fetch("http://localhost/x.png").await.unwrap_err();
    assert!(matches!(err, FetchError::Refused { range: "loopback", .. }), "{err}");
}

#[tokio::test]
async fn fetches_follows_redirects_and_sends_the_host() {
    let server = TestServer::start(None).await;
    let f = test_fetcher();
    assert_eq!(f.fetch(&server.url("/img.png")).await.unwrap(), IMAGE);
    assert_eq!(f.fetch(&server.url("/octet")).await.unwrap(), IMAGE);
    assert_eq!(f.fetch(&server.url("/hop/3")).await.unwrap(), IMAGE);
    assert_eq!(f.fetch(&server.url("/dir/relative#frag")).await.unwrap(), IMAGE);
    let by_name = format!("http://images.test:{}/img.png", server.port);
    assert_eq!(f.fetch(&by_name).await.unwrap(), IMAGE);
    let seen = server.seen();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        ["/img.png", "/octet", "/hop/3", "/hop/2", "/hop/1", "/img.png", "/dir/relative", "/dir/img.png", "/img.png"]
    );
    assert_eq!(seen[0].host, format!("127.0.0.1:{}", server.port));
    assert_eq!(seen.last().unwrap().host, format!("images.test:{}", server.port));
}

#[tokio::test]
async fn each_redirect_hop_is_checked() {
    let server = TestServer::start(None).await;
    let f = test_fetcher();
    // 10.255.255.1 would not answer: a refusal (not a timeout) shows it was never tried.
    let err = f.fetch(&server.url("/to-private")).await.unwrap_err();
    assert!(matches!(err, FetchError::Refused { range: "private (RFC 1918)", .. }), "{err}");
    let err = f.fetch(&server.url("/to-ipv6-loopback")).await.unwrap_err();
    assert!(matches!(err, FetchError::Refused { range: "loopback", .. }), "{err}");
    let err = f.fetch(&server.url("/to-file")).await.unwrap_err();
    assert!(matches!(err, FetchError::BadUrl { .. }), "{err}");
    let err = f.fetch(&server.url("/loop")).await.unwrap_err();
    assert_eq!(err, FetchError::TooManyRedirects);
    assert_eq!(server.seen().iter().filter(|s| s.path == "/loop").count(), MAX_REDIRECTS + 1);
}

#[tokio::test]
async fn errors_limits_and_timeout() {
    let server = TestServer::start(None).await;
    let f = test_fetcher();
    let err = f.fetch(&server.url("/missing")).await.unwrap_err();
    assert!(matches!(err, FetchError::Status { status: 404, .. }), "{err}");
    let err = f.fetch(&server.url("/html")).await.unwrap_err();
    assert!(matches!(err, FetchError::NotImage { ref content_type, .. } if content_type.starts_with("text/html")));
    assert_eq!(f.fetch(&server.url("/big")).await.unwrap_err(), FetchError::TooLarge { max: LIMIT });
    assert_eq!(f.fetch(&server.url("/endless")).await.unwrap_err(), FetchError::TooLarge { max: LIMIT });
    let quick = RemoteFetcher::for_test(
        Duration::from_millis(300),
        LIMIT,
        TestNet { allowed: vec![LOCAL], names: vec![] },
        None,
    );
    let t0 = std::time::Instant::now();
    assert_eq!(quick.fetch(&server.url("/slow")).await.unwrap_err(), FetchError::Timeout(Duration::from_millis(300)));
    assert!(t0.elapsed() < Duration::from_secs(5));
    for (url, why) in [
        ("ftp://example.com/x.png", "only http and https"),
        ("http://user:pw@example.com/x.png", "credentials"),
        ("http:///x.png", ""),
        ("not a url", ""),
    ] {
        let err = f.fetch(url).await.unwrap_err();
        assert!(matches!(err, FetchError::BadUrl { .. }) && err.to_string().contains(why), "{url}: {err}");
    }
}

#[tokio::test]
async fn https_verifies_the_certificate_and_sends_sni() {
    // A CA and a leaf for images.test signed by it.
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf =
        rcgen::CertificateParams::new(vec!["images.test".to_string()]).unwrap().signed_by(&leaf_key, &ca).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
    let server_cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], key)
        .unwrap();
    let server = TestServer::start(Some(tokio_rustls::TlsAcceptor::from(Arc::new(server_cfg)))).await;
    let mut roots = RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let net = || TestNet { allowed: vec![LOCAL], names: vec![("images.test".into(), LOCAL)] };
    let f = RemoteFetcher::for_test(Duration::from_secs(5), LIMIT, net(), Some(roots));
    let url = format!("https://images.test:{}/img.png", server.port);
    assert_eq!(f.fetch(&url).await.unwrap(), IMAGE);
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].sni.as_deref(), Some("images.test"));
    assert_eq!(seen[0].host, format!("images.test:{}", server.port));
    // The same server is untrusted with the public roots, and by IP its certificate does not match.
    let public_roots = RemoteFetcher::for_test(Duration::from_secs(5), LIMIT, net(), None);
    assert!(matches!(public_roots.fetch(&url).await.unwrap_err(), FetchError::Tls { .. }));
    let mut roots = RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let by_ip = RemoteFetcher::for_test(Duration::from_secs(5), LIMIT, net(), Some(roots));
    let err = by_ip.fetch(&format!("https://127.0.0.1:{}/img.png", server.port)).await.unwrap_err();
    assert!(matches!(err, FetchError::Tls { .. }), "{err}");
    assert_eq!(server.seen().len(), 1, "no request went over an unverified connection");
}
