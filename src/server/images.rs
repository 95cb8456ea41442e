//! Images in chat requests: where they come from (OpenAI `image_url` parts, Anthropic `image`
//! blocks), fetching their bytes under the server's media policy, and decoding within limits.
//! Every failure is the client's: a 400 naming the part at fault.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::engine_loop::EngineHandle;
use super::errors::ApiError;
use crate::media::remote::{FetchError, RemoteFetcher};
use crate::media::{decode_image, DecodeLimits, RgbImage};

/// What the server accepts as an image source.
#[derive(Debug, Clone, Default)]
pub struct MediaPolicy {
    /// `file://` URLs are read only from under this directory (canonical path).
    pub allowed_local_media_path: Option<PathBuf>,
    /// http(s) URLs are fetched only with this (`--allow-remote-media`).
    pub remote: Option<Arc<RemoteFetcher>>,
    pub limits: DecodeLimits,
}

/// An image reference from a request, with the JSON paths of its part and of the field
/// holding the image.
#[derive(Debug, Clone)]
pub struct ImageRef {
    /// The content item (`messages[0].content[1]`).
    pub item: String,
    /// Its type (`image_url`, `image`).
    pub item_type: &'static str,
    /// The field with the data or URL.
    pub path: String,
    pub source: Source,
}

#[derive(Debug, Clone)]
pub enum Source {
    /// `data:` URL or base64 block: the encoded bytes.
    Base64(String),
    Url(String),
}

/// OpenAI: `{"type": "image_url", "image_url": {"url": ...}}` (or the url as a string).
pub fn openai_image(part: &Value, path: &str) -> Result<ImageRef, ApiError> {
    let url = match part.get("image_url") {
        Some(Value::String(u)) => u.as_str(),
        Some(obj) => obj.get("url").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(format!("{path}.image_url.url"), format!("`{path}.image_url.url` must be a string"))
        })?,
        None => {
            return Err(ApiError::invalid_param(format!("{path}.image_url"), format!("`{path}` has no `image_url`")))
        }
    };
    Ok(ImageRef {
        item: path.to_string(),
        item_type: "image_url",
        path: format!("{path}.image_url.url"),
        source: url_source(url),
    })
}

/// Anthropic: `{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}`
/// or `{"type": "url", "url": ...}`.
pub fn anthropic_image(block: &Value, path: &str) -> Result<ImageRef, ApiError> {
    let src = block.get("source").filter(|s| s.is_object()).ok_or_else(|| {
        ApiError::invalid_param(format!("{path}.source"), format!("`{path}.source` must be an object"))
    })?;
    let field = |name: &str| {
        src.get(name).and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(format!("{path}.source.{name}"), format!("`{path}.source.{name}` must be a string"))
        })
    };
    let r = |field: &str, source| ImageRef {
        item: path.to_string(),
        item_type: "image",
        path: format!("{path}.source.{field}"),
        source,
    };
    match src.get("type").and_then(Value::as_str) {
        Some("base64") => {
            field("media_type")?;
            Ok(r("data", Source::Base64(field("data")?.to_string())))
        }
        Some("url") => Ok(r("url", url_source(field("url")?))),
        _ => Err(ApiError::invalid_param(
            format!("{path}.source.type"),
            format!("`{path}.source.type` must be \"base64\" or \"url\""),
        )),
    }
}

fn url_source(url: &str) -> Source {
    Source::from_url(url)
}

impl Source {
    /// A `data:...;base64,` URL's bytes, else the URL to fetch.
    pub fn from_url(url: &str) -> Source {
        match url.strip_prefix("data:").and_then(|rest| rest.split_once(',')) {
            Some((meta, data)) if meta.ends_with(";base64") => Source::Base64(data.to_string()),
            _ => Source::Url(url.to_string()),
        }
    }
}

