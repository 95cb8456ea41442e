//! The Hugging Face environment, read as `huggingface_hub` reads it, so that both find the same
//! cache, endpoint and token: `HF_HOME` (default `$XDG_CACHE_HOME/huggingface`, else
//! `~/.cache/huggingface`), `HF_HUB_CACHE` (or the older `HUGGINGFACE_HUB_CACHE`; default
//! `$HF_HOME/hub`), `HF_ENDPOINT` (default `https://huggingface.co`), `HF_TOKEN` (else the file
//! `HF_TOKEN_PATH`, default `$HF_HOME/token`, which `hf auth login` writes), `HF_HUB_OFFLINE`
//! (or `TRANSFORMERS_OFFLINE`; 1, ON, YES or TRUE: use only the cache).

use std::path::PathBuf;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where the token came from, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    Env,
    File,
}

impl TokenSource {
    pub fn describe(self) -> &'static str {
        match self {
            TokenSource::Env => "HF_TOKEN",
            TokenSource::File => "the token file (HF_TOKEN_PATH or $HF_HOME/token)",
        }
    }
}

#[derive(Debug, Clone)]
pub struct HubSettings {
    /// The Hub's base URL, without a trailing slash.
    pub endpoint: String,
    /// The hub cache: `models--ORG--NAME/{blobs,snapshots,refs}` live here.
    pub cache: PathBuf,
    pub token: Option<(String, TokenSource)>,
    /// Use only the cache; never touch the network.
    pub offline: bool,
}

impl HubSettings {
    /// The settings the environment gives.
    pub fn from_env() -> HubSettings {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// The settings from a lookup of variables (the environment, or a test's map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> HubSettings {
        let home_dir = || var("HOME").map(PathBuf::from).or_else(dirs::home_dir).unwrap_or_else(std::env::temp_dir);
        let expand = |p: String| match p.strip_prefix("~/") {
            Some(rest) => home_dir().join(rest),
            None if p == "~" => home_dir(),
            None => PathBuf::from(p),
        };
        let hf_home = var("HF_HOME").map(expand).unwrap_or_else(|| {
            var("XDG_CACHE_HOME").map(expand).unwrap_or_else(|| home_dir().join(".cache")).join("huggingface")
        });
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(expand)
            .unwrap_or_else(|| hf_home.join("hub"));
        let endpoint =
            var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()).trim_end_matches('/').to_string();
        let token = match var("HF_TOKEN") {
            Some(t) => Some((t.trim().to_string(), TokenSource::Env)),
            None => {
                let file = var("HF_TOKEN_PATH").map(expand).unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(file)
                    .ok()
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
                    .map(|t| (t, TokenSource::File))
            }
        };
        let truthy = |name: &str| {
            var(name).is_some_and(|v| ["1", "ON", "YES", "TRUE"].contains(&v.trim().to_ascii_uppercase().as_str()))
        };
        let offline = truthy("HF_HUB_OFFLINE") || truthy("TRANSFORMERS_OFFLINE");
        HubSettings { endpoint, cache, token, offline }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> HubSettings {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        HubSettings::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn reads_the_variables_as_huggingface_hub_does() {
        let s = settings(&[("HOME", "/home/u")]);
        assert_eq!(s.cache, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(s.endpoint, DEFAULT_ENDPOINT);
        assert!(!s.offline && s.token.is_none());
        let s = settings(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(s.cache, PathBuf::from("/x/huggingface/hub"));
        let s = settings(&[("HOME", "/home/u"), ("HF_HOME", "~/hf"), ("HF_ENDPOINT", "http://127.0.0.1:9/")]);
        assert_eq!(s.cache, PathBuf::from("/home/u/hf/hub"));
        assert_eq!(s.endpoint, "http://127.0.0.1:9");
        let s = settings(&[("HF_HOME", "/a"), ("HUGGINGFACE_HUB_CACHE", "/old")]);
        assert_eq!(s.cache, PathBuf::from("/old"));
        let s = settings(&[("HF_HOME", "/a"), ("HUGGINGFACE_HUB_CACHE", "/old"), ("HF_HUB_CACHE", "/new")]);
        assert_eq!(s.cache, PathBuf::from("/new"));
        for (v, on) in [("1", true), ("yes", true), ("True", true), ("0", false), ("no", false)] {
            assert_eq!(settings(&[("HF_HUB_OFFLINE", v)]).offline, on, "HF_HUB_OFFLINE={v}");
        }
        assert!(settings(&[("TRANSFORMERS_OFFLINE", "1")]).offline);
        let s = settings(&[("HF_TOKEN", " hf_abc\n")]);
        assert_eq!(s.token, Some(("hf_abc".to_string(), TokenSource::Env)));
    }

    #[test]
    fn reads_the_token_file() {
        let dir = std::env::temp_dir().join(format!("iris-hub-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), "hf_file\n").unwrap();
        let home = dir.to_str().unwrap();
        assert_eq!(settings(&[("HF_HOME", home)]).token, Some(("hf_file".to_string(), TokenSource::File)));
        // HF_TOKEN wins over the file.
        assert_eq!(settings(&[("HF_HOME", home), ("HF_TOKEN", "hf_env")]).token.unwrap().0, "hf_env");
        std::fs::write(dir.join("other"), "hf_other").unwrap();
        let other = dir.join("other");
        let s = settings(&[("HF_HOME", home), ("HF_TOKEN_PATH", other.to_str().unwrap())]);
        assert_eq!(s.token.unwrap().0, "hf_other");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
