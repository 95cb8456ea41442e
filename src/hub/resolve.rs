//! From a model id to local files:
//!
//! - `HF_HUB_OFFLINE`: the cached snapshot of the revision (its ref, or the commit), or an
//!   error saying what is missing. No request is made.
//! - a commit whose snapshot has everything (each optional file present or known absent): that
//!   snapshot, without a request.
//! - otherwise the listing of the revision (one request) gives the commit and the files; the
//!   plan's files missing from the snapshot are fetched (a HEAD each, then a GET unless the blob
//!   is already cached, from another revision or from Python), linked into the snapshot, and then
//!   the revision's ref is updated. When the Hub cannot be reached, a complete cached snapshot of the
//!   revision is used, with a warning.

use std::cell::Cell;
use std::path::PathBuf;

use super::cache::RepoCache;
use super::client::{Client, Listing};
use super::download::{self, Source};
use super::error::HubError;
use super::files::{self, Plan, Want, INDEX};
use super::id::{is_commit, HubId};
use super::settings::HubSettings;

/// The model `id` at `revision` (default `main`): its snapshot directory (config, tokenizer,
/// safetensors), or the GGUF file in it that the tag or `gguf_file` picks.
pub fn fetch_model(
    id: &HubId,
    revision: Option<&str>,
    gguf_file: Option<&str>,
    settings: &HubSettings,
) -> Result<PathBuf, HubError> {
    fetch(&id.repo, revision.unwrap_or("main"), Want::Model { tag: id.tag.as_deref(), gguf_file }, settings)
}

/// The tokenizer files of `id` at `revision` (default `main`): a snapshot directory with
/// tokenizer.json.
pub fn fetch_tokenizer(id: &HubId, revision: Option<&str>, settings: &HubSettings) -> Result<PathBuf, HubError> {
    fetch(&id.repo, revision.unwrap_or("main"), Want::Tokenizer, settings)
}

