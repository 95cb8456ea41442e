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
//! `gemma4` writes its arguments in Gemma's own value syntax (`tools/gemma4.rs`): the grammar
//! holds them to the schema as that syntax writes them: bare keys (the properties in sorted
//! order, as the template writes them; the required ones always), strings between `<|"|>`
//! quotes (one of an enum, or matching a pattern, else any text without a quote), numbers,
//! booleans and nulls as JSON (bounds kept), lists and mappings written the same way. Gemma's
//! markup strings are its special tokens: the grammar asks for those tokens ([`Markup`]).
//!
//! The grammar is llguidance's lark dialect, in which `%json {schema}` is a rule matching
//! that schema's JSON and `<[id]>` is the token `id`.

use serde_json::{json, Value};

use super::tools::gemma4::QUOTE;
use super::tools::{ToolFormat, ToolSpec};
use crate::engine::grammar::compact;
use crate::engine::GrammarSpec;

/// A format's markup strings that are single tokens of the model's vocabulary (Gemma 4's
/// call, quote tokens): the grammar asks for the token, which a text rule never produces.
#[derive(Debug, Clone, Default)]
pub struct Markup {
    tokens: Vec<(&'static str, u32)>,
}

/// Gemma 4's markup strings.
const GEMMA_MARKUP: [&str; 3] = [QUOTE, GEMMA_OPEN, GEMMA_CLOSE];
const GEMMA_OPEN: &str = "<|tool_call>";
const GEMMA_CLOSE: &str = "<tool_call|>";

impl Markup {
    /// The markup tokens `token_to_id` knows (it gives a string's id in the vocabulary).
    pub fn new(token_to_id: impl Fn(&str) -> Option<u32>) -> Self {
        Markup { tokens: GEMMA_MARKUP.iter().filter_map(|m| token_to_id(m).map(|id| (*m, id))).collect() }
    }

    /// `s` in a lark rule: its token, or its text.
    fn lit(&self, s: &str) -> String {
        match self.tokens.iter().find(|(m, _)| *m == s) {
            Some((_, id)) => format!("<[{id}]>"),
            None => lit(s),
        }
    }

