//! The grammar that holds a forced tool call (`tool_choice: "required"` or a named function)
//! to the tools' schemas: the continuation of the call's opening that iris writes after the
//! prompt (`tool_request::forced_opening`), in the model's own format, so that what the model
//! writes is a call its parser reads and whose arguments validate against the tool's schema.
//!
//! The JSON formats (`hermes`, `llama3_json`) hold the arguments to the schema as one JSON
//! object (of the listed properties only, unless the schema sets `additionalProperties`). The XML formats (`qwen3_xml`, `glm45`) write one tag per parameter: the schema's
//! properties in order (the required ones always, the others optionally), each value bare
//! when the schema says it is a string (enums and patterns kept) and JSON otherwise, as the
//! parsers read them back. A required call may be followed by more calls when the request
//! allows parallel calls; then the reply ends (the grammar is complete).
//!
//! The grammar is llguidance's lark dialect, in which `%json {schema}` is a rule matching
//! that schema's JSON.

use serde_json::{json, Value};

use super::tools::{ToolFormat, ToolSpec};
use crate::engine::grammar::compact;
use crate::engine::GrammarSpec;

/// The lark grammar of what follows the forced opening: a call to `name` (a named
/// `tool_choice`) or to any of `tools` (`required`; several in a row if `parallel`).
pub fn forced_call(format: ToolFormat, tools: &[ToolSpec], name: Option<&str>, parallel: bool) -> GrammarSpec {
    let mut g = Grammar::default();
    let start = match name {
        // The opening already named the function: its arguments and the call's end.
        Some(n) => {
            let tool = tools.iter().find(|t| t.name == n);
            let rule = g.named_body(format, tool);
            g.rules.push(format!("start: {rule}"));
            return GrammarSpec::Lark(g.text());
        }
        None => {
            let alternatives: Vec<String> = tools.iter().map(|t| g.call_after_name(format, t)).collect();
            g.rules.push(format!("call: {}", alternatives.join(" | ")));
            if parallel {
                format!("call ({} call)*", lit(&format!("{}{}", separator(format), any_opening(format))))
            } else {
                "call".to_string()
            }
        }
    };
    g.rules.push(format!("start: {start}"));
    GrammarSpec::Lark(g.text())
}

/// What comes between two calls.
fn separator(format: ToolFormat) -> &'static str {
    match format {
        ToolFormat::Llama3Json => "; ",
        _ => "\n",
    }
}

/// The opening of a call to any function (what `forced_opening` writes for `required`).
fn any_opening(format: ToolFormat) -> &'static str {
    match format {
        ToolFormat::Hermes => "<tool_call>\n{\"name\": \"",
        ToolFormat::Qwen3Xml => "<tool_call>\n<function=",
        ToolFormat::Glm45 => "<tool_call>",
        ToolFormat::Llama3Json => "{\"name\": \"",
    }
}

/// A lark string literal of `s`.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// `schema` as JSON without free whitespace (as `GrammarCompiler` matches schemas).
fn json_rule(schema: &Value) -> String {
    let s = if schema.is_object() { schema.clone() } else { json!({}) };
    format!("%json {}", compact(s))
}

#[derive(Default)]
struct Grammar {
    rules: Vec<String>,
}

impl Grammar {
    fn text(&self) -> String {
        self.rules.join("\n")
    }

    /// A new rule `body`, by its name.
    fn rule(&mut self, body: String) -> String {
        let name = format!("r{}", self.rules.len());
        self.rules.push(format!("{name}: {body}"));
        name
    }

    /// A call to `tool` after its opening's `{"name": "` / `<function=` / `<tool_call>`.
    fn call_after_name(&mut self, format: ToolFormat, tool: &ToolSpec) -> String {
        let head = match format {
            ToolFormat::Hermes => format!("{}\", \"arguments\": ", tool.name),
            ToolFormat::Llama3Json => format!("{}\", \"parameters\": ", tool.name),
            ToolFormat::Qwen3Xml => format!("{}>\n", tool.name),
            ToolFormat::Glm45 => format!("{}\n", tool.name),
        };
        let body = self.named_body(format, Some(tool));
        self.rule(format!("{} {body}", lit(&head)))
    }

