//! What keeps a browser from being turned against the server: the `Host` check (DNS
//! rebinding), CORS (`--allowed-origins`, `--allowed-methods`, `--allowed-headers`,
//! `--allowed-credentials`, as vLLM names them) with `OPTIONS` preflight, and JSON content
//! types on the JSON endpoints (a cross-origin `text/plain` POST needs no preflight, so it
//! must be refused here).
//!
//! Without `--allowed-origins` a request whose `Origin` is not the server itself is refused;
//! clients that are not browsers send no `Origin` and are not affected.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

pub use super::browser_policy::{BrowserPolicy, LOOPBACK_HOSTS};
use super::errors::{ApiError, Flavor};
use super::state::AppState;

/// The host name of a `Host` header value, without port or IPv6 brackets.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// `scheme://host[:port]` of an `Origin` header value: same-origin when it names the `Host`.
fn is_same_origin(origin: &str, host: Option<&str>) -> bool {
    let Some(host) = host else { return false };
    let rest = origin.split_once("://").map(|(_, r)| r).unwrap_or(origin);
    rest.eq_ignore_ascii_case(host.trim())
}

fn header_str<'a>(headers: &'a HeaderMap, name: header::HeaderName) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn forbidden(msg: String, flavor: Flavor) -> Response {
    ApiError::new(StatusCode::FORBIDDEN, msg).code("forbidden").with_flavor(flavor).into_response()
}

/// The `Host` check, then CORS: preflights are answered here; other cross-origin requests
/// go on only from allowed origins, and their responses get the CORS headers.
pub async fn guard(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let policy = &app.cfg.browser;
    let flavor = Flavor::for_path(req.uri().path());
    let headers = req.headers();
    let host = match headers.get(header::HOST) {
        None => None,
        Some(v) => match v.to_str() {
            Ok(h) => Some(h.to_string()),
            Err(_) => {
                return ApiError::bad_request("the Host header is not valid text").with_flavor(flavor).into_response();
            }
        },
    };
    if let Some(h) = &host {
        if !policy.host_allowed(host_name(h)) {
            // DNS rebinding: a page on evil.example whose name now resolves to this address.
            tracing::warn!("refused a request for Host `{h}` (not in --allowed-hosts)");
            return forbidden(
                format!(
                    "the Host `{}` is not served here: start the server with --allowed-hosts naming it",
                    host_name(h)
                ),
                flavor,
            );
        }
    }
    let Some(origin) = header_str(headers, header::ORIGIN).map(str::to_string) else {
        return next.run(req).await;
    };
    // A page of the server itself (the Host check above already vouched for the name).
    if is_same_origin(&origin, host.as_deref()) {
        return next.run(req).await;
    }
    if !policy.origin_allowed(&origin) {
        return forbidden(
            format!(
                "cross-origin requests from `{origin}` are refused: start the server with --allowed-origins {origin} \
             to allow them"
            ),
            flavor,
        );
    }
    let preflight = req.method() == Method::OPTIONS && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        return preflight_response(policy, &origin, headers, flavor);
    }
    let mut resp = next.run(req).await;
    add_cors_headers(policy, &origin, resp.headers_mut());
    resp
}

fn add_cors_headers(policy: &BrowserPolicy, origin: &str, h: &mut HeaderMap) {
    if let Ok(v) = HeaderValue::from_str(&policy.allow_origin_value(origin)) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    if policy.allow_credentials {
        h.insert(header::ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
    }
    h.append(header::VARY, HeaderValue::from_static("Origin"));
}

fn preflight_response(policy: &BrowserPolicy, origin: &str, headers: &HeaderMap, flavor: Flavor) -> Response {
    let any = |list: &[String]| list.iter().any(|m| m == "*");
    let method = header_str(headers, header::ACCESS_CONTROL_REQUEST_METHOD).unwrap_or("").trim();
    if !any(&policy.allowed_methods) && !policy.allowed_methods.iter().any(|m| m.eq_ignore_ascii_case(method)) {
        return ApiError::bad_request(format!(
            "CORS preflight: the method `{method}` is not allowed (--allowed-methods)"
        ))
        .with_flavor(flavor)
        .into_response();
    }
    let asked: Vec<&str> = header_str(headers, header::ACCESS_CONTROL_REQUEST_HEADERS)
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if !any(&policy.allowed_headers) {
        if let Some(bad) = asked.iter().find(|a| !policy.allowed_headers.iter().any(|h| h.eq_ignore_ascii_case(a))) {
            return ApiError::bad_request(format!(
                "CORS preflight: the header `{bad}` is not allowed (--allowed-headers)"
            ))
            .with_flavor(flavor)
            .into_response();
        }
    }
    let mut resp = StatusCode::NO_CONTENT.into_response();
    let h = resp.headers_mut();
    add_cors_headers(policy, origin, h);
    let methods =
        if any(&policy.allowed_methods) { "GET, POST, OPTIONS".to_string() } else { policy.allowed_methods.join(", ") };
    let allow_headers = if any(&policy.allowed_headers) { asked.join(", ") } else { policy.allowed_headers.join(", ") };
    if let Ok(v) = HeaderValue::from_str(&methods) {
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, v);
    }
    if !allow_headers.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&allow_headers) {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, v);
        }
    }
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    resp
}

/// POSTs to the JSON endpoints must say `Content-Type: application/json`.
pub async fn require_json(req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let flavor = Flavor::for_path(req.uri().path());
    let ct = req.headers().get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("?"));
    let is_json = ct.is_some_and(|ct| {
        let media = ct.split(';').next().unwrap_or("").trim();
        media.eq_ignore_ascii_case("application/json")
    });
    // No body and no type (`curl -X POST`): the handler's "not valid JSON" 400 says more.
    let empty = req.headers().get(header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() == b"0");
    if is_json || (ct.is_none() && empty) {
        return next.run(req).await;
    }
    let got = match ct {
        Some(ct) => format!("`{ct}`"),
        None => "none".to_string(),
    };
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        format!("the request body must be JSON with `Content-Type: application/json` (got {got})"),
    )
    .code("unsupported_media_type")
    .with_flavor(flavor)
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_and_origins() {
        assert_eq!(host_name("127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(host_name("[::1]:8000"), "::1");
        assert_eq!(host_name("localhost"), "localhost");
        assert_eq!(host_name("evil.example:80"), "evil.example");
        assert!(is_same_origin("http://127.0.0.1:8000", Some("127.0.0.1:8000")));
        assert!(!is_same_origin("http://evil.example", Some("127.0.0.1:8000")));
    }
}