fn is_remote(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// The bodies of the http(s) image URLs among `refs` (None for the others), fetched
/// concurrently when the server allows remote media; without it `load` refuses them.
async fn fetch_remote(refs: &[ImageRef], policy: &MediaPolicy) -> Result<Vec<Option<Vec<u8>>>, ApiError> {
    let Some(fetcher) = &policy.remote else { return Ok(vec![None; refs.len()]) };
    let fetches = refs.iter().map(|r| async move {
        match &r.source {
            Source::Url(url) if is_remote(url) => fetcher.fetch(url).await.map(Some).map_err(|e| {
                ApiError::invalid_param(
                    r.path.clone(),
                    format!("cannot fetch the image at `{}`: {}", r.path, public(&e)),
                )
            }),
            _ => Ok(None),
        }
    });
    futures_util::future::try_join_all(fetches).await
}

/// What a client may learn of a failed fetch: never the internal address a name resolved to
/// (that would map the server's network for it); the log has the whole error.
fn public(e: &FetchError) -> String {
    match e {
        // An address the client wrote itself tells it nothing new.
        FetchError::Refused { host, .. } if host.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok() => {
            e.to_string()
        }
        FetchError::Refused { host, .. } => {
            tracing::info!("image fetch refused: {e}");
            format!("refusing to fetch from `{host}`: it is not a public address")
        }
        other => other.to_string(),
    }
}

/// The decoded image a reference points to; `fetched` holds the body of an http(s) URL.
pub fn load(r: &ImageRef, policy: &MediaPolicy, fetched: Option<Vec<u8>>) -> Result<RgbImage, ApiError> {
    let bad = |msg: String| ApiError::invalid_param(r.path.clone(), msg);
    let bytes = match (&r.source, fetched) {
        (_, Some(body)) => body,
        (Source::Base64(data), None) => {
            // The encoded form is 4/3 of the bytes: refuse before decoding a huge payload.
            if data.len() / 4 * 3 > policy.limits.max_bytes + 3 {
                return Err(bad(format!("the image is larger than the limit of {} bytes", policy.limits.max_bytes)));
            }
            base64_decode(data).ok_or_else(|| bad(format!("`{}` is not valid base64", r.path)))?
        }
        (Source::Url(url), None) if is_file_url(url) => {
            let path = file_url_path(url).map_err(bad)?;
            read_local(&path, policy).map_err(bad)?
        }
        (Source::Url(url), None) if is_remote(url) => {
            return Err(bad("image URLs over the network are disabled on this server (start it with \
                 --allow-remote-media to fetch them); send the image as a `data:` URL (base64)"
                .into()))
        }
        (Source::Url(_), None) => {
            return Err(bad("the image must be a `data:` URL (base64) or a `file://` URL".into()))
        }
    };
    decode_image(&bytes, &policy.limits).map_err(|e| bad(format!("{}: {e}", r.path)))
}

/// Whether `url` has the `file` scheme (in any case, RFC 3986).
fn is_file_url(url: &str) -> bool {
    url.get(..5).is_some_and(|s| s.eq_ignore_ascii_case("file:"))
}

/// The local path of a `file` URL (RFC 8089): `file:///p`, `file://localhost/p` or `file:/p`,
/// percent-decoded; a query or fragment is not part of the path.
fn file_url_path(url: &str) -> Result<String, String> {
    let rest = &url[5..];
    let rest = rest.split(['?', '#']).next().unwrap_or(rest);
    let path = match rest.strip_prefix("//") {
        Some(auth_path) => {
            let (host, path) = auth_path.split_at(auth_path.find('/').unwrap_or(auth_path.len()));
            if !(host.is_empty() || host.eq_ignore_ascii_case("localhost")) {
                return Err(format!("`file://{host}/...` names another host: only local files are read"));
            }
            path
        }
        None => rest,
    };
    if !path.starts_with('/') {
        return Err("a `file://` URL needs an absolute path (file:///path/to/image)".into());
    }
    percent_decode(path).ok_or_else(|| "the `file://` URL has a bad percent-escape or is not UTF-8".to_string())
}

/// `%XX` escapes decoded; None when one is malformed or the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Reads a local file only from under the allowed directory, after resolving `..` and links.
/// A path that does not resolve and one outside the directory get the same answer, so a
/// client cannot probe which files exist elsewhere (the log says which it was).
fn read_local(path: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let Some(root) = &policy.allowed_local_media_path else {
        return Err("local image files are disabled (start the server with --allowed-local-media-path DIR)".into());
    };
    let unavailable = || format!("`{path}` is not a file under the allowed media directory");
    let real = Path::new(path).canonicalize().map_err(|e| {
        tracing::info!("local image `{path}`: {e}");
        unavailable()
    })?;
    if !real.starts_with(root) {
        tracing::info!("local image `{path}` resolves outside --allowed-local-media-path");
        return Err(unavailable());
    }
    let meta = std::fs::metadata(&real).map_err(|e| format!("cannot open `{path}`: {e}"))?;
    if !meta.is_file() {
        return Err(format!("`{path}` is not a file"));
    }
    if meta.len() > policy.limits.max_bytes as u64 {
        return Err(format!("the image is larger than the limit of {} bytes", policy.limits.max_bytes));
    }
    std::fs::read(&real).map_err(|e| format!("cannot read `{path}`: {e}"))
}

/// Standard base64 (padding optional, whitespace ignored); None if malformed.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let body: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let body = body.strip_suffix(b"==").or_else(|| body.strip_suffix(b"=")).unwrap_or(&body);
    if body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c)? << (18 - 6 * i);
        }
        out.extend_from_slice(&acc.to_be_bytes()[1..chunk.len()]);
    }
    Some(out)
}

