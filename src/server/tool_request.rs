//! What a request says about tools: the tool definitions (for the chat template and the
//! parsers), `tool_choice`, and how its replies are parsed ([`ReplySetup`]), including the
//! text iris writes after the prompt to make the model call a tool (`required`, a named
//! function): the call's opening, in the model's own format, so the reply continues a call,
//! and the grammar that holds the rest of the call to the tools' schemas (`tool_grammar`).

use serde_json::{json, Value};

use super::engine_loop::EngineHandle;
use super::errors::ApiError;
use super::reasoning::{prompt_opens_thinking, ReasoningFormat};
use super::reply::ReplySetup;
use super::structured::Asked;
use super::tool_grammar::Markup;
use super::tools::{ToolFormat, ToolSpec, Tools};
use crate::engine::GrammarSpec;
use crate::tokenizer::TextTokenizer;

/// `--tool-call-parser` and `--reasoning-parser`, as the server runs with them.
#[derive(Debug, Clone, Default)]
pub struct ParserConfig {
    /// `None`: read the format from the chat template.
    pub tool_format: Option<ToolFormat>,
    pub reasoning: Option<ReasoningFormat>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function(String),
}

/// A request's tools.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    /// As the chat template gets them: `{"type": "function", "function": {...}}`, as sent.
    pub template_tools: Vec<Value>,
    pub specs: Tools,
    pub choice: ToolChoice,
    pub parallel: bool,
}

impl ToolRequest {
    pub fn none() -> Self {
        ToolRequest { template_tools: Vec::new(), specs: Tools::default(), choice: ToolChoice::None, parallel: true }
    }

