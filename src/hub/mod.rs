//! Models by Hugging Face id (`--model ORG/NAME[:TAG]`): the files a model needs, downloaded
//! into the Hugging Face cache (the layout `huggingface_hub` uses, so each reuses the other's
//! downloads), and the local path the loader then reads.
//!
//! - `id.rs`: `ORG/NAME[:TAG]`, and commit ids.
//! - `settings.rs`: the HF_* environment (cache, endpoint, token, offline).
//! - `files.rs`: which of a repo's files to fetch (configs, tokenizer, the index's shards, or
//!   one GGUF chosen by tag), from a list of names.
//! - `cache.rs`: the cache layout: `models--ORG--NAME/{blobs,snapshots/<commit>,refs,.no_exist}`.
//! - `client.rs`: the Hub's HTTP API on hyper + rustls (listing, file metadata, redirects, token).
//! - `download.rs`: one file into a blob: resumed with `Range`, checked (size, LFS sha256),
//!   with a progress bar.
//! - `resolve.rs`: the whole: offline and commit shortcuts, listing, plan, downloads, links.

mod cache;
mod client;
mod download;
mod error;
mod files;
mod id;
mod resolve;
mod settings;

pub use error::HubError;
pub use id::HubId;
pub use resolve::{fetch_model, fetch_tokenizer};
pub use settings::HubSettings;
