//! Tokenization: tokenizer.json or GGUF metadata, chat templates.
//!
//! [`TextTokenizer`] wraps a `tokenizers::Tokenizer` with what generation needs around it:
//! the BOS/EOS ids and the chat template, loaded either from a Hugging Face model directory
//! or from a GGUF file's metadata.

mod chat_encode;
pub mod chat_template;
pub mod gguf;
mod post_processor;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use tokenizers::Tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate, ChatTemplateError, ContentPart, MessageContent, RenderOptions};
pub use gguf::{tokenizer_from_gguf, GgufTokenizer, GgufTokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: cannot read: {source}", file.display())]
    Io { file: PathBuf, source: std::io::Error },
    #[error("{}: invalid JSON: {source}", file.display())]
    Json { file: PathBuf, source: serde_json::Error },
    #[error("{}: {reason}", file.display())]
    Invalid { file: PathBuf, reason: String },
    #[error("{}: not a readable GGUF file: {reason}", file.display())]
    GgufFile { file: PathBuf, reason: String },
    #[error(transparent)]
    Gguf(#[from] GgufTokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error("{}: {source}", file.display())]
    Template { file: PathBuf, source: ChatTemplateError },
    #[error("this tokenizer has no chat template")]
    NoChatTemplate,
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

/// A text tokenizer with its special ids and chat template.
#[derive(Debug)]
pub struct TextTokenizer {
    /// Shared with every sequence's incremental detokenizer.
    inner: Arc<Tokenizer>,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    /// `bos_token`, `eos_token`, ... as the chat template sees them.
    special_tokens: Vec<(String, String)>,
    chat_template: Option<ChatTemplate>,
    /// Keeps special tokens out of what callers write (see `chat_encode.rs`).
    guard: chat_encode::SpecialGuard,
}

impl TextTokenizer {
    /// Load from a Hugging Face model directory: `tokenizer.json` (required),
    /// `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json` and
    /// `config.json` (all optional).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tokenizer_file = dir.join("tokenizer.json");
        let mut inner = Tokenizer::from_file(&tokenizer_file).map_err(|e| TokenizerError::Invalid {
            file: tokenizer_file.clone(),
            reason: format!("cannot load tokenizer: {e}"),
        })?;

        let config_file = dir.join("tokenizer_config.json");
        let config = read_json_if_exists(&config_file)?.unwrap_or_default();
        let token = |name: &str| special_token_content(&config, name, &config_file);
        let special_tokens: Vec<(String, String)> = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .into_iter()
            .filter_map(|name| token(name).transpose().map(|t| t.map(|t| (name.to_string(), t))))
            .collect::<Result<_>>()?;
        let named = |name: &str| special_tokens.iter().find(|(n, _)| n == name).map(|(_, t)| t.clone());
        update_post_processor(&mut inner, &config, &config_file, named("bos_token"), named("eos_token"))?;

        // `chat_template.jinja` wins, then the processor's `chat_template.json` (how VLM
        // checkpoints ship it), then tokenizer_config.json's field, as in transformers.
        let jinja_file = dir.join("chat_template.jinja");
        let processor_file = dir.join("chat_template.json");
        let template_source = match read_if_exists(&jinja_file)? {
            Some(source) => Some((source, &jinja_file)),
            None => match read_json_if_exists(&processor_file)? {
                Some(j) => {
                    let v = j.get("chat_template").unwrap_or(&serde_json::Value::Null);
                    chat_template::template_from_config_value(v, &processor_file)?.map(|s| (s, &processor_file))
                }
                None => match config.get("chat_template") {
                    Some(v) => chat_template::template_from_config_value(v, &config_file)?.map(|s| (s, &config_file)),
                    None => None,
                },
            },
        };
        let chat_template = template_source
            .map(|(s, file)| {
                ChatTemplate::new(&s).map_err(|source| TokenizerError::Template { file: file.clone(), source })
            })
            .transpose()?;

        // BOS/EOS ids: generation_config.json, then config.json, then the tokenizer's tokens.
        let generation = read_json_if_exists(&dir.join("generation_config.json"))?;
        let model_config = read_json_if_exists(&dir.join("config.json"))?;
        let configs: Vec<&serde_json::Value> =
            [generation.as_ref(), model_config.as_ref()].into_iter().flatten().collect();
        let token_id = |name: &str| named(name).and_then(|t| inner.token_to_id(&t));
        let bos_token_id = configs
            .iter()
            .find_map(|c| ids_of(c.get("bos_token_id")).into_iter().next())
            .or_else(|| token_id("bos_token"));
        let mut eos_token_ids = Vec::new();
        let eos_candidates = configs.iter().flat_map(|c| ids_of(c.get("eos_token_id"))).chain(token_id("eos_token"));
        for id in eos_candidates {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        let guard = chat_encode::SpecialGuard::new(&inner);
        Ok(Self { inner: Arc::new(inner), bos_token_id, eos_token_ids, special_tokens, chat_template, guard })
    }

    /// Build from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let g = tokenizer_from_gguf(content)?;
        let special_tokens = [
            ("bos_token", g.bos_token),
            ("eos_token", g.eos_token),
            ("unk_token", g.unk_token),
            ("pad_token", g.pad_token),
        ]
        .into_iter()
        .filter_map(|(name, t)| t.map(|t| (name.to_string(), t)))
        .collect();
        let chat_template = g.chat_template.as_deref().map(ChatTemplate::new).transpose()?;
        let eos_token_ids = g.eos_token_id.into_iter().chain(g.extra_eos_token_ids).collect();
        let guard = chat_encode::SpecialGuard::new(&g.tokenizer);
        Ok(Self {
            inner: Arc::new(g.tokenizer),
            bos_token_id: g.bos_token_id,
            eos_token_ids,
            special_tokens,
            chat_template,
            guard,
        })
    }

    /// Read a GGUF file's metadata and build from it.
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut file =
            std::fs::File::open(path).map_err(|source| TokenizerError::Io { file: path.to_path_buf(), source })?;
        let content = Content::read(&mut file)
            .map_err(|e| TokenizerError::GgufFile { file: path.to_path_buf(), reason: e.to_string() })?;
        Self::from_gguf(&content)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode(text, add_special_tokens).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Every id that ends generation (generation_config's `eos_token_id` may be a list).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The wrapped `tokenizers` tokenizer (e.g. for streaming decode).
    pub fn inner(&self) -> &Arc<Tokenizer> {
        &self.inner
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Render a conversation with the model's chat template.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, Default::default())
    }

    /// Like [`Self::apply_chat_template`], with extra template variables
    /// (e.g. `enable_thinking`), which override the special tokens.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or(TokenizerError::NoChatTemplate)?;
        let options = RenderOptions { add_generation_prompt, special_tokens: self.special_tokens.clone(), extra };
        Ok(template.render(messages, &options)?)
    }

    /// Render and tokenize a conversation. Like transformers, the rendered text is encoded
    /// without adding special tokens: the template already writes BOS where it belongs.
    pub fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.encode_chat_with(messages, add_generation_prompt, Default::default())
    }

    /// Like [`Self::encode_chat`], with extra template variables. Special tokens come only
    /// from the template: special-token strings in message content or in `extra` are
    /// tokenized as the text they are (no role injection).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>> {
        let mut injected = false;
        let mut check = |s: &mut String| injected |= self.guard.contains_special(s);
        let mut probe = messages.to_vec();
        let mut probe_extra = extra.clone();
        for_each_caller_string(&mut probe, &mut probe_extra, &mut check);
        if !injected {
            // The common case: exactly transformers' tokens.
            let text = self.apply_chat_template_with(messages, add_generation_prompt, extra)?;
            return self.encode(&text, false);
        }
        let mut protect = |s: &mut String| *s = self.guard.protect(s);
        let (mut messages, mut extra) = (probe, probe_extra);
        for_each_caller_string(&mut messages, &mut extra, &mut protect);
        let text = self.apply_chat_template_with(&messages, add_generation_prompt, extra)?;
        self.guard.encode_rendered(&text).map_err(TokenizerError::Encode)
    }

    /// Encodes `text` with special-token strings read as text (no BOS/EOS added): what a
    /// caller wrote, e.g. an assistant prefill, never becomes a control token.
    pub fn encode_plain_text(&self, text: &str) -> Result<Vec<u32>> {
        self.guard.encode_text(text).map_err(TokenizerError::Encode)
    }

    /// `s` (a caller's string inside markup iris writes) with its special-token strings
    /// broken, so that [`Self::encode_markup`] tokenizes them as text.
    pub fn protect(&self, s: &str) -> String {
        self.guard.protect(s)
    }

    /// Encodes markup iris writes itself (a forced tool call's opening, which continues the
    /// template's prompt): its special-token strings are the control tokens, as in a rendered
    /// template (Gemma 4's `<|tool_call>`, GLM's `<tool_call>`), and what a caller supplied
    /// in it, [`Self::protect`]ed, is text. No BOS/EOS added.
    pub fn encode_markup(&self, markup: &str) -> Result<Vec<u32>> {
        if markup.is_empty() {
            return Ok(Vec::new());
        }
        self.guard.encode_rendered(markup).map_err(TokenizerError::Encode)
    }
}

