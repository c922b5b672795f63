//! Anthropic's Messages API: what Claude Code and the `anthropic` SDKs speak.
//!
//! `POST /v1/messages` (JSON, or SSE with Anthropic's named events: `message_start`,
//! `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`) and
//! `POST /v1/messages/count_tokens`. A request becomes the same chat-template conversation as an
//! OpenAI one: `system` first; a user turn's `tool_result` blocks become tool messages and its
//! text a user message; an assistant turn's `thinking`, `text` and `tool_use` blocks its reasoning,
//! content and tool calls. `tools` (`name`, `description`, `input_schema`) are offered as
//! functions, `tool_choice` narrows them, `thinking: {"type": "enabled" | "disabled"}` sets the
//! template's `enable_thinking`. The answer comes back as `thinking`, `text` and `tool_use`
//! blocks with `stop_reason` `end_turn`, `max_tokens`, `stop_sequence` (naming it) or
//! `tool_use`. Keys come as `x-api-key` (or `Authorization: Bearer`); errors have Anthropic's
//! shape, `{"type": "error", "error": {"type", "message"}}`.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sluice_backend::Backend;
use sluice_engine::chat::ChatMessage;
use sluice_engine::output::OutputEvent;
use sluice_engine::{FinishReason, GenerationStats};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{self, Sampling, Stop};
use crate::error::ApiError;
use crate::worker::{CancelOnDrop, Event};
use crate::{body_bytes, keys_match, random_u64, sse, App};

/// An error in Anthropic's shape.
pub(crate) fn error_response(e: ApiError) -> Response {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    (e.status, Json(body)).into_response()
}

/// The server's key as `x-api-key` (Anthropic's header) or `Authorization: Bearer`.
pub(crate) async fn check_key<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &app.config.api_key {
        let headers = request.headers();
        let given = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .or_else(|| {
                headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
            });
        if !given.is_some_and(|g| keys_match(g.as_bytes(), key.as_bytes())) {
            app.metrics.requests_failed.fetch_add(1, Relaxed);
            let message = if given.is_some() {
                "incorrect API key (send the server's --api-key as `x-api-key: KEY`)"
            } else {
                "missing API key (send the server's --api-key as `x-api-key: KEY`)"
            };
            return error_response(
                ApiError::invalid(message).with_status(StatusCode::UNAUTHORIZED),
            );
        }
    }
    next.run(request).await
}

/// `POST /v1/messages`.
#[derive(Deserialize)]
struct MessagesRequest {
    max_tokens: Option<u64>,
    messages: Vec<Value>,
    system: Option<Value>,
    tools: Option<Vec<ToolDef>>,
    tool_choice: Option<ToolChoice>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    thinking: Option<Thinking>,
}

#[derive(Deserialize)]
struct ToolDef {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: String,
    description: Option<String>,
    input_schema: Option<Value>,
}

#[derive(Deserialize)]
struct ToolChoice {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
}

#[derive(Deserialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: String,
}

