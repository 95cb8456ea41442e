//! One repo's part of the Hugging Face cache, laid out as `huggingface_hub` lays it out:
//!
//! ```text
//! <cache>/models--ORG--NAME/
//!   blobs/<etag>                       file contents, named by their ETag (an LFS file's sha256)
//!   blobs/<etag>.incomplete            a download in progress (resumed from its length)
//!   snapshots/<commit>/<file>          relative symlinks to the blobs: what the loader reads
//!   refs/<revision>                    the commit a branch or tag pointed to (no newline)
//!   .no_exist/<commit>/<file>          files known to be absent at that commit
//! <cache>/.locks/models--ORG--NAME/<etag>.lock   held while a blob downloads (flock)
//! ```

use std::fs::File;
use std::path::{Path, PathBuf};

use super::error::HubError;

pub struct RepoCache {
    dir: PathBuf,
    locks: PathBuf,
}

/// A blob's download lock, released when dropped.
pub struct BlobLock(#[allow(dead_code)] File);

impl RepoCache {
    pub fn new(cache: &Path, repo: &str) -> RepoCache {
        let folder = format!("models--{}", repo.replace('/', "--"));
        RepoCache { dir: cache.join(&folder), locks: cache.join(".locks").join(folder) }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// The commit a revision names: itself if it is one, else the cached ref.
    pub fn commit_of(&self, revision: &str) -> Option<String> {
        if super::id::is_commit(revision) {
            return Some(revision.to_ascii_lowercase());
        }
        if !safe_relative(revision) {
            return None;
        }
        let commit = std::fs::read_to_string(self.dir.join("refs").join(revision)).ok()?;
        let commit = commit.trim();
        super::id::is_commit(commit).then(|| commit.to_string())
    }

    /// Records that `revision` (a branch or tag) points to `commit`.
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        if super::id::is_commit(revision) || !safe_relative(revision) {
            return Ok(());
        }
        let path = self.dir.join("refs").join(revision);
        if std::fs::read_to_string(&path).is_ok_and(|c| c == commit) {
            return Ok(());
        }
        let parent = path.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        // Written whole then renamed, so a reader never sees half a commit id.
        let tmp = path.with_file_name(format!(".{}.{}.tmp", file_name(&path), std::process::id()));
        std::fs::write(&tmp, commit).map_err(|e| HubError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| HubError::io(&path, e))
    }

    /// Whether the snapshot of `commit` has `file` (its link resolves).
    pub fn has(&self, commit: &str, file: &str) -> bool {
        self.snapshot(commit).join(file).is_file()
    }

    /// Whether `file` is known to be absent at `commit`.
    pub fn known_absent(&self, commit: &str, file: &str) -> bool {
        self.dir.join(".no_exist").join(commit).join(file).exists()
    }

    /// Records that `file` is absent at `commit` (best effort: it only saves a later lookup).
    pub fn mark_absent(&self, commit: &str, file: &str) {
        let marker = self.dir.join(".no_exist").join(commit).join(file);
        if let Some(parent) = marker.parent() {
            let _ = std::fs::create_dir_all(parent).and_then(|_| File::create(&marker));
        }
    }

    /// Links `snapshots/<commit>/<file>` to the blob `etag` (a relative symlink, so the cache
    /// can move; a copy where symlinks are not available).
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf, HubError> {
        let pointer = self.snapshot(commit).join(file);
        let parent = pointer.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        let _ = std::fs::remove_file(&pointer);
        let result = make_link(&self.blob(etag), &pointer, file.split('/').count() + 1, etag);
        match result {
            // Another process linked it meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && pointer.is_file() => Ok(pointer),
            Err(e) => Err(HubError::io(&pointer, e)),
            Ok(()) => Ok(pointer),
        }
    }

    /// Takes the download lock of blob `etag` (the lock file `huggingface_hub` takes too),
    /// waiting for another process that holds it.
    pub fn lock(&self, etag: &str) -> Result<BlobLock, HubError> {
        std::fs::create_dir_all(&self.locks).map_err(|e| HubError::io(&self.locks, e))?;
        let path = self.locks.join(format!("{etag}.lock"));
        let file =
            File::options().create(true).truncate(false).write(true).open(&path).map_err(|e| HubError::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                tracing::info!("waiting for another download of {} ({})", etag, path.display());
                file.lock().map_err(|e| HubError::io(&path, e))?;
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(HubError::io(&path, e)),
        }
        Ok(BlobLock(file))
    }

    /// The files of a cached snapshot, as `/`-separated paths relative to it.
    pub fn snapshot_files(&self, commit: &str) -> Vec<String> {
        let root = self.snapshot(commit);
        let mut out = Vec::new();
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.is_file() {
                    if let Some(rel) = p.strip_prefix(&root).ok().and_then(|r| r.to_str()) {
                        out.push(rel.replace(std::path::MAIN_SEPARATOR, "/"));
                    }
                }
            }
        }
        out.sort();
        out
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(unix)]
fn make_link(_blob: &Path, pointer: &Path, ups: usize, etag: &str) -> std::io::Result<()> {
    let target: PathBuf = std::iter::repeat_n("..", ups).collect::<PathBuf>().join("blobs").join(etag);
    std::os::unix::fs::symlink(target, pointer)
}