/// Calls `f` on every string a caller supplied for the template: message contents, text
/// parts, other message fields (tool calls, names), and the extra template variables.
fn for_each_caller_string(
    messages: &mut [ChatMessage],
    extra: &mut serde_json::Map<String, serde_json::Value>,
    f: &mut impl FnMut(&mut String),
) {
    fn value(v: &mut serde_json::Value, f: &mut impl FnMut(&mut String)) {
        match v {
            serde_json::Value::String(s) => f(s),
            serde_json::Value::Array(items) => items.iter_mut().for_each(|i| value(i, f)),
            serde_json::Value::Object(map) => map.values_mut().for_each(|i| value(i, f)),
            _ => {}
        }
    }
    for m in messages {
        match &mut m.content {
            Some(MessageContent::Text(t)) => f(t),
            Some(MessageContent::Parts(parts)) => {
                for p in parts {
                    if let Some(t) = &mut p.text {
                        f(t);
                    }
                    p.extra.values_mut().for_each(|v| value(v, f));
                }
            }
            None => {}
        }
        m.extra.values_mut().for_each(|v| value(v, f));
    }
    extra.values_mut().for_each(|v| value(v, f));
}

fn read_if_exists(file: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(file) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io { file: file.to_path_buf(), source }),
    }
}

fn read_json_if_exists(file: &Path) -> Result<Option<serde_json::Value>> {
    read_if_exists(file)?
        .map(|text| {
            serde_json::from_str(&text).map_err(|source| TokenizerError::Json { file: file.to_path_buf(), source })
        })
        .transpose()
}

