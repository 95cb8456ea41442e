//! Which of a repo's files a model needs, from the list of its file names: the Hub's listing
//! when online, a cached snapshot's files offline (the same rules, so both pick the same).

use super::error::HubError;

/// The weights of a sharded safetensors checkpoint name their shards here.
pub const INDEX: &str = "model.safetensors.index.json";
/// The weights of an unsharded one.
pub const SINGLE: &str = "model.safetensors";
pub const CONFIG: &str = "config.json";
pub const TOKENIZER: &str = "tokenizer.json";

/// What iris reads from a model directory when present (loader.rs, tokenizer/, media/processor.rs):
/// the tokenizer too, which `--tokenizer` may take from elsewhere.
const MODEL_OPTIONAL: &[&str] = &[
    "generation_config.json",
    TOKENIZER,
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
];

/// What `TextTokenizer::from_dir` reads besides tokenizer.json.
const TOKENIZER_OPTIONAL: &[&str] =
    &["tokenizer_config.json", "chat_template.jinja", "chat_template.json", "generation_config.json", CONFIG];

/// What is wanted from a repo.
#[derive(Debug, Clone, Copy)]
pub enum Want<'a> {
    /// A model: its safetensors directory, or one GGUF file (`ORG/NAME:TAG`, `--gguf-file`).
    Model { tag: Option<&'a str>, gguf_file: Option<&'a str> },
    /// Only the tokenizer's files (`--tokenizer ORG/NAME`).
    Tokenizer,
}

/// The files to have for a want.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Files to fetch, in order. With `sharded`, the index is among them and its shards are
    /// known only once it is read.
    pub fetch: Vec<String>,
    /// Files iris would read that the repo does not have; the cache records them (`.no_exist`,
    /// as `huggingface_hub` does) so that a later run with the commit needs no listing.
    pub absent: Vec<String>,
    /// The GGUF file to load, or `None` for the directory.
    pub gguf: Option<String>,
    pub sharded: bool,
}

/// The plan for `want` from a repo with files `names`.
pub fn plan(repo: &str, revision: &str, want: Want, names: &[&str]) -> Result<Plan, HubError> {
    let has = |f: &str| names.contains(&f);
    let (required, optional): (Vec<&str>, &[&str]) = match want {
        Want::Tokenizer => {
            if !has(TOKENIZER) {
                return Err(HubError::NoTokenizer { repo: repo.to_string() });
            }
            (vec![TOKENIZER], TOKENIZER_OPTIONAL)
        }
        Want::Model { tag, gguf_file } => match choose_weights(repo, revision, tag, gguf_file, names)? {
            Weights::Gguf(f) => {
                return Ok(Plan { fetch: vec![f.clone()], absent: vec![], gguf: Some(f), sharded: false })
            }
            Weights::Safetensors { sharded } => {
                if !has(CONFIG) {
                    return Err(HubError::EntryNotFound {
                        repo: repo.to_string(),
                        revision: revision.to_string(),
                        file: CONFIG.to_string(),
                    });
                }
                (vec![CONFIG, if sharded { INDEX } else { SINGLE }], MODEL_OPTIONAL)
            }
        },
    };
    let sharded = required.contains(&INDEX);
    let mut fetch: Vec<String> = required.iter().map(|f| f.to_string()).collect();
    fetch.extend(optional.iter().filter(|f| has(f)).map(|f| f.to_string()));
    let mut absent: Vec<String> = optional.iter().filter(|f| !has(f)).map(|f| f.to_string()).collect();
    if matches!(want, Want::Model { .. }) && !sharded {
        absent.push(INDEX.to_string());
    }
    Ok(Plan { fetch, absent, gguf: None, sharded })
}

