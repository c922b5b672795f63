//! Renders a conversation into the prompt text a model was trained on, with the model's own
//! Hugging Face chat template (Jinja), the way `transformers`' `apply_chat_template` does.
//!
//! A model only answers well when its prompt is byte-for-byte the format it was trained on, and
//! that format lives in `tokenizer_config.json` as a Jinja template written for Python's jinja2.
//! [`ChatTemplate`] compiles it once with `minijinja` set up like transformers' environment:
//! `trim_blocks` and `lstrip_blocks`, loop controls, Python string/dict methods
//! (`minijinja_contrib::pycompat`), `raise_exception`, `strftime_now`, and transformers' own
//! `tojson` (`json.dumps(x, ensure_ascii=False, indent=...)`, keys in their given order, `", "`
//! and `": "` separators). Printed `None`/booleans/floats read as Python prints them.
//!
//! Tool-call arguments that arrive as a JSON string (the OpenAI wire format) are parsed into an
//! object before rendering, as vLLM does: templates such as Qwen3.5's iterate
//! `tool_call.arguments|items`, and Qwen3's `tojson` of an object reproduces the spacing the
//! model emitted.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

/// One message of a conversation, in the OpenAI / transformers shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Serialised as `null` when absent, as OpenAI clients send assistant tool-call turns.
    #[serde(default)]
    pub content: Option<String>,
    /// `[{"id": .., "type": "function", "function": {"name": .., "arguments": ..}}]`;
    /// `arguments` may be an object or a JSON string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with only a role and text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChatError {
    #[error("chat template syntax error at line {line}: {detail}")]
    Syntax { line: usize, detail: String },
    /// The template called `raise_exception(msg)`.
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("chat template failed{at}: {detail}", at = line_suffix(*.line))]
    Render { line: Option<usize>, detail: String },
    #[error("invalid chat template argument: {0}")]
    Argument(String),
}

fn line_suffix(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

/// A ChatML template for models that ship none.
pub const FALLBACK_CHATML: &str = "{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + (message.content if message.content is string else '') + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
";

const TEMPLATE_NAME: &str = "chat_template";

/// Names the renderer sets itself; `extra` may not override them.
const RESERVED: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// A compiled chat template plus the special tokens it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error names the template's line and quotes it.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(py_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", py_string_filter);
        let source = rewrite_generation_tags(source);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| syntax_error(&e, &source))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages` (plus `tools`, the generation prompt and any extra template kwargs
    /// such as `enable_thinking`) into the prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        let mut ctx = serde_json::Map::new();
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), b.clone().into());
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), e.clone().into());
        }
        for (k, v) in extra {
            if RESERVED.contains(&k.as_str()) {
                return Err(ChatError::Argument(format!(
                    "extra kwarg `{k}` would replace the renderer's own `{k}`"
                )));
            }
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), normalize_messages(messages));
        ctx.insert(
            "tools".into(),
            tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| render_error(&e))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| render_error(&e))
    }
}

/// Serialises the messages, parsing JSON-string tool-call arguments into objects.
fn normalize_messages(messages: &[ChatMessage]) -> serde_json::Value {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let mut v = serde_json::to_value(m).unwrap_or(serde_json::Value::Null);
        if let Some(calls) = v.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
            for call in calls {
                let target = if call.get("function").is_some_and(|f| f.is_object()) {
                    call.get_mut("function")
                } else {
                    Some(call)
                };
                if let Some(args) = target.and_then(|t| t.get_mut("arguments")) {
                    if let Some(s) = args.as_str() {
                        if s.trim().is_empty() {
                            *args = serde_json::Value::Object(serde_json::Map::new());
                        } else if let Ok(obj @ serde_json::Value::Object(_)) =
                            serde_json::from_str::<serde_json::Value>(s)
                        {
                            *args = obj;
                        }
                    }
                }
            }
        }
        out.push(v);
    }
    serde_json::Value::Array(out)
}

/// transformers' `{% generation %}` blocks (assistant-mask markers) render their body; minijinja
/// has no such tag, so turn them into an always-true `if`, keeping whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_string();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open_ws, body) = split_ws_marker_start(inner);
        let (body, close_ws) = split_ws_marker_end(body);
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{open_ws} if true {close_ws}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{open_ws} endif {close_ws}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_ws_marker_start(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => (&s[..1], &s[1..]),
        _ => ("", s),
    }
}

fn split_ws_marker_end(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-' | b'+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

fn syntax_error(e: &Error, source: &str) -> ChatError {
    let line = e.line().unwrap_or(0);
    let detail = e
        .detail()
        .map_or_else(|| e.kind().to_string(), str::to_string);
    let quoted = source
        .lines()
        .nth(line.saturating_sub(1))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let short: String = l.chars().take(100).collect();
            format!(" (in `{short}`)")
        })
        .unwrap_or_default();
    ChatError::Syntax {
        line,
        detail: format!("{detail}{quoted}"),
    }
}

/// Marks errors that came from the template's own `raise_exception`.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn render_error(e: &Error) -> ChatError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(r) = s.downcast_ref::<Raised>() {
            return ChatError::Raised(r.0.clone());
        }
        src = s.source();
    }
    let mut detail = e
        .detail()
        .map_or_else(|| e.kind().to_string(), str::to_string);
    if let Some(s) = std::error::Error::source(e) {
        let _ = write!(detail, ": {s}");
    }
    ChatError::Render {
        line: e.line(),
        detail,
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

// ---------------------------------------------------------------------------------------------
// Python-flavoured printing

/// Python's `repr(float)` (which is also its `str`): shortest round-trip digits, scientific
/// notation outside 1e-4..1e16, always a `.0` or exponent.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let mut s = format!("{f}");
        if !s.contains('.') {
            s.push_str(".0");
        }
        s
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mant}e{sign}{:02}", exp.abs())
    }
}

/// `Some(text)` where Python's `str()` prints a scalar differently from minijinja.
fn py_scalar_str(v: &Value) -> Option<String> {
    match v.kind() {
        ValueKind::None => Some("None".into()),
        ValueKind::Bool => Some(if v.is_true() { "True" } else { "False" }.into()),
        ValueKind::Number if !v.is_integer() => f64::try_from(v.clone()).ok().map(py_float),
        _ => None,
    }
}

fn py_formatter(out: &mut minijinja::Output, state: &State, value: &Value) -> Result<(), Error> {
    match py_scalar_str(value) {
        Some(s) => out.write_str(&s).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    }
}

fn py_string_filter(value: &Value) -> Value {
    match py_scalar_str(value) {
        Some(s) => Value::from(s),
        None if value.kind() == ValueKind::String => value.clone(),
        None if value.is_undefined() => Value::from(""),
        None => Value::from(value.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// tojson: transformers' `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
