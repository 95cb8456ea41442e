//! A conversation made into the prompt the engine runs, as the chat and the Responses
//! endpoints both do it: the chat template with the request's tools and variables, the
//! opening of a forced tool call after it, the images' tokens; and how the replies are
//! parsed. One place, so the two endpoints cannot drift apart.

use serde_json::{Map, Value};

use super::engine_loop::EngineHandle;
use super::errors::ApiError;
use super::images::ImageRef;
use super::reply::{Delta, Reply, ReplyParser, ReplySetup};
use super::state::AppState;
use super::structured::{self, Asked};
use super::tool_request::{reply_setup, Forced, ToolRequest};
use crate::engine::{Grammar, ImageInput, SamplingParams};
use crate::tokenizer::{ChatMessage, TextTokenizer, TokenizerError};

/// Renders and tokenizes a conversation; template errors are the client's (400). Special
/// tokens come only from the template: what the client wrote is tokenized as text.
pub fn encode_chat(
    tok: &TextTokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    extra: Map<String, Value>,
) -> Result<Vec<u32>, ApiError> {
    tok.encode_chat_with(messages, add_generation_prompt, extra).map_err(|e| match e {
        TokenizerError::Encode(m) => ApiError::bad_request(format!("cannot tokenize the conversation: {m}")),
        e => ApiError::bad_request(format!("cannot apply the chat template: {e}")).param("messages"),
    })
}

/// What a conversation became.
pub struct ChatPrompt {
    /// The prompt, with each image's tokens expanded.
    pub tokens: Vec<u32>,
    pub images: Vec<ImageInput>,
    /// How the replies are parsed.
    pub setup: ReplySetup,
    /// What iris wrote after the template (a forced call's opening: every reply continues
    /// it, so its parser reads it first) and the grammar of the rest of the call.
    pub forced: Forced,
}

impl ChatPrompt {
    /// Renders `messages` with `tools` (put where the template reads them, next to `extra`),
    /// appends a forced call's opening and loads the images. Tool-call ids get `id_prefix`.
    #[allow(clippy::too_many_arguments)]
    pub async fn build(
        app: &AppState,
        engine: &EngineHandle,
        messages: &[ChatMessage],
        images: Vec<ImageRef>,
        tools: &ToolRequest,
        mut extra: Map<String, Value>,
        add_generation_prompt: bool,
        id_prefix: &'static str,
    ) -> Result<ChatPrompt, ApiError> {
        super::images::check_accepted(engine, &images)?;
        let tok = &engine.tokenizer;
        tools.template_vars(&mut extra);
        let mut prompt = encode_chat(tok, messages, add_generation_prompt, extra)?;
        let (setup, forced) = reply_setup(&app.cfg.parsers, engine, tools, &prompt, id_prefix)?;
        forced.append_to(tok, &mut prompt)?;
        let (tokens, images) = super::images::prepare(&app.cfg.media, engine, prompt, images).await?;
        Ok(ChatPrompt { tokens, images, setup, forced })
    }

    /// The grammar the replies follow: a forced call's (the call is the whole reply), else
    /// the structured output the request asked for, which a reply that begins in its
    /// thinking follows from the thinking's end on (the answer is what has a schema). With a
    /// reasoning parser and a prompt that does not open the thinking, the reply may open it
    /// with its first token (the format's special opening token) and think before the answer.
    pub async fn grammar(&self, engine: &EngineHandle, asked: Option<&Asked>) -> Result<Option<Grammar>, ApiError> {
        if let Some(call) = self.forced.asked() {
            return structured::compile_off_thread(engine, Some(&call)).await;
        }
        let grammar = structured::compile_off_thread(engine, asked).await?;
        let Some(format) = self.setup.reasoning else { return Ok(grammar) };
        let tok = &engine.tokenizer;
        // Where the format's thinking ends.
        let end = format.markers().1;
        let marker = match tok.token_to_id(end) {
            Some(id) => vec![id],
            None => tok.encode_plain_text(end).map_err(|e| ApiError::bad_request(e.to_string()))?,
        };
        if self.setup.begins_in_thinking() {
            return Ok(grammar.map(|g| g.after(marker)));
        }
        // Only a special token opens it: a plain one would let any reply that starts with it
        // out of its grammar.
        Ok(match tok.token_to_id(format.opening_token()) {
            Some(open) => grammar.map(|g| g.after_optional_opening(open, marker)),
            None => grammar,
        })
    }

    /// What the parsers need of the sampling ([`ReplySetup::fit`]): the tags, which may be
    /// special tokens, unless the request said otherwise (`explicit`); the format's stops.
    pub fn fit_params(&self, params: &mut SamplingParams, explicit: Option<bool>) {
        self.setup.fit(params, explicit);
    }

    /// A parser for one reply, already fed the forced opening; what that gave (a streaming
    /// format's call starts there) goes to `early`.
    pub fn parser(&self, early: &mut Vec<Delta>) -> ReplyParser {
        let mut p = ReplyParser::new(&self.setup);
        p.feed(&self.forced.text, early);
        p
    }

    /// A whole reply's text, parsed.
    pub fn reply(&self, text: &str) -> Reply {
        Reply::parse(&self.setup, &format!("{}{text}", self.forced.text))
    }
}