/// The shard file names an index's `weight_map` lists, each once, sorted.
pub fn shards(index_json: &str) -> Result<Vec<String>, String> {
    let json: serde_json::Value = serde_json::from_str(index_json).map_err(|e| format!("not valid JSON: {e}"))?;
    let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or("missing `weight_map` object")?;
    let mut files = Vec::new();
    for v in map.values() {
        let f = v.as_str().ok_or("`weight_map` values must be file names")?;
        if !files.iter().any(|g| g == f) {
            files.push(f.to_string());
        }
    }
    files.sort();
    Ok(files)
}

#[derive(Debug, PartialEq)]
enum Weights {
    Safetensors { sharded: bool },
    Gguf(String),
}

fn choose_weights(
    repo: &str,
    revision: &str,
    tag: Option<&str>,
    gguf_file: Option<&str>,
    names: &[&str],
) -> Result<Weights, HubError> {
    let mut ggufs: Vec<&str> = names.iter().copied().filter(|n| n.to_ascii_lowercase().ends_with(".gguf")).collect();
    ggufs.sort();
    let listed = |files: &[&str]| if files.is_empty() { "none".to_string() } else { files.join(", ") };
    if let Some(file) = gguf_file {
        // The exact path, else a unique file of that base name.
        let found = match ggufs.iter().find(|n| **n == file) {
            Some(n) => Some(*n),
            None => match ggufs.iter().filter(|n| base_name(n) == file).collect::<Vec<_>>().as_slice() {
                [one] => Some(**one),
                _ => None,
            },
        };
        return match found {
            Some(f) => single_file(repo, f, &ggufs),
            None => Err(HubError::GgufFileMissing {
                repo: repo.to_string(),
                file: file.to_string(),
                candidates: listed(&ggufs),
            }),
        };
    }
    // Vision projectors (mmproj-*.gguf) sit beside the language models; only --gguf-file takes one.
    let models: Vec<&str> =
        ggufs.iter().copied().filter(|n| !base_name(n).to_ascii_lowercase().starts_with("mmproj")).collect();
    if let Some(tag) = tag {
        let matches: Vec<&str> = models.iter().copied().filter(|n| tag_matches(n, tag)).collect();
        return match matches.as_slice() {
            [] => {
                Err(HubError::GgufNoMatch { repo: repo.to_string(), tag: tag.to_string(), candidates: listed(&models) })
            }
            [one] => single_file(repo, one, &ggufs),
            several => match one_split_set(several) {
                Some(parts) => {
                    Err(HubError::SplitGguf { repo: repo.to_string(), first: several[0].to_string(), parts })
                }
                None => Err(HubError::GgufAmbiguous {
                    repo: repo.to_string(),
                    tag: tag.to_string(),
                    candidates: several.join(", "),
                }),
            },
        };
    }
    if names.contains(&INDEX) {
        return Ok(Weights::Safetensors { sharded: true });
    }
    if names.contains(&SINGLE) {
        return Ok(Weights::Safetensors { sharded: false });
    }
    match models.as_slice() {
        [] => Err(HubError::NoWeights { repo: repo.to_string(), revision: revision.to_string() }),
        [one] => single_file(repo, one, &ggufs),
        several => match one_split_set(several) {
            Some(parts) => Err(HubError::SplitGguf { repo: repo.to_string(), first: several[0].to_string(), parts }),
            None => Err(HubError::GgufChoiceNeeded { repo: repo.to_string(), candidates: several.join(", ") }),
        },
    }
}

/// A chosen GGUF, unless it is one part of a split file.
fn single_file(repo: &str, file: &str, all: &[&str]) -> Result<Weights, HubError> {
    match split_part(file) {
        Some((_, total)) => {
            let first = all.iter().find(|n| same_split(n, file) && split_part(n).is_some_and(|(p, _)| p == 1));
            Err(HubError::SplitGguf { repo: repo.to_string(), first: first.unwrap_or(&file).to_string(), parts: total })
        }
        None => Ok(Weights::Gguf(file.to_string())),
    }
}

