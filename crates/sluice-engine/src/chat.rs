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
//! model emitted. Templates that can only print the string are the exception: DeepSeek's
//! (V3, R1, V3.1) concatenate `'...' + tool['function']['arguments']`, which fails on an object.
//! [`ChatTemplate::new`] finds these by rendering a probe call both ways, as minja (llama.cpp's
//! Jinja engine) does to decide the opposite, and then gives them the arguments as JSON text.
//!
//! gpt-oss's template (OpenAI's harmony format, [`ChatTemplate::is_harmony`]) reads earlier
//! reasoning from `message.thinking`, not `reasoning_content`, and only for turns with tool calls
//! (it drops the reasoning of answered turns, as harmony wants); it also rejects a turn with both
//! reasoning and content, and cannot test a `null` content. Templates that read
//! `message.thinking` and never `reasoning_content` therefore get `reasoning_content` as
//! `thinking`, without the content of a tool-call turn that has reasoning, and without `null`
//! contents, as llama.cpp prepares messages for gpt-oss (`common_chat_params_init_gpt_oss`).

use std::fmt::Write as _;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

mod isolate;
mod pycompat;

pub use isolate::{isolate_templates, serve_template_worker_if_asked, TEMPLATE_MEMORY};
use pycompat::{py_formatter, py_string_filter, strftime_now, tojson};

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

#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
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

/// Instructions one render may run (minijinja's fuel). Qwen3's template over 2000 messages and
/// a tool renders in ~7 ms, where running out of 50M instructions took 1.4 s on a 2-core VM:
/// 20M leaves real templates a wide margin and stops a loop that would not end within about
/// half a second. (minijinja itself refuses ranges over 100k items, huge repeated strings and
/// deep recursion.) Fuel bounds instructions, not bytes: memory is bounded by rendering in a
/// child process ([`isolate_templates`]).
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// The longest prompt a render may return: some 16 million tokens, past any model's context,
/// so only a runaway template reaches it (and the tokenizer never sees its output).
pub const MAX_PROMPT_BYTES: usize = 64 << 20;

/// Names the renderer sets itself; `extra` may not override them.
const RESERVED: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// A compiled chat template plus the special tokens it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The template prints tool-call arguments given as JSON text but not as an object.
    string_arguments: bool,
    /// The template writes the harmony format.
    harmony: bool,
    /// The template reads earlier reasoning as `message.thinking` (see the module docs).
    thinking_field: bool,
    /// The renderer process, when templates render isolated ([`isolate_templates`]).
    isolated: Option<isolate::Isolated>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("string_arguments", &self.string_arguments)
            .field("harmony", &self.harmony)
            .field("thinking_field", &self.thinking_field)
            .field("isolated", &self.isolated.is_some())
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error names the template's line and quotes it. Renders run
    /// in a child process when [`isolate_templates`] was called, else in this one.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let Some(exe) = isolate::worker_exe() else {
            return Self::in_process(source, bos_token, eos_token);
        };
        // Compiled here too, for the syntax errors and the flags read from the source; the
        // probe renders, so it runs in the child.
        let mut template = Self::compile(source, bos_token.clone(), eos_token.clone())?;
        let init = isolate::Init {
            source: source.to_string(),
            bos_token,
            eos_token,
            string_arguments: None,
        };
        let (isolated, string_arguments) = isolate::Isolated::start(exe, &init)?;
        template.string_arguments = string_arguments;
        template.isolated = Some(isolated);
        Ok(template)
    }

    /// [`new`](Self::new), rendering in this process whatever [`isolate_templates`] says
    /// (bounded by fuel, not in memory).
    pub fn in_process(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut template = Self::compile(source, bos_token, eos_token)?;
        template.string_arguments = template.needs_string_arguments();
        Ok(template)
    }

    fn compile(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        // A template is a program from the model's files: bound each render's work.
        env.set_fuel(Some(TEMPLATE_FUEL));
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
        let harmony = source.contains("<|channel|>");
        let thinking_field =
            source.contains("message.thinking") && !source.contains("reasoning_content");
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| syntax_error(&e, &source))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            string_arguments: false,
            harmony,
            thinking_field,
            isolated: None,
        })
    }

    /// Whether the template writes OpenAI's harmony format (gpt-oss: `<|start|>assistant
    /// <|channel|>final<|message|>...`), told by its `<|channel|>` marker. The model's answer is
    /// then harmony too ([`crate::output::OutputOptions::harmony`]).
    pub fn is_harmony(&self) -> bool {
        self.harmony
    }

    /// Whether a past tool call renders when its arguments are JSON text but not when they are
    /// an object. minja (google/minja `chat-template.hpp`, used by llama.cpp) probes templates the
    /// same way for `requires_object_arguments`; here objects are the default, so the probe asks
    /// the opposite question. A template that fails both ways keeps objects.
    fn needs_string_arguments(&self) -> bool {
        const NEEDLE: &str = "argument_needle";
        let renders = |object_arguments: bool| {
            let arguments = serde_json::json!({ NEEDLE: "probe" });
            let call = serde_json::json!({
                "id": "call_probe",
                "type": "function",
                "function": {"name": "probe_tool", "arguments": arguments},
            });
            let messages = [
                ChatMessage::new("user", "Probe."),
                ChatMessage {
                    content: None,
                    tool_calls: Some(serde_json::Value::Array(vec![call])),
                    ..ChatMessage::new("assistant", "")
                },
            ];
            let no_extra = serde_json::Map::new();
            self.render_with(&messages, None, false, &no_extra, object_arguments)
                .is_ok_and(|out| out.contains(NEEDLE))
        };
        !renders(true) && renders(false)
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
        let object_arguments = !self.string_arguments;
        let prompt = match &self.isolated {
            Some(isolated) => isolated.render(&isolate::RenderRef {
                messages,
                tools,
                add_generation_prompt,
                extra,
                object_arguments,
            }),
            None => self.render_with(
                messages,
                tools,
                add_generation_prompt,
                extra,
                object_arguments,
            ),
        }?;
        if prompt.len() > MAX_PROMPT_BYTES {
            return Err(ChatError::Render {
                line: None,
                detail: format!(
                    "the template wrote {} of prompt, over the {} a prompt may be",
                    sluice_sys::format_bytes_binary(prompt.len() as u64),
                    sluice_sys::format_bytes_binary(MAX_PROMPT_BYTES as u64)
                ),
            });
        }
        Ok(prompt)
    }

    /// [`render`](Self::render), with tool-call arguments as objects or as JSON text.
    fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
        object_arguments: bool,
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
        ctx.insert(
            "messages".into(),
            normalize_messages(messages, object_arguments, self.thinking_field),
        );
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

