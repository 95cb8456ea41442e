//! Structured outputs in requests: OpenAI's `response_format` (chat, completions), the
//! Responses API's `text.format`, and vLLM's `structured_outputs` / `guided_json` /
//! `guided_regex` / `guided_choice` / `guided_grammar` extras, read into one `GrammarSpec` and
//! compiled for the model. A request may ask for one grammar; a malformed or unsatisfiable
//! one is a 400 naming the field and the problem.

use serde_json::Value;

use super::engine_loop::EngineHandle;
use super::errors::ApiError;
use crate::engine::{Grammar, GrammarSpec};

/// vLLM's top-level guided fields and the grammar each one is.
pub const GUIDED_FIELDS: &[&str] =
    &["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"];

/// A grammar and the request field it came from (for messages).
#[derive(Debug, Clone, PartialEq)]
pub struct Asked {
    pub spec: GrammarSpec,
    pub field: String,
}

fn bad(field: impl Into<String>, msg: impl Into<String>) -> ApiError {
    ApiError::invalid_param(field, msg).code("invalid_structured_output")
}

/// A JSON schema given as an object, or as a string holding one (vLLM takes both).
fn schema_value(v: &Value, field: &str) -> Result<Value, ApiError> {
    match v {
        Value::String(s) => {
            serde_json::from_str(s).map_err(|e| bad(field, format!("`{field}` is not valid JSON: {e}")))
        }
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(bad(field, format!("`{field}` must be a JSON schema (an object)"))),
    }
}

fn string(v: &Value, field: &str) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| bad(field, format!("`{field}` must be a string")))
}

fn choices(v: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    let list = v.as_array().ok_or_else(|| bad(field, format!("`{field}` must be a list of strings")))?;
    let out: Option<Vec<String>> = list.iter().map(|c| c.as_str().map(str::to_string)).collect();
    let out = out.ok_or_else(|| bad(field, format!("`{field}` must be a list of strings")))?;
    if out.is_empty() {
        return Err(bad(field, format!("`{field}` must list at least one choice")));
    }
    Ok(out)
}

/// OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `json_schema.schema`).
fn response_format(v: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let ty = v.get("type").and_then(Value::as_str);
    match ty {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let js = v.get("json_schema").filter(|j| j.is_object()).ok_or_else(|| {
                bad("response_format.json_schema", "`response_format.json_schema` must be an object with a `schema`")
            })?;
            let schema = js.get("schema").ok_or_else(|| {
                bad("response_format.json_schema.schema", "`response_format.json_schema.schema` is required")
            })?;
            Ok(Some(GrammarSpec::JsonSchema(schema_value(schema, "response_format.json_schema.schema")?)))
        }
        _ => Err(bad(
            "response_format.type",
            format!(
                "`response_format.type` must be `text`, `json_object` or `json_schema`, got {}",
                v.get("type").map_or("nothing".to_string(), Value::to_string)
            ),
        )),
    }
}

/// vLLM's `structured_outputs` object: one of `json`, `regex`, `choice`, `grammar`,
/// `json_object: true`.
fn structured_outputs(v: &Value) -> Result<Option<Asked>, ApiError> {
    let obj = v.as_object().ok_or_else(|| bad("structured_outputs", "`structured_outputs` must be an object"))?;
    let mut found = Vec::new();
    for (k, x) in obj {
        if x.is_null() {
            continue;
        }
        let field = format!("structured_outputs.{k}");
        let spec = match k.as_str() {
            "json" => GrammarSpec::JsonSchema(schema_value(x, &field)?),
            "regex" => GrammarSpec::Regex(string(x, &field)?),
            "choice" => GrammarSpec::Choice(choices(x, &field)?),
            "grammar" => GrammarSpec::Lark(string(x, &field)?),
            "json_object" if x == &Value::Bool(true) => GrammarSpec::JsonObject,
            "json_object" if x == &Value::Bool(false) => continue,
            _ => {
                return Err(bad(
                    &field,
                    format!("unsupported field `{field}` (iris reads json, regex, choice, grammar, json_object)"),
                )
                .code("unsupported_field"))
            }
        };
        found.push(Asked { spec, field });
    }
    one(found)
}

fn one(mut found: Vec<Asked>) -> Result<Option<Asked>, ApiError> {
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|a| a.field.as_str()).collect();
        return Err(bad(
            &found[1].field,
            format!("ask for one structured output at a time, not {}", names.join(" and ")),
        ));
    }
    Ok(found.pop())
}

