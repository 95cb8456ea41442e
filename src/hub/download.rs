//! One file into its blob: streamed into `<blob>.incomplete`, resumed from that file's length
//! with `Range` (after a cut connection, in this run or a later one), checked against the
//! expected size and, for LFS files, their sha256, then renamed into place. A progress bar
//! shows on a terminal.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper::header;
use hyper::Method;
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use super::client::Client;
use super::error::HubError;

/// Failed attempts in a row (each without progress) before a download gives up.
const MAX_FAILURES: u32 = 5;

/// Where a file comes from and what it must be.
pub struct Source<'a> {
    pub url: &'a str,
    pub size: Option<u64>,
    /// An LFS file's sha256 (hex).
    pub sha256: Option<&'a str>,
}

/// The partial file of a download in progress.
struct Partial {
    path: PathBuf,
    file: std::fs::File,
    len: u64,
    hash: Sha256,
}

impl Partial {
    /// Opens (or creates) `path`, hashing what it already holds.
    fn open(path: PathBuf, size: Option<u64>) -> Result<Partial, HubError> {
        let io = |e| HubError::io(&path, e);
        let mut file =
            std::fs::File::options().create(true).truncate(false).read(true).write(true).open(&path).map_err(io)?;
        let mut len = file.metadata().map_err(io)?.len();
        if size.is_some_and(|s| len > s) {
            file.set_len(0).map_err(io)?;
            len = 0;
        }
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = file.read(&mut buf[..want]).map_err(io)?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            left -= n as u64;
        }
        file.seek(SeekFrom::Start(len)).map_err(io)?;
        Ok(Partial { path, file, len, hash })
    }

    fn restart(&mut self) -> Result<(), HubError> {
        let io = |e| HubError::io(&self.path, e);
        self.file.set_len(0).map_err(io)?;
        self.file.seek(SeekFrom::Start(0)).map_err(io)?;
        self.len = 0;
        self.hash = Sha256::new();
        Ok(())
    }

    fn append(&mut self, data: &[u8]) -> Result<(), HubError> {
        self.file.write_all(data).map_err(|e| HubError::io(&self.path, e))?;
        self.hash.update(data);
        self.len += data.len() as u64;
        Ok(())
    }
}

/// How one attempt ended, short of an error that ends the download.
enum Attempt {
    Done,
    /// The connection failed; the partial file keeps what arrived.
    Failed(String),
}

/// Downloads `src` into `blob` (its parent is created), labelled `name` on the progress bar.
pub async fn fetch(client: &Client, src: Source<'_>, blob: &Path, name: &str) -> Result<(), HubError> {
    if let Some(parent) = blob.parent() {
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
    }
    let mut size = src.size;
    let mut part = Partial::open(PathBuf::from(format!("{}.incomplete", blob.display())), size)?;
    if part.len > 0 {
        tracing::info!("resuming {name} from byte {}", part.len);
    }
    let bar = progress_bar(name, size, part.len);
    let mut failures = 0;
    loop {
        if size.is_some_and(|s| part.len == s) {
            break;
        }
        let before = part.len;
        match attempt(client, src.url, &mut part, &mut size, &bar).await? {
            Attempt::Done => break,
            Attempt::Failed(reason) => {
                failures = if part.len > before { 1 } else { failures + 1 };
                if failures >= MAX_FAILURES {
                    bar.abandon();
                    return Err(HubError::Download { file: name.to_string(), reason });
                }
                tracing::debug!("{name}: {reason}; resuming from byte {}", part.len);
                tokio::time::sleep(Duration::from_millis(250 << failures.min(5))).await;
            }
        }
    }
    bar.finish_and_clear();
    let Partial { path, file, len, hash } = part;
    drop(file);
    if let Some(expected) = size.filter(|s| *s != len) {
        return Err(HubError::Size { file: name.to_string(), expected, got: len });
    }
    if let Some(expected) = src.sha256 {
        let got = hex(&hash.finalize());
        if !got.eq_ignore_ascii_case(expected) {
            let _ = std::fs::remove_file(&path);
            return Err(HubError::Checksum { file: name.to_string(), expected: expected.to_string(), got });
        }
    }
    std::fs::rename(&path, blob).map_err(|e| HubError::io(blob, e))
}

