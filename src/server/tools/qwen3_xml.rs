//! `qwen3_xml` / `qwen3_coder`: Qwen3-Coder and Qwen3.5 write each call as
//! `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`
//! (Qwen3-Coder.jinja, Qwen3.5-4B.jinja). Values are bare text; the tool's schema says what
//! each one is (strings stay text, numbers, booleans, objects and arrays are read as JSON;
//! a parameter the schema does not list stays text, as in vLLM).

use serde_json::Map;

use super::parser::{arguments_text, typed_value, Tools};
use super::tagged::BlockFormat;

pub struct Qwen3Xml;

impl BlockFormat for Qwen3Xml {
    const OPEN: &'static str = "<tool_call>";
    const CLOSE: &'static str = "</tool_call>";

    fn parse(body: &str, tools: &Tools) -> Option<Vec<(String, String)>> {
        let mut calls = Vec::new();
        let mut rest = body.trim();
        while !rest.is_empty() {
            let after = rest.strip_prefix("<function=")?;
            let gt = after.find('>')?;
            let name = after[..gt].trim().to_string();
            if name.is_empty() {
                return None;
            }
            let inner_and_rest = &after[gt + 1..];
            // A call cut short (no `</function>`) keeps what it has, when it ends cleanly.
            let (inner, next) = match inner_and_rest.find("</function>") {
                Some(end) => (&inner_and_rest[..end], &inner_and_rest[end + "</function>".len()..]),
                None => (inner_and_rest, ""),
            };
            let args = parameters(inner, &name, tools)?;
            calls.push((name, arguments_text(&args)));
            rest = next.trim();
        }
        (!calls.is_empty()).then_some(calls)
    }
}

fn parameters(mut inner: &str, function: &str, tools: &Tools) -> Option<Map<String, serde_json::Value>> {
    let mut args = Map::new();
    loop {
        inner = inner.trim_start();
        if inner.is_empty() {
            return Some(args);
        }
        let after = inner.strip_prefix("<parameter=")?;
        let gt = after.find('>')?;
        let key = after[..gt].trim().to_string();
        let value_and_rest = &after[gt + 1..];
        // The value runs to its closing tag; a value cut short at the end runs to the end.
        let (value, next) = match value_and_rest.find("</parameter>") {
            Some(end) => (&value_and_rest[..end], &value_and_rest[end + "</parameter>".len()..]),
            None => (value_and_rest, ""),
        };
        // The template writes one newline on each side of a value.
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let ty = tools.param_type(function, &key);
        args.insert(key, typed_value(value, ty.as_deref(), false));
        inner = next;
    }
}
