//! Hugging Face chat templates, rendered with minijinja the way transformers renders them
//! with jinja2 (`render_jinja_template` / `_compile_jinja_template`):
//!
//! * `trim_blocks` and `lstrip_blocks` on, trailing newline of the template dropped;
//! * globals `raise_exception`, `strftime_now`; filter `tojson` with Python's `json.dumps`
//!   output (no HTML escaping, `ensure_ascii=False`, `indent`, `separators`, `sort_keys`);
//! * Python string/dict methods (`strip`, `startswith`, `split`, `items`, ...) via
//!   minijinja-contrib's pycompat; `{% break %}` / `{% continue %}`;
//! * variables `messages`, `add_generation_prompt`, `tools` (none unless the extra variables
//!   give them), `documents` (none), the special tokens (`bos_token`, `eos_token`, ...) and
//!   any extra keyword arguments.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template does not compile: {0:#}")]
    Syntax(minijinja::Error),
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    #[error("chat template failed to render: {0:#}")]
    Render(minijinja::Error),
    #[error("{file}: {reason}")]
    Source { file: String, reason: String },
}

type Result<T> = std::result::Result<T, ChatTemplateError>;

/// One chat message: a role and its content, plus any other fields (e.g. `tool_calls`),
/// which are passed to the template untouched.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` is left out of what the template sees, like transformers drops `None` keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with plain text content.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: Some(MessageContent::Text(content.into())), extra: Default::default() }
    }

    /// A message whose content is a list of parts (text, image, ...).
    pub fn parts(role: impl Into<String>, parts: Vec<ContentPart>) -> Self {
        Self { role: role.into(), content: Some(MessageContent::Parts(parts)), extra: Default::default() }
    }
}

/// A string, or a list of typed parts (`{"type": "text", "text": ...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ContentPart {
    pub fn text(text: impl Into<String>) -> Self {
        Self { kind: "text".to_string(), text: Some(text.into()), extra: Default::default() }
    }

    /// An image placeholder part (`{"type": "image"}`); templates only test for its presence.
    pub fn image() -> Self {
        Self { kind: "image".to_string(), text: None, extra: Default::default() }
    }
}

/// What a template sees besides the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    /// Special tokens by their transformers name (`bos_token`, `eos_token`, ...).
    pub special_tokens: Vec<(String, String)>,
    /// Extra keyword arguments (e.g. `enable_thinking`); they override special tokens.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's text (the server reads the tool-call format a model was taught from it).
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compile a template source.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, without_generation_tags(source)).map_err(ChatTemplateError::Syntax)?;
        Ok(Self { env, source: source.to_string() })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render `messages` like transformers' `apply_chat_template(..., tokenize=False)`.
    pub fn render(&self, messages: &[ChatMessage], options: &RenderOptions) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        for (name, token) in &options.special_tokens {
            ctx.insert(name.clone(), token.clone().into());
        }
        ctx.extend(options.extra.clone());
        // `tools` comes in with the extra variables when the request has tools (a list of
        // `{"type": "function", "function": {...}}`, as transformers passes them).
        ctx.entry("tools").or_insert(serde_json::Value::Null);
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), options.add_generation_prompt.into());
        let mut ctx = Value::from_serialize(&ctx);
        // Messages go in as their own serialization so that key order stays as written.
        let messages = Value::from_serialize(messages);
        ctx = minijinja::context! { messages => messages, ..ctx };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(ChatTemplateError::Render)?;
        template.render(ctx).map_err(|e| match raised_message(&e) {
            Some(msg) => ChatTemplateError::Raised(msg),
            None => ChatTemplateError::Render(e),
        })
    }
}

/// transformers' `{% generation %}` tag only marks assistant text for masks; outside of
/// that it renders its body. minijinja has no such tag, so it becomes an always-true `if`
/// (keeping any `-` whitespace control the tag had).
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        // Search past the opening `{%` so that `{%}` is not taken for a whole tag.
        let Some(len) = rest[start + 2..].find("%}").map(|l| l + 2) else {
            break;
        };
        let tag = &rest[start..start + len + 2];
        let inner = tag[2..tag.len() - 2].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        match inner {
            "generation" => out.push_str(&tag.replacen("generation", "if true", 1)),
            "endgeneration" => out.push_str(&tag.replacen("endgeneration", "endif", 1)),
            _ => out.push_str(tag),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// The message `raise_exception` was called with, carried as the error's source.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(r) = e.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        source = e.source();
    }
    None
}