#[cfg(not(unix))]
fn make_link(blob: &Path, pointer: &Path, _ups: usize, _etag: &str) -> std::io::Result<()> {
    std::fs::copy(blob, pointer).map(|_| ())
}

/// A path from the Hub that is safe to join under a cache folder: relative, no `..`, `.` or
/// empty parts, no backslashes.
pub fn safe_relative(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && !p.contains('\\')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// An ETag usable as a blob name (the Hub's are hex digests).
pub fn safe_etag(etag: &str) -> bool {
    !etag.is_empty() && etag.len() <= 128 && etag.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn lays_out_refs_blobs_and_snapshots() {
        let root = std::env::temp_dir().join(format!("iris-hub-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let c = RepoCache::new(&root, "org/name");
        assert_eq!(c.dir(), root.join("models--org--name"));
        assert_eq!(c.commit_of("main"), None);
        c.write_ref("main", COMMIT).unwrap();
        assert_eq!(std::fs::read_to_string(c.dir().join("refs/main")).unwrap(), COMMIT, "no newline, as Python writes");
        assert_eq!(c.commit_of("main").as_deref(), Some(COMMIT));
        assert_eq!(c.commit_of(COMMIT).as_deref(), Some(COMMIT));
        assert_eq!(c.commit_of("../x"), None);

        std::fs::create_dir_all(c.blob("e1").parent().unwrap()).unwrap();
        std::fs::write(c.blob("e1"), b"top").unwrap();
        std::fs::write(c.blob("e2"), b"nested").unwrap();
        c.link(COMMIT, "config.json", "e1").unwrap();
        c.link(COMMIT, "sub/dir/x.gguf", "e2").unwrap();
        // Linking again replaces the link.
        c.link(COMMIT, "config.json", "e1").unwrap();
        assert_eq!(std::fs::read(c.snapshot(COMMIT).join("sub/dir/x.gguf")).unwrap(), b"nested");
        #[cfg(unix)]
        assert_eq!(
            std::fs::read_link(c.snapshot(COMMIT).join("sub/dir/x.gguf")).unwrap(),
            PathBuf::from("../../../../blobs/e2")
        );
        assert!(c.has(COMMIT, "config.json") && !c.has(COMMIT, "tokenizer.json"));
        assert_eq!(c.snapshot_files(COMMIT), ["config.json", "sub/dir/x.gguf"]);
        assert!(!c.known_absent(COMMIT, "chat_template.json"));
        c.mark_absent(COMMIT, "chat_template.json");
        assert!(c.known_absent(COMMIT, "chat_template.json"));
        drop(c.lock("e1").unwrap());
        let _again = c.lock("e1").unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn refuses_unsafe_names() {
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a\\b", "./a"] {
            assert!(!safe_relative(bad), "{bad}");
        }
        assert!(safe_relative("a/b.gguf") && safe_relative("refs/pr/1"));
        assert!(safe_etag("ab12-_") && !safe_etag("../x") && !safe_etag(""));
    }
}
