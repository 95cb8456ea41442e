//! Model ids (`ORG/NAME[:TAG]`) and commit ids.

/// A model id on the Hub: `ORG/NAME`, with an optional `:TAG` that picks a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// `ORG/NAME`.
    pub repo: String,
    pub tag: Option<String>,
}

impl HubId {
    /// `ORG/NAME` or `ORG/NAME:TAG` (exactly one slash; letters, digits, `-`, `_`, `.`, as
    /// the Hub allows), else `None`.
    pub fn parse(s: &str) -> Option<HubId> {
        let (repo, tag) = match s.split_once(':') {
            Some((r, t)) => (r, Some(t)),
            None => (s, None),
        };
        let (org, name) = repo.split_once('/')?;
        if !valid_part(org) || !valid_part(name) {
            return None;
        }
        if let Some(t) = tag {
            if t.is_empty() || !t.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return None;
            }
        }
        Some(HubId { repo: repo.to_string(), tag: tag.map(str::to_string) })
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.tag {
            Some(t) => write!(f, "{}:{t}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

/// One side of `ORG/NAME`: the Hub's rule (no leading or trailing `-` or `.`, no `--` or `..`,
/// which also keeps the cache's `models--ORG--NAME` unambiguous).
fn valid_part(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 96
        && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !p.starts_with(['-', '.'])
        && !p.ends_with(['-', '.'])
        && !p.contains("--")
        && !p.contains("..")
}

/// A full commit id (40 hex digits), as opposed to a branch or tag name.
pub fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids() {
        let id = HubId::parse("Qwen/Qwen2.5-0.5B-Instruct").unwrap();
        assert_eq!((id.repo.as_str(), id.tag), ("Qwen/Qwen2.5-0.5B-Instruct", None));
        let id = HubId::parse("bartowski/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m").unwrap();
        assert_eq!(id.tag.as_deref(), Some("q4_k_m"));
        assert_eq!(id.to_string(), "bartowski/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m");
        for not_an_id in [
            "model",
            "a/b/c",
            "/abs",
            "a/",
            "./model",
            "../model",
            "a/b:",
            "a/b:c:d",
            "a b/c",
            "C:/models/x",
            "a--b/c",
            "a/b.",
            "-a/b",
            "models/tiny.gguf:x/y",
        ] {
            assert_eq!(HubId::parse(not_an_id), None, "{not_an_id}");
        }
    }

    #[test]
    fn tells_commits_from_names() {
        assert!(is_commit("0123456789abcdef0123456789abcdef01234567"));
        assert!(!is_commit("main"));
        assert!(!is_commit("0123456789abcdef"));
    }
}
