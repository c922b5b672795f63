//! OpenAI's Responses API (`POST /v1/responses`): what Codex and the newer OpenAI SDK agents speak.
//!
//! A request becomes the same chat-template conversation as a chat completion: `instructions`
//! as the system message, `input` (a string, or items: messages with text parts, the
//! `reasoning`, `function_call` and `function_call_output` items of earlier turns) as the turns,
//! where an earlier answer's reasoning, text and calls join into one assistant message. The
//! answer comes back as `reasoning` (its text as `reasoning_text` content), `message`
//! (`output_text`) and `function_call` items; `status` is `incomplete` with
//! `incomplete_details.reason` `max_output_tokens` when the limit cut it. `stream: true` sends the
//! typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`, ..., `response.completed`), each with its
//! `sequence_number`. Responses are not stored: `previous_response_id` is refused (send the whole
//! conversation, as `store: false` clients do).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
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

use crate::api::{self, Sampling};
use crate::error::ApiError;
use crate::worker::{CancelOnDrop, Event};
use crate::{body_bytes, failed, random_u64, sse, tool_call_id, unix_now, App};

/// `POST /v1/responses`.
#[derive(Deserialize)]
struct ResponsesRequest {
    input: Value,
    instructions: Option<String>,
    /// As sent: echoed back in the response, and read as [`ToolDef`]s.
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    max_output_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    stream: Option<bool>,
    reasoning: Option<Reasoning>,
    previous_response_id: Option<String>,
    parallel_tool_calls: Option<bool>,
}

#[derive(Deserialize)]
struct ToolDef {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    description: Option<String>,
    parameters: Option<Value>,
}

#[derive(Deserialize)]
struct Reasoning {
    effort: Option<String>,
}

/// The assistant turn being gathered from consecutive output items of an earlier answer.
#[derive(Default)]
struct AssistantTurn {
    reasoning: String,
    text: String,
    calls: Vec<Value>,
}

impl AssistantTurn {
    fn flush(&mut self, out: &mut Vec<ChatMessage>) {
        let t = std::mem::take(self);
        if t.reasoning.is_empty() && t.text.is_empty() && t.calls.is_empty() {
            return;
        }
        out.push(ChatMessage {
            content: (!t.text.is_empty() || t.calls.is_empty()).then_some(t.text),
            tool_calls: (!t.calls.is_empty()).then_some(Value::Array(t.calls)),
            reasoning_content: (!t.reasoning.is_empty()).then_some(t.reasoning),
            ..ChatMessage::new("assistant", "")
        });
    }
}

fn str_field<'a>(item: &'a Value, name: &str, at: &str) -> Result<&'a str, ApiError> {
    item.get(name).and_then(Value::as_str).ok_or_else(|| {
        ApiError::field(
            &format!("{at}.{name}"),
            format!("{at}.{name} is required (a string)"),
        )
    })
}