fn fetch(repo: &str, revision: &str, want: Want, settings: &HubSettings) -> Result<PathBuf, HubError> {
    let cache = RepoCache::new(&settings.cache, repo);
    if settings.offline {
        let not_cached = |missing: String| HubError::NotCached {
            repo: repo.to_string(),
            revision: revision.to_string(),
            cache: settings.cache.clone(),
            missing,
        };
        let commit = cache.commit_of(revision).ok_or_else(|| not_cached("no snapshot of it".into()))?;
        return cached(&cache, repo, &commit, want, false).map_err(not_cached);
    }
    if is_commit(revision) {
        if let Ok(path) = cached(&cache, repo, &revision.to_ascii_lowercase(), want, true) {
            return Ok(path);
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| HubError::Download { file: repo.to_string(), reason: format!("cannot start a runtime: {e}") })?;
    rt.block_on(online(&cache, repo, revision, want, settings))
}

async fn online(
    cache: &RepoCache,
    repo: &str,
    revision: &str,
    want: Want<'_>,
    settings: &HubSettings,
) -> Result<PathBuf, HubError> {
    let client = Client::new(settings);
    let listing = match client.listing(repo, revision).await {
        Ok(l) => l,
        Err(e) if e.is_unreachable() => {
            let commit = cache.commit_of(revision);
            if let Some(path) = commit.as_deref().and_then(|c| cached(cache, repo, c, want, false).ok()) {
                tracing::warn!("{e}; using the cached snapshot {}", path.display());
                return Ok(path);
            }
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let names: Vec<&str> = listing.files.iter().map(|f| f.name.as_str()).collect();
    let commit = listing.commit.clone();
    let plan = files::plan(repo, revision, want, &names)?;
    let fetcher = Fetcher { client: &client, cache, repo, revision, listing: &listing, announced: Cell::new(false) };
    for f in &plan.fetch {
        fetcher.ensure(f).await?;
    }
    if plan.sharded {
        for shard in read_shards(cache, repo, &commit)? {
            if listing.file(&shard).is_none() {
                return Err(HubError::MissingShard { repo: repo.to_string(), index: INDEX.to_string(), shard });
            }
            fetcher.ensure(&shard).await?;
        }
    }
    for f in &plan.absent {
        cache.mark_absent(&commit, f);
    }
    // Last: until the snapshot is complete, the ref keeps naming the one before (which the
    // offline and unreachable paths then still find whole).
    cache.write_ref(revision, &commit)?;
    Ok(target(cache, &commit, &plan))
}

struct Fetcher<'a> {
    client: &'a Client,
    cache: &'a RepoCache,
    repo: &'a str,
    revision: &'a str,
    listing: &'a Listing,
    /// Whether the first download was logged.
    announced: Cell<bool>,
}

impl Fetcher<'_> {
    /// `file` in the snapshot: linked to its blob, fetched first unless the blob is cached.
    async fn ensure(&self, file: &str) -> Result<(), HubError> {
        let commit = &self.listing.commit;
        if self.cache.has(commit, file) {
            return Ok(());
        }
        let meta = self.client.file_meta(self.repo, commit, file).await?;
        let listed = self.listing.file(file);
        let lfs = listed.and_then(|f| f.lfs.as_ref());
        let sha256 = lfs.and_then(|l| l.sha256.clone()).or(meta.sha256.clone());
        let size = meta.size.or(lfs.and_then(|l| l.size)).or(listed.and_then(|f| f.size));
        let blob = self.cache.blob(&meta.etag);
        if !blob.is_file() {
            let _lock = self.cache.lock(&meta.etag)?;
            if !blob.is_file() {
                if !self.announced.replace(true) {
                    tracing::info!(
                        "downloading {} ({} = {}) from {} into {}",
                        self.repo,
                        self.revision,
                        &commit[..12],
                        self.client.endpoint(),
                        self.cache.dir().display()
                    );
                }
                let src = Source { url: &meta.url, size, sha256: sha256.as_deref() };
                download::fetch(self.client, src, &blob, file).await?;
            }
        }
        self.cache.link(commit, file, &meta.etag)?;
        Ok(())
    }
}

/// The shards the snapshot's index names.
fn read_shards(cache: &RepoCache, repo: &str, commit: &str) -> Result<Vec<String>, HubError> {
    let path = cache.snapshot(commit).join(INDEX);
    let text = std::fs::read_to_string(&path).map_err(|e| HubError::io(&path, e))?;
    let bad = |reason: String| HubError::BadReply { url: format!("{repo}/{INDEX}"), reason };
    let shards = files::shards(&text).map_err(bad)?;
    match shards.iter().find(|s| !super::cache::safe_relative(s)) {
        Some(s) => Err(bad(format!("unusable shard name `{s}`"))),
        None => Ok(shards),
    }
}

fn target(cache: &RepoCache, commit: &str, plan: &Plan) -> PathBuf {
    match &plan.gguf {
        Some(f) => cache.snapshot(commit).join(f),
        None => cache.snapshot(commit),
    }
}

/// The cached snapshot of `commit`, if it has what `want` needs (else what it lacks). `strict`:
/// also every optional file must be present or known absent, so that the snapshot is what a
/// download would give; and weights without a tag or file must be safetensors (a GGUF found
/// alone in a snapshot may sit beside safetensors never fetched).
fn cached(cache: &RepoCache, repo: &str, commit: &str, want: Want, strict: bool) -> Result<PathBuf, String> {
    let snapshot = cache.snapshot(commit);
    if !snapshot.is_dir() {
        return Err(format!("no snapshot of commit {commit}"));
    }
    let names = cache.snapshot_files(commit);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let plan = files::plan(repo, commit, want, &names).map_err(|e| e.to_string())?;
    if plan.sharded {
        let shards = read_shards(cache, repo, commit).map_err(|e| e.to_string())?;
        if let Some(s) = shards.iter().find(|s| !cache.has(commit, s)) {
            return Err(format!("the snapshot lacks the shard {s}"));
        }
    }
    if strict {
        if let Some(f) = plan.absent.iter().find(|f| !cache.known_absent(commit, f)) {
            return Err(format!("not known whether the repo has {f}"));
        }
        if matches!(want, Want::Model { tag: None, gguf_file: None }) && plan.gguf.is_some() {
            return Err("a GGUF chosen without a tag".into());
        }
    }
    Ok(target(cache, commit, &plan))
}