/// A special token in tokenizer_config.json: a string or an AddedToken dict with `content`.
fn special_token_content(config: &serde_json::Value, name: &str, file: &Path) -> Result<Option<String>> {
    match config.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => match v.get("content").and_then(|c| c.as_str()) {
            Some(s) => Ok(Some(s.to_string())),
            None => Err(TokenizerError::Invalid {
                file: file.to_path_buf(),
                reason: format!("`{name}` must be a string or an object with a string `content`"),
            }),
        },
    }
}

/// `eos_token_id` as an int or a list of ints.
fn ids_of(value: Option<&serde_json::Value>) -> Vec<u32> {
    match value {
        Some(serde_json::Value::Number(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()).into_iter().collect(),
        Some(serde_json::Value::Array(items)) => {
            items.iter().filter_map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
        }
        _ => Vec::new(),
    }
}

/// transformers (v5) rewrites the post-processor to `bos $A eos` when tokenizer_config.json
/// sets `add_bos_token` or `add_eos_token`; an unset flag then counts as false.
fn update_post_processor(
    tokenizer: &mut Tokenizer,
    config: &serde_json::Value,
    file: &Path,
    bos: Option<String>,
    eos: Option<String>,
) -> Result<()> {
    let flag = |name: &str| config.get(name).and_then(|v| v.as_bool());
    let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
    if add_bos.is_none() && add_eos.is_none() {
        return Ok(());
    }
    let with_id = |token: Option<String>, enabled: Option<bool>| {
        token.filter(|_| enabled == Some(true)).and_then(|t| tokenizer.token_to_id(&t).map(|id| (t, id)))
    };
    let bos = with_id(bos, add_bos);
    let eos = with_id(eos, add_eos);
    let processor = post_processor::bos_eos_processor(bos, eos).map_err(|e| TokenizerError::Invalid {
        file: file.to_path_buf(),
        reason: format!("cannot build the BOS/EOS post-processor: {e}"),
    })?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny but complete model directory: WordLevel-free BPE tokenizer.json with a
    /// template-processing BOS, plus config files.
    fn write_model_dir(dir: &Path, tokenizer_config: serde_json::Value) {
        let tokenizer = serde_json::json!({
            "version": "1.0",
            "added_tokens": [
                {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "h": 3, "i": 4, "hi": 5, "Ġ": 6, "Ġhi": 7, "\n": 8, "Ċ": 9, "u": 10, ":": 11},
                "merges": ["h i", "Ġ hi"]
            }
        });
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write");
        std::fs::write(dir.join("tokenizer_config.json"), tokenizer_config.to_string()).expect("write");
        std::fs::write(dir.join("generation_config.json"), r#"{"bos_token_id": 0, "eos_token_id": [1, 2]}"#)
            .expect("write");
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 1}"#).expect("write");
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("iris-tokenizer-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }

    #[test]
    fn from_dir_reads_ids_template_and_bos_flag() {
        let dir = temp_dir("dir");
        write_model_dir(
            &dir,
            serde_json::json!({
                "bos_token": {"content": "<s>", "special": true},
                "eos_token": "</s>",
                "add_bos_token": true,
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
            }),
        );
        let tok = TextTokenizer::from_dir(&dir).expect("load");
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.eos_token_ids(), &[1, 2]);
        assert_eq!(tok.vocab_size(), 12);
        // add_bos_token in tokenizer_config.json installs a BOS post-processor.
        assert_eq!(tok.encode("hi hi", true).expect("encode"), vec![0, 5, 7]);
        assert_eq!(tok.encode("hi hi", false).expect("encode"), vec![5, 7]);
        assert_eq!(tok.decode(&[0, 5, 7], true).expect("decode"), "hi hi");

        let msgs = [ChatMessage::text("u", "hi")];
        assert_eq!(tok.apply_chat_template(&msgs, false).expect("render"), "<s>u:hi");
        // The template wrote <s>; encode_chat must not add a second one.
        assert_eq!(tok.encode_chat(&msgs, false).expect("encode"), vec![0, 10, 11, 5]);

        // chat_template.json (a processor's) takes precedence over the config's template...
        std::fs::write(dir.join("chat_template.json"), r#"{"chat_template": "P{{ messages | length }}"}"#)
            .expect("write");
        let tok = TextTokenizer::from_dir(&dir).expect("load");
        assert_eq!(tok.apply_chat_template(&msgs, false).expect("render"), "P1");
        // ... and chat_template.jinja over both.
        std::fs::write(dir.join("chat_template.jinja"), "J{{ messages | length }}").expect("write");
        let tok = TextTokenizer::from_dir(&dir).expect("load");
        assert_eq!(tok.apply_chat_template(&msgs, false).expect("render"), "J1");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn from_dir_errors_name_the_file() {
        let dir = temp_dir("bad");
        write_model_dir(&dir, serde_json::json!({}));
        std::fs::write(dir.join("generation_config.json"), "{not json").expect("write");
        let err = TextTokenizer::from_dir(&dir).expect_err("bad json");
        assert!(err.to_string().contains("generation_config.json"), "{err}");

        std::fs::remove_file(dir.join("tokenizer.json")).expect("rm");
        let err = TextTokenizer::from_dir(&dir).expect_err("no tokenizer.json");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&dir).ok();

        let tok = {
            let dir = temp_dir("notemplate");
            write_model_dir(&dir, serde_json::json!({}));
            let tok = TextTokenizer::from_dir(&dir).expect("load");
            std::fs::remove_dir_all(&dir).ok();
            tok
        };
        assert!(matches!(tok.apply_chat_template(&[], true), Err(TokenizerError::NoChatTemplate)));
        // Without add_bos_token the tokenizer.json's own (absent) post-processor stays.
        assert_eq!(tok.encode("hi", true).expect("encode"), vec![5]);
    }
}