/// A message's text: a string, or its text parts joined.
fn text_of(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(t) => Ok(t.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match kind {
                    "input_text" | "output_text" | "text" | "reasoning_text" | "summary_text" => {
                        text.push_str(str_field(p, "text", &format!("{at}[{j}]"))?)
                    }
                    _ => {
                        return Err(ApiError::field(
                            &format!("{at}[{j}]"),
                            format!(
                                "{at}[{j}]: content of type `{kind}` is not supported here \
                                 (text only)"
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::field(
            at,
            format!("{at} must be a string or a list of content parts"),
        )),
    }
}

impl ResponsesRequest {
    fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.previous_response_id.is_some() {
            return Err(ApiError::field(
                "previous_response_id",
                "previous_response_id is not supported: sluice does not store responses; send \
                 the whole conversation in `input`",
            ));
        }
        let mut out = Vec::new();
        if let Some(i) = &self.instructions {
            out.push(ChatMessage::new("system", i.clone()));
        }
        let items = match &self.input {
            Value::String(t) => {
                out.push(ChatMessage::new("user", t.clone()));
                return Ok(out);
            }
            Value::Array(items) if !items.is_empty() => items,
            _ => {
                return Err(ApiError::field(
                    "input",
                    "input must be a string or a non-empty list of items",
                ))
            }
        };
        let mut turn = AssistantTurn::default();
        let mut names: HashMap<String, String> = HashMap::new();
        for (i, item) in items.iter().enumerate() {
            let at = format!("input[{i}]");
            let kind = item.get("type").and_then(Value::as_str);
            match (kind, item.get("role").and_then(Value::as_str)) {
                (None | Some("message"), Some("assistant")) => {
                    let content = item.get("content").unwrap_or(&Value::Null);
                    turn.text
                        .push_str(&text_of(content, &format!("{at}.content"))?);
                }
                (None | Some("message"), Some(role)) => {
                    let role = match role {
                        "developer" | "system" => "system",
                        "user" => "user",
                        other => {
                            return Err(ApiError::field(
                                &format!("{at}.role"),
                                format!(
                                    "{at}.role must be user, assistant, system or developer, \
                                     got {other:?}"
                                ),
                            ))
                        }
                    };
                    turn.flush(&mut out);
                    let content = item.get("content").unwrap_or(&Value::Null);
                    out.push(ChatMessage::new(
                        role,
                        text_of(content, &format!("{at}.content"))?,
                    ));
                }
                (Some("reasoning"), _) => {
                    for key in ["content", "summary"] {
                        if let Some(parts @ Value::Array(p)) = item.get(key) {
                            if !p.is_empty() {
                                turn.reasoning
                                    .push_str(&text_of(parts, &format!("{at}.{key}"))?);
                                break;
                            }
                        }
                    }
                }
                (Some("function_call"), _) => {
                    let call_id = str_field(item, "call_id", &at)?;
                    let name = str_field(item, "name", &at)?;
                    let arguments = str_field(item, "arguments", &at)?;
                    names.insert(call_id.to_string(), name.to_string());
                    turn.calls.push(json!({
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }));
                }
                (Some("function_call_output"), _) => {
                    turn.flush(&mut out);
                    let call_id = str_field(item, "call_id", &at)?;
                    let output = item.get("output").unwrap_or(&Value::Null);
                    out.push(ChatMessage {
                        tool_call_id: Some(call_id.to_string()),
                        name: names.get(call_id).cloned(),
                        ..ChatMessage::new("tool", text_of(output, &format!("{at}.output"))?)
                    });
                }
                (Some(other), _) => {
                    return Err(ApiError::field(
                        &format!("{at}.type"),
                        format!(
                            "{at}: input items of type `{other}` are not supported here \
                             (message, reasoning, function_call, function_call_output are)"
                        ),
                    ))
                }
                (None, None) => {
                    return Err(ApiError::field(
                        &at,
                        format!("{at} has neither a `type` nor a `role`"),
                    ))
                }
            }
        }
        turn.flush(&mut out);
        Ok(out)
    }

    /// The function tools as the chat templates take them; `None`: no tools.
    fn tools(&self) -> Result<Option<Value>, ApiError> {
        let Some(tools) = &self.tools else {
            return Ok(None);
        };
        let mut functions = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let t: ToolDef = serde_json::from_value(t.clone())
                .map_err(|e| ApiError::field(&format!("tools[{i}]"), format!("tools[{i}]: {e}")))?;
            if t.kind != "function" {
                return Err(ApiError::field(
                    &format!("tools[{i}].type"),
                    format!(
                        "tools[{i}]: the built-in tool `{}` is not available here; only \
                         function tools are",
                        t.kind
                    ),
                ));
            }
            let name = t.name.as_deref().ok_or_else(|| {
                ApiError::field(
                    &format!("tools[{i}].name"),
                    format!("tools[{i}].name is required"),
                )
            })?;
            let mut f = Map::new();
            f.insert("name".into(), json!(name));
            if let Some(d) = &t.description {
                f.insert("description".into(), json!(d));
            }
            if let Some(p) = &t.parameters {
                f.insert("parameters".into(), p.clone());
            }
            functions.push((name.to_string(), json!({"type": "function", "function": f})));
        }
        let chosen: Vec<Value> = match &self.tool_choice {
            None => functions.into_iter().map(|f| f.1).collect(),
            Some(Value::String(m)) => match m.as_str() {
                "none" => return Ok(None),
                // No constrained decoding: `required` offers the tools like `auto`.
                "auto" | "required" => functions.into_iter().map(|f| f.1).collect(),
                other => {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!("tool_choice must be none, auto, required or a named function, got {other:?}"),
                    ))
                }
            },
            Some(c) => {
                let name = c.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::field(
                        "tool_choice",
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ..}",
                    )
                })?;
                let named: Vec<Value> = functions
                    .into_iter()
                    .filter(|f| f.0 == name)
                    .map(|f| f.1)
                    .collect();
                if named.is_empty() {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!("tool_choice names `{name}`, which is not in tools"),
                    ));
                }
                named
            }
        };
        Ok((!chosen.is_empty()).then_some(Value::Array(chosen)))
    }

    fn template_kwargs(&self) -> Result<Map<String, Value>, ApiError> {
        let mut kwargs = Map::new();
        if let Some(effort) = self.reasoning.as_ref().and_then(|r| r.effort.as_ref()) {
            if !matches!(effort.as_str(), "minimal" | "low" | "medium" | "high") {
                return Err(ApiError::field(
                    "reasoning.effort",
                    format!(
                        "reasoning.effort must be minimal, low, medium or high, got {effort:?}"
                    ),
                ));
            }
            // gpt-oss's template knows low, medium and high.
            let effort = if effort == "minimal" { "low" } else { effort };
            kwargs.insert("reasoning_effort".into(), json!(effort));
        }
        Ok(kwargs)
    }

    fn sampling(&self) -> Sampling {
        Sampling {
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            stream: self.stream,
            ..Sampling::default()
        }
    }
}

