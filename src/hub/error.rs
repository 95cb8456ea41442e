//! What can go wrong between a model id and its files, each as one line for the CLI.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("`{repo}` is not a local path, and {endpoint} has no model `{repo}` (HTTP {status}){hint}")]
    RepoNotFound { repo: String, endpoint: String, status: u16, hint: &'static str },
    #[error("`{repo}` has no revision `{revision}` on {endpoint}")]
    RevisionNotFound { repo: String, revision: String, endpoint: String },
    #[error("`{repo}` has no file `{file}` at {revision}")]
    EntryNotFound { repo: String, revision: String, file: String },
    #[error(
        "`{repo}` is gated or private (HTTP {status}): set HF_TOKEN (or log in with `hf auth login`) to a token of an \
         account that has accepted its license at {page}"
    )]
    GatedNoToken { repo: String, status: u16, page: String },
    #[error(
        "`{repo}` is gated (HTTP {status}) and the token from {source_name} has no access: accept the license at {page} \
         with that account, or set HF_TOKEN to a token that has access"
    )]
    GatedDenied { repo: String, status: u16, page: String, source_name: &'static str },
    #[error(
        "`{repo}` is not a local path, and its revision `{revision}` is not in the Hugging Face cache {}: {missing}; \
         HF_HUB_OFFLINE is set: unset it to download",
        cache.display()
    )]
    NotCached { repo: String, revision: String, cache: PathBuf, missing: String },
    #[error("cannot reach {url}: {reason} (HF_ENDPOINT sets the Hub's address; HF_HUB_OFFLINE=1 uses only the cache)")]
    Unreachable { url: String, reason: String },
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: {reason}")]
    BadReply { url: String, reason: String },
    #[error("{url}: more than {max} redirects")]
    TooManyRedirects { url: String, max: usize },
    #[error("`{repo}` ({revision}) holds neither *.safetensors nor *.gguf weights")]
    NoWeights { repo: String, revision: String },
    #[error("`{repo}` has no GGUF file matching `{tag}`; its GGUF files: {candidates}")]
    GgufNoMatch { repo: String, tag: String, candidates: String },
    #[error("`{repo}:{tag}` matches several GGUF files: {candidates}; name one with --gguf-file")]
    GgufAmbiguous { repo: String, tag: String, candidates: String },
    #[error(
        "`{repo}` holds several GGUF files: {candidates}; pick one with {repo}:TAG (e.g. {repo}:Q4_K_M) or --gguf-file"
    )]
    GgufChoiceNeeded { repo: String, candidates: String },
    #[error("`{repo}` has no file `{file}`; its GGUF files: {candidates}")]
    GgufFileMissing { repo: String, file: String, candidates: String },
    #[error("`{repo}`: {first} is one of {parts} parts of a split GGUF; iris loads single-file GGUFs only")]
    SplitGguf { repo: String, first: String, parts: u32 },
    #[error("`{repo}` has no tokenizer.json to take the tokenizer from")]
    NoTokenizer { repo: String },
    #[error("`{repo}`: {index} names `{shard}`, which the repo does not have")]
    MissingShard { repo: String, index: String, shard: String },
    #[error("{file}: downloaded {got} bytes, expected {expected}")]
    Size { file: String, expected: u64, got: u64 },
    #[error(
        "{file}: checksum mismatch: sha256 {got}, expected {expected} (the partial download was removed; run again)"
    )]
    Checksum { file: String, expected: String, got: String },
    #[error("downloading {file} failed: {reason}")]
    Download { file: String, reason: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

impl HubError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> HubError {
        HubError::Io { path: path.into(), source }
    }

    /// The Hub could not be asked at all (no connection, timeout, a server error): the cache may
    /// still answer.
    pub fn is_unreachable(&self) -> bool {
        match self {
            HubError::Unreachable { .. } => true,
            HubError::Status { status, .. } => *status >= 500,
            _ => false,
        }
    }
}
