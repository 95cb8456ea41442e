//! A request body with a deadline: it must arrive within `--body-read-timeout` of its head,
//! and it ends at once when shutdown begins, so a client that sends half a body and stalls
//! holds neither a handler nor the shutdown.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::sync::watch;

/// Why a request body was cut off; the handler's error names it (408 / 503).
#[derive(Debug, Clone, thiserror::Error)]
pub enum BodyCut {
    #[error("the request body did not arrive within {}s (--body-read-timeout)", .0.as_secs_f64())]
    Timeout(Duration),
    #[error("the server is shutting down")]
    ShuttingDown,
}

impl BodyCut {
    /// The cut that caused a body read error, if one did.
    pub fn find<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyCut> {
        let mut e: Option<&'a (dyn std::error::Error + 'static)> = Some(err);
        while let Some(cur) = e {
            if let Some(cut) = cur.downcast_ref::<BodyCut>() {
                return Some(cut);
            }
            e = cur.source();
        }
        None
    }
}

pub struct TimedBody {
    inner: Incoming,
    limit: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
    stop: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl TimedBody {
    pub fn new(inner: Incoming, limit: Duration, stop: watch::Receiver<bool>) -> Self {
        let stop = Box::pin(async move {
            let mut stop = stop;
            // A dropped sender means the server is gone: treat it as a shutdown too.
            let _ = stop.wait_for(|s| *s).await;
        });
        TimedBody { inner, limit, deadline: Box::pin(tokio::time::sleep(limit)), stop }
    }
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyCut::Timeout(self.limit)))));
        }
        if self.stop.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyCut::ShuttingDown))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