fn short_id(prefix: &str) -> String {
    format!("{prefix}_{:016x}{:08x}", random_u64(), random_u64() as u32)
}

/// An open output item: its index in `output`, id, kind and text so far.
struct Open {
    index: usize,
    id: String,
    kind: &'static str,
    text: String,
}

/// The output items of an answer, built from the model's events; `emit` collects the streamed
/// events that go with each step (a non-streamed answer drops them).
struct Items {
    output: Vec<Value>,
    open: Option<Open>,
    /// Whitespace that would open a message by itself (a model's "\n\n" before a call).
    held: String,
    sequence: u64,
    emitted: Vec<Value>,
}

impl Items {
    fn new() -> Self {
        Items {
            output: Vec::new(),
            open: None,
            held: String::new(),
            sequence: 0,
            emitted: Vec::new(),
        }
    }

    fn emit(&mut self, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.emitted.push(v);
    }

    fn part(kind: &str, text: &str) -> Value {
        match kind {
            "message" => json!({"type": "output_text", "text": text, "annotations": []}),
            _ => json!({"type": "reasoning_text", "text": text}),
        }
    }

    fn item(kind: &str, id: &str, status: &str, parts: Vec<Value>) -> Value {
        match kind {
            "message" => json!({"type": "message", "id": id, "status": status,
                                "role": "assistant", "content": parts}),
            _ => json!({"type": "reasoning", "id": id, "status": status, "summary": [],
                        "content": parts}),
        }
    }

    fn close(&mut self) {
        let Some(o) = self.open.take() else { return };
        let part = Self::part(o.kind, &o.text);
        let (index, id) = (o.index, o.id.clone());
        let done = if o.kind == "message" {
            "response.output_text.done"
        } else {
            "response.reasoning_text.done"
        };
        let mut v =
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": o.text});
        if o.kind == "message" {
            v["logprobs"] = json!([]);
        }
        self.emit(done, v);
        self.emit(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        let item = Self::item(o.kind, &id, "completed", vec![part]);
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.output.push(item);
    }

    fn text(&mut self, kind: &'static str, t: String) {
        if self.open.as_ref().map(|o| o.kind) != Some(kind) {
            self.close();
            let (index, id) = (
                self.output.len(),
                short_id(if kind == "message" { "msg" } else { "rs" }),
            );
            let item = Self::item(kind, &id, "in_progress", Vec::new());
            self.emit(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.emit(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": Self::part(kind, "")}),
            );
            self.open = Some(Open {
                index,
                id,
                kind,
                text: String::new(),
            });
        }
        let o = self.open.as_mut().expect("opened above");
        o.text.push_str(&t);
        let (id, index) = (o.id.clone(), o.index);
        let delta = if kind == "message" {
            "response.output_text.delta"
        } else {
            "response.reasoning_text.delta"
        };
        let mut v = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t});
        if kind == "message" {
            v["logprobs"] = json!([]);
        }
        self.emit(delta, v);
    }