impl MessagesRequest {
    /// The conversation for the chat template.
    fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        let mut out = Vec::new();
        if let Some(system) = &self.system {
            out.push(ChatMessage::new("system", text_of(system, "system")?));
        }
        if self.messages.is_empty() {
            return Err(ApiError::field("messages", "messages must not be empty"));
        }
        // Tool names by `tool_use` id: a tool message names its tool (some templates print it).
        let mut tool_names: HashMap<String, String> = HashMap::new();
        for (i, m) in self.messages.iter().enumerate() {
            let at = format!("messages[{i}]");
            let role = m.get("role").and_then(Value::as_str).unwrap_or("");
            let content = m
                .get("content")
                .ok_or_else(|| ApiError::field(&at, format!("{at}.content is required")))?;
            let blocks: Vec<Value> = match content {
                Value::String(t) => vec![json!({"type": "text", "text": t})],
                Value::Array(b) => b.clone(),
                _ => {
                    return Err(ApiError::field(
                        &format!("{at}.content"),
                        format!("{at}.content must be a string or a list of content blocks"),
                    ))
                }
            };
            match role {
                "user" => user_turn(&blocks, &at, &tool_names, &mut out)?,
                "assistant" => out.push(assistant_turn(&blocks, &at, &mut tool_names)?),
                other => {
                    return Err(ApiError::field(
                        &format!("{at}.role"),
                        format!("{at}.role must be \"user\" or \"assistant\", got {other:?}"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// The tools to offer, as the chat templates take them (OpenAI functions); `None`: none.
    fn tools(&self) -> Result<Option<Value>, ApiError> {
        let Some(tools) = &self.tools else {
            return Ok(None);
        };
        for (i, t) in tools.iter().enumerate() {
            if let Some(kind) = t.kind.as_deref().filter(|k| *k != "custom") {
                return Err(ApiError::field(
                    &format!("tools[{i}].type"),
                    format!(
                        "tools[{i}]: Anthropic's server tool `{kind}` is not available here; \
                         only custom tools (name, description, input_schema) are"
                    ),
                ));
            }
        }
        let chosen: Vec<&ToolDef> = match &self.tool_choice {
            None => tools.iter().collect(),
            Some(c) => match (c.kind.as_str(), &c.name) {
                ("none", _) => return Ok(None),
                // No constrained decoding: `any` offers the tools like `auto`.
                ("auto" | "any", _) => tools.iter().collect(),
                ("tool", Some(name)) => {
                    let named: Vec<&ToolDef> = tools.iter().filter(|t| &t.name == name).collect();
                    if named.is_empty() {
                        return Err(ApiError::field(
                            "tool_choice",
                            format!("tool_choice names `{name}`, which is not in tools"),
                        ));
                    }
                    named
                }
                (kind, _) => {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!(
                            "tool_choice must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or \
                             {{\"type\": \"tool\", \"name\": ..}}, got type {kind:?}"
                        ),
                    ))
                }
            },
        };
        if chosen.is_empty() {
            return Ok(None);
        }
        let functions = chosen
            .into_iter()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), json!(t.name));
                if let Some(d) = &t.description {
                    f.insert("description".into(), json!(d));
                }
                f.insert(
                    "parameters".into(),
                    t.input_schema
                        .clone()
                        .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
                );
                json!({"type": "function", "function": f})
            })
            .collect();
        Ok(Some(Value::Array(functions)))
    }

    /// `thinking` as the templates' `enable_thinking` (Qwen's).
    fn template_kwargs(&self) -> Result<Map<String, Value>, ApiError> {
        let mut kwargs = Map::new();
        match self.thinking.as_ref().map(|t| t.kind.as_str()) {
            None | Some("adaptive") => {}
            Some("enabled") => {
                kwargs.insert("enable_thinking".into(), json!(true));
            }
            Some("disabled") => {
                kwargs.insert("enable_thinking".into(), json!(false));
            }
            Some(other) => {
                return Err(ApiError::field(
                    "thinking.type",
                    format!("thinking.type must be \"enabled\" or \"disabled\", got {other:?}"),
                ))
            }
        }
        Ok(kwargs)
    }

    /// The sampling fields in the shape the OpenAI endpoints check them in.
    fn sampling(&self) -> Result<Sampling, ApiError> {
        let max_tokens = self.max_tokens.ok_or_else(|| {
            ApiError::field(
                "max_tokens",
                "max_tokens is required (the most tokens to generate)",
            )
        })?;
        Ok(Sampling {
            max_tokens: Some(max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences.clone().map(Stop::Many),
            stream: self.stream,
            ..Sampling::default()
        })
    }
}

/// The text of `system` or of a tool result: a string, or text blocks joined.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(t) => Ok(t.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (block_type(b), b.get("text").and_then(Value::as_str)) {
                    ("text", Some(t)) => {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t);
                    }
                    (kind, _) => return Err(unsupported_block(kind, &format!("{at}[{j}]"))),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::field(
            at,
            format!("{at} must be a string or a list of text blocks"),
        )),
    }
}

fn block_type(b: &Value) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("")
}

fn unsupported_block(kind: &str, at: &str) -> ApiError {
    ApiError::field(
        at,
        format!(
            "{at}: content blocks of type `{kind}` are not supported here (text, tool_use, \
             tool_result and thinking are)"
        ),
    )
}

/// A string field of a block, required.
fn field<'a>(b: &'a Value, name: &str, at: &str) -> Result<&'a str, ApiError> {
    b.get(name).and_then(Value::as_str).ok_or_else(|| {
        ApiError::field(
            &format!("{at}.{name}"),
            format!("{at}.{name} is required (a string)"),
        )
    })
}