// sort_keys=sort_keys)`

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    if depth > 128 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nesting too deep",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&py_float(f));
                }
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, style, depth, '[', ']', items.len(), |out, i| {
                write_json(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                entries.push((json_key(&k)?, val));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, style, depth, '{', '}', entries.len(), |out, i| {
                write_json_str(out, &entries[i].0, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &entries[i].1, style, depth + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} value is not JSON serializable", v.kind()),
            ));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    style: &JsonStyle,
    depth: usize,
    open: char,
    close: char,
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..=depth {
                out.push_str(ind);
            }
        }
        item(out, i)?;
    }
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
    out.push(close);
    Ok(())
}

/// Python turns str, int, float, bool and None keys into strings.
fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or("").to_string(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => py_float(f64::try_from(k.clone())?),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::None => "null".to_string(),
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be strings, not {other}"),
            ))
        }
    })
}

/// Python's JSON string escaping.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
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
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// strftime_now

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31) (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month 1..=12, day 1..=31) to days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

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
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` over a Unix time (UTC) for the common directives; unknown ones are copied.
fn strftime(fmt: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    let (h, mi, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => num(&mut out, y.rem_euclid(100), 2),
            Some('m') => num(&mut out, mo as i64, 2),
            Some('d') => num(&mut out, d as i64, 2),
            Some('e') => {
                let _ = write!(out, "{d:>2}");
            }
            Some('H') => num(&mut out, h, 2),
            Some('I') => num(&mut out, (h + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, mi, 2),
            Some('S') => num(&mut out, s, 2),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('j') => num(&mut out, yday, 3),
            Some('B') => out.push_str(MONTHS[mo as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[mo as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('u') => num(&mut out, wd as i64 + 1, 1),
            Some('w') => num(&mut out, (wd as i64 + 1) % 7, 1),
            Some('F') => {
                let _ = write!(out, "{y}-{mo:02}-{d:02}");
            }
            Some('T') => {
                let _ = write!(out, "{h:02}:{mi:02}:{s:02}");
            }
            Some('D') => {
                let _ = write!(out, "{mo:02}/{d:02}/{:02}", y.rem_euclid(100));
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `strftime_now(fmt)`: the current time (UTC; the engine has no time-zone database).
fn strftime_now(fmt: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const QWEN3: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/qwen3_chat_template.jinja"
    ));
    const QWEN35: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/qwen3_5_chat_template.jinja"
    ));

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    fn no_extra() -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }

    fn qwen3() -> ChatTemplate {
        ChatTemplate::new(QWEN3, None, Some("<|im_end|>".into())).unwrap()
    }

    fn weather_tool() -> serde_json::Value {
        // Keys deliberately not in alphabetical order: the rendering must keep this order.
        json!([{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather in a city, e.g. Zürich",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "description": "City name"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                    },
                    "required": ["location"]
                }
            }
        }])
    }

    const WEATHER_TOOL_JSON: &str = r#"{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city, e.g. Zürich", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}"#;

    #[test]
    fn qwen3_system_user_generation_prompt() {
        let t = qwen3();
        let out = t
            .render(
                &[msg("system", "You are helpful."), msg("user", "Hi there!")],
                None,
                true,
                &no_extra(),
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
        );
        // Without a generation prompt the text ends after the last message.
        let out = t
            .render(&[msg("user", "Hi")], None, false, &no_extra())
            .unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn qwen3_enable_thinking_false_appends_empty_think() {
        let t = qwen3();
        let mut extra = no_extra();
        extra.insert("enable_thinking".into(), json!(false));
        let out = t
            .render(&[msg("user", "2+2?")], None, true, &extra)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        extra.insert("enable_thinking".into(), json!(true));
        let out = t
            .render(&[msg("user", "2+2?")], None, true, &extra)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn qwen3_multi_turn_strips_earlier_reasoning() {
        let t = qwen3();
        let msgs = [
            msg("user", "What is 2+2?"),
            msg(
                "assistant",
                "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4.",
            ),
            msg("user", "And 3+3?"),
        ];
        let out = t.render(&msgs, None, true, &no_extra()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n2+2 = 4.<|im_end|>\n\
             <|im_start|>user\nAnd 3+3?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // The same with the reasoning given separately.
        let mut with_field = msgs.clone();
        with_field[1] = ChatMessage {
            reasoning_content: Some("Simple arithmetic.".into()),
            ..msg("assistant", "2+2 = 4.")
        };
        assert_eq!(t.render(&with_field, None, true, &no_extra()).unwrap(), out);
        // A final assistant turn (after the last user query) keeps its reasoning.
        let out = t.render(&msgs[..2], None, false, &no_extra()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4.<|im_end|>\n"
        );
    }

    #[test]
    fn qwen3_tools_block() {
        let t = qwen3();
        let tools = weather_tool();
        let out = t
            .render(
                &[msg("system", "Be brief."), msg("user", "Weather in Paris?")],
                Some(&tools),
                true,
                &no_extra(),
            )
            .unwrap();
        let want = format!(
            "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{WEATHER_TOOL_JSON}\n</tools>\n\n\
             For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
             <tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(out, want);
    }

    fn tool_round_trip(arguments: serde_json::Value) -> Vec<ChatMessage> {
        vec![
            msg("user", "Weather in Paris?"),
            ChatMessage {
                role: "assistant".into(),
                content: None,
                tool_calls: Some(json!([{
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments}
                }])),
                tool_call_id: None,
                name: None,
                reasoning_content: Some("I should call the tool.".into()),
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..msg("tool", "{\"temp_c\": 18}")
            },
        ]
    }

    #[test]
    fn qwen3_tool_call_round_trip() {
        let t = qwen3();
        let tools = weather_tool();
        let msgs = tool_round_trip(json!({"location": "Paris", "unit": "celsius"}));
        let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
        let want_tail = "<|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n\
             <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n";
        assert!(out.starts_with("<|im_start|>system\n# Tools\n\n"), "{out}");
        assert!(out.ends_with(want_tail), "{out}");
        // Arguments as an OpenAI-style JSON string (compact, keys unordered) render the same.
        let msgs_str = tool_round_trip(json!("{\"location\":\"Paris\",\"unit\":\"celsius\"}"));
        assert_eq!(
            t.render(&msgs_str, Some(&tools), true, &no_extra())
                .unwrap(),
            out
        );
        // A string that is not a JSON object passes through verbatim (the template's string
        // branch).
        let msgs_raw = tool_round_trip(json!("not json"));
        let out_raw = t
            .render(&msgs_raw, Some(&tools), true, &no_extra())
            .unwrap();
        assert!(out_raw.contains("\"arguments\": not json}"), "{out_raw}");
    }

    #[test]
    fn qwen35_renders() {
        let t = ChatTemplate::new(QWEN35, None, Some("<|im_end|>".into())).unwrap();
        let out = t
            .render(
                &[msg("system", "  Be brief. "), msg("user", "Hi")],
                None,
                true,
                &no_extra(),
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );
        let mut extra = no_extra();
        extra.insert("enable_thinking".into(), json!(false));
        let out = t.render(&[msg("user", "Hi")], None, true, &extra).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );

        // Tool call with string arguments: Qwen3.5 iterates `arguments|items`, so they must
        // arrive as an object. Non-string values print as JSON, booleans as Python's True.
        let tools = weather_tool();
        let mut msgs = tool_round_trip(json!(
            "{\"location\": \"Paris\", \"days\": 2, \"opts\": {\"unit\": \"celsius\"}, \"alerts\": true}"
        ));
        msgs.push(msg("assistant", "It is 18 °C."));
        let out = t.render(&msgs, Some(&tools), false, &no_extra()).unwrap();
        let want = format!(
            "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{WEATHER_TOOL_JSON}\n</tools>\
             \n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n\
             <function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n\
             <parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n\
             </parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n\
             - Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n\
             - Required parameters MUST be specified\n\
             - You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n\
             - If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n\
             </IMPORTANT><|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n\
             <tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n\
             <parameter=opts>\n{{\"unit\": \"celsius\"}}\n</parameter>\n<parameter=alerts>\nTrue\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{{\"temp_c\": 18}}\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\nIt is 18 °C.<|im_end|>\n"
        );
        assert_eq!(out, want);

        // The template's raise_exception surfaces as ChatError::Raised.
        let err = t
            .render(&[msg("system", "x")], None, true, &no_extra())
            .unwrap_err();
        assert_eq!(
            err,
            ChatError::Raised("No user query found in messages.".into())
        );
        assert_eq!(
            err.to_string(),
            "chat template rejected the conversation: No user query found in messages."
        );
    }

    #[test]
    fn fallback_chatml() {
        let t = ChatTemplate::new(FALLBACK_CHATML, None, None).unwrap();
        let msgs = [
            msg("system", "S"),
            msg("user", "U"),
            ChatMessage {
                content: None,
                ..msg("assistant", "")
            },
        ];
        let out = t.render(&msgs, None, true, &no_extra()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn syntax_error_names_the_line() {
        let src = "{%- for m in messages %}\n{{ m.content }}\n{%- if %}\n{%- endfor %}";
        let err = ChatTemplate::new(src, None, None).unwrap_err();
        match &err {
            ChatError::Syntax { line, detail } => {
                assert_eq!(*line, 3, "{err}");
                assert!(detail.contains("{%- if %}"), "{err}");
            }
            other => panic!("{other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.starts_with("chat template syntax error at line 3:"),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn runtime_error_is_reported() {
        let t = ChatTemplate::new("line one\n{{ messages[0].content + 1 }}", None, None).unwrap();
        let err = t
            .render(&[msg("user", "x")], None, false, &no_extra())
            .unwrap_err();
        assert!(
            matches!(err, ChatError::Render { line: Some(2), .. }),
            "{err:?}"
        );
        let err = t
            .render(
                &[],
                None,
                false,
                &serde_json::Map::from_iter([("messages".into(), json!(1))]),
            )
            .unwrap_err();
        assert!(matches!(err, ChatError::Argument(_)), "{err:?}");
    }

    #[test]
    fn hf_environment_features() {
        let render = |src: &str, extra: serde_json::Value| {
            let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).unwrap();
            let extra = extra.as_object().cloned().unwrap_or_default();
            t.render(
                &[
                    msg("user", "  Hello, World  "),
                    msg("assistant", "A"),
                    msg("user", "B"),
                ],
                None,
                false,
                &extra,
            )
            .unwrap()
        };
        // bos/eos tokens and extra kwargs at top level.
        assert_eq!(
            render(
                "{{ bos_token }}|{{ eos_token }}|{{ foo }}",
                json!({"foo": 3})
            ),
            "<s>|</s>|3"
        );
        // trim_blocks + lstrip_blocks: block lines leave no whitespace behind.
        assert_eq!(
            render("{% for m in messages %}\n    {% if loop.last %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}", json!({})),
            "user\n"
        );
        // Reverse slicing, namespace, loop controls.
        assert_eq!(
            render(
                "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if loop.index > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.content }}{% endfor %}{{ ns.n }}",
                json!({})
            ),
            "BA2"
        );
        // Python string methods.
        assert_eq!(
            render(
                "{% set c = messages[0].content %}{{ c.strip() }}|{{ c.lstrip() }}|{{ c.rstrip() }}|{{ c.strip().startswith('Hello') }}|{{ c.strip().endswith('x') }}|{{ c.split(',')[1] }}|{{ c.replace('World', 'there') }}",
                json!({})
            ),
            "Hello, World|Hello, World  |  Hello, World|True|False| World  |  Hello, there  "
        );
        // is string / is mapping, length, items, Python-style printing.
        assert_eq!(
            render(
                "{{ d is mapping }} {{ s is string }} {{ d|length }} {% for k, v in d|items %}{{ k }}={{ v }};{% endfor %} {{ none_v }} {{ f }} {{ big }} {{ d.b|string }}",
                json!({"d": {"z": 1, "b": true}, "s": "x", "none_v": null, "f": 0.5, "big": 1e20})
            ),
            "True True 2 z=1;b=True; None 0.5 1e+20 True"
        );
        // tojson: Python separators, key order, no ASCII escaping, indent, sort_keys.
        assert_eq!(
            render(
                "{{ d|tojson }}",
                json!({"d": {"z": [1, 2.0, "é<>&'"], "a": null}})
            ),
            r#"{"z": [1, 2.0, "é<>&'"], "a": null}"#
        );
        assert_eq!(
            render(
                "{{ d|tojson(indent=2) }}",
                json!({"d": {"z": [1, {}], "a": "\n"}})
            ),
            "{\n  \"z\": [\n    1,\n    {}\n  ],\n  \"a\": \"\\n\"\n}"
        );
        assert_eq!(
            render(
                "{{ d|tojson(sort_keys=true, ensure_ascii=true) }}",
                json!({"d": {"z": "é😀", "a": 1}})
            ),
            r#"{"a": 1, "z": "\u00e9\ud83d\ude00"}"#
        );
        assert_eq!(
            render(
                "{{ d|tojson(separators=[',', ':']) }}",
                json!({"d": {"a": [1, 2]}})
            ),
            r#"{"a":[1,2]}"#
        );
        // raise_exception, strftime_now.
        let t = ChatTemplate::new(
            "{{ raise_exception('bad role: ' + messages[0].role) }}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            t.render(&[msg("tool", "")], None, false, &no_extra()),
            Err(ChatError::Raised("bad role: tool".into()))
        );
        let year = render("{{ strftime_now('%Y') }}", json!({}));
        assert!(year.len() == 4 && year.starts_with("20"), "{year}");
        // {% generation %} blocks (transformers' assistant masks) render their body.
        assert_eq!(
            render("{%- for m in messages %}\n{%- generation %}{{ m.content }}{%- endgeneration %}\n{%- endfor %}", json!({})),
            "  Hello, World  AB"
        );
    }

    #[test]
    fn strftime_matches_c() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %-d, %I %p %j %%", t),
            "Thursday February 29, 01 PM 060 %"
        );
        assert_eq!(strftime("%a %F %T", 0), "Thu 1970-01-01 00:00:00");
        assert_eq!(strftime("%j %D", 1_735_603_200), "366 12/31/24");
        assert_eq!(strftime("%j", 1_735_689_600), "001");
        for days in [-800_000i64, -1, 0, 59, 60, 11_016, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn py_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
            (0.1 + 0.2, "0.30000000000000004"),
        ] {
            assert_eq!(py_float(f), s);
        }
    }

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<crate::tokenizer::Tokenizer>();
        assert_send_sync::<crate::sampler::Sampler>();
    }

    #[test]
    fn message_serialization() {
        let m = ChatMessage {
            content: None,
            ..msg("assistant", "")
        };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"role":"assistant","content":null}"#
        );
        let back: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
        assert_eq!(back, msg("user", "hi"));
    }
}