/// Whether `tag` names a quantization in `name`, case-insensitively: it must stand between
/// separators, and not be followed by `_` (`Q4_K` is not `Q4_K_M`) or a letter or digit.
pub fn tag_matches(name: &str, tag: &str) -> bool {
    let (name, tag) = (name.to_ascii_lowercase(), tag.to_ascii_lowercase());
    let bytes = name.as_bytes();
    if tag.is_empty() {
        return false;
    }
    name.match_indices(&tag).any(|(i, _)| {
        let end = i + tag.len();
        let before = i == 0 || !bytes[i - 1].is_ascii_alphanumeric();
        let after = end == bytes.len() || !(bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_');
        before && after
    })
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// `name-00002-of-00005.gguf` -> (2, 5).
fn split_part(name: &str) -> Option<(u32, u32)> {
    let stem = name.get(..name.len().checked_sub(".gguf".len())?)?;
    let (rest, total) = stem.rsplit_once("-of-")?;
    let (_, part) = rest.rsplit_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(part) || !digits(total) {
        return None;
    }
    Some((part.parse().ok()?, total.parse().ok()?))
}

/// Two parts of the same split file: the same name but for the part number.
fn same_split(a: &str, b: &str) -> bool {
    let prefix =
        |n: &str| n.rsplit_once("-of-").and_then(|(rest, _)| rest.rsplit_once('-')).map(|(p, _)| p.to_string());
    prefix(a).is_some() && prefix(a) == prefix(b)
}

/// The part count when all `names` are parts of one split file.
fn one_split_set(names: &[&str]) -> Option<u32> {
    let (_, total) = split_part(names[0])?;
    names.iter().all(|n| same_split(n, names[0])).then_some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GGUF_REPO: &[&str] = &[
        "README.md",
        "Model-Q4_K_M.gguf",
        "Model-Q4_K_S.gguf",
        "Model-Q8_0.gguf",
        "Model-bf16.gguf",
        "Model-f16.gguf",
        "mmproj-Model-f16.gguf",
    ];

    fn gguf(names: &[&str], tag: Option<&str>, file: Option<&str>) -> Result<Weights, HubError> {
        choose_weights("org/m", "main", tag, file, names)
    }

    #[test]
    fn tags_match_quantizations_case_insensitively() {
        assert!(tag_matches("Model-Q4_K_M.gguf", "q4_k_m"));
        assert!(tag_matches("model.q4_k_m.gguf", "Q4_K_M"));
        assert!(tag_matches("Q4_K_M/model.gguf", "Q4_K_M"));
        assert!(!tag_matches("Model-Q4_K_M.gguf", "Q4_K"), "a prefix of a longer quant name");
        assert!(!tag_matches("Model-bf16.gguf", "f16"));
        assert!(!tag_matches("Model-Q4_K_M.gguf", "4_K_M"));
        assert_eq!(gguf(GGUF_REPO, Some("q4_k_m"), None).unwrap(), Weights::Gguf("Model-Q4_K_M.gguf".into()));
        assert_eq!(gguf(GGUF_REPO, Some("F16"), None).unwrap(), Weights::Gguf("Model-f16.gguf".into()));
    }

    #[test]
    fn no_match_or_several_is_an_error_listing_the_candidates() {
        let e = gguf(GGUF_REPO, Some("Q5_K_M"), None).unwrap_err().to_string();
        assert!(
            e.contains("no GGUF file matching `Q5_K_M`") && e.contains("Model-Q4_K_S.gguf, Model-Q8_0.gguf"),
            "{e}"
        );
        assert!(!e.contains("mmproj"), "{e}");
        let names = ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"];
        let e = gguf(&names, Some("q4_k_m"), None).unwrap_err().to_string();
        assert!(e.contains("`org/m:q4_k_m` matches several GGUF files: a-Q4_K_M.gguf, b-Q4_K_M.gguf"), "{e}");
        let e = gguf(GGUF_REPO, None, None).unwrap_err().to_string();
        assert!(e.contains("holds several GGUF files") && e.contains("org/m:TAG"), "{e}");
        let e = gguf(&["README.md"], None, None).unwrap_err().to_string();
        assert!(e.contains("neither *.safetensors nor *.gguf"), "{e}");
    }

    #[test]
    fn gguf_file_names_the_file() {
        assert_eq!(gguf(GGUF_REPO, None, Some("Model-Q8_0.gguf")).unwrap(), Weights::Gguf("Model-Q8_0.gguf".into()));
        let names = ["sub/x.gguf"];
        assert_eq!(gguf(&names, None, Some("x.gguf")).unwrap(), Weights::Gguf("sub/x.gguf".into()));
        let e = gguf(GGUF_REPO, None, Some("nope.gguf")).unwrap_err().to_string();
        assert!(e.contains("no file `nope.gguf`") && e.contains("mmproj-Model-f16.gguf"), "{e}");
        // One GGUF beside a projector needs no tag.
        assert_eq!(gguf(&["m-Q8_0.gguf", "mmproj-f16.gguf"], None, None).unwrap(), Weights::Gguf("m-Q8_0.gguf".into()));
    }

    #[test]
    fn split_ggufs_are_refused() {
        let names = ["Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf", "m-Q8_0.gguf"];
        let e = gguf(&names, Some("Q4_K_M"), None).unwrap_err().to_string();
        assert!(e.contains("m-Q4_K_M-00001-of-00002.gguf is one of 2 parts"), "{e}");
        let e = gguf(&names, None, Some("Q4_K_M/m-Q4_K_M-00002-of-00002.gguf")).unwrap_err().to_string();
        assert!(e.contains("00001-of-00002.gguf is one of 2 parts"), "{e}");
        assert_eq!(split_part("m-00003-of-00010.gguf"), Some((3, 10)));
        assert_eq!(split_part("m-Q8_0.gguf"), None);
    }

    #[test]
    fn model_plans() {
        let names =
            ["config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "README.md", "x.gguf"];
        let p = plan("org/m", "main", Want::Model { tag: None, gguf_file: None }, &names).unwrap();
        assert_eq!(p.fetch, ["config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"]);
        assert!(p.absent.contains(&"generation_config.json".to_string()) && p.absent.contains(&INDEX.to_string()));
        assert!(!p.sharded && p.gguf.is_none());
        // A tag picks the GGUF even where safetensors exist.
        let p = plan("org/m", "main", Want::Model { tag: Some("x"), gguf_file: None }, &names).unwrap();
        assert_eq!((p.fetch, p.gguf), (vec!["x.gguf".to_string()], Some("x.gguf".to_string())));
        let names = ["config.json", INDEX, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        let p = plan("org/m", "main", Want::Model { tag: None, gguf_file: None }, &names).unwrap();
        assert_eq!(p.fetch, ["config.json", INDEX]);
        assert!(p.sharded);
        let e = plan("org/m", "main", Want::Model { tag: None, gguf_file: None }, &["model.safetensors"]).unwrap_err();
        assert!(e.to_string().contains("no file `config.json`"), "{e}");
    }

    #[test]
    fn tokenizer_plans() {
        let names = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"];
        let p = plan("org/t", "main", Want::Tokenizer, &names).unwrap();
        assert_eq!(p.fetch, ["tokenizer.json", "tokenizer_config.json", "config.json"]);
        let e = plan("org/t", "main", Want::Tokenizer, &["config.json"]).unwrap_err().to_string();
        assert!(e.contains("no tokenizer.json"), "{e}");
    }

    #[test]
    fn reads_shards_from_an_index() {
        let index = r#"{"metadata": {}, "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}}"#;
        assert_eq!(shards(index).unwrap(), ["m-1.safetensors", "m-2.safetensors"]);
        assert!(shards("{}").is_err());
        assert!(shards(r#"{"weight_map": {"a": 1}}"#).is_err());
    }
}