/// A user turn: its tool results as tool messages, then its text as a user message.
fn user_turn(
    blocks: &[Value],
    at: &str,
    tool_names: &HashMap<String, String>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let mut text = String::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match block_type(b) {
            "text" => text.push_str(field(b, "text", &at)?),
            "tool_result" => {
                let id = field(b, "tool_use_id", &at)?;
                let mut content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{at}.content"))?,
                };
                if b.get("is_error") == Some(&Value::Bool(true)) {
                    content = format!("Error: {content}");
                }
                out.push(ChatMessage {
                    tool_call_id: Some(id.to_string()),
                    name: tool_names.get(id).cloned(),
                    ..ChatMessage::new("tool", content)
                });
            }
            kind => return Err(unsupported_block(kind, &at)),
        }
    }
    if !text.is_empty() || !blocks.iter().any(|b| block_type(b) == "tool_result") {
        out.push(ChatMessage::new("user", text));
    }
    Ok(())
}

/// An assistant turn: thinking as reasoning, text as content, tool uses as tool calls.
fn assistant_turn(
    blocks: &[Value],
    at: &str,
    tool_names: &mut HashMap<String, String>,
) -> Result<ChatMessage, ApiError> {
    let (mut reasoning, mut text, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match block_type(b) {
            "text" => text.push_str(field(b, "text", &at)?),
            "thinking" => reasoning.push_str(field(b, "thinking", &at)?),
            "redacted_thinking" => {}
            "tool_use" => {
                let (id, name) = (field(b, "id", &at)?, field(b, "name", &at)?);
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                tool_names.insert(id.to_string(), name.to_string());
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": input},
                }));
            }
            kind => return Err(unsupported_block(kind, &at)),
        }
    }
    Ok(ChatMessage {
        content: (!text.is_empty() || calls.is_empty()).then_some(text),
        tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
        reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
        ..ChatMessage::new("assistant", "")
    })
}

/// `toolu_` + 24 alphanumerics, like Anthropic's tool-use ids.
fn tool_use_id() -> String {
    format!(
        "toolu_{}",
        crate::tool_call_id().trim_start_matches("call_")
    )
}

fn stop_reason(finish: FinishReason, tool_use: bool) -> &'static str {
    match finish {
        FinishReason::Length => "max_tokens",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::Stop | FinishReason::Cancelled if tool_use => "tool_use",
        FinishReason::Stop | FinishReason::Cancelled => "end_turn",
    }
}

fn usage(stats: &GenerationStats) -> Value {
    json!({
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": stats.cached_tokens,
        "output_tokens": stats.generated_tokens,
    })
}

/// The parsed request and its rendered prompt.
struct Rendered {
    request: MessagesRequest,
    prompt: sluice_engine::ChatPrompt,
    tools: Option<Value>,
}

fn render<B: Backend + 'static>(
    app: &App<B>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Rendered, ApiError> {
    let body = body_bytes(body)?;
    let request: MessagesRequest = api::parse_body(&body)?;
    let messages = request.messages()?;
    let tools = request.tools()?;
    let kwargs = request.template_kwargs()?;
    let prompt = app
        .engine
        .chat_prompt(&messages, tools.as_ref(), &kwargs)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(Rendered {
        request,
        prompt,
        tools,
    })
}

/// `POST /v1/messages/count_tokens`: the prompt's length, `{"input_tokens": N}`.
pub(crate) async fn count_tokens<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match render(&app, body) {
        Ok(r) => Json(json!({"input_tokens": r.prompt.tokens.len()})).into_response(),
        Err(e) => {
            app.metrics.requests_failed.fetch_add(1, Relaxed);
            error_response(e)
        }
    }
}

/// `POST /v1/messages`.
pub(crate) async fn messages<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.metrics.requests_chat.fetch_add(1, Relaxed);
    match messages_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => {
            app.metrics.requests_failed.fetch_add(1, Relaxed);
            error_response(e)
        }
    }
}