/// Serialises the messages with tool-call arguments as objects (JSON-string arguments parsed,
/// when they hold an object) or as JSON text (objects written compactly, as minja does); with
/// `thinking_field`, reasoning as `thinking` (see the module docs).
fn normalize_messages(
    messages: &[ChatMessage],
    object_arguments: bool,
    thinking_field: bool,
) -> serde_json::Value {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let mut v = serde_json::to_value(m).unwrap_or(serde_json::Value::Null);
        if let (true, Some(obj)) = (thinking_field, v.as_object_mut()) {
            let calls = m
                .tool_calls
                .as_ref()
                .and_then(|c| c.as_array())
                .is_some_and(|c| !c.is_empty());
            if let Some(r) = &m.reasoning_content {
                obj.insert("thinking".into(), r.clone().into());
                if calls {
                    obj.remove("content");
                }
            }
            if obj.get("content").is_some_and(|c| c.is_null()) {
                obj.remove("content");
            }
        }
        if let Some(calls) = v.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
            for call in calls {
                let target = if call.get("function").is_some_and(|f| f.is_object()) {
                    call.get_mut("function")
                } else {
                    Some(call)
                };
                if let Some(args) = target.and_then(|t| t.get_mut("arguments")) {
                    if object_arguments {
                        if let Some(parsed) = args.as_str().and_then(arguments_object) {
                            *args = parsed;
                        }
                    } else if args.is_object() {
                        *args = serde_json::Value::String(args.to_string());
                    }
                }
            }
        }
        out.push(v);
    }
    serde_json::Value::Array(out)
}

/// The object a JSON-string `arguments` holds (empty text: no arguments); None if it holds
/// something else.
fn arguments_object(s: &str) -> Option<serde_json::Value> {
    if s.trim().is_empty() {
        return Some(serde_json::Value::Object(serde_json::Map::new()));
    }
    serde_json::from_str::<serde_json::Value>(s)
        .ok()
        .filter(serde_json::Value::is_object)
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
        // The closing `%}` comes after the opening `{%` (in `{%}` they overlap).
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
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
    if e.kind() == ErrorKind::OutOfFuel {
        return ChatError::Render {
            line: e.line(),
            detail: format!(
                "the template ran past {TEMPLATE_FUEL} instructions (a loop that does not end, or one far too long for a prompt), so sluice stopped it"
            ),
        };
    }
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

#[cfg(test)]
mod tests;
