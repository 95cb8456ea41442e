//! Build a `tokenizers::Tokenizer` from the `tokenizer.ggml.*` metadata of a GGUF file.
//!
//! A GGUF carries no `tokenizer.json`; it stores the vocabulary, scores, token types and
//! (for byte-level BPE) the merges under llama.cpp's key names. We rebuild the same pipeline
//! that Hugging Face transformers builds from those keys (its GGUF tokenizer integration),
//! so that ids match what the model was run with in Python:
//!
//! * `gpt2`: byte-level BPE from tokens + merges.
//! * `llama`: SentencePiece-style BPE with byte fallback; merges come from the file or are
//!   recovered from the vocabulary (see [`merges_from_vocab`]). Gemma files get Gemma's
//!   normalizer and their merges ranked by token position, like transformers does.

use std::collections::{HashMap, HashSet};

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// SentencePiece's word-boundary marker.
const SPM_SPACE: char = '\u{2581}';

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufTokenizerError {
    #[error("GGUF metadata key `{key}` is missing")]
    MissingKey { key: String },
    #[error("GGUF metadata key `{key}` has the wrong type: expected {expected}, found {found}")]
    WrongType { key: String, expected: &'static str, found: String },
    #[error("GGUF metadata key `{key}` is invalid: {reason}")]
    Invalid { key: String, reason: String },
    #[error("GGUF tokenizer model `{0}` (key `tokenizer.ggml.model`) is not supported; supported: gpt2, llama")]
    UnsupportedModel(String),
    #[error("could not build the tokenizer from GGUF metadata: {0}")]
    Build(String),
}

type Result<T> = std::result::Result<T, GgufTokenizerError>;

/// The tokenizer a GGUF describes, plus the metadata the engine needs next to it.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// Extra end-of-generation ids llama.cpp declares (`eot_token_id`, `eom_token_id`).
    pub extra_eos_token_ids: Vec<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    pub chat_template: Option<String>,
}

/// Build the tokenizer from `tokenizer.ggml.*` metadata.
pub fn tokenizer_from_gguf(content: &Content) -> Result<GgufTokenizer> {
    let meta = Metadata(&content.metadata);
    let spec = VocabSpec::read(&meta)?;

    let mut tokenizer = match spec.model.as_str() {
        "gpt2" => byte_level_bpe(&spec)?,
        "llama" if spec.is_gemma() => gemma_bpe(&spec)?,
        "llama" => sentencepiece_bpe(&spec)?,
        other => return Err(GgufTokenizerError::UnsupportedModel(other.to_string())),
    };
    add_special_tokens(&mut tokenizer, &spec);
    set_post_processor(&mut tokenizer, &spec)?;

    let token = |id: Option<u32>| id.and_then(|id| spec.tokens.get(id as usize).cloned());
    let extra_eos_token_ids =
        [spec.eot_id, spec.eom_id].into_iter().flatten().filter(|id| Some(*id) != spec.eos_id).collect();
    Ok(GgufTokenizer {
        bos_token_id: spec.bos_id,
        eos_token_id: spec.eos_id,
        extra_eos_token_ids,
        bos_token: token(spec.bos_id),
        eos_token: token(spec.eos_id),
        unk_token: token(spec.unk_id),
        pad_token: token(spec.pad_id),
        chat_template: meta.opt_string("tokenizer.chat_template")?,
        tokenizer,
    })
}

/// Typed access to GGUF metadata with errors that name the key.
struct Metadata<'a>(&'a HashMap<String, Value>);

