//! `qwen3_xml` / `qwen3_coder`: Qwen3-Coder and Qwen3.5 write each call as
//! `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`
//! (Qwen3-Coder.jinja, Qwen3.5-4B.jinja). Values are bare text; the tool's schema says what
//! each one is (strings stay text, numbers, booleans, objects and arrays are read as JSON;
//! a parameter the schema does not list stays text, as in vLLM). Calls stream: the call
//! begins at `<function=f>`, each parameter is a piece of its arguments at `</parameter>`.

use super::parser::{typed_value, Tools};
use super::tagged::{BlockFormat, Header, Item};

pub struct Qwen3Xml;

const FUNCTION: &str = "<function=";
const PARAMETER: &str = "<parameter=";
const END_PARAMETER: &str = "</parameter>";
const END_FUNCTION: &str = "</function>";

impl BlockFormat for Qwen3Xml {
    const OPEN: &'static str = "<tool_call>";
    const CLOSE: &'static str = "</tool_call>";
    const STREAMS: bool = true;

    fn header(rest: &str, complete: bool) -> Header {
        let t = rest.trim_start();
        let lead = rest.len() - t.len();
        let Some(after) = t.strip_prefix(FUNCTION) else {
            return if !complete && FUNCTION.starts_with(t) { Header::Pending } else { Header::Invalid };
        };
        match after.find('>') {
            Some(gt) => {
                let name = after[..gt].trim();
                if name.is_empty() || name.contains(char::is_whitespace) || name.contains('<') {
                    Header::Invalid
                } else {
                    Header::Name(name.to_string(), lead + FUNCTION.len() + gt + 1)
                }
            }
            None if complete => Header::Invalid,
            None => Header::Pending,
        }
    }

    fn item(rest: &str, name: &str, tools: &Tools, complete: bool) -> Item {
        let t = rest.trim_start();
        let lead = rest.len() - t.len();
        if t.starts_with(END_FUNCTION) {
            return Item::EndFunction(lead + END_FUNCTION.len());
        }
        let Some(after) = t.strip_prefix(PARAMETER) else {
            let maybe = PARAMETER.starts_with(t) || END_FUNCTION.starts_with(t);
            return if !complete && maybe { Item::Pending } else { Item::End };
        };
        let Some(gt) = after.find('>') else { return if complete { Item::End } else { Item::Pending } };
        let key = after[..gt].trim().to_string();
        let value_and_rest = &after[gt + 1..];
        // The value runs to its closing tag; one cut short at the end of the reply runs to
        // the end.
        let (value, used) = match value_and_rest.find(END_PARAMETER) {
            Some(end) => (&value_and_rest[..end], end + END_PARAMETER.len()),
            None if complete => (value_and_rest, value_and_rest.len()),
            None => return Item::Pending,
        };
        // The template writes one newline on each side of a value.
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let ty = tools.param_type(name, &key);
        let v = typed_value(value, ty.as_deref(), false);
        Item::Param(key, v, lead + PARAMETER.len() + gt + 1 + used)
    }
}
