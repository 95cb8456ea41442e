//! `gemma4`: Gemma 4 writes each call as `<|tool_call>call:f{key:value,...}<tool_call|>`
//! (google-gemma-4-31B-it.jinja, its `format_argument` macro): keys bare, strings between
//! `<|"|>` quotes with nothing escaped, numbers and `true` / `false` bare, lists `[a,b]`,
//! mappings `{k:v}` with bare keys in sorted order, several calls one block after another.
//! Values are read into JSON as the model writes them; a bare value that is no number, boolean
//! or null is a string, and one whose parameter the schema types `string` stays the text it
//! was. Calls stream: the call begins once `call:f{` is complete, each argument is a piece of
//! its arguments once its value is complete (a bare scalar at the `,` or `}` after it).

use serde_json::{Map, Value};

use super::parser::Tools;
use super::tagged::{BlockFormat, Header, Item};

pub struct Gemma4;

/// Gemma 4's string quote (one special token).
pub const QUOTE: &str = "<|\"|>";
const CALL: &str = "call:";

/// A value (or key) read at the start of some text.
#[derive(Debug, PartialEq)]
enum Read<T> {
    /// More text is needed to decide.
    Pending,
    /// Not a value.
    Bad,
    /// The value and the bytes it took.
    Done(T, usize),
}

impl BlockFormat for Gemma4 {
    const OPEN: &'static str = "<|tool_call>";
    const CLOSE: &'static str = "<tool_call|>";
    const STREAMS: bool = true;

    fn header(rest: &str, complete: bool) -> Header {
        let t = rest.trim_start();
        let lead = rest.len() - t.len();
        let Some(after) = t.strip_prefix(CALL) else {
            return if !complete && CALL.starts_with(t) { Header::Pending } else { Header::Invalid };
        };
        let (name, used) = match after.find('{') {
            Some(i) => (after[..i].trim(), lead + CALL.len() + i + 1),
            None if complete => (after.trim(), rest.len()),
            None if after.contains(|c: char| c.is_whitespace() || "<}".contains(c)) => return Header::Invalid,
            None => return Header::Pending,
        };
        if name.is_empty() || name.contains(|c: char| c.is_whitespace() || "<>{}[],:".contains(c)) {
            Header::Invalid
        } else {
            Header::Name(name.to_string(), used)
        }
    }

    fn item(rest: &str, name: &str, tools: &Tools, complete: bool) -> Item {
        let pending = if complete { Item::End } else { Item::Pending };
        let t = rest.trim_start();
        let t = t.strip_prefix(',').map(str::trim_start).unwrap_or(t);
        let lead = rest.len() - t.len();
        if t.is_empty() {
            return pending;
        }
        if t.starts_with('}') {
            return Item::EndFunction(lead + 1);
        }
        let (key, after_key) = match read_key(t, complete) {
            Read::Done(k, n) => (k, n),
            Read::Pending => return pending,
            Read::Bad => return Item::End,
        };
        let v = &t[after_key..];
        let value_at = after_key + (v.len() - v.trim_start().len());
        let (value, used) = match read_value(&t[value_at..], complete) {
            Read::Done(v, n) => (v, n),
            Read::Pending => return pending,
            Read::Bad => return Item::End,
        };
        let raw = t[value_at..value_at + used].trim();
        // A bare value for a string parameter (`zip:75001`) is its text.
        let value = match (&value, tools.param_type(name, &key).as_deref()) {
            (Value::Number(_) | Value::Bool(_) | Value::Null, Some("string")) => Value::String(raw.to_string()),
            _ => value,
        };
        Item::Param(key, value, lead + value_at + used)
    }
}

/// A mapping key and its `:` at the start of `s` (bare, or quoted as some models write it).
fn read_key(s: &str, complete: bool) -> Read<String> {
    let (key, end) = if let Some(q) = s.strip_prefix(QUOTE) {
        match q.find(QUOTE) {
            Some(e) => (q[..e].to_string(), QUOTE.len() + e + QUOTE.len()),
            None => return if complete { Read::Bad } else { Read::Pending },
        }
    } else if !complete && s.len() < QUOTE.len() && QUOTE.starts_with(s) {
        return Read::Pending;
    } else {
        match s.find(|c: char| c == ':' || "{}[],<".contains(c)) {
            Some(e) if s[e..].starts_with(':') => (s[..e].trim().to_string(), e),
            Some(_) => return Read::Bad,
            None => return if complete { Read::Bad } else { Read::Pending },
        }
    };
    let rest = &s[end..];
    let colon = rest.trim_start();
    if colon.is_empty() {
        return if complete { Read::Bad } else { Read::Pending };
    }
    match colon.strip_prefix(':') {
        Some(_) if !key.is_empty() => Read::Done(key, end + (rest.len() - colon.len()) + 1),
        _ => Read::Bad,
    }
}