/// Refuses images for a model without a vision tower, and more than `--limit-mm-per-prompt`
/// allows (before the template sees them).
pub fn check_accepted(engine: &EngineHandle, refs: &[ImageRef]) -> Result<(), ApiError> {
    // The first image past the limit.
    if let Some((limit, r)) = engine.limits.max_images.and_then(|n| Some((n, refs.get(n)?))) {
        let msg = match limit {
            0 => format!(
                "this server was started with --limit-mm-per-prompt image 0: it takes no images (`{}` is an `{}` item)",
                r.item, r.item_type
            ),
            n => format!(
                "at most {n} image(s) may be provided in one prompt (this server was started with --limit-mm-per-prompt image {n}); this request has {}",
                refs.len()
            ),
        };
        return Err(ApiError::invalid_param(format!("{}.type", r.item), msg));
    }
    match (refs.first(), &engine.vision) {
        (Some(r), None) => Err(ApiError::invalid_param(
            format!("{}.type", r.item),
            format!(
                "this model does not accept images: `{}` is an `{}` item, which needs a vision-language model",
                r.item, r.item_type
            ),
        )),
        _ => Ok(()),
    }
}

/// Loads a request's images and expands the prompt's image placeholders to the number of
/// embeddings each image takes. Decoding and preprocessing run on the blocking pool.
pub async fn prepare(
    policy: &MediaPolicy,
    engine: &EngineHandle,
    prompt: Vec<u32>,
    refs: Vec<ImageRef>,
) -> Result<(Vec<u32>, Vec<crate::engine::ImageInput>), ApiError> {
    if refs.is_empty() {
        return Ok((prompt, Vec::new()));
    }
    check_accepted(engine, &refs)?;
    let Some(vision) = engine.vision.clone() else { return Ok((prompt, Vec::new())) };
    let fetched = fetch_remote(&refs, policy).await?;
    let policy = policy.clone();
    let (prompt, images) = tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
        let mut images = Vec::with_capacity(refs.len());
        for (r, fetched) in refs.iter().zip(fetched) {
            let img = load(r, &policy, fetched)?;
            let pixels = vision
                .preprocess(&img)
                .map_err(|e| ApiError::invalid_param(r.path.clone(), format!("{}: {e}", r.path)))?;
            images.push(crate::engine::ImageInput::new(pixels));
        }
        let counts: Vec<usize> = images.iter().map(|i| vision.num_image_tokens(&i.pixels)).collect();
        let prompt = crate::engine::expand_image_tokens(&prompt, vision.as_ref(), &counts).map_err(|e| {
            ApiError::bad_request(format!("the chat template did not place the images: {e}")).param("messages")
        })?;
        Ok((prompt, images))
    })
    .await
    .map_err(|e| ApiError::internal(format!("image preprocessing failed: {e}")))??;
    Ok((prompt, images))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVs\nbG8h").unwrap(), b"hell\x6f!");
        assert!(base64_decode("a").is_none());
        assert!(base64_decode("a*==").is_none());
    }

    #[test]
    fn sources_and_policy() {
        let part = serde_json::json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}});
        assert!(matches!(openai_image(&part, "m").unwrap().source, Source::Base64(ref d) if d == "AAAA"));
        let block = serde_json::json!({"type": "image", "source": {"type": "base64", "media_type": "image/png"}});
        assert!(anthropic_image(&block, "m").is_err());
        let at = |source| ImageRef { item: "i".into(), item_type: "image_url", path: "p".into(), source };
        let remote = at(Source::Url("http://127.0.0.1/x.png".into()));
        let err = load(&remote, &MediaPolicy::default(), None).unwrap_err();
        assert_eq!(err.status.as_u16(), 400);
        assert!(err.message.contains("--allow-remote-media"), "{}", err.message);
        let local = at(Source::Url("file:///etc/passwd".into()));
        let err = load(&local, &MediaPolicy::default(), None).unwrap_err();
        assert!(err.message.contains("--allowed-local-media-path"), "{}", err.message);
        let dir = std::env::temp_dir().canonicalize().unwrap();
        let policy = MediaPolicy { allowed_local_media_path: Some(dir.join("iris-none")), ..Default::default() };
        let outside = at(Source::Url(format!("file://{}/../etc/passwd", dir.display())));
        assert!(load(&outside, &policy, None).unwrap_err().message.contains("not a file under the allowed"));
    }

    #[test]
    fn file_urls_follow_rfc_8089() {
        assert_eq!(file_url_path("file:///a/b%20c.png").unwrap(), "/a/b c.png");
        assert_eq!(file_url_path("FILE://localhost/a.png").unwrap(), "/a.png");
        assert_eq!(file_url_path("file:/a.png?x#y").unwrap(), "/a.png");
        assert!(file_url_path("file://other/a.png").unwrap_err().contains("another host"));
        assert!(file_url_path("file:///a%zz").is_err());
        assert!(file_url_path("file://a.png").is_err());
        assert!(is_file_url("File:///x") && !is_file_url("fil"));
    }
}
