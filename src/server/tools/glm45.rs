//! `glm45`: GLM-4.5 / 4.6 (and 4.5V / 4.6V) write each call as
//! `<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>` (GLM-4.6.jinja:
//! string values bare, others as JSON). A value whose schema type is not `string` is read as
//! JSON where it is JSON; without a schema, JSON-looking values are read as JSON too (the
//! template wrote them with `tojson`).

use serde_json::Map;

use super::parser::{arguments_text, typed_value, Tools};
use super::tagged::BlockFormat;

pub struct Glm45;

impl BlockFormat for Glm45 {
    const OPEN: &'static str = "<tool_call>";
    const CLOSE: &'static str = "</tool_call>";

    fn parse(body: &str, tools: &Tools) -> Option<Vec<(String, String)>> {
        let body = body.trim();
        let name_end = body.find("<arg_key>").unwrap_or(body.len());
        let name = body[..name_end].trim().to_string();
        if name.is_empty() || name.contains(char::is_whitespace) || name.contains('<') {
            return None;
        }
        let mut args = Map::new();
        let mut rest = &body[name_end..];
        loop {
            rest = rest.trim_start();
            if rest.is_empty() {
                break;
            }
            let after = rest.strip_prefix("<arg_key>")?;
            let end = after.find("</arg_key>")?;
            let key = after[..end].trim().to_string();
            let after = after[end + "</arg_key>".len()..].trim_start().strip_prefix("<arg_value>")?;
            let (value, next) = match after.find("</arg_value>") {
                Some(end) => (&after[..end], &after[end + "</arg_value>".len()..]),
                None => (after, ""),
            };
            let ty = tools.param_type(&name, &key);
            args.insert(key, typed_value(value, ty.as_deref(), true));
            rest = next;
        }
        Some(vec![(name, arguments_text(&args))])
    }
}