impl Metadata<'_> {
    fn get(&self, key: &str) -> Result<&Value> {
        self.0.get(key).ok_or_else(|| GgufTokenizerError::MissingKey { key: key.to_string() })
    }

    fn wrong_type(key: &str, expected: &'static str, value: &Value) -> GgufTokenizerError {
        GgufTokenizerError::WrongType { key: key.to_string(), expected, found: format!("{:?}", value.value_type()) }
    }

    fn string(&self, key: &str) -> Result<String> {
        match self.get(key)? {
            Value::String(s) => Ok(s.clone()),
            v => Err(Self::wrong_type(key, "string", v)),
        }
    }

    fn opt_string(&self, key: &str) -> Result<Option<String>> {
        self.0.get(key).map(|_| self.string(key)).transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong_type(key, "bool", v)),
        }
    }

    /// Token ids are written as u32 by llama.cpp, but other writers use other integer widths.
    fn opt_id(&self, key: &str) -> Result<Option<u32>> {
        let Some(v) = self.0.get(key) else {
            return Ok(None);
        };
        let id = match v {
            Value::U8(x) => Some(*x as i64),
            Value::I8(x) => Some(*x as i64),
            Value::U16(x) => Some(*x as i64),
            Value::I16(x) => Some(*x as i64),
            Value::U32(x) => Some(*x as i64),
            Value::I32(x) => Some(*x as i64),
            Value::U64(x) => i64::try_from(*x).ok(),
            Value::I64(x) => Some(*x),
            _ => return Err(Self::wrong_type(key, "integer", v)),
        };
        // A negative id (e.g. -1) is llama.cpp's way of saying "none".
        Ok(id.and_then(|id| u32::try_from(id).ok()))
    }

    fn array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            v => Err(Self::wrong_type(key, "array", v)),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        self.array(key)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                v => Err(Self::wrong_type(key, "array of strings", v)),
            })
            .collect()
    }

    fn opt_strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.0.get(key).map(|_| self.strings(key)).transpose()
    }

    fn opt_numbers(&self, key: &str) -> Result<Option<Vec<f64>>> {
        if !self.0.contains_key(key) {
            return Ok(None);
        }
        self.array(key)?
            .iter()
            .map(|v| match v {
                Value::F32(x) => Ok(*x as f64),
                Value::F64(x) => Ok(*x),
                Value::I32(x) => Ok(*x as f64),
                Value::U32(x) => Ok(*x as f64),
                Value::I8(x) => Ok(*x as f64),
                Value::U8(x) => Ok(*x as f64),
                Value::I16(x) => Ok(*x as f64),
                Value::U16(x) => Ok(*x as f64),
                Value::I64(x) => Ok(*x as f64),
                Value::U64(x) => Ok(*x as f64),
                v => Err(Self::wrong_type(key, "array of numbers", v)),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// Everything the builders need, read and checked once.
struct VocabSpec {
    architecture: String,
    model: String,
    pre: Option<String>,
    tokens: Vec<String>,
    scores: Option<Vec<f64>>,
    token_types: Option<Vec<i32>>,
    merges: Option<Vec<String>>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    unk_id: Option<u32>,
    pad_id: Option<u32>,
    eot_id: Option<u32>,
    eom_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: Option<bool>,
}

impl VocabSpec {
    fn read(meta: &Metadata) -> Result<Self> {
        let tokens = meta.strings("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        let scores = meta.opt_numbers("tokenizer.ggml.scores")?;
        let token_types =
            meta.opt_numbers("tokenizer.ggml.token_type")?.map(|t| t.into_iter().map(|x| x as i32).collect::<Vec<_>>());
        for (key, len) in [
            ("tokenizer.ggml.scores", scores.as_ref().map(Vec::len)),
            ("tokenizer.ggml.token_type", token_types.as_ref().map(Vec::len)),
        ] {
            if let Some(len) = len.filter(|&len| len != n) {
                return Err(GgufTokenizerError::Invalid {
                    key: key.to_string(),
                    reason: format!("has {len} entries but there are {n} tokens"),
                });
            }
        }
        let id = |key: &str| -> Result<Option<u32>> {
            let id = meta.opt_id(key)?;
            match id {
                Some(i) if i as usize >= n => Err(GgufTokenizerError::Invalid {
                    key: key.to_string(),
                    reason: format!("id {i} is out of range for {n} tokens"),
                }),
                _ => Ok(id),
            }
        };
        let model = meta.string("tokenizer.ggml.model")?;
        let architecture = meta.opt_string("general.architecture")?.unwrap_or_default();
        // transformers: sentencepiece vocabularies add BOS unless the file says otherwise;
        // gemma4 files set the flag but their chat template writes `<bos>` itself.
        let add_bos = if architecture == "gemma4" {
            false
        } else {
            meta.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(model == "llama")
        };
        Ok(Self {
            pre: meta.opt_string("tokenizer.ggml.pre")?,
            scores,
            token_types,
            merges: meta.opt_strings("tokenizer.ggml.merges")?,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            eot_id: id("tokenizer.ggml.eot_token_id")?,
            eom_id: id("tokenizer.ggml.eom_token_id")?,
            add_bos,
            add_eos: meta.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            add_space_prefix: meta.opt_bool("tokenizer.ggml.add_space_prefix")?,
            architecture,
            model,
            tokens,
        })
    }

    fn is_gemma(&self) -> bool {
        matches!(self.architecture.as_str(), "gemma" | "gemma2" | "gemma3")
    }

    fn token_type(&self, id: usize) -> Option<i32> {
        self.token_types.as_ref().and_then(|t| t.get(id).copied())
    }

    fn parsed_merges(&self) -> Result<Option<Merges>> {
        let Some(merges) = &self.merges else {
            return Ok(None);
        };
        merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| {
                    GgufTokenizerError::Invalid {
                        key: "tokenizer.ggml.merges".to_string(),
                        reason: format!("merge {i} ({m:?}) is not two tokens separated by a space"),
                    }
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn build_err(e: impl std::fmt::Display) -> GgufTokenizerError {
    GgufTokenizerError::Build(e.to_string())
}

/// GPT-2's reversible byte -> printable-char table (`bytes_to_unicode`).
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\0')
        };
    }
    table
}

/// Split regexes transformers substitutes for some `tokenizer.ggml.pre` values.
fn split_regex_for(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => Some(LLAMA3),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => Some(QWEN2),
        _ => None,
    }
}

fn byte_level_pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper> {
    let plain = ByteLevel::new(false, true, true);
    Ok(match pre {
        Some(p) if split_regex_for(p).is_some() => {
            let regex = split_regex_for(p).unwrap_or_default();
            let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(build_err)?;
            PreSequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
        // StarCoder-family vocabularies (SmolLM's included) were trained with every digit
        // split off; their `tokenizer.json` has `Digits(individual)` before `ByteLevel`, and
        // llama.cpp's `smollm`/`starcoder` pre-tokenizers do the same.
        Some("smollm" | "starcoder") => PreSequence::new(vec![Digits::new(true).into(), plain.into()]).into(),
        _ => plain.into(),
    })
}

/// `gpt2`: byte-level BPE. Tokens not already spelled in the byte alphabet are re-spelled.
fn byte_level_bpe(spec: &VocabSpec) -> Result<Tokenizer> {
    let alphabet = bytes_to_unicode();
    let in_alphabet: HashSet<char> = alphabet.iter().copied().collect();
    let vocab: Vocab = spec
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| {
            let spelled = if t.chars().all(|c| in_alphabet.contains(&c)) {
                t.clone()
            } else {
                t.bytes().map(|b| alphabet[b as usize]).collect()
            };
            (spelled, id as u32)
        })
        .collect();
    let merges = spec
        .parsed_merges()?
        .ok_or_else(|| GgufTokenizerError::MissingKey { key: "tokenizer.ggml.merges".to_string() })?;
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(build_err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(byte_level_pre_tokenizer(spec.pre.as_deref())?));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    Ok(tokenizer)
}

/// `llama` (SentencePiece BPE with byte fallback), as transformers' `LlamaTokenizer`.
fn sentencepiece_bpe(spec: &VocabSpec) -> Result<Tokenizer> {
    let vocab = vocab_of(&spec.tokens);
    let merges = match spec.parsed_merges()? {
        Some(m) => m,
        None => {
            let scores = spec.scores.as_ref().ok_or_else(|| GgufTokenizerError::MissingKey {
                key: "tokenizer.ggml.scores (needed when tokenizer.ggml.merges is absent)".to_string(),
            })?;
            merges_from_vocab(&spec.tokens, &vocab, |id| scores[id as usize])
        }
    };
    let unk = unk_token(spec, &vocab);
    let mut tokenizer = Tokenizer::new(spm_bpe(vocab, merges, unk)?);
    // transformers always prepends `▁` to the first word here; llama.cpp honours the
    // file's `add_space_prefix`. We follow the file, since it describes the model.
    let prefix = spec.add_space_prefix.unwrap_or(true);
    let scheme = if prefix { PrependScheme::First } else { PrependScheme::Never };
    tokenizer.with_pre_tokenizer(Some(Metaspace::new(SPM_SPACE, scheme, false)));
    let mut decoders = spm_decoders()?;
    if prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// Gemma: no prefix space, spaces normalized to `▁`, and merges ranked by token position
/// (Gemma's scores do not follow its merge order; the order in the file does).
fn gemma_bpe(spec: &VocabSpec) -> Result<Tokenizer> {
    // Tokens made only of whitespace are stored with real spaces, but the normalizer turns
    // spaces into `▁` before lookup; respell them like transformers does.
    let tokens: Vec<String> = spec
        .tokens
        .iter()
        .map(|t| {
            if t.contains(' ') && t.chars().all(is_python_space) {
                SPM_SPACE.to_string().repeat(t.chars().count())
            } else {
                t.clone()
            }
        })
        .collect();
    let vocab = vocab_of(&tokens);
    let merges = match spec.parsed_merges()? {
        Some(m) => m,
        None => merges_from_vocab(&tokens, &vocab, |id| -(id as f64)),
    };
    let unk = unk_token(spec, &vocab);
    let mut tokenizer = Tokenizer::new(spm_bpe(vocab, merges, unk)?);
    tokenizer.with_normalizer(Some(Replace::new(" ", SPM_SPACE.to_string()).map_err(build_err)?));
    // A no-op after the normalizer, kept so the pipeline is the one transformers builds.
    tokenizer.with_pre_tokenizer(Some(
        Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false).map_err(build_err)?,
    ));
    tokenizer.with_decoder(Some(DecoderSequence::new(spm_decoders()?)));
    Ok(tokenizer)
}

/// Python's `str.isspace`, which also counts the ASCII separators 0x1C..=0x1F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// token -> id; a repeated token keeps its last id, as a Python dict comprehension would.
fn vocab_of(tokens: &[String]) -> HashMap<String, u32> {
    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect()
}

fn unk_token(spec: &VocabSpec, vocab: &HashMap<String, u32>) -> Option<String> {
    spec.unk_id
        .and_then(|id| spec.tokens.get(id as usize).cloned())
        .or_else(|| vocab.contains_key("<unk>").then(|| "<unk>".to_string()))
}

fn spm_bpe(vocab: HashMap<String, u32>, merges: Merges, unk: Option<String>) -> Result<BPE> {
    let vocab: Vocab = vocab.into_iter().collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).fuse_unk(true).byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    builder.build().map_err(build_err)
}

fn spm_decoders() -> Result<Vec<DecoderWrapper>> {
    let replace =
        tokenizers::decoders::DecoderWrapper::Replace(Replace::new(SPM_SPACE.to_string(), " ").map_err(build_err)?);
    Ok(vec![replace, ByteFallback::new().into(), Fuse::new().into()])
}

/// Recover BPE merges from a vocabulary, like transformers' `generate_merges` (used by its
/// SentencePiece -> fast converter): every way to cut a piece into two vocabulary pieces is a
/// merge, ranked by the merged piece's score (higher first), then by longer left, longer right.
/// Within one piece, candidates are ordered by (left id, right id); the sort is stable.
pub fn merges_from_vocab(tokens: &[String], vocab: &HashMap<String, u32>, score_of: impl Fn(u32) -> f64) -> Merges {
    struct Candidate {
        left: u32,
        right: u32,
        score: f64,
        left_len: usize,
        right_len: usize,
    }
    let mut candidates = Vec::new();
    let mut seen = HashSet::new();
    for piece in tokens {
        // A dict keyed by token visits each token once, at its first position.
        if !seen.insert(piece.as_str()) {
            continue;
        }
        let Some(&piece_id) = vocab.get(piece) else {
            continue;
        };
        let score = score_of(piece_id);
        let start = candidates.len();
        for (n_left, (cut, _)) in piece.char_indices().enumerate().skip(1) {
            let (l, r) = piece.split_at(cut);
            if let (Some(&left), Some(&right)) = (vocab.get(l), vocab.get(r)) {
                candidates.push(Candidate { left, right, score, left_len: n_left, right_len: r.chars().count() });
            }
        }
        candidates[start..].sort_by_key(|c| (c.left, c.right));
    }
    candidates.sort_by(|a, b| {
        b.score.total_cmp(&a.score).then(b.left_len.cmp(&a.left_len)).then(b.right_len.cmp(&a.right_len))
    });
    candidates.into_iter().map(|c| (tokens[c.left as usize].clone(), tokens[c.right as usize].clone())).collect()
}

/// Control tokens become special added tokens, user-defined ones plain added tokens, so that
/// both are matched whole in text instead of being cut into pieces.
fn add_special_tokens(tokenizer: &mut Tokenizer, spec: &VocabSpec) {
    let byte_level = spec.model == "gpt2";
    let alphabet: HashSet<char> = bytes_to_unicode().into_iter().collect();
    let control: Vec<AddedToken> = spec
        .tokens
        .iter()
        .enumerate()
        .filter(|(id, _)| spec.token_type(*id) == Some(TOKEN_TYPE_CONTROL))
        // In a byte-level vocabulary a control token outside the byte alphabet is a
        // mislabel; adding it would grow the vocabulary past the model's size.
        .filter(|(_, t)| !byte_level || t.chars().all(|c| alphabet.contains(&c)))
        .map(|(_, t)| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    tokenizer.add_special_tokens(&control);

    let user_defined: Vec<AddedToken> = spec
        .tokens
        .iter()
        .enumerate()
        .filter(|(id, _)| spec.token_type(*id) == Some(TOKEN_TYPE_USER_DEFINED))
        .filter(|(_, t)| tokenizer.token_to_id(t).is_some())
        .map(|(_, t)| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    tokenizer.add_tokens(&user_defined);

    // Named special tokens are always special, even if the file did not mark them control.
    let added = tokenizer.get_added_vocabulary().get_vocab().clone();
    let named: Vec<AddedToken> = [spec.bos_id, spec.eos_id, spec.unk_id, spec.pad_id]
        .into_iter()
        .flatten()
        .filter_map(|id| spec.tokens.get(id as usize))
        .filter(|t| !added.contains_key(*t))
        .map(|t| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    tokenizer.add_special_tokens(&named);
}

/// `bos $A eos` as configured, like transformers' `update_post_processor`.
fn set_post_processor(tokenizer: &mut Tokenizer, spec: &VocabSpec) -> Result<()> {
    let named = |id: Option<u32>, enabled: bool| {
        id.filter(|_| enabled).and_then(|id| spec.tokens.get(id as usize).map(|t| (t.clone(), id)))
    };
    let bos = named(spec.bos_id, spec.add_bos);
    let eos = named(spec.eos_id, spec.add_eos);
    let processor = super::post_processor::bos_eos_processor(bos, eos).map_err(build_err)?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    fn strings(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
    }

    /// Write metadata to an in-memory GGUF and read it back, like a file on disk.
    fn round_trip(metadata: &[(&str, Value)]) -> Content {
        let refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let mut buf = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut buf, &refs, &[]).expect("write gguf");
        buf.set_position(0);
        Content::read(&mut buf).expect("read gguf")
    }

    fn ids(tok: &Tokenizer, text: &str, special: bool) -> Vec<u32> {
        tok.encode(text, special).expect("encode").get_ids().to_vec()
    }

    /// A tiny GPT-2 style vocabulary: control token, byte alphabet subset, a few merges.
    fn gpt2_gguf(pre: &str) -> Content {
        // ids: 0 <|endoftext|>, 1..=8 letters and Ġ, 9..=13 merged pieces, 14/15 digits,
        // 16 <|im_start|>, 17 "12".
        let tokens = [
            "<|endoftext|>",
            "h",
            "e",
            "l",
            "o",
            "Ġ",
            "w",
            "r",
            "d",
            "he",
            "ll",
            "hell",
            "hello",
            "Ġw",
            "1",
            "2",
            "<|im_start|>",
            "12",
        ];
        let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "1 2"];
        let mut types = vec![Value::I32(1); tokens.len()];
        types[0] = Value::I32(3);
        types[16] = Value::I32(3);
        round_trip(&[
            ("general.architecture", Value::String("llama".into())),
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String(pre.into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            ("tokenizer.ggml.merges", strings(&merges)),
            ("tokenizer.ggml.token_type", Value::Array(types)),
            ("tokenizer.ggml.bos_token_id", Value::U32(16)),
            ("tokenizer.ggml.eos_token_id", Value::U32(0)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
            ("tokenizer.chat_template", Value::String("{{ messages }}".into())),
        ])
    }

    #[test]
    fn gpt2_round_trip_encodes_with_merges_and_specials() {
        let built = tokenizer_from_gguf(&gpt2_gguf("default")).expect("build");
        let tok = &built.tokenizer;
        assert_eq!(ids(tok, "hello", true), vec![12]);
        // " world": Ġw merges; o r l d stay single.
        assert_eq!(ids(tok, "hello world", true), vec![12, 13, 4, 7, 3, 8]);
        assert_eq!(ids(tok, "hell", true), vec![11]);
        // The control token is matched whole, in the middle of text too.
        assert_eq!(ids(tok, "he<|endoftext|>lo", false), vec![9, 0, 3, 4]);
        assert_eq!(ids(tok, "<|im_start|>hello", false), vec![16, 12]);
        // Without a Digits pre-tokenizer "12" is one word and merges.
        assert_eq!(ids(tok, "12", false), vec![17]);
        assert_eq!(tok.decode(&[12, 13, 4, 7, 3, 8], true).expect("decode"), "hello world");
        assert_eq!(tok.decode(&[0, 12], true).expect("decode"), "hello");
        assert_eq!(tok.decode(&[0, 12], false).expect("decode"), "<|endoftext|>hello");
        assert_eq!(built.bos_token_id, Some(16));
        assert_eq!(built.eos_token.as_deref(), Some("<|endoftext|>"));
        assert_eq!(built.chat_template.as_deref(), Some("{{ messages }}"));
    }

    #[test]
    fn smollm_pre_tokenizer_splits_digits() {
        let plain = tokenizer_from_gguf(&gpt2_gguf("default")).expect("build").tokenizer;
        let smollm = tokenizer_from_gguf(&gpt2_gguf("smollm")).expect("build").tokenizer;
        // The merge "1 2" exists, but SmolLM's vocabulary was trained with digits split.
        assert_eq!(ids(&smollm, "12", false), vec![14, 15]);
        assert_eq!(ids(&plain, "12", false), vec![17]);
        assert_eq!(ids(&smollm, "hello 12", false), vec![12, 5, 14, 15]);
    }

    fn spm_tokens() -> (Vec<String>, Vec<f64>, Vec<i32>) {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        let mut types = vec![2, 3, 3];
        for b in 0..=255u32 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        // id 259..: pieces, in decreasing score
        let pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "▁w", "hell", "▁hello", "llo", "▁he", "or"];
        let mut scores = vec![0.0; tokens.len()];
        for (i, p) in pieces.iter().enumerate() {
            tokens.push(p.to_string());
            types.push(1);
            scores.push(-(i as f64));
        }
        (tokens, scores, types)
    }

    fn spm_gguf(arch: &str, add_space_prefix: Option<bool>) -> Content {
        let (tokens, scores, types) = spm_tokens();
        let mut meta = vec![
            ("general.architecture", Value::String(arch.into())),
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect())),
            ("tokenizer.ggml.scores", Value::Array(scores.into_iter().map(|s| Value::F32(s as f32)).collect())),
            ("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect())),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ];
        if let Some(p) = add_space_prefix {
            meta.push(("tokenizer.ggml.add_space_prefix", Value::Bool(p)));
        }
        round_trip(&meta)
    }

    const SPM: u32 = 259; // id of the first ordinary piece, "▁"

    #[test]
    fn spm_round_trip_derives_merges_from_scores() {
        let tok = tokenizer_from_gguf(&spm_gguf("llama", None)).expect("build").tokenizer;
        let p = |i: u32| SPM + i;
        // "hello" -> "▁hello" (dummy prefix): built through ▁h? no: h+e=he (9), l+l=ll (8),
        // ▁+he=▁he (14), ▁he+ll? no such token; hell=he+ll(11)... ▁hello = ▁he + llo.
        // Best-scored merges first: ll(8) > he(9) > ▁w(10) > hell(11) > ▁hello(12) > llo(13) > ▁he(14).
        // ▁ h e l l o -> ▁ h e ll o -> ▁ he ll o -> ▁ hell o; ▁hello needs ▁he+llo, not reachable.
        assert_eq!(ids(&tok, "hello", false), vec![p(0), p(11), p(4)]);
        // BOS is added by the post-processor (add_bos_token defaults to true for llama).
        assert_eq!(ids(&tok, "hello", true), vec![1, p(0), p(11), p(4)]);
        // "world": ▁w merges, o r -> or, l, d.
        assert_eq!(ids(&tok, "world", false), vec![p(10), p(15), p(3), p(7)]);
        // Unknown characters fall back to UTF-8 bytes: "é" = C3 A9.
        assert_eq!(ids(&tok, "é", false), vec![p(0), 3 + 0xC3, 3 + 0xA9]);
        assert_eq!(tok.decode(&[1, p(0), p(11), p(4), 3 + 0xC3, 3 + 0xA9], true).expect("decode"), "helloé");
    }

    #[test]
    fn spm_respects_add_space_prefix_false() {
        let tok = tokenizer_from_gguf(&spm_gguf("llama", Some(false))).expect("build").tokenizer;
        assert_eq!(ids(&tok, "hello", false), vec![SPM + 11, SPM + 4]);
        assert_eq!(ids(&tok, " world", false), vec![SPM + 10, SPM + 15, SPM + 3, SPM + 7]);
    }

    #[test]
    fn gemma_has_no_prefix_and_ranks_merges_by_position() {
        let tok = tokenizer_from_gguf(&spm_gguf("gemma3", Some(false))).expect("build").tokenizer;
        assert_eq!(ids(&tok, "hello world", false), vec![SPM + 11, SPM + 4, SPM + 10, SPM + 15, SPM + 3, SPM + 7]);
        assert_eq!(ids(&tok, "hello", true), vec![1, SPM + 11, SPM + 4]);
    }

    #[test]
    fn merges_follow_score_then_length_order() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"].map(String::from).to_vec();
        let vocab = vocab_of(&tokens);
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let merges = merges_from_vocab(&tokens, &vocab, |id| scores[id as usize]);
        let pairs: Vec<(&str, &str)> = merges.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // bc (-1) before ab (-2) before the two cuts of abc (-3): longer left first.
        assert_eq!(pairs, vec![("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]);
    }

    #[test]
    fn missing_and_wrong_keys_are_named() {
        let no_tokens = round_trip(&[("tokenizer.ggml.model", Value::String("gpt2".into()))]);
        let err = tokenizer_from_gguf(&no_tokens).expect_err("no tokens");
        assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");

        let wrong = round_trip(&[("tokenizer.ggml.model", Value::U32(3)), ("tokenizer.ggml.tokens", strings(&["a"]))]);
        let err = tokenizer_from_gguf(&wrong).expect_err("model is not a string");
        assert!(matches!(err, GgufTokenizerError::WrongType { ref key, .. } if key == "tokenizer.ggml.model"), "{err}");

        let unknown = round_trip(&[
            ("tokenizer.ggml.model", Value::String("bert".into())),
            ("tokenizer.ggml.tokens", strings(&["a"])),
        ]);
        assert!(matches!(tokenizer_from_gguf(&unknown), Err(GgufTokenizerError::UnsupportedModel(m)) if m == "bert"));

        let no_merges = round_trip(&[
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.tokens", strings(&["a"])),
        ]);
        let err = tokenizer_from_gguf(&no_merges).expect_err("gpt2 needs merges");
        assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
    }
}