    fn push(&mut self, e: OutputEvent) {
        match e {
            OutputEvent::Reasoning(t) => self.text("reasoning", t),
            OutputEvent::Content(t) => {
                if self.open.as_ref().map(|o| o.kind) != Some("message") && t.trim().is_empty() {
                    self.held.push_str(&t);
                    return;
                }
                let t = std::mem::take(&mut self.held) + &t;
                self.text("message", t);
            }
            OutputEvent::ToolCall(c) => {
                self.close();
                self.held.clear();
                let (index, id) = (self.output.len(), short_id("fc"));
                let call_id = c.id.unwrap_or_else(tool_call_id);
                let item = |arguments: &str, status: &str| {
                    json!({"type": "function_call", "id": id, "call_id": call_id, "name": c.name,
                           "arguments": arguments, "status": status})
                };
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item("", "in_progress")}),
                );
                self.emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": c.arguments}),
                );
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": c.name,
                           "arguments": c.arguments}),
                );
                let done = item(&c.arguments, "completed");
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": done}),
                );
                self.output.push(done);
            }
        }
    }

    fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.emitted)
    }
}

/// The response object: its settings echoed, and the output and usage once done.
struct Envelope {
    id: String,
    created_at: u64,
    model: String,
    settings: Map<String, Value>,
}

impl Envelope {
    fn response(&self, status: &str, output: &[Value], done: Option<&GenerationStats>) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": null,
            "incomplete_details": null,
            "usage": null,
        });
        if let Some(stats) = done {
            if stats.finish == FinishReason::Length {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r["usage"] = json!({
                "input_tokens": stats.prompt_tokens,
                "input_tokens_details": {"cached_tokens": stats.cached_tokens},
                "output_tokens": stats.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            });
        }
        let obj = r.as_object_mut().expect("an object");
        for (k, v) in &self.settings {
            obj.insert(k.clone(), v.clone());
        }
        r
    }
}

fn status_of(stats: &GenerationStats) -> &'static str {
    match stats.finish {
        FinishReason::Length => "incomplete",
        _ => "completed",
    }
}

/// `POST /v1/responses`.
pub(crate) async fn responses<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.metrics.requests_chat.fetch_add(1, Relaxed);
    match responses_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => failed(&app, e),
    }
}

async fn responses_inner<B: Backend + 'static>(
    app: &Arc<App<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let request: ResponsesRequest = api::parse_body(&body)?;
    let messages = request.messages()?;
    let tools = request.tools()?;
    let kwargs = request.template_kwargs()?;
    let prompt = app
        .engine
        .chat_prompt(&messages, tools.as_ref(), &kwargs)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let prepared = app.prepare_chat(prompt, request.sampling(), tools)?;
    let (rx, guard) = app.submit(&prepared)?;
    let mut settings = Map::new();
    settings.insert("instructions".into(), json!(request.instructions));
    settings.insert("max_output_tokens".into(), json!(request.max_output_tokens));
    settings.insert("temperature".into(), json!(prepared.params.temperature));
    settings.insert("top_p".into(), json!(prepared.params.top_p));
    settings.insert(
        "tool_choice".into(),
        request.tool_choice.clone().unwrap_or(json!("auto")),
    );
    settings.insert(
        "tools".into(),
        json!(request.tools.clone().unwrap_or_default()),
    );
    settings.insert(
        "parallel_tool_calls".into(),
        json!(request.parallel_tool_calls.unwrap_or(true)),
    );
    settings.insert("previous_response_id".into(), Value::Null);
    settings.insert("store".into(), json!(false));
    settings.insert("text".into(), json!({"format": {"type": "text"}}));
    settings.insert("metadata".into(), json!({}));
    let envelope = Envelope {
        id: short_id("resp"),
        created_at: unix_now(),
        model: app.config.model_name.clone(),
        settings,
    };
    if prepared.sampling.stream() {
        let mut items = Items::new();
        let created = envelope.response("in_progress", &[], None);
        items.emit("response.created", json!({"response": created.clone()}));
        items.emit("response.in_progress", json!({"response": created}));
        let opening: Vec<SseEvent> = items.take_events().iter().map(event).collect();
        let s = ResponseStream {
            items,
            envelope,
            rx,
            _guard: guard,
            finished: false,
        };
        return Ok(sse(stream::iter(opening).chain(s.events())));
    }
    let (events, stats, _) = crate::collect(rx, guard).await?;
    let mut items = Items::new();
    for e in events {
        items.push(e);
    }
    items.close();
    let status = status_of(&stats);
    Ok(Json(envelope.response(status, &items.output, Some(&stats))).into_response())
}