async fn messages_inner<B: Backend + 'static>(
    app: &Arc<App<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Rendered {
        request,
        prompt,
        tools,
    } = render(app, body)?;
    let prepared = app.prepare_chat(prompt, request.sampling()?, tools)?;
    let (rx, guard) = app.submit(&prepared)?;
    let id = format!("msg_{:016x}{:08x}", random_u64(), random_u64() as u32);
    let model = app.config.model_name.clone();
    if prepared.sampling.stream() {
        let stream = MessageStream {
            blocks: Blocks::default(),
            rx,
            _guard: guard,
            finished: false,
        };
        let start = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prepared.prompt.len(), "output_tokens": 0},
        }});
        return Ok(sse(stream::iter([event(&start)]).chain(stream.events())));
    }
    let (events, stats, stop_sequence) = crate::collect(rx, guard).await?;
    let mut content: Vec<Value> = Vec::new();
    let mut tool_use = false;
    for e in events {
        let (kind, text) = match e {
            OutputEvent::Reasoning(t) => ("thinking", t),
            OutputEvent::Content(t) => ("text", t),
            OutputEvent::ToolCall(c) => {
                tool_use = true;
                content.push(json!({
                    "type": "tool_use",
                    "id": c.id.unwrap_or_else(tool_use_id),
                    "name": c.name,
                    "input": input_of(&c.arguments),
                }));
                continue;
            }
        };
        match content.last_mut() {
            Some(last) if last["type"] == kind => {
                let field = if kind == "text" { "text" } else { "thinking" };
                let joined = format!("{}{text}", last[field].as_str().unwrap_or(""));
                last[field] = Value::String(joined);
            }
            _ if kind == "text" => content.push(json!({"type": "text", "text": text})),
            _ => content.push(json!({"type": "thinking", "thinking": text, "signature": ""})),
        }
    }
    // A model's "\n\n" around a tool call is not an answer.
    content.retain(|b| b["type"] != "text" || !b["text"].as_str().unwrap_or("").trim().is_empty());
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(stats.finish, tool_use),
        "stop_sequence": stop_sequence,
        "usage": usage(&stats),
    }))
    .into_response())
}

/// A tool call's arguments (a JSON object's text) as the `input` object.
fn input_of(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

fn event(v: &Value) -> SseEvent {
    SseEvent::default()
        .event(v["type"].as_str().unwrap_or("message"))
        .data(v.to_string())
}

/// The content blocks of a streamed answer: which one is open, and how many were opened.
#[derive(Default)]
struct Blocks {
    open: Option<&'static str>,
    count: usize,
    tool_use: bool,
    /// Whitespace that would open a text block by itself (a model's "\n\n" before a tool
    /// call), held until text follows.
    held: String,
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Value>) {
        if self.open.take().is_some() {
            out.push(json!({"type": "content_block_stop", "index": self.count - 1}));
        }
    }

    fn open(&mut self, kind: &'static str, block: Value, out: &mut Vec<Value>) {
        self.close(out);
        self.open = Some(kind);
        self.count += 1;
        out.push(
            json!({"type": "content_block_start", "index": self.count - 1, "content_block": block}),
        );
    }

    fn delta(&self, delta: Value, out: &mut Vec<Value>) {
        out.push(json!({"type": "content_block_delta", "index": self.count - 1, "delta": delta}));
    }

    fn push(&mut self, e: OutputEvent, out: &mut Vec<Value>) {
        match e {
            OutputEvent::Reasoning(t) => {
                if self.open != Some("thinking") {
                    self.open(
                        "thinking",
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                        out,
                    );
                }
                self.delta(json!({"type": "thinking_delta", "thinking": t}), out);
            }
            OutputEvent::Content(t) => {
                if self.open != Some("text") {
                    if t.trim().is_empty() {
                        self.held.push_str(&t);
                        return;
                    }
                    self.open("text", json!({"type": "text", "text": ""}), out);
                }
                let text = std::mem::take(&mut self.held) + &t;
                self.delta(json!({"type": "text_delta", "text": text}), out);
            }
            OutputEvent::ToolCall(c) => {
                self.held.clear();
                self.tool_use = true;
                let block = json!({
                    "type": "tool_use",
                    "id": c.id.unwrap_or_else(tool_use_id),
                    "name": c.name,
                    "input": {},
                });
                self.open("tool_use", block, out);
                let json = input_of(&c.arguments).to_string();
                self.delta(
                    json!({"type": "input_json_delta", "partial_json": json}),
                    out,
                );
                self.close(out);
            }
        }
    }
}

/// A streamed answer: the model thread's events as Anthropic's SSE events.
struct MessageStream {
    blocks: Blocks,
    rx: UnboundedReceiver<Event>,
    /// Dropped with the stream when the client disconnects: cancels the generation.
    _guard: CancelOnDrop,
    finished: bool,
}

