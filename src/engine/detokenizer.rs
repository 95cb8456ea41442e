//! Streaming token ids to text without emitting broken characters.
//!
//! Decoding token by token is wrong twice over: byte-level BPE tokens may hold half
//! of a UTF-8 character, and decoders edit text depending on neighbours (SentencePiece
//! strips the leading space of the first token). So, like vLLM and TGI, we keep a
//! small window of ids: `ids[..read]` is text already emitted (kept as context),
//! `ids[read..]` is pending. Each step decodes the window and emits whatever extends
//! the decoded context, unless it ends in U+FFFD, which means a character is still
//! incomplete and the next token should finish it.

use std::sync::Arc;
use tokenizers::Tokenizer;

/// Prompt tokens kept as left context for the first output tokens (vLLM uses 5).
const PROMPT_CONTEXT: usize = 5;

#[derive(Debug, thiserror::Error)]
#[error("detokenization failed: {0}")]
pub struct DetokenizeError(String);

/// Turns a stream of generated ids into text deltas.
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// The window: context ids followed by ids not yet emitted.
    ids: Vec<u32>,
    /// Number of context ids at the start of `ids`.
    read: usize,
    /// `decode(ids[..read])`, cached.
    context: String,
}

impl IncrementalDetokenizer {
    /// `prompt_tokens` give the first output tokens their left context (so e.g. a
    /// leading space is not stripped); none of the prompt's text is ever emitted.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        prompt_tokens: &[u32],
        skip_special_tokens: bool,
    ) -> Result<Self, DetokenizeError> {
        let ids = prompt_tokens[prompt_tokens.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let mut d = Self { tokenizer, skip_special_tokens, read: ids.len(), ids, context: String::new() };
        d.context = d.decode(&d.ids)?;
        Ok(d)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, DetokenizeError> {
        self.tokenizer.decode(ids, self.skip_special_tokens).map_err(|e| DetokenizeError(e.to_string()))
    }

    /// Add one generated token; returns the newly completed text (often empty).
    pub fn push(&mut self, token: u32) -> Result<String, DetokenizeError> {
        self.ids.push(token);
        let text = self.decode(&self.ids)?;
        if text.len() <= self.context.len() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = self.delta(&text);
        // The pending ids become the context of the next step.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.context = self.decode(&self.ids)?;
        Ok(delta)
    }

    /// Emit whatever is still held back (an incomplete character is emitted as
    /// U+FFFD, exactly as a full `decode` would show it). Call once at the end.
    pub fn finish(&mut self) -> Result<String, DetokenizeError> {
        let text = self.decode(&self.ids)?;
        let delta = if text.len() > self.context.len() { self.delta(&text) } else { String::new() };
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.context = self.decode(&self.ids)?;
        Ok(delta)
    }

    /// The part of `text` past the decoded context. A decoder whose output for the
    /// context is not a prefix of its output for the longer window would make us
    /// slice mid-character; emit nothing then rather than garbage or a panic.
    fn delta(&self, text: &str) -> String {
        if text.starts_with(&self.context) {
            text[self.context.len()..].to_string()
        } else {
            tracing::warn!(context = %self.context, %text, "detokenizer window is not prefix-stable");
            text.get(self.context.len()..).unwrap_or_default().to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// GPT-2's byte -> printable char map, which byte-level BPE vocabularies use.
    fn byte_to_char() -> Vec<char> {
        let printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
        let mut out = vec!['\0'; 256];
        let mut extra = 0;
        for b in 0..256u32 {
            let c = if printable.contains(&b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            out[b as usize] = char::from_u32(c).unwrap_or('?');
        }
        out
    }

    /// A byte-level BPE tokenizer: ids 0..256 are the bytes, 256 merges "é"'s two
    /// bytes, 257 merges "h"+"i", and 258 is a special `<eos>`.
    fn tokenizer() -> Arc<Tokenizer> {
        let map = byte_to_char();
        let mut vocab = serde_json::Map::new();
        for (b, c) in map.iter().enumerate() {
            vocab.insert(c.to_string(), json!(b));
        }
        let e_acute: String = "é".bytes().map(|b| map[b as usize]).collect();
        vocab.insert(e_acute.clone(), json!(256));
        vocab.insert("hi".into(), json!(257));
        let e_parts: Vec<String> = "é".bytes().map(|b| map[b as usize].to_string()).collect();
        let spec = json!({
            "version": "1.0",
            "added_tokens": [{"id": 258, "content": "<eos>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": vocab, "merges": [[e_parts[0], e_parts[1]], ["h", "i"]]}
        });
        let tok: Tokenizer = spec.to_string().parse().expect("test tokenizer json");
        Arc::new(tok)
    }

    fn ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, false).expect("encode").get_ids().to_vec()
    }

    fn stream(tok: &Arc<Tokenizer>, prompt: &[u32], out: &[u32], skip: bool) -> Vec<String> {
        let mut d = IncrementalDetokenizer::new(tok.clone(), prompt, skip).expect("new");
        let mut deltas: Vec<String> = out.iter().map(|&t| d.push(t).expect("push")).collect();
        deltas.push(d.finish().expect("finish"));
        deltas
    }

    #[test]
    fn the_test_tokenizer_is_what_we_think() {
        let tok = tokenizer();
        assert_eq!(ids(&tok, "hi"), vec![257]);
        assert_eq!(ids(&tok, "é"), vec![256]);
        // "€" is three bytes with no merge: three tokens, none valid alone.
        assert_eq!(ids(&tok, "€"), vec![0xE2, 0x82, 0xAC]);
        assert_eq!(tok.decode(&[0xE2, 0x82], false).expect("decode"), "\u{FFFD}");
    }

    #[test]
    fn split_characters_are_emitted_once_complete() {
        let tok = tokenizer();
        let text = "hi €! é 🦀x";
        let out = ids(&tok, text);
        let deltas = stream(&tok, &[], &out, true);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
        assert_eq!(deltas.concat(), text);
        assert_eq!(deltas.concat(), tok.decode(&out, true).expect("decode"));
        // "€" arrives as 3 tokens: two empty deltas, then the whole character.
        let euro = out.iter().position(|&t| t == 0xE2).expect("euro start");
        assert_eq!(&deltas[euro..euro + 3], &["", "", "€"]);
    }

    #[test]
    fn prompt_context_is_never_emitted_and_special_tokens_follow_the_flag() {
        let tok = tokenizer();
        let prompt = ids(&tok, "say hi");
        let mut out = ids(&tok, " é");
        out.push(258);
        assert_eq!(stream(&tok, &prompt, &out, true).concat(), " é");
        assert_eq!(stream(&tok, &prompt, &out, false).concat(), " é<eos>");
    }

    #[test]
    fn finish_flushes_an_incomplete_tail() {
        let tok = tokenizer();
        let deltas = stream(&tok, &[], &[257, 0xE2, 0x82], true);
        assert_eq!(deltas, vec!["hi", "", "", "\u{FFFD}"]);
        assert_eq!(deltas.concat(), tok.decode(&[257, 0xE2, 0x82], true).expect("decode"));
    }
}