fn event(v: &Value) -> SseEvent {
    SseEvent::default()
        .event(v["type"].as_str().unwrap_or("message"))
        .data(v.to_string())
}

struct ResponseStream {
    items: Items,
    envelope: Envelope,
    rx: UnboundedReceiver<Event>,
    /// Dropped with the stream when the client disconnects: cancels the generation.
    _guard: CancelOnDrop,
    finished: bool,
}

impl ResponseStream {
    fn events(self) -> impl Stream<Item = SseEvent> + Send + 'static {
        stream::unfold(self, |mut s| async move {
            if s.finished {
                return None;
            }
            match s.rx.recv().await {
                Some(Event::Output(events)) => {
                    for e in events {
                        s.items.push(e);
                    }
                }
                Some(Event::Done { stats, .. }) => {
                    s.finished = true;
                    s.items.close();
                    let status = status_of(&stats);
                    let response = s.envelope.response(status, &s.items.output, Some(&stats));
                    let kind = if status == "completed" {
                        "response.completed"
                    } else {
                        "response.incomplete"
                    };
                    s.items.emit(kind, json!({"response": response}));
                }
                Some(Event::Error(e)) => {
                    s.finished = true;
                    s.items.emit(
                        "error",
                        json!({"code": "server_error", "message": e, "param": null}),
                    );
                }
                None => return None,
            }
            let out: Vec<SseEvent> = s.items.take_events().iter().map(event).collect();
            Some((stream::iter(out), s))
        })
        .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn items_of_an_earlier_answer_join_into_one_assistant_turn() {
        let r = request(json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"location\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18C."}]},
                {"role": "user", "content": "Thanks"},
            ],
        }));
        let m = r.messages().unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "assistant", "user"]
        );
        assert_eq!(m[2].reasoning_content.as_deref(), Some("Use the tool."));
        assert_eq!(m[2].content, None);
        assert_eq!(
            m[2].tool_calls.as_ref().unwrap()[0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].content.as_deref(), Some("18C."));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let e = request(json!({"input": "x", "previous_response_id": "resp_1"}))
            .messages()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("previous_response_id"));
        let e = request(json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}))
            .messages()
            .unwrap_err();
        assert!(e.message.contains("`input_image`"), "{}", e.message);
        let e = request(json!({"input": [{"type": "item_reference", "id": "x"}]}))
            .messages()
            .unwrap_err();
        assert!(e.message.contains("`item_reference`"), "{}", e.message);
        let e = request(json!({"input": "x", "tools": [{"type": "web_search"}]}))
            .tools()
            .unwrap_err();
        assert!(e.message.contains("`web_search`"), "{}", e.message);
        let e = request(json!({"input": "x", "reasoning": {"effort": "max"}}))
            .template_kwargs()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("reasoning.effort"));
    }

    #[test]
    fn streamed_items_follow_the_event_order_clients_expect() {
        let mut items = Items::new();
        items.push(OutputEvent::Reasoning("hm".into()));
        items.push(OutputEvent::Content("\n".into()));
        items.push(OutputEvent::ToolCall(
            sluice_engine::output::ParsedToolCall {
                name: "f".into(),
                arguments: "{}".into(),
                id: None,
            },
        ));
        items.push(OutputEvent::Content("ok".into()));
        items.close();
        let kinds: Vec<&str> = items
            .emitted
            .iter()
            .map(|v| v["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
        let seq: Vec<u64> = items
            .emitted
            .iter()
            .map(|v| v["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seq, (0..16).collect::<Vec<_>>());
        let types: Vec<&str> = items
            .output
            .iter()
            .map(|v| v["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["reasoning", "function_call", "message"]);
        assert!(items.output[1]["call_id"]
            .as_str()
            .unwrap()
            .starts_with("call_"));
    }
}
