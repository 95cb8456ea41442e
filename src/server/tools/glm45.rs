//! `glm45`: GLM-4.5 / 4.6 (and 4.5V / 4.6V) write each call as
//! `<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>` (GLM-4.6.jinja:
//! string values bare, others as JSON). A value whose schema type is not `string` is read as
//! JSON where it is JSON; without a schema, JSON-looking values are read as JSON too (the
//! template wrote them with `tojson`). Calls stream: the call begins once its name is
//! complete, each argument is a piece of its arguments at `</arg_value>`.

use super::parser::{typed_value, Tools};
use super::tagged::{BlockFormat, Header, Item};

pub struct Glm45;

const KEY: &str = "<arg_key>";
const END_KEY: &str = "</arg_key>";
const VALUE: &str = "<arg_value>";
const END_VALUE: &str = "</arg_value>";

impl BlockFormat for Glm45 {
    const OPEN: &'static str = "<tool_call>";
    const CLOSE: &'static str = "</tool_call>";
    const STREAMS: bool = true;

    fn header(rest: &str, complete: bool) -> Header {
        let t = rest.trim_start();
        let lead = rest.len() - t.len();
        // The name ends at the line's end or at the first argument.
        let end = [t.find('\n'), t.find(KEY)].into_iter().flatten().min();
        let (name, used) = match end {
            Some(e) => (t[..e].trim(), lead + e),
            None if complete => (t.trim(), rest.len()),
            None => return Header::Pending,
        };
        if name.is_empty() || name.contains(char::is_whitespace) || name.contains('<') {
            Header::Invalid
        } else {
            Header::Name(name.to_string(), used)
        }
    }

    fn item(rest: &str, name: &str, tools: &Tools, complete: bool) -> Item {
        let t = rest.trim_start();
        let lead = rest.len() - t.len();
        let pending = if complete { Item::End } else { Item::Pending };
        let Some(after_key) = t.strip_prefix(KEY) else {
            return if !complete && KEY.starts_with(t) { Item::Pending } else { Item::End };
        };
        let Some(end_key) = after_key.find(END_KEY) else { return pending };
        let key = after_key[..end_key].trim().to_string();
        let after = &after_key[end_key + END_KEY.len()..];
        let v = after.trim_start();
        let Some(value_and_rest) = v.strip_prefix(VALUE) else {
            return if !complete && VALUE.starts_with(v) { Item::Pending } else { Item::End };
        };
        let (value, used) = match value_and_rest.find(END_VALUE) {
            Some(end) => (&value_and_rest[..end], end + END_VALUE.len()),
            None if complete => (value_and_rest, value_and_rest.len()),
            None => return Item::Pending,
        };
        let ty = tools.param_type(name, &key);
        let consumed = lead + KEY.len() + end_key + END_KEY.len() + (after.len() - v.len()) + VALUE.len() + used;
        Item::Param(key, typed_value(value, ty.as_deref(), true), consumed)
    }
}