/// The grammar a chat or completions request asks for, if any.
pub fn from_body(body: &Value) -> Result<Option<Asked>, ApiError> {
    let field = |name: &str| body.get(name).filter(|v| !v.is_null());
    let mut found = Vec::new();
    if let Some(f) = field("response_format") {
        if let Some(spec) = response_format(f)? {
            found.push(Asked { spec, field: "response_format".into() });
        }
    }
    if let Some(v) = field("guided_json") {
        found.push(Asked {
            spec: GrammarSpec::JsonSchema(schema_value(v, "guided_json")?),
            field: "guided_json".into(),
        });
    }
    if let Some(v) = field("guided_regex") {
        found.push(Asked { spec: GrammarSpec::Regex(string(v, "guided_regex")?), field: "guided_regex".into() });
    }
    if let Some(v) = field("guided_choice") {
        found.push(Asked { spec: GrammarSpec::Choice(choices(v, "guided_choice")?), field: "guided_choice".into() });
    }
    if let Some(v) = field("guided_grammar") {
        found.push(Asked { spec: GrammarSpec::Lark(string(v, "guided_grammar")?), field: "guided_grammar".into() });
    }
    if let Some(v) = field("structured_outputs") {
        found.extend(structured_outputs(v)?);
    }
    one(found)
}

/// The Responses API's `text.format`: `text`, `json_object`, or `json_schema` with the
/// schema at `schema` (flat, unlike chat's `response_format`).
pub fn from_text_format(format: Option<&Value>) -> Result<Option<Asked>, ApiError> {
    let Some(f) = format.filter(|f| !f.is_null()) else { return Ok(None) };
    let spec = match f.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => GrammarSpec::JsonObject,
        Some("json_schema") => {
            let schema =
                f.get("schema").ok_or_else(|| bad("text.format.schema", "`text.format.schema` is required"))?;
            GrammarSpec::JsonSchema(schema_value(schema, "text.format.schema")?)
        }
        _ => return Err(bad("text.format.type", "`text.format.type` must be `text`, `json_object` or `json_schema`")),
    };
    Ok(Some(Asked { spec, field: "text.format".into() }))
}

/// Compiles what was asked on a blocking thread: a schema can take milliseconds to compile
/// (the first one also builds the vocabulary trie), which would hold up the other requests
/// of the async thread it ran on.
pub async fn compile_off_thread(engine: &EngineHandle, asked: Option<&Asked>) -> Result<Option<Grammar>, ApiError> {
    let Some(asked) = asked.cloned() else { return Ok(None) };
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || compile(&engine, &asked))
        .await
        .map_err(|e| ApiError::internal(format!("grammar compilation failed: {e}")))?
        .map(Some)
}

/// Compiles what was asked for this model; a bad grammar is a 400 on its field.
fn compile(engine: &EngineHandle, asked: &Asked) -> Result<Grammar, ApiError> {
    let compiler = engine.grammar_compiler().map_err(|e| {
        ApiError::bad_request(e.to_string()).param(asked.field.clone()).code("invalid_structured_output")
    })?;
    compiler.compile(&asked.spec).map_err(|e| bad(asked.field.clone(), format!("`{}`: {e}", asked.field)))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn each_field_reads_its_grammar_and_two_are_refused() {
        let spec = |b: Value| from_body(&b).expect("valid").map(|a| (a.spec, a.field));
        assert_eq!(spec(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            spec(json!({"response_format": {"type": "json_object"}})),
            Some((GrammarSpec::JsonObject, "response_format".into()))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            spec(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}})
            ),
            Some((GrammarSpec::JsonSchema(schema.clone()), "response_format".into()))
        );
        assert_eq!(
            spec(json!({"guided_json": schema.to_string()})),
            Some((GrammarSpec::JsonSchema(schema.clone()), "guided_json".into()))
        );
        assert_eq!(
            spec(json!({"guided_choice": ["yes", "no"]})),
            Some((GrammarSpec::Choice(vec!["yes".into(), "no".into()]), "guided_choice".into()))
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"regex": "[0-9]+"}})),
            Some((GrammarSpec::Regex("[0-9]+".into()), "structured_outputs.regex".into()))
        );
        let two = from_body(&json!({"guided_regex": "a", "response_format": {"type": "json_object"}}));
        assert!(two.expect_err("two grammars").to_string().contains("one structured output"));
        for b in [
            json!({"response_format": {"type": "json_schema"}}),
            json!({"response_format": {"type": "yaml"}}),
            json!({"guided_choice": []}),
            json!({"guided_json": "{not json"}),
            json!({"structured_outputs": {"xml": "a"}}),
        ] {
            assert!(from_body(&b).is_err(), "{b}");
        }
        let f = json!({"type": "json_schema", "name": "x", "schema": schema, "strict": true});
        assert_eq!(from_text_format(Some(&f)).expect("valid").map(|a| a.spec), Some(GrammarSpec::JsonSchema(schema)));
        assert!(from_text_format(Some(&json!({"type": "json_schema"}))).is_err());
    }
}