    fn is_token(&self, s: &str) -> bool {
        self.tokens.iter().any(|(m, _)| *m == s)
    }
}

/// The lark grammar of what follows the forced opening: a call to `name` (a named
/// `tool_choice`) or to any of `tools` (`required`; several in a row if `parallel`).
pub fn forced_call(
    format: ToolFormat,
    tools: &[ToolSpec],
    name: Option<&str>,
    parallel: bool,
    markup: &Markup,
) -> GrammarSpec {
    let mut g = Grammar { rules: Vec::new(), markup: markup.clone(), any: false };
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
                let next = match format {
                    // Gemma 4 writes its calls back to back.
                    ToolFormat::Gemma4 => format!("{} {}", markup.lit(GEMMA_OPEN), lit("call:")),
                    _ => lit(&format!("{}{}", separator(format), any_opening(format))),
                };
                format!("call ({next} call)*")
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
        ToolFormat::Gemma4 => "<|tool_call>call:",
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

struct Grammar {
    rules: Vec<String>,
    markup: Markup,
    /// The rules of any Gemma value are written.
    any: bool,
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
            ToolFormat::Gemma4 => format!("{}{{", tool.name),
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
            ToolFormat::Gemma4 => {
                let members = self.gemma_members(&schema);
                format!("{members} {} {}", lit("}"), self.markup.lit(GEMMA_CLOSE))
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

impl Grammar {
    /// A value of `schema` in Gemma's syntax.
    fn gemma_value(&mut self, schema: &Value) -> String {
        let Some(o) = schema.as_object().filter(|o| !o.is_empty()) else { return self.gemma_any() };
        if let Some(values) = o.get("enum").and_then(Value::as_array).filter(|e| !e.is_empty()) {
            let alts: Vec<String> = values.iter().map(|v| self.gemma_literal(v)).collect();
            return format!("({})", alts.join(" | "));
        }
        if let Some(c) = o.get("const") {
            return self.gemma_literal(c);
        }
        if let Some(alts) = o.get("anyOf").or_else(|| o.get("oneOf")).and_then(Value::as_array) {
            let alts: Vec<String> = alts.iter().map(|a| self.gemma_value(a)).collect();
            return format!("({})", alts.join(" | "));
        }
        let ty = match o.get("type") {
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(ts)) => {
                let alts: Vec<String> = ts
                    .iter()
                    .map(|t| {
                        let mut one = schema.clone();
                        one["type"] = t.clone();
                        self.gemma_value(&one)
                    })
                    .collect();
                return format!("({})", alts.join(" | "));
            }
            _ if o.contains_key("properties") => "object".into(),
            _ => return self.gemma_any(),
        };
        let q = self.markup.lit(QUOTE);
        match ty.as_str() {
            "string" => match o.get("pattern").and_then(Value::as_str) {
                Some(p) => {
                    let p = p.strip_prefix('^').unwrap_or(p);
                    let p = p.strip_suffix('$').unwrap_or(p);
                    let t = self.rule(format!("/{}/", p.replace('/', "\\/")));
                    format!("{q} {t} {q}")
                }
                None => self.gemma_string(),
            },
            "array" => {
                let item = match o.get("items") {
                    Some(items) => self.gemma_value(items),
                    None => self.gemma_any(),
                };
                let item = self.rule(item);
                let min = o.get("minItems").and_then(Value::as_u64).unwrap_or(0);
                let max = o.get("maxItems").and_then(Value::as_u64);
                let more = match (min.saturating_sub(1), max) {
                    (_, Some(0)) => return format!("{} {}", lit("["), lit("]")),
                    (lo, Some(hi)) => format!("{{{lo},{}}}", hi - 1),
                    (lo, None) => format!("{{{lo},}}"),
                };
                let items = format!("{item} ({} {item}){more}", lit(","));
                let items = if min == 0 { format!("({items})?") } else { items };
                format!("{} {items} {}", lit("["), lit("]"))
            }
            "object" => {
                let members = self.gemma_members(schema);
                format!("{} {members} {}", lit("{"), lit("}"))
            }
            // Numbers, booleans and null read as JSON.
            _ => json_rule(schema),
        }
    }

    /// The members of a mapping of `schema` (without its braces): the listed properties in
    /// sorted order, the required ones always, or any members when it lists none.
    fn gemma_members(&mut self, schema: &Value) -> String {
        let Some(props) = schema.get("properties").and_then(Value::as_object).filter(|p| !p.is_empty()) else {
            self.gemma_any();
            return "(gmember (\",\" gmember)*)?".into();
        };
        let required: Vec<&str> =
            schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let mut keys: Vec<&String> = props.keys().collect();
        keys.sort_by_key(|k| (k.to_lowercase(), k.to_string()));
        let members: Vec<(String, bool)> = keys
            .iter()
            .map(|k| {
                let value = self.gemma_value(&props[k.as_str()]);
                (self.rule(format!("{} {value}", lit(&format!("{k}:")))), required.contains(&k.as_str()))
            })
            .collect();
        // tails[i]: members i.. each after a comma.
        let mut tails = vec!["\"\"".to_string(); members.len() + 1];
        for i in (0..members.len()).rev() {
            let (m, req) = &members[i];
            let one = format!("{} {m}", lit(","));
            let body = if *req { format!("{one} {}", tails[i + 1]) } else { format!("({one})? {}", tails[i + 1]) };
            tails[i] = self.rule(body);
        }
        // The first member written is any one up to the first required one.
        let mut alts = Vec::new();
        for (i, (m, req)) in members.iter().enumerate() {
            alts.push(format!("{m} {}", tails[i + 1]));
            if *req {
                break;
            }
        }
        if members.iter().all(|(_, req)| !req) {
            alts.push("\"\"".into());
        }
        format!("({})", alts.join(" | "))
    }

    /// A string: quoted text without a quote in it (as the parser reads strings).
    fn gemma_string(&mut self) -> String {
        let q = self.markup.lit(QUOTE);
        if self.markup.is_token(QUOTE) {
            // The quote is a token no text rule makes: the text only must not spell it (nor
            // the call's end, where the parser would end the call).
            if !self.rules.iter().any(|r| r.starts_with("GTEXT:")) {
                let (q, end) = (regex_literal(QUOTE), regex_literal(GEMMA_CLOSE));
                self.rules.push(format!("GTEXT: /(?s:.+)/ & ~/(?s:.*)({q}|{end})(?s:.*)/"));
            }
            format!("{q} GTEXT? {q}")
        } else {
            // The text runs to the first quote (a lazy lexeme ends at its first match).
            let name = format!("r{}", self.rules.len());
            self.rules.push(format!("{name}[lazy]: /(?s:.*){}/", regex_literal(QUOTE)));
            format!("{q} {name}")
        }
    }

    /// `v` written in Gemma's syntax.
    fn gemma_literal(&mut self, v: &Value) -> String {
        match v {
            Value::String(s) => {
                let q = self.markup.lit(QUOTE);
                if s.is_empty() {
                    format!("{q} {q}")
                } else {
                    format!("{q} {} {q}", lit(s))
                }
            }
            Value::Array(items) => {
                let items: Vec<String> = items.iter().map(|i| self.gemma_literal(i)).collect();
                format!("{} {} {}", lit("["), items.join(&format!(" {} ", lit(","))), lit("]"))
            }
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort_by_key(|k| (k.to_lowercase(), k.to_string()));
                let members: Vec<String> = keys
                    .iter()
                    .map(|k| format!("{} {}", lit(&format!("{k}:")), self.gemma_literal(&map[k.as_str()])))
                    .collect();
                format!("{} {} {}", lit("{"), members.join(&format!(" {} ", lit(","))), lit("}"))
            }
            scalar => lit(&scalar.to_string()),
        }
    }

    /// Any value (`gany`), written once.
    fn gemma_any(&mut self) -> String {
        if !self.any {
            self.any = true;
            let s = self.gemma_string();
            let num = json_rule(&json!({"type": "number"}));
            let (open, close, comma) = (lit("["), lit("]"), lit(","));
            self.rules.push(format!(
                "gany: {s} | {num} | \"true\" | \"false\" | \"null\" | {open} (gany ({comma} gany)*)? {close} | {} (gmember ({comma} gmember)*)? {}",
                lit("{"),
                lit("}")
            ));
            self.rules.push("gmember: /[A-Za-z_][A-Za-z0-9_]*/ \":\" gany".into());
        }
        "gany".into()
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
