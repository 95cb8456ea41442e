//! Connections: the accept loop, its bound on open connections, the per-connection
//! timeouts, and graceful shutdown.
//!
//! axum's own `serve` has no timeouts: a client that sends half a request head and stalls
//! keeps its connection (and a task) forever. Here each connection is a hyper HTTP/1.1
//! connection with
//! * a header-read timeout (hyper's): a request head must be complete within it of the
//!   connection opening or the previous response ending;
//! * a keep-alive timeout: a connection with no request running that receives nothing for
//!   this long is closed (uvicorn's `--timeout-keep-alive`);
//! * a body-read timeout (`timed_body.rs`): a request body must arrive within it of its head.
//!
//! At most `max_connections` are open at once; one more gets a 503 with a JSON body and
//! `Retry-After`, and is closed. On shutdown every connection is told to finish: idle ones and
//! ones in the middle of a request head close at once, bodies still being read end (so a
//! half-sent request never delays shutdown), responses being written finish.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

use super::errors::ApiError;
use super::timed_body::TimedBody;

/// The limits of the accept loop and of each connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub body_read_timeout: Duration,
}

/// The open connections: a permit each.
#[derive(Clone)]
pub struct Connections {
    limits: ConnectionLimits,
    permits: Arc<Semaphore>,
    /// Turned true when shutdown begins.
    stop: watch::Receiver<bool>,
}

impl Connections {
    pub fn new(limits: ConnectionLimits, stop: watch::Receiver<bool>) -> Self {
        Connections { limits, permits: Arc::new(Semaphore::new(limits.max_connections)), stop }
    }

    pub fn open(&self) -> usize {
        self.limits.max_connections - self.permits.available_permits()
    }

    /// Resolves once every connection has closed.
    pub async fn drained(&self) {
        let all = u32::try_from(self.limits.max_connections).unwrap_or(u32::MAX);
        let _ = self.permits.acquire_many(all).await;
    }

    /// Accepts connections until shutdown begins, then returns (the connections go on
    /// finishing on their own tasks).
    pub async fn accept_loop(self, listener: TcpListener, app: Router) {
        let mut stop = self.stop.clone();
        // Excess connections are answered on short tasks of their own; this bounds them.
        let refusals = Arc::new(Semaphore::new(64));
        loop {
            let accepted = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                a = listener.accept() => a,
            };
            let tcp = match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: wait a moment rather than spin.
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Streams write one small chunk per token: with Nagle's algorithm each chunk would
            // wait for the ACK of the previous one, which a client may delay by ~40 ms.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY: {e}");
            }
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => {
                    let this = self.clone();
                    let app = app.clone();
                    tokio::spawn(async move {
                        this.serve_one(tcp, app).await;
                        drop(permit);
                    });
                }
                Err(_) => match refusals.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let max = self.limits.max_connections;
                        tokio::spawn(async move {
                            refuse(tcp, max).await;
                            drop(permit);
                        });
                    }
                    Err(_) => drop(tcp),
                },
            }
        }
    }

    async fn serve_one(&self, tcp: TcpStream, app: Router) {
        let activity = Arc::new(Activity::default());
        let io = TokioIo::new(WatchedIo { inner: tcp, activity: activity.clone() });
        let body_timeout = self.limits.body_read_timeout;
        let stop = self.stop.clone();
        let service = {
            let activity = activity.clone();
            hyper::service::service_fn(move |req: Request<Incoming>| {
                let guard = RequestGuard::new(activity.clone());
                let app = app.clone();
                let req = req.map(|b| Body::new(TimedBody::new(b, body_timeout, stop.clone())));
                async move {
                    let resp = app.oneshot(req).await.unwrap_or_else(|never| match never {});
                    Ok::<_, std::convert::Infallible>(resp.map(|b| Body::new(GuardedBody { inner: b, _guard: guard })))
                }
            })
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(self.limits.header_read_timeout).keep_alive(true);
        let conn = builder.serve_connection(io, service);
        let mut conn = std::pin::pin!(conn);
        let mut stop = self.stop.clone();
        let keep_alive = self.limits.keep_alive_timeout;
        let mut closing = false;
        let mut check_at = Instant::now() + keep_alive;
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!("connection ended: {e}");
                    }
                    return;
                }
                _ = stop.wait_for(|s| *s), if !closing => {
                    if activity.active.load(Ordering::SeqCst) == 0 {
                        // Idle, or in the middle of a request head: nothing to finish. (hyper's
                        // own graceful shutdown would wait for a half-sent head to time out.)
                        return;
                    }
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
                _ = tokio::time::sleep_until(check_at), if !closing => {
                    match activity.idle_deadline(keep_alive) {
                        // Nothing running and nothing received for the whole timeout.
                        Some(d) if d <= Instant::now() => return,
                        Some(d) => check_at = d,
                        None => check_at = Instant::now() + keep_alive,
                    }
                }
            }
        }
    }
}

/// Answers a connection over the limit with a 503 and closes it.
async fn refuse(mut tcp: TcpStream, max: usize) {
    let body = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the server has {max} connections open (--max-connections); retry later"),
    )
    .code("too_many_connections")
    .body()
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let write = async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await?;
        tcp.shutdown().await?;
        // Read what the client sent, briefly: closing with unread bytes would reset the
        // connection, and the client might never see the answer.
        let mut buf = [0u8; 4096];
        let mut left: usize = 64 * 1024;
        while left > 0 {
            let n = tokio::io::AsyncReadExt::read(&mut tcp, &mut buf).await?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// What the keep-alive timer needs to know about a connection.
struct Activity {
    /// Requests whose response is not yet fully written.
    active: AtomicUsize,
    /// Bytes arrived since the connection last became idle.
    received: AtomicBool,
    /// When it last became idle (no request running).
    idle_since: Mutex<Instant>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            active: AtomicUsize::new(0),
            received: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
        }
    }
}

impl Activity {
    /// When the connection counts as idle for `timeout`, if it is idle now.
    fn idle_deadline(&self, timeout: Duration) -> Option<Instant> {
        if self.active.load(Ordering::SeqCst) > 0 || self.received.load(Ordering::SeqCst) {
            return None;
        }
        Some(*self.idle_since.lock().unwrap_or_else(|p| p.into_inner()) + timeout)
    }
}

/// Counts a request as running from its head until its response has been written.
struct RequestGuard(Arc<Activity>);

impl RequestGuard {
    fn new(a: Arc<Activity>) -> Self {
        a.active.fetch_add(1, Ordering::SeqCst);
        RequestGuard(a)
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            self.0.received.store(false, Ordering::SeqCst);
        }
    }
}

/// A response body that keeps its request counted as running until hyper drops it.
struct GuardedBody {
    inner: Body,
    _guard: RequestGuard,
}

impl hyper::body::Body for GuardedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting when bytes arrive (so a connection in the middle of a request head is
/// not taken for idle; hyper's header-read timeout covers it).
struct WatchedIo {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for WatchedIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.received.store(true, Ordering::SeqCst);
        }
        r
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