/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")
                })?;
                " ".repeat(n.max(0) as usize)
            }
        }),
    };
    // Python's defaults: ", " and ": " inline, "," and ": " with an indent.
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let parts: Vec<String> =
                v.try_iter()?.map(|p| p.as_str().map(str::to_string)).collect::<Option<_>>().ok_or_else(|| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    let writer = JsonWriter {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    writer.write(&mut out, value, 0)?;
    Ok(Value::from(out))
}

/// Writes a minijinja value as Python's `json.dumps` would.
struct JsonWriter {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonWriter {
    fn write(&self, out: &mut String, v: &Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
        use minijinja::value::ValueKind;
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&python_number(v)),
            ValueKind::String => self.write_str(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.write_container(out, '[', ']', depth, items.len(), |out, i| {
                    self.write(out, &items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.write_container(out, '{', '}', depth, keys.len(), |out, i| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => self.write_str(out, s),
                        // Python turns non-string keys into strings.
                        None => self.write_str(out, &key.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(key)?, depth + 1)
                })?;
            }
            _ => self.write_str(out, &v.to_string()),
        }
        Ok(())
    }

    fn write_container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        depth: usize,
        len: usize,
        mut item: impl FnMut(&mut String, usize) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(ind) = &self.indent {
                out.push('\n');
                out.push_str(&ind.repeat(depth + 1));
            }
            item(out, i)?;
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
        out.push(close);
        Ok(())
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python's `repr` writes it (`1.0`, `1e-05`, `1e+16`).
fn python_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let Ok(f) = f64::try_from(v.clone()) else {
        return v.to_string();
    };
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust writes `1e-5`; Python writes `1e-05` (sign, at least two exponent digits).
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// `datetime.now().strftime(format)`, in UTC, for the directives templates use.
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(secs, &format)
}

fn strftime(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", (h + 11) % 12 + 1)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The template named in a `tokenizer_config.json` `chat_template` field: a string, or a
/// list of `{name, template}` of which "default" is used (as transformers does).
pub fn template_from_config_value(value: &serde_json::Value, file: &Path) -> Result<Option<String>> {
    let source_err = |reason: String| ChatTemplateError::Source { file: file.display().to_string(), reason };
    match value {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(items) => {
            for item in items {
                let name = item.get("name").and_then(|n| n.as_str());
                let template = item.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => {
                        return Err(source_err("`chat_template` list entries need string `name` and `template`".into()))
                    }
                }
            }
            Err(source_err("`chat_template` is a list of named templates without a \"default\" one".into()))
        }
        _ => Err(source_err("`chat_template` must be a string or a list of {name, template}".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Gemma 3's template (text parts only), as published with the model.
    const GEMMA: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"#;

    fn opts(add_generation_prompt: bool) -> RenderOptions {
        RenderOptions {
            add_generation_prompt,
            special_tokens: vec![("bos_token".into(), "<bos>".into()), ("eos_token".into(), "<eos>".into())],
            extra: Default::default(),
        }
    }

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Hi there"),
            ChatMessage::text("assistant", "Hello! "),
            ChatMessage::parts("user", vec![ContentPart::image(), ContentPart::text(" What is this? ")]),
        ]
    }

    #[test]
    fn chatml_renders_like_transformers() {
        let t = ChatTemplate::new(CHATML).expect("compile");
        let msgs = vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Hi"),
            ChatMessage::text("assistant", "Hello!"),
            ChatMessage::text("user", "2+2?"),
        ];
        let out = t.render(&msgs, &opts(true)).expect("render");
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let no_prompt = t.render(&msgs[..2], &opts(false)).expect("render");
        assert_eq!(no_prompt, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn gemma_template_renders_system_user_assistant_user() {
        let t = ChatTemplate::new(GEMMA).expect("compile");
        let out = t.render(&conversation(), &opts(true)).expect("render");
        assert_eq!(
            out,
            "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n\
             <start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n\
             <start_of_turn>model\n"
        );
    }

    #[test]
    fn raise_exception_is_a_typed_error() {
        let t = ChatTemplate::new(GEMMA).expect("compile");
        let msgs = vec![ChatMessage::text("user", "a"), ChatMessage::text("user", "b")];
        match t.render(&msgs, &opts(false)) {
            Err(ChatTemplateError::Raised(m)) => {
                assert_eq!(m, "Conversation roles must alternate user/assistant/user/assistant/...")
            }
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn trim_and_lstrip_blocks_match_jinja_settings() {
        // trim_blocks eats the newline after a block tag, lstrip_blocks the indent before it,
        // and the template's single trailing newline is dropped, like jinja2's defaults.
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src).expect("compile");
        let msgs = vec![ChatMessage::text("user", "a"), ChatMessage::text("assistant", "b")];
        assert_eq!(t.render(&msgs, &opts(false)).expect("render"), "[a]\n");
    }

    #[test]
    fn python_methods_loop_controls_and_kwargs() {
        let src = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
                   {% if m.role.startswith('sys') %}{% continue %}{% endif %}\
                   {{ m.content.strip().upper() }}|{{ m.content.split(',') | length }}|{% endfor %}\
                   {{ enable_thinking }}|{{ tools is none }}";
        let t = ChatTemplate::new(src).expect("compile");
        let msgs = vec![
            ChatMessage::text("system", "s"),
            ChatMessage::text("user", " a,b "),
            ChatMessage::text("user", "never"),
        ];
        let mut o = opts(false);
        o.extra.insert("enable_thinking".into(), false.into());
        // Python prints booleans capitalized, and so does minijinja.
        assert_eq!(t.render(&msgs, &o).expect("render"), "A,B|2|False|True");
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let src = "{{ x | tojson }}\n{{ x | tojson(indent=2) }}\n{{ x | tojson(ensure_ascii=true) }}\n{{ x | tojson(separators=[',', ':'], sort_keys=true) }}";
        let t = ChatTemplate::new(src).expect("compile");
        let mut o = opts(false);
        let x = serde_json::json!({"name": "é<tag>&'", "n": 1, "f": 0.5, "e": [], "l": [true, null]});
        o.extra.insert("x".into(), x);
        let out = t.render(&[], &o).expect("render");
        // Keys keep the order they were written in (serde_json's preserve_order), as Python
        // dicts do; sort_keys sorts them.
        assert_eq!(
            out,
            "{\"name\": \"é<tag>&'\", \"n\": 1, \"f\": 0.5, \"e\": [], \"l\": [true, null]}\n\
             {\n  \"name\": \"é<tag>&'\",\n  \"n\": 1,\n  \"f\": 0.5,\n  \"e\": [],\n  \"l\": [\n    true,\n    null\n  ]\n}\n\
             {\"name\": \"\\u00e9<tag>&'\", \"n\": 1, \"f\": 0.5, \"e\": [], \"l\": [true, null]}\n\
             {\"e\":[],\"f\":0.5,\"l\":[true,null],\"n\":1,\"name\":\"é<tag>&'\"}"
        );
    }

    #[test]
    fn message_keys_keep_their_order_in_tojson() {
        let t = ChatTemplate::new("{{ messages[0] | tojson }}").expect("compile");
        let out = t.render(&[ChatMessage::text("user", "hi")], &opts(false)).expect("render");
        assert_eq!(out, "{\"role\": \"user\", \"content\": \"hi\"}");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let t = ChatTemplate::new("a{%- generation -%} b {%- endgeneration -%} c").expect("compile");
        assert_eq!(t.render(&[], &opts(false)).expect("render"), "abc");
    }

    #[test]
    fn python_number_formatting() {
        assert_eq!(python_number(&Value::from(1.0)), "1.0");
        assert_eq!(python_number(&Value::from(0.1)), "0.1");
        assert_eq!(python_number(&Value::from(1e-5)), "1e-05");
        assert_eq!(python_number(&Value::from(1.5e20)), "1.5e+20");
        assert_eq!(python_number(&Value::from(42)), "42");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(strftime(1_709_211_909, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(strftime(1_709_211_909, "%A %B %-d %H:%M:%S %p %j %%"), "Thursday February %-d 13:05:09 PM 060 %");
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
    }

    #[test]
    fn config_value_picks_default_template() {
        let file = Path::new("tokenizer_config.json");
        let list = serde_json::json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        assert_eq!(template_from_config_value(&list, file).expect("ok").as_deref(), Some("D"));
        let no_default = serde_json::json!([{"name": "tool_use", "template": "T"}]);
        let err = template_from_config_value(&no_default, file).expect_err("no default");
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
        assert_eq!(template_from_config_value(&serde_json::json!("S"), file).expect("ok").as_deref(), Some("S"));
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(matches!(ChatTemplate::new("{% if %}"), Err(ChatTemplateError::Syntax(_))));
    }
}