    /// A call's arguments and end, after the opening that named the function (`tool`; None:
    /// a function the request does not define, whose arguments are any JSON object).
    fn named_body(&mut self, format: ToolFormat, tool: Option<&ToolSpec>) -> String {
        let schema = tool.map(|t| t.parameters.clone()).unwrap_or_else(|| json!({"type": "object"}));
        let body = match format {
            ToolFormat::Hermes => format!("{} {}", json_rule(&object(schema)), lit("}\n</tool_call>")),
            ToolFormat::Llama3Json => format!("{} {}", json_rule(&object(schema)), lit("}")),
            ToolFormat::Qwen3Xml => {
                let params = self.xml_params(&schema, "<parameter=", ">\n", "\n</parameter>\n");
                format!("{params} {}", lit("</function>\n</tool_call>"))
            }
            ToolFormat::Glm45 => {
                let params = self.xml_params(&schema, "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n");
                format!("{params} {}", lit("</tool_call>"))
            }
        };
        self.rule(body)
    }

    /// The parameters of an XML call: each property as `open key mid value close`, in the
    /// schema's order, optional unless required.
    fn xml_params(&mut self, schema: &Value, open: &str, mid: &str, close: &str) -> String {
        let required: Vec<&str> =
            schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let Some(props) = schema.get("properties").and_then(Value::as_object) else { return "\"\"".into() };
        let mut parts = Vec::new();
        for (key, prop) in props {
            let value = self.xml_value(prop, close);
            let param = format!("{} {value}", lit(&format!("{open}{key}{mid}")));
            parts.push(if required.contains(&key.as_str()) { param } else { format!("({param})?") });
        }
        if parts.is_empty() {
            "\"\"".into()
        } else {
            parts.join(" ")
        }
    }

    /// One XML parameter's value and its closing tag: a string bare (one of its enum, or
    /// matching its pattern, else any text up to the first closing tag), anything else JSON.
    fn xml_value(&mut self, prop: &Value, close: &str) -> String {
        // An enum of strings only (None when any value is not a string).
        let strings: Option<Vec<&str>> =
            prop.get("enum").and_then(Value::as_array).and_then(|e| e.iter().map(Value::as_str).collect());
        let is_string = super::tools::parser::schema_type(prop).as_deref() == Some("string");
        match (is_string, strings) {
            (_, Some(e)) if !e.is_empty() => {
                let alts: Vec<String> = e.iter().map(|s| lit(s)).collect();
                format!("({}) {}", alts.join(" | "), lit(close))
            }
            (true, _) => match prop.get("pattern").and_then(Value::as_str) {
                Some(p) => {
                    let p = p.strip_prefix('^').unwrap_or(p);
                    let p = p.strip_suffix('$').unwrap_or(p);
                    let t = self.rule(format!("/{}/", p.replace('/', "\\/")));
                    format!("{t} {}", lit(close))
                }
                // The text runs to the first closing tag (a lazy lexeme ends at its first match).
                None => {
                    let name = format!("r{}", self.rules.len());
                    let close = regex_literal(close);
                    self.rules.push(format!("{name}[lazy]: /(.|\\n)*{close}/"));
                    name
                }
            },
            (false, _) => format!("{} {}", json_rule(prop), lit(close)),
        }
    }
}

/// A tool's parameters schema as an object schema (`{}`: any object) of the properties it
/// lists, unless it allows others itself: a call carries the tool's parameters (the XML
/// formats cannot write others), not names a model makes up.
fn object(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("type").or_insert_with(|| json!("object"));
        if o.contains_key("properties") {
            o.entry("additionalProperties").or_insert(json!(false));
        }
    }
    schema
}

/// `s` as a lark regex that matches exactly it.
fn regex_literal(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '/' => out.push_str("\\/"),
            c if "\\.+*?()|[]{}^$".contains(c) => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests;