/// One GET, from where the partial file ends.
async fn attempt(
    client: &Client,
    url: &str,
    part: &mut Partial,
    size: &mut Option<u64>,
    bar: &ProgressBar,
) -> Result<Attempt, HubError> {
    let range = format!("bytes={}-", part.len);
    let mut headers = vec![(header::ACCEPT_ENCODING, "identity")];
    if part.len > 0 {
        headers.push((header::RANGE, range.as_str()));
    }
    let mut reply = match client.request(Method::GET, url, &headers, false).await {
        Ok(r) => r,
        Err(HubError::Unreachable { reason, .. }) => return Ok(Attempt::Failed(reason)),
        Err(e) => return Err(e),
    };
    match reply.status {
        206 => {
            // `bytes START-END/TOTAL`: it must go on where the partial file ends.
            let range = reply.header("content-range").and_then(content_range);
            match range {
                Some((start, total)) if start == part.len => {
                    size.get_or_insert(total);
                }
                _ => {
                    part.restart()?;
                    bar.set_position(0);
                    return Ok(Attempt::Failed("the server resumed at another offset".into()));
                }
            }
        }
        200 => {
            // A server that ignores Range sends it all again.
            if part.len > 0 {
                part.restart()?;
                bar.set_position(0);
            }
            if size.is_none() {
                *size = reply.header("content-length").and_then(|s| s.trim().parse().ok());
            }
        }
        416 if part.len > 0 => {
            // Nothing past the end: the partial file is longer than the file, or complete.
            if size.is_some_and(|s| s == part.len) {
                return Ok(Attempt::Done);
            }
            part.restart()?;
            bar.set_position(0);
            return Ok(Attempt::Failed("the server refused the range".into()));
        }
        s if s >= 500 => return Ok(Attempt::Failed(format!("HTTP {s}"))),
        s => return Err(HubError::Status { url: reply.url.clone(), status: s }),
    }
    if let Some(s) = *size {
        bar.set_length(s);
    }
    loop {
        match reply.chunk().await {
            Ok(Some(data)) => {
                part.append(&data)?;
                bar.set_position(part.len);
            }
            Ok(None) => break,
            Err(reason) => return Ok(Attempt::Failed(reason)),
        }
    }
    match *size {
        Some(s) if part.len < s => {
            Ok(Attempt::Failed(format!("the connection closed after {} of {s} bytes", part.len)))
        }
        _ => Ok(Attempt::Done),
    }
}

/// `bytes 100-199/200` -> (100, 200).
fn content_range(v: &str) -> Option<(u64, u64)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (span, total) = rest.split_once('/')?;
    let (start, _) = span.split_once('-')?;
    Some((start.trim().parse().ok()?, total.trim().parse().ok()?))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A bar of bytes on stderr (drawn only on a terminal).
fn progress_bar(name: &str, size: Option<u64>, start: u64) -> ProgressBar {
    let bar = ProgressBar::new(size.unwrap_or(0));
    let template = "{msg:30!} [{bar:30}] {bytes:>10}/{total_bytes:10} {bytes_per_sec:>12} {eta:>4}";
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> "),
    );
    bar.set_message(name.to_string());
    bar.set_position(start);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_content_ranges() {
        assert_eq!(content_range("bytes 100-199/200"), Some((100, 200)));
        assert_eq!(content_range("bytes */200"), None);
        assert_eq!(hex(&[0, 255, 16]), "00ff10");
    }

    #[test]
    fn a_partial_file_is_hashed_and_resumed() {
        let p = std::env::temp_dir().join(format!("iris-hub-partial-{}", std::process::id()));
        std::fs::write(&p, b"hello ").unwrap();
        let mut part = Partial::open(p.clone(), Some(11)).unwrap();
        assert_eq!(part.len, 6);
        part.append(b"world").unwrap();
        assert_eq!(hex(&part.hash.clone().finalize()), hex(&Sha256::digest(b"hello world")));
        drop(part);
        assert_eq!(std::fs::read(&p).unwrap(), b"hello world");
        // Longer than the file: started over.
        let part = Partial::open(p.clone(), Some(3)).unwrap();
        assert_eq!(part.len, 0);
        std::fs::remove_file(&p).unwrap();
    }
}
