//! What every tool-call parser shares: the [`ToolParser`] trait, the events it emits, and the
//! tools of the request (their parameter schemas turn the XML formats' text values into JSON).

use serde_json::Value;

/// One piece of a reply as a tool-call parser sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    /// Text outside any call (or a malformed call, given back as the text it was).
    Text(String),
    /// A call begins: its function's name.
    Start { name: String },
    /// A piece of the current call's arguments (a JSON object's text, in order).
    Args(String),
    /// The current call is complete.
    End,
}

/// An incremental parser of one tool-call format. Fed the reply's text in pieces of any
/// size, it emits the same events (joined) as when fed the whole text at once: every
/// decision waits until the text that decides it is complete, and text that could still
/// turn out to open a call is held back.
pub trait ToolParser: Send {
    /// Takes the next piece of text.
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>);
    /// The reply ended: releases what is held back (an unterminated call that parses is a
    /// call; one that does not is text).
    fn finish(&mut self, out: &mut Vec<ToolEvent>);
}

/// A tool of the request: its name and its parameters' JSON schema.
#[derive(Debug, Clone, Default)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

/// The tools of a request, for the parsers that need the parameter types.
#[derive(Debug, Clone, Default)]
pub struct Tools(pub Vec<ToolSpec>);

impl Tools {
    /// The JSON schema type of parameter `param` of function `function` (the first
    /// non-null one when the schema lists several), if the schema says.
    pub fn param_type(&self, function: &str, param: &str) -> Option<String> {
        let tool = self.0.iter().find(|t| t.name == function)?;
        let schema = tool.parameters.get("properties")?.get(param)?;
        schema_type(schema)
    }
}

/// A schema's type (the first non-null one of a list or of `anyOf` / `oneOf`), if it says.
pub fn schema_type(schema: &Value) -> Option<String> {
    match schema.get("type") {
        Some(Value::String(t)) => Some(t.clone()),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).find(|t| *t != "null").map(str::to_string),
        _ => {
            // An enum or const without a type: the type its values share.
            let values = match (schema.get("enum"), schema.get("const")) {
                (Some(Value::Array(e)), _) => Some(e.as_slice()),
                (_, Some(c)) => Some(std::slice::from_ref(c)),
                _ => None,
            };
            if let Some(values) = values {
                return shared_type(values);
            }
            // `anyOf: [{type: ...}, {type: "null"}]`, the shape pydantic writes for Optional.
            let alts = schema.get("anyOf").or_else(|| schema.get("oneOf"))?.as_array()?;
            alts.iter().filter_map(schema_type).find(|t| t != "null")
        }
    }
}

/// The JSON type all of `values` have (integers are numbers too), if they share one.
fn shared_type(values: &[Value]) -> Option<String> {
    let ty = |v: &Value| match v {
        Value::String(_) => "string",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::Null => "null",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let first = ty(values.first()?);
    let all = |t: &str| values.iter().all(|v| ty(v) == t || (t == "number" && ty(v) == "integer"));
    if all(first) {
        Some(first.to_string())
    } else if all("number") {
        Some("number".to_string())
    } else {
        None
    }
}

/// What a parameter value written as plain text becomes, by its schema type (the XML
/// formats write strings bare and other values as JSON). `untyped` is what to do when the
/// schema does not say: keep the text, or read it as JSON where it is JSON.
pub fn typed_value(text: &str, ty: Option<&str>, untyped_as_json: bool) -> Value {
    let json = || serde_json::from_str::<Value>(text.trim()).ok();
    let v = match ty {
        Some("string") => None,
        Some("integer") => {
            text.trim().parse::<i64>().ok().map(Value::from).or_else(|| json().filter(|v| v.is_number()))
        }
        Some("number") => json().filter(|v| v.is_number()),
        Some("boolean") => match text.trim().to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        Some("null") => (text.trim() == "null").then_some(Value::Null),
        Some("object") => json().filter(Value::is_object),
        Some("array") => json().filter(Value::is_array),
        Some(_) => json(),
        None if untyped_as_json => json(),
        None => None,
    };
    v.unwrap_or_else(|| Value::String(text.to_string()))
}

/// The events of one complete call.
pub fn call_events(name: String, arguments: String, out: &mut Vec<ToolEvent>) {
    out.push(ToolEvent::Start { name });
    out.push(ToolEvent::Args(arguments));
    out.push(ToolEvent::End);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_follow_the_schema_type() {
        assert_eq!(typed_value("42", Some("integer"), false), json!(42));
        assert_eq!(typed_value(" 2.5\n", Some("number"), false), json!(2.5));
        assert_eq!(typed_value("True", Some("boolean"), false), json!(true));
        assert_eq!(typed_value("[1, 2]", Some("array"), false), json!([1, 2]));
        assert_eq!(typed_value("{\"a\": 1}", Some("object"), false), json!({"a": 1}));
        // A value that does not fit its type stays the text it was.
        assert_eq!(typed_value("many", Some("integer"), false), json!("many"));
        assert_eq!(typed_value("42", Some("string"), false), json!("42"));
        assert_eq!(typed_value("42", None, false), json!("42"));
        assert_eq!(typed_value("42", None, true), json!(42));
    }

    #[test]
    fn param_types_come_from_the_schema() {
        let tools = Tools(vec![ToolSpec {
            name: "f".into(),
            parameters: json!({"type": "object", "properties": {
                "a": {"type": "integer"},
                "b": {"type": ["null", "boolean"]},
                "c": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                "d": {"description": "no type"},
                "e": {"enum": [1, 2.5]},
                "f": {"const": "x"},
                "g": {"enum": [1, "x"]},
            }}),
        }]);
        assert_eq!(tools.param_type("f", "a").as_deref(), Some("integer"));
        assert_eq!(tools.param_type("f", "b").as_deref(), Some("boolean"));
        assert_eq!(tools.param_type("f", "c").as_deref(), Some("number"));
        assert_eq!(tools.param_type("f", "d"), None);
        assert_eq!(tools.param_type("f", "e").as_deref(), Some("number"));
        assert_eq!(tools.param_type("f", "f").as_deref(), Some("string"));
        assert_eq!(tools.param_type("f", "g"), None);
        assert_eq!(tools.param_type("g", "a"), None);
    }
}
