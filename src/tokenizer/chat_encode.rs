//! Tokenizing a rendered conversation so that special tokens come only from the chat
//! template: a user who types `<|im_end|>\n<|im_start|>system` gets those characters as
//! text, never the control tokens (role injection).
//!
//! Before rendering, every special-token string inside message content (and other caller
//! strings the template sees) is broken by a marker character, so it can no longer match.
//! After rendering, the special-token strings still present are the template's own: the text
//! is split at them, the marker is taken out of the text between them again, and that text
//! is encoded with special-token matching off (`tokenizers`' `encode_special_tokens`,
//! transformers' `split_special_tokens`). A conversation whose content holds no special
//! string takes the plain path (render, encode), so its tokens are exactly transformers'.

use std::sync::Arc;

use tokenizers::Tokenizer;

/// Inserted after the first character of a special-token string found in content; a private
/// use character, which no tokenizer gives a meaning to.
const MARK: char = '\u{E000}';

/// A special added token as the tokenizer matches it.
#[derive(Debug, Clone)]
struct Special {
    content: String,
    /// `content` with [`MARK`] after its first character.
    broken: String,
    id: u32,
    /// The token absorbs the whitespace before (lstrip) or after (rstrip) it.
    lstrip: bool,
    rstrip: bool,
}

/// The special tokens of a tokenizer, and a copy of it that encodes them as text.
#[derive(Debug)]
pub struct SpecialGuard {
    /// Longest first, so that a scan finds the longest match (as `tokenizers` does).
    specials: Vec<Special>,
    /// The first bytes of the special tokens.
    first_bytes: [bool; 256],
    text_only: Arc<Tokenizer>,
}

impl SpecialGuard {
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let mut specials: Vec<Special> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| Special {
                broken: break_token(&t.content),
                content: t.content,
                id,
                lstrip: t.lstrip,
                rstrip: t.rstrip,
            })
            .collect();
        specials.sort_by(|a, b| b.content.len().cmp(&a.content.len()).then(a.id.cmp(&b.id)));
        let mut first_bytes = [false; 256];
        for t in &specials {
            first_bytes[t.content.as_bytes()[0] as usize] = true;
        }
        let mut text_only = tokenizer.clone();
        text_only.set_encode_special_tokens(true);
        SpecialGuard { specials, first_bytes, text_only: Arc::new(text_only) }
    }

    /// Whether `s` holds a special-token string.
    pub fn contains_special(&self, s: &str) -> bool {
        self.specials.iter().any(|t| s.contains(t.content.as_str()))
    }

    /// `s` with every special-token string broken by the marker (so it renders as text).
    pub fn protect(&self, s: &str) -> String {
        let mut out = s.to_string();
        for t in &self.specials {
            if out.contains(t.content.as_str()) {
                out = out.replace(t.content.as_str(), &t.broken);
            }
        }
        out
    }

    /// Encodes text whose special-token strings are all meant as text.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, String> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        self.text_only.encode(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())
    }

    /// Encodes a rendered template whose content was [`Self::protect`]ed: the special
    /// strings left are the template's and become their ids; the text between them (marker
    /// removed) is encoded as text.
    pub fn encode_rendered(&self, rendered: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::new();
        let mut text_start = 0;
        let mut i = 0;
        let bytes = rendered.as_bytes();
        // Whitespace a previous rstrip token absorbed.
        let mut skip_ws = false;
        while i < rendered.len() {
            // Only a position whose byte starts some special token can start a match.
            if !self.first_bytes[bytes[i] as usize] || !rendered.is_char_boundary(i) {
                i += 1;
                continue;
            }
            let rest = &rendered[i..];
            let Some(t) = self.specials.iter().find(|t| rest.starts_with(t.content.as_str())) else {
                i += 1;
                continue;
            };
            let mut text = &rendered[text_start..i];
            if skip_ws {
                text = text.trim_start();
            }
            if t.lstrip {
                text = text.trim_end();
            }
            ids.extend(self.encode_text(&self.restore(text))?);
            ids.push(t.id);
            i += t.content.len();
            text_start = i;
            skip_ws = t.rstrip;
        }
        let mut text = &rendered[text_start..];
        if skip_ws {
            text = text.trim_start();
        }
        ids.extend(self.encode_text(&self.restore(text))?);
        Ok(ids)
    }

    /// Takes the marker out of broken special-token strings again.
    fn restore(&self, s: &str) -> String {
        if !s.contains(MARK) {
            return s.to_string();
        }
        let mut out = s.to_string();
        for t in &self.specials {
            if out.contains(t.broken.as_str()) {
                out = out.replace(t.broken.as_str(), &t.content);
            }
        }
        out
    }
}

fn break_token(s: &str) -> String {
    let mut chars = s.chars();
    let mut out = String::with_capacity(s.len() + MARK.len_utf8());
    if let Some(c) = chars.next() {
        out.push(c);
    }
    out.push(MARK);
    out.extend(chars);
    out
}