/// A value at the start of `s`. Without `complete`, a value is only read once its text is
/// all there (a bare scalar once the `,`, `}` or `]` after it is).
fn read_value(s: &str, complete: bool) -> Read<Value> {
    if let Some(q) = s.strip_prefix(QUOTE) {
        return match q.find(QUOTE) {
            Some(e) => Read::Done(Value::String(q[..e].to_string()), QUOTE.len() + e + QUOTE.len()),
            // The reply ended inside the string: what is there is the string.
            None if complete => Read::Done(Value::String(q.to_string()), s.len()),
            None => Read::Pending,
        };
    }
    if !complete && s.len() < QUOTE.len() && QUOTE.starts_with(s) {
        return Read::Pending;
    }
    match s.as_bytes().first() {
        None => {
            if complete {
                Read::Bad
            } else {
                Read::Pending
            }
        }
        Some(b'[') => read_list(s, complete),
        Some(b'{') => read_map(s, complete),
        Some(_) => {
            let end = match s.find(|c: char| ",}]<".contains(c)) {
                Some(e) => e,
                None if complete => s.len(),
                None => return Read::Pending,
            };
            match scalar(s[..end].trim()) {
                Some(v) => Read::Done(v, end),
                None => Read::Bad,
            }
        }
    }
}

/// A bare scalar: a JSON number, boolean or null (Python's spellings too), else the text.
fn scalar(text: &str) -> Option<Value> {
    if text.is_empty() {
        return None;
    }
    Some(match text {
        "true" | "True" => Value::Bool(true),
        "false" | "False" => Value::Bool(false),
        "null" | "None" | "none" => Value::Null,
        _ => match serde_json::from_str::<Value>(text) {
            Ok(n @ Value::Number(_)) => n,
            _ => Value::String(text.to_string()),
        },
    })
}

/// Skips whitespace from `at`; `None` when the text ends there.
fn skip_ws(s: &str, at: usize) -> Option<usize> {
    let rest = &s[at..];
    let t = rest.trim_start();
    (!t.is_empty()).then_some(at + rest.len() - t.len())
}

fn read_list(s: &str, complete: bool) -> Read<Value> {
    let incomplete = if complete { Read::Bad } else { Read::Pending };
    let mut items = Vec::new();
    let Some(mut at) = skip_ws(s, 1) else { return incomplete };
    if s[at..].starts_with(']') {
        return Read::Done(Value::Array(items), at + 1);
    }
    loop {
        match read_value(&s[at..], complete) {
            Read::Done(v, n) => {
                items.push(v);
                at += n;
            }
            Read::Pending => return Read::Pending,
            Read::Bad => return Read::Bad,
        }
        let Some(next) = skip_ws(s, at) else { return incomplete };
        at = next + 1;
        match s.as_bytes()[next] {
            b']' => return Read::Done(Value::Array(items), at),
            b',' => match skip_ws(s, at) {
                Some(a) => at = a,
                None => return incomplete,
            },
            _ => return Read::Bad,
        }
    }
}

fn read_map(s: &str, complete: bool) -> Read<Value> {
    let incomplete = if complete { Read::Bad } else { Read::Pending };
    let mut map = Map::new();
    let Some(mut at) = skip_ws(s, 1) else { return incomplete };
    if s[at..].starts_with('}') {
        return Read::Done(Value::Object(map), at + 1);
    }
    loop {
        let key = match read_key(&s[at..], complete) {
            Read::Done(k, n) => {
                at += n;
                k
            }
            Read::Pending => return Read::Pending,
            Read::Bad => return Read::Bad,
        };
        let Some(v) = skip_ws(s, at) else { return incomplete };
        match read_value(&s[v..], complete) {
            Read::Done(value, n) => {
                map.insert(key, value);
                at = v + n;
            }
            Read::Pending => return Read::Pending,
            Read::Bad => return Read::Bad,
        }
        let Some(next) = skip_ws(s, at) else { return incomplete };
        at = next + 1;
        match s.as_bytes()[next] {
            b'}' => return Read::Done(Value::Object(map), at),
            b',' => match skip_ws(s, at) {
                Some(a) => at = a,
                None => return incomplete,
            },
            _ => return Read::Bad,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_read_as_the_template_writes_them() {
        let q = |s: &str| s.replace('"', QUOTE);
        for (text, want) in [
            (q("\"a, b}\""), json!("a, b}")),
            ("42,".into(), json!(42)),
            ("-2.5e3}".into(), json!(-2500.0)),
            ("true]".into(), json!(true)),
            ("None,".into(), json!(null)),
            (q("[\"x\",1,[true]]"), json!(["x", 1, [true]])),
            (q("{b:{c:\"d\"},a:[]}"), json!({"b": {"c": "d"}, "a": []})),
            (q("{\"quoted\":1}"), json!({"quoted": 1})),
            ("bare words}".into(), json!("bare words")),
        ] {
            match read_value(&text, false) {
                Read::Done(v, _) => assert_eq!(v, want, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        // Not complete yet, and malformed.
        for text in ["42", "<|\"", "<|\"|>abc", "[1,", "{a:1", "{a", "tru"] {
            assert_eq!(read_value(text, false), Read::Pending, "{text}");
        }
        for text in ["[1,,2]", "{:1}", "{a 1}", ""] {
            assert_eq!(read_value(text, true), Read::Bad, "{text}");
        }
    }
}
