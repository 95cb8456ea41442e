//! The browser-facing settings (`--allowed-origins`, `--allowed-hosts`, ...) and what they
//! allow; `browser.rs` applies them to requests.

/// The browser-facing settings.
#[derive(Debug, Clone, Default)]
pub struct BrowserPolicy {
    /// Origins allowed to call the API (`*`: any). Empty: none but the server's own.
    pub allowed_origins: Vec<String>,
    /// Methods a preflight may ask for (`*`: any).
    pub allowed_methods: Vec<String>,
    /// Request headers a preflight may ask for (`*`: any).
    pub allowed_headers: Vec<String>,
    /// Send `Access-Control-Allow-Credentials: true` (the origin is then echoed, never `*`).
    pub allow_credentials: bool,
    /// Host names (no port) the `Host` header may name; `None`: any.
    pub allowed_hosts: Option<Vec<String>>,
}

/// The names a loopback bind answers to by default.
pub const LOOPBACK_HOSTS: &[&str] = &["localhost", "127.0.0.1", "::1"];

impl BrowserPolicy {
    pub fn origin_allowed(&self, origin: &str) -> bool {
        self.allowed_origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    }

    pub fn host_allowed(&self, host: &str) -> bool {
        match &self.allowed_hosts {
            None => true,
            Some(list) => list.iter().any(|h| h == "*" || h.eq_ignore_ascii_case(host)),
        }
    }

    /// `Access-Control-Allow-Origin` for an allowed origin.
    pub fn allow_origin_value(&self, origin: &str) -> String {
        if self.allowed_origins.iter().any(|o| o == "*") && !self.allow_credentials {
            "*".to_string()
        } else {
            origin.to_string()
        }
    }
}
