//! `--api-key`: `Authorization: Bearer KEY` (OpenAI; the scheme in any case, RFC 9110) or
//! `x-api-key: KEY` (Anthropic). A header that is there but cannot be used says why.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::{ApiError, Flavor};
use super::state::AppState;

/// A credential the client sent, or why what it sent is unusable.
enum Presented<'a> {
    Key(&'a str),
    Unusable(String),
}

fn bearer(headers: &HeaderMap) -> Option<Presented<'_>> {
    let v = headers.get("authorization")?;
    let Ok(v) = v.to_str() else {
        return Some(Presented::Unusable("the Authorization header is not valid text".into()));
    };
    let v = v.trim();
    let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Some(Presented::Unusable(format!(
            "the Authorization header uses the `{scheme}` scheme: send `Authorization: Bearer <key>`"
        )));
    }
    match rest.trim() {
        "" => Some(Presented::Unusable("the Authorization header has no key after `Bearer`".into())),
        key => Some(Presented::Key(key)),
    }
}

fn x_api_key(headers: &HeaderMap) -> Option<Presented<'_>> {
    let v = headers.get("x-api-key")?;
    Some(match v.to_str() {
        Ok(k) if !k.trim().is_empty() => Presented::Key(k.trim()),
        Ok(_) => Presented::Unusable("the x-api-key header is empty".into()),
        Err(_) => Presented::Unusable("the x-api-key header is not valid text".into()),
    })
}

pub async fn auth(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = &app.cfg.api_key else {
        return next.run(req).await;
    };
    let presented: Vec<Presented> = [bearer(req.headers()), x_api_key(req.headers())].into_iter().flatten().collect();
    let ok = presented.iter().any(|p| matches!(p, Presented::Key(k) if constant_time_eq(k.as_bytes(), key.as_bytes())));
    if ok {
        return next.run(req).await;
    }
    let msg = if presented.is_empty() {
        "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`".to_string()
    } else if let Some(Presented::Unusable(why)) = presented.iter().find(|p| matches!(p, Presented::Unusable(_))) {
        why.clone()
    } else {
        "invalid API key".to_string()
    };
    ApiError::new(StatusCode::UNAUTHORIZED, msg)
        .code("invalid_api_key")
        .with_flavor(Flavor::for_path(req.uri().path()))
        .into_response()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
