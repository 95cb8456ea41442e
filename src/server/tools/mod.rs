//! Tool calls in model output, one file per format, chosen with vLLM's `--tool-call-parser`
//! names or detected from the chat template.
//!
//! * `parser.rs`: the [`ToolParser`] trait and its events, the request's tools;
//! * `tagged.rs`: the scanner of the formats that wrap calls in tags;
//! * `hermes.rs`, `qwen3_xml.rs`, `glm45.rs`, `llama3_json.rs`, `gemma4.rs`: the formats.

pub mod gemma4;
pub mod glm45;
pub mod hermes;
pub mod llama3_json;
pub mod parser;
pub mod qwen3_xml;
pub mod tagged;

pub use parser::{ToolEvent, ToolParser, ToolSpec, Tools};

/// A tool-call format, by vLLM's `--tool-call-parser` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Qwen3Xml,
    Glm45,
    Llama3Json,
    Gemma4,
}

impl ToolFormat {
    /// Every accepted name (`qwen3_coder` is vLLM's other name of `qwen3_xml`).
    pub const NAMES: &'static [&'static str] =
        &["hermes", "qwen3_xml", "qwen3_coder", "glm45", "llama3_json", "gemma4"];

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "hermes" => ToolFormat::Hermes,
            "qwen3_xml" | "qwen3_coder" => ToolFormat::Qwen3Xml,
            "glm45" | "glm4_moe" => ToolFormat::Glm45,
            "llama3_json" => ToolFormat::Llama3Json,
            "gemma4" => ToolFormat::Gemma4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Qwen3Xml => "qwen3_xml",
            ToolFormat::Glm45 => "glm45",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Gemma4 => "gemma4",
        }
    }

    /// The format a chat template teaches its model, read from the instructions and the way
    /// it writes earlier calls; `None` when it shows none iris knows.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<|tool_call>call:") {
            Some(ToolFormat::Gemma4)
        } else if template.contains("<arg_key>") && template.contains("<tool_call>") {
            Some(ToolFormat::Glm45)
        } else if template.contains("<function=") && template.contains("<parameter=") {
            Some(ToolFormat::Qwen3Xml)
        } else if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("\"parameters\": ") && template.contains("<|start_header_id|>") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// Where the model's turn ends after its calls, when that is a token of its own the
    /// model's EOS ids may not list: Gemma 4's template writes `<|tool_response>` right after
    /// the calls (the results follow in the same turn), so a reply stops there, as
    /// transformers' response template for `gemma4` closes the content there.
    pub fn stop_markers(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Gemma4 => &["<|tool_response>"],
            _ => &[],
        }
    }

    /// A parser for one reply.
    pub fn parser(self, tools: Tools) -> Box<dyn ToolParser> {
        match self {
            ToolFormat::Hermes => Box::new(tagged::Tagged::<hermes::Hermes>::new(tools)),
            ToolFormat::Qwen3Xml => Box::new(tagged::Tagged::<qwen3_xml::Qwen3Xml>::new(tools)),
            ToolFormat::Glm45 => Box::new(tagged::Tagged::<glm45::Glm45>::new(tools)),
            ToolFormat::Llama3Json => Box::new(llama3_json::Llama3Json::new()),
            ToolFormat::Gemma4 => Box::new(tagged::Tagged::<gemma4::Gemma4>::new(tools)),
        }
    }
}

#[cfg(test)]
mod tests;