impl MessageStream {
    fn events(self) -> impl Stream<Item = SseEvent> + Send + 'static {
        stream::unfold(self, |mut s| async move {
            if s.finished {
                return None;
            }
            let mut out = Vec::new();
            match s.rx.recv().await {
                Some(Event::Output(events)) => {
                    for e in events {
                        s.blocks.push(e, &mut out);
                    }
                }
                Some(Event::Done {
                    stats,
                    stop_sequence,
                }) => {
                    s.finished = true;
                    s.blocks.close(&mut out);
                    out.push(json!({
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": stop_reason(stats.finish, s.blocks.tool_use),
                            "stop_sequence": stop_sequence,
                        },
                        "usage": usage(&stats),
                    }));
                    out.push(json!({"type": "message_stop"}));
                }
                Some(Event::Error(e)) => {
                    s.finished = true;
                    out.push(
                        json!({"type": "error", "error": {"type": "api_error", "message": e}}),
                    );
                }
                None => return None,
            }
            let events: Vec<SseEvent> = out.iter().map(event).collect();
            Some((stream::iter(events), s))
        })
        .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> MessagesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn a_tool_conversation_becomes_the_chat_templates_messages() {
        let r = request(json!({
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"location": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ]},
            ],
        }));
        let m = r.messages().unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[0].content.as_deref(), Some("Be brief."));
        assert_eq!(m[2].content, None);
        assert_eq!(m[2].reasoning_content.as_deref(), Some("Use the tool."));
        assert_eq!(
            m[2].tool_calls,
            Some(json!([{"id": "toolu_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]))
        );
        assert_eq!(m[3].content.as_deref(), Some("18C"));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].content.as_deref(), Some("And tomorrow?"));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let base = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            request(b)
        };
        let e = with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        )
        .messages()
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        assert!(e.message.contains("`image`"), "{}", e.message);
        let e = with("messages", json!([{"role": "system", "content": "x"}]))
            .messages()
            .unwrap_err();
        assert!(
            e.message.contains("\"user\" or \"assistant\""),
            "{}",
            e.message
        );
        let e = with(
            "tools",
            json!([{"type": "web_search_20250305", "name": "web_search"}]),
        )
        .tools()
        .unwrap_err();
        assert!(e.message.contains("web_search_20250305"), "{}", e.message);
        let e = with("tool_choice", json!({"type": "tool", "name": "nope"}));
        let e = MessagesRequest {
            tools: Some(vec![ToolDef {
                kind: None,
                name: "f".into(),
                description: None,
                input_schema: None,
            }]),
            ..e
        }
        .tools()
        .unwrap_err();
        assert!(e.message.contains("`nope`"), "{}", e.message);
        let mut b = base.clone();
        b.as_object_mut().unwrap().remove("max_tokens");
        let Err(e) = request(b).sampling() else {
            panic!("max_tokens is required")
        };
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = with("thinking", json!({"type": "maybe"}))
            .template_kwargs()
            .unwrap_err();
        assert!(e.message.contains("\"maybe\""), "{}", e.message);
    }

    #[test]
    fn streamed_blocks_open_close_and_hold_leading_whitespace() {
        let mut b = Blocks::default();
        let mut out = Vec::new();
        b.push(OutputEvent::Reasoning("think".into()), &mut out);
        b.push(OutputEvent::Content("\n\n".into()), &mut out);
        b.push(
            OutputEvent::ToolCall(sluice_engine::output::ParsedToolCall {
                name: "f".into(),
                arguments: r#"{"a":1}"#.into(),
                id: None,
            }),
            &mut out,
        );
        b.push(OutputEvent::Content("ok".into()), &mut out);
        b.close(&mut out);
        let kinds: Vec<String> = out
            .iter()
            .map(|v| {
                let t = v["type"].as_str().unwrap();
                match v.get("content_block").or(v.get("delta")) {
                    Some(x) => format!("{t}:{}:{}", v["index"], x["type"].as_str().unwrap()),
                    None => format!("{t}:{}", v["index"]),
                }
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "content_block_start:0:thinking",
                "content_block_delta:0:thinking_delta",
                "content_block_stop:0",
                "content_block_start:1:tool_use",
                "content_block_delta:1:input_json_delta",
                "content_block_stop:1",
                "content_block_start:2:text",
                "content_block_delta:2:text_delta",
                "content_block_stop:2",
            ]
        );
        assert_eq!(out[4]["delta"]["partial_json"], r#"{"a":1}"#);
        assert!(b.tool_use);
        assert!(out[3]["content_block"]["id"]
            .as_str()
            .unwrap()
            .starts_with("toolu_"));
    }
}