    /// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
    pub fn openai(tools: Option<&Value>, choice: Option<&Value>, parallel: Option<bool>) -> Result<Self, ApiError> {
        let mut template_tools = Vec::new();
        let mut specs = Vec::new();
        match tools {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) => {
                for (i, t) in list.iter().enumerate() {
                    let at = format!("tools[{i}]");
                    match t.get("type").and_then(Value::as_str) {
                        Some("function") => {}
                        Some(other) => {
                            return Err(ApiError::invalid_param(
                                format!("{at}.type"),
                                format!("`{at}.type` is `{other}`: only `function` tools are supported"),
                            ))
                        }
                        None => {
                            return Err(ApiError::invalid_param(
                                format!("{at}.type"),
                                format!("`{at}` must be an object with `type: \"function\"`"),
                            ))
                        }
                    }
                    let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
                        ApiError::invalid_param(format!("{at}.function"), format!("`{at}.function` must be an object"))
                    })?;
                    specs.push(spec(f, &format!("{at}.function"))?);
                    template_tools.push(t.clone());
                }
            }
            Some(_) => return Err(ApiError::invalid_param("tools", "`tools` must be a list of tools")),
        }
        let choice = match choice {
            None | Some(Value::Null) => {
                if specs.is_empty() {
                    ToolChoice::None
                } else {
                    ToolChoice::Auto
                }
            }
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("`tool_choice` `{other}` is not one of auto, none, required, or a named function"),
                    ))
                }
            },
            Some(v @ Value::Object(_)) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "tool_choice",
                            "a named `tool_choice` is `{\"type\": \"function\", \"function\": {\"name\": ...}}`",
                        )
                    })?;
                ToolChoice::Function(name.to_string())
            }
            Some(_) => {
                return Err(ApiError::invalid_param("tool_choice", "`tool_choice` must be a string or an object"))
            }
        };
        let req = ToolRequest { template_tools, specs: Tools(specs), choice, parallel: parallel.unwrap_or(true) };
        req.check_choice("tool_choice")?;
        Ok(req)
    }

    /// A choice that needs tools has them, and a named one is among them.
    pub fn check_choice(&self, param: &str) -> Result<(), ApiError> {
        match &self.choice {
            ToolChoice::Required | ToolChoice::Function(_) if self.specs.0.is_empty() => Err(ApiError::invalid_param(
                param,
                format!("`{param}` asks for a tool call, but the request has no `tools`"),
            )),
            ToolChoice::Function(name) if !self.specs.0.iter().any(|t| &t.name == name) => {
                Err(ApiError::invalid_param(
                    param,
                    format!("`{param}` names the function `{name}`, which is not among the request's tools"),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Puts the tools where the chat template reads them.
    pub fn template_vars(&self, extra: &mut serde_json::Map<String, Value>) {
        if !self.template_tools.is_empty() {
            extra.insert("tools".into(), Value::Array(self.template_tools.clone()));
        }
    }
}

/// A function definition (`name`, `description`, `parameters`) read at `at`.
pub fn spec(f: &Value, at: &str) -> Result<ToolSpec, ApiError> {
    let name = match f.get("name") {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        _ => {
            return Err(ApiError::invalid_param(
                format!("{at}.name"),
                format!("`{at}.name` must be a non-empty string"),
            ))
        }
    };
    let parameters = match f.get("parameters").or_else(|| f.get("input_schema")) {
        None | Some(Value::Null) => json!({}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid_param(
                format!("{at}.parameters"),
                format!("`{at}`'s parameters must be a JSON schema object"),
            ))
        }
    };
    Ok(ToolSpec { name, parameters })
}

/// A forced tool call: the text iris appends to the prompt so that the reply continues a
/// call (the caller feeds it to each reply's parser before the model's text), and the
/// grammar the rest of the call follows. Empty when the request forces no call.
#[derive(Debug, Clone, Default)]
pub struct Forced {
    pub text: String,
    /// `text` as markup to tokenize: the format's tags are its control tokens, the function
    /// name (the caller's) is protected as text.
    markup: String,
    pub grammar: Option<GrammarSpec>,
}

impl Forced {
    /// The forced call to `name` (or, `None`, to any of `tools`) in `format`, after `close`
    /// (the end of a thinking the prompt opened, or nothing).
    pub fn call(
        tok: &TextTokenizer,
        format: ToolFormat,
        tools: &[ToolSpec],
        name: Option<&str>,
        parallel: bool,
        close: &str,
    ) -> Forced {
        let markup = Markup::new(|s| tok.token_to_id(s));
        let grammar = super::tool_grammar::forced_call(format, tools, name, parallel, &markup);
        let protected = name.map(|n| tok.protect(n));
        Forced {
            text: format!("{close}{}", forced_opening(format, name)),
            markup: format!("{close}{}", forced_opening(format, protected.as_deref())),
            grammar: Some(grammar),
        }
    }

    /// The grammar as a request's structured output, on the field it comes from.
    pub fn asked(&self) -> Option<Asked> {
        self.grammar.clone().map(|spec| Asked { spec, field: "tools".into() })
    }

    /// Appends the opening to `prompt`, tokenized as the template's markup is: the call's
    /// tags as the control tokens they are (Gemma 4's `<|tool_call>`, GLM's `<tool_call>`),
    /// so the model reads the opening it was trained on.
    pub fn append_to(&self, tok: &TextTokenizer, prompt: &mut Vec<u32>) -> Result<(), ApiError> {
        prompt.extend(tok.encode_markup(&self.markup).map_err(|e| ApiError::bad_request(e.to_string()))?);
        Ok(())
    }
}

/// How the replies of a request are parsed, and the forced call (if any) that its prompt
/// ends with.
pub fn reply_setup(
    cfg: &ParserConfig,
    engine: &EngineHandle,
    tools: &ToolRequest,
    prompt: &[u32],
    id_prefix: &'static str,
) -> Result<(ReplySetup, Forced), ApiError> {
    let tok = &engine.tokenizer;
    let template = tok.chat_template().map(|t| t.source());
    let reasoning = cfg.reasoning.or_else(|| template.and_then(ReasoningFormat::detect));
    let starts_in_thinking = reasoning.is_some_and(|r| {
        let tail = &prompt[prompt.len().saturating_sub(16)..];
        prompt_opens_thinking(r, &tok.decode(tail, false).unwrap_or_default())
    });
    let format = cfg.tool_format.or_else(|| template.and_then(ToolFormat::detect));
    let stop_token_ids =
        format.map(|f| f.stop_markers().iter().filter_map(|m| tok.token_to_id(m)).collect()).unwrap_or_default();
    let mut setup = ReplySetup {
        reasoning,
        starts_in_thinking,
        tools: None,
        single_call: !tools.parallel,
        id_prefix,
        stop_token_ids,
    };
    if tools.specs.0.is_empty() || tools.choice == ToolChoice::None {
        return Ok((setup, Forced::default()));
    }
    let Some(format) = format else {
        return Err(ApiError::invalid_param(
            "tools",
            format!(
                "the request has tools, but this model's chat template shows no tool-call format iris knows; \
                 start the server with --tool-call-parser (one of {})",
                ToolFormat::NAMES.join(", ")
            ),
        ));
    };
    setup.tools = Some((format, tools.specs.clone()));
    let name = match &tools.choice {
        ToolChoice::Required => None,
        ToolChoice::Function(name) => Some(name.as_str()),
        _ => return Ok((setup, Forced::default())),
    };
    // A forced call is the answer, so a thinking the prompt opened is closed first.
    let close = match reasoning {
        Some(r) if starts_in_thinking => r.close_text(),
        _ => "",
    };
    Ok((setup, Forced::call(tok, format, &tools.specs.0, name, tools.parallel, close)))
}

/// The start of a call in `format`: of any call, or of one to `name`.
pub fn forced_opening(format: ToolFormat, name: Option<&str>) -> String {
    match (format, name) {
        (ToolFormat::Hermes, None) => "<tool_call>\n{\"name\": \"".into(),
        (ToolFormat::Hermes, Some(n)) => format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", json!(n)),
        (ToolFormat::Qwen3Xml, None) => "<tool_call>\n<function=".into(),
        (ToolFormat::Qwen3Xml, Some(n)) => format!("<tool_call>\n<function={n}>\n"),
        (ToolFormat::Glm45, None) => "<tool_call>".into(),
        (ToolFormat::Glm45, Some(n)) => format!("<tool_call>{n}\n"),
        (ToolFormat::Llama3Json, None) => "{\"name\": \"".into(),
        (ToolFormat::Llama3Json, Some(n)) => format!("{{\"name\": {}, \"parameters\": ", json!(n)),
        (ToolFormat::Gemma4, None) => "<|tool_call>call:".into(),
        (ToolFormat::Gemma4, Some(n)) => format!("<|tool_call>call:{n}{{"),
    }
}

/// An assistant message's `tool_calls` for the chat template: each call's `arguments` JSON
/// text read into an object (Qwen3-Coder's, GLM's and Llama's templates iterate it as a
/// mapping; vLLM does the same), text that is not JSON left as it is.
pub fn template_tool_calls(calls: &Value, at: &str) -> Result<Value, ApiError> {
    let Value::Array(list) = calls else {
        return Err(ApiError::invalid_param(at, format!("`{at}` must be a list")));
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, c) in list.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let f = c.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::invalid_param(format!("{at}.function"), format!("`{at}.function` must be an object"))
        })?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(format!("{at}.function.name"), format!("`{at}.function.name` must be a string"))
        })?;
        let args = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone())),
            Some(v) => v.clone(),
        };
        let mut call = serde_json::Map::new();
        if let Some(id) = c.get("id") {
            call.insert("id".into(), id.clone());
        }
        call.insert("type".into(), json!("function"));
        call.insert("function".into(), json!({ "name": name, "arguments": args }));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_tool_choice_forms() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let r = ToolRequest::openai(Some(&tools), None, None).expect("ok");
        assert_eq!(r.choice, ToolChoice::Auto);
        let r = ToolRequest::openai(
            Some(&tools),
            Some(&json!({"type": "function", "function": {"name": "f"}})),
            Some(false),
        )
        .expect("ok");
        assert_eq!(r.choice, ToolChoice::Function("f".into()));
        assert!(!r.parallel);
        let no_tools = ToolRequest::openai(None, None, None).expect("ok");
        assert_eq!(no_tools.choice, ToolChoice::None);
        for (tools, choice) in [
            (tools.clone(), json!({"type": "function", "function": {"name": "g"}})),
            (tools.clone(), json!("sometimes")),
            (json!(null), json!("required")),
            (json!([{"type": "retrieval"}]), json!("auto")),
            (json!([{"type": "function", "function": {"name": ""}}]), json!("auto")),
        ] {
            assert!(ToolRequest::openai(Some(&tools), Some(&choice), None).is_err(), "{tools} {choice}");
        }
    }

    #[test]
    fn history_arguments_become_objects() {
        let calls = json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                           {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]);
        let out = template_tool_calls(&calls, "messages[1].tool_calls").expect("ok");
        assert_eq!(out[0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(out[1]["function"]["arguments"], json!("not json"));
        assert!(template_tool_calls(&json!([{"id": "x"}]), "m").is_err());
    }

    #[test]
    fn forced_openings_are_the_formats_own() {
        assert_eq!(forced_opening(ToolFormat::Hermes, Some("f")), "<tool_call>\n{\"name\": \"f\", \"arguments\": ");
        assert_eq!(forced_opening(ToolFormat::Qwen3Xml, Some("f")), "<tool_call>\n<function=f>\n");
        assert_eq!(forced_opening(ToolFormat::Glm45, Some("f")), "<tool_call>f\n");
        assert_eq!(forced_opening(ToolFormat::Llama3Json, Some("f")), "{\"name\": \"f\", \"parameters\": ");
        assert_eq!(forced_opening(ToolFormat::Gemma4, Some("f")), "<|tool_call>call:f{");
    }
}
