//! An OpenAI-compatible HTTP server over one loaded model: what Open WebUI, agents, editors and
//! the `openai` SDKs talk to.
//!
//! Routes: `POST /v1/chat/completions` and `POST /v1/completions` (JSON or SSE streaming),
//! OpenAI's `POST /v1/responses` ([`responses`]), Anthropic's `POST /v1/messages` and
//! `/v1/messages/count_tokens` ([`anthropic`]),
//! `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), and for people and other
//! tools the web page at `/` ([`web`]: chat, and a live view of the experts streaming) with the
//! live statistics it draws, `GET /stats` and `GET /stats/stream` ([`live`]). Requests queue
//! for the single model thread ([`worker`]); a client that disconnects cancels its generation.
//! Chat requests are rendered with the model's own chat template; `<think>` reasoning
//! (gpt-oss: the harmony analysis channel) comes back as `reasoning_content` and `<tool_call>`
//! blocks (and the other families' call formats) as OpenAI `tool_calls`
//! ([`sluice_engine::output`]). A request that
//! extends an earlier conversation resumes from the saved model state of the common prefix
//! ([`sluice_engine::prompt_cache`]) and reports it in `usage.prompt_tokens_details.cached_tokens`.
//!
//! ```no_run
//! # fn demo(engine: sluice_engine::Engine<sluice_cpu::CpuBackend>) -> anyhow::Result<()> {
//! let config = sluice_server::ServerConfig::new("127.0.0.1:8080".parse()?, "my-model");
//! sluice_server::run(engine, config, |addr| eprintln!("listening on http://{addr}"))?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod anthropic;
pub mod api;
pub mod error;
pub mod live;
pub mod metrics;
mod responses;
pub mod web;
pub mod worker;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};
use sluice_backend::Backend;
use sluice_engine::output::{prompt_opens_thinking, OutputEvent, OutputOptions};
use sluice_engine::{Engine, FinishReason, GenerationStats};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use api::{ChatRequest, CompletionRequest, Prompt, Sampling};
use error::ApiError;
use metrics::Metrics;
use worker::{CancelOnDrop, Event, Job, Queue};

/// How the server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// The model id clients see in `/v1/models` and responses.
    pub model_name: String,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Saved request states kept for prompt reuse (0 turns the prompt cache off).
    pub prompt_cache: usize,
    /// Generations run together at most (continuous batching); more wait in a queue.
    pub parallel: usize,
    /// After SIGTERM or Ctrl-C: how long running requests may take to finish (no new
    /// connections are accepted meanwhile) before the server exits anyway.
    pub shutdown_timeout: std::time::Duration,
    /// The most tokens one request may generate: asking for more is an error, and requests that
    /// do not say get this limit (None: up to the context).
    pub max_tokens_limit: Option<usize>,
    /// Browser origins allowed to call the server (CORS), e.g. `http://localhost:3000`; `*`
    /// allows any. Empty: no CORS headers, and preflight requests are refused.
    pub cors_origins: Vec<String>,
}

impl ServerConfig {
    pub fn new(addr: SocketAddr, model_name: impl Into<String>) -> Self {
        ServerConfig {
            addr,
            model_name: model_name.into(),
            api_key: None,
            max_body_bytes: 16 << 20,
            prompt_cache: 8,
            parallel: 4,
            shutdown_timeout: std::time::Duration::from_secs(30),
            max_tokens_limit: None,
            cors_origins: Vec::new(),
        }
    }
}

struct App<B: Backend> {
    engine: Arc<Engine<B>>,
    queue: Queue,
    metrics: Arc<Metrics>,
    config: ServerConfig,
    created: u64,
    ids: AtomicU64,
    live: live::Live,
}

/// Serves until Ctrl-C or SIGTERM, then lets running requests finish (or until a bind/serve
/// error). `on_ready` gets the bound address (useful with port 0).
pub fn run<B: Backend + 'static>(
    engine: Engine<B>,
    config: ServerConfig,
    on_ready: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    // The model computes on its own thread pool; HTTP needs little.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(engine, config, on_ready))
}

async fn serve<B: Backend + 'static>(
    engine: Engine<B>,
    config: ServerConfig,
    on_ready: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.addr))?;
    let addr = listener.local_addr()?;
    let grace = config.shutdown_timeout;
    // Set when the stop signal comes: ends the statistics streams, which would otherwise keep
    // the graceful shutdown waiting for the whole grace period.
    let (closing, closing_rx) = tokio::sync::watch::channel(false);
    let router = router_with(engine, config, closing_rx)?;
    on_ready(addr);
    // On a stop signal the server stops accepting and lets running requests finish; past the
    // grace period it exits anyway.
    let stopping = Arc::new(tokio::sync::Notify::new());
    let server = axum::serve(listener, router).with_graceful_shutdown({
        let stopping = stopping.clone();
        async move {
            let signal = stop_signal().await;
            closing.send_replace(true);
            eprintln!(
                "sluice: {signal}: no new connections; waiting up to {} s (--shutdown-timeout) for running requests",
                grace.as_secs_f64()
            );
            stopping.notify_one();
        }
    });
    tokio::select! {
        r = server => {
            r?;
            eprintln!("sluice: stopped");
        }
        _ = async {
            stopping.notified().await;
            tokio::time::sleep(grace).await;
        } => eprintln!("sluice: requests still running after --shutdown-timeout; exiting"),
    }
    Ok(())
}

/// The first of Ctrl-C (SIGINT) and, on Unix, SIGTERM; its name.
async fn stop_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => "interrupted",
                _ = term.recv() => "terminated",
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                "interrupted"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "interrupted"
    }
}

/// Whether `given` is `key`, in a time that depends on the key's length only, not on where the
/// two first differ: a client cannot find the key a byte at a time by timing the replies.
fn keys_match(given: &[u8], key: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != key.len());
    for (i, &k) in key.iter().enumerate() {
        diff |= k ^ given.get(i).copied().unwrap_or(!k);
    }
    std::hint::black_box(diff) == 0
}

/// The routes; `closing` turns true when the server starts to shut down.
fn router_with<B: Backend + 'static>(
    engine: Engine<B>,
    config: ServerConfig,
    closing: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Router> {
    let engine = Arc::new(engine);
    let metrics = Arc::new(Metrics::default());
    let queue = worker::start(
        engine.clone(),
        metrics.clone(),
        config.prompt_cache,
        config.parallel,
    )?;
    let app = Arc::new(App {
        engine,
        queue,
        metrics,
        created: unix_now(),
        ids: AtomicU64::new(0),
        config: config.clone(),
        live: live::Live::new(closing),
    });
    live::start_sampler(Arc::downgrade(&app));
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions::<B>))
        .route("/v1/completions", post(completions::<B>))
        .route("/v1/responses", post(responses::responses::<B>))
        .route("/v1/models", get(list_models::<B>))
        .route("/v1/models/{*id}", get(get_model::<B>))
        // llama-server's routes without the prefix, which some clients call.
        .route("/chat/completions", post(chat_completions::<B>))
        .route("/completions", post(completions::<B>))
        .route("/responses", post(responses::responses::<B>))
        .route("/models", get(list_models::<B>))
        .route_layer(middleware::from_fn_with_state(app.clone(), check_key::<B>));
    let messages = Router::new()
        .route("/v1/messages", post(anthropic::messages::<B>))
        .route(
            "/v1/messages/count_tokens",
            post(anthropic::count_tokens::<B>),
        )
        .route_layer(middleware::from_fn_with_state(
            app.clone(),
            anthropic::check_key::<B>,
        ));
    Ok(Router::new()
        .merge(v1)
        .merge(messages)
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics_text::<B>))
        .route("/stats", get(live::stats::<B>))
        .route("/stats/stream", get(live::stream::<B>))
        .route("/", get(web::index))
        .route("/assets/{*name}", get(web::asset))
        .fallback(|| async {
            ApiError::invalid("no such route (see /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, /health, /metrics, /stats, /stats/stream, and the web page at /)")
                .with_status(StatusCode::NOT_FOUND)
        })
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .layer(middleware::from_fn_with_state(app.clone(), refuse_oversized_body::<B>))
        .layer(middleware::from_fn_with_state(app.clone(), cors::<B>))
        .with_state(app))
}

/// CORS for the origins of `--cors-origin`: a preflight (`OPTIONS` with
/// `Access-Control-Request-Method`) from an allowed origin is answered 204 with what it may
/// send; other responses to an allowed origin carry `Access-Control-Allow-Origin`. Without
/// allowed origins nothing changes (a preflight gets 405, so browsers on other origins cannot
/// call the server).
async fn cors<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    request: Request,
    next: Next,
) -> Response {
    let allowed = &app.config.cors_origins;
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let Some(origin) = origin.filter(|_| !allowed.is_empty()) else {
        return next.run(request).await;
    };
    let allow = if allowed.iter().any(|a| a == "*") {
        Some("*".to_string())
    } else {
        allowed.iter().find(|a| **a == origin).cloned()
    };
    let preflight = request.method() == axum::http::Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let Some(allow) = allow else {
        if preflight {
            return ApiError::invalid(format!(
                "origin {origin} is not allowed (sluice serve --cors-origin)"
            ))
            .with_status(StatusCode::FORBIDDEN)
            .into_response();
        }
        return next.run(request).await;
    };
    let value =
        |s: &str| header::HeaderValue::from_str(s).unwrap_or(header::HeaderValue::from_static("*"));
    let mut response = if preflight {
        let asked = request
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(header::HeaderValue::from_static(
                "authorization, content-type, x-api-key, anthropic-version",
            ));
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            header::HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            header::HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(request).await
    };
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value(&allow));
    h.insert(header::VARY, header::HeaderValue::from_static("Origin"));
    response
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How much of an over-limit body the server reads and discards before answering 413. A server
/// that answers while the client is still sending, then closes, resets the connection: the
/// client sees a broken pipe instead of the error. Past this cap (or [`DRAIN_TIME`]) it does close.
const DRAIN_CAP: u64 = 256 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Answers a request whose declared `Content-Length` is over the limit with a 413 that the client
/// can read: the body is drained first (bounded), the answer says `Connection: close`.
async fn refuse_oversized_body<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    request: Request,
    next: Next,
) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(declared) = declared.filter(|&n| n > app.config.max_body_bytes as u64) else {
        return next.run(request).await;
    };
    app.metrics.requests_failed.fetch_add(1, Relaxed);
    if declared <= DRAIN_CAP {
        let mut body = request.into_body().into_data_stream();
        let drain = async { while let Some(Ok(_)) = body.next().await {} };
        let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
    }
    let message = format!(
        "the request body ({declared} bytes) is larger than the server's limit of {} bytes \
         (sluice serve --max-body)",
        app.config.max_body_bytes
    );
    let mut response = ApiError::invalid(message)
        .with_status(StatusCode::PAYLOAD_TOO_LARGE)
        .into_response();
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

async fn check_key<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &app.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| keys_match(g.as_bytes(), key.as_bytes())) {
            app.metrics.requests_failed.fetch_add(1, Relaxed);
            let message = if given.is_some() {
                "incorrect API key (send the server's --api-key as `Authorization: Bearer KEY`)"
            } else {
                "missing API key (send the server's --api-key as `Authorization: Bearer KEY`)"
            };
            return ApiError::invalid(message)
                .with_status(StatusCode::UNAUTHORIZED)
                .with_code("invalid_api_key")
                .into_response();
        }
    }
    next.run(request).await
}

fn model_json<B: Backend>(app: &App<B>) -> Value {
    json!({
        "id": app.config.model_name,
        "object": "model",
        "created": app.created,
        "owned_by": "sluice",
        "max_model_len": app.engine.model.info().max_context,
    })
}

async fn list_models<B: Backend + 'static>(State(app): State<Arc<App<B>>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_json(&app)]}))
}

async fn get_model<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    Path(id): Path<String>,
) -> Response {
    if id == app.config.model_name {
        Json(model_json(&app)).into_response()
    } else {
        ApiError::invalid(format!(
            "model `{id}` does not exist (this server has `{}`)",
            app.config.model_name
        ))
        .with_status(StatusCode::NOT_FOUND)
        .with_code("model_not_found")
        .into_response()
    }
}

async fn metrics_text<B: Backend + 'static>(State(app): State<Arc<App<B>>>) -> Response {
    let store = app.engine.store.as_ref().map(|s| s.stats());
    let vram = app.engine.model.backend().expert_cache_stats();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(store.as_ref(), vram.as_ref()),
    )
        .into_response()
}

/// Everything a handler prepared for the model thread, plus what the response needs.
struct Prepared {
    prompt: Vec<u32>,
    sampling: Sampling,
    params: sluice_engine::sampler::SamplingParams,
    max_tokens: usize,
    output: OutputOptions,
    checkpoint: Option<usize>,
}

impl<B: Backend + 'static> App<B> {
    /// The id, timestamp and model name of a new reply; ids are `PREFIX-<random><counter>`.
    fn reply(&self, prefix: &str) -> Reply {
        let n = self.ids.fetch_add(1, Relaxed);
        Reply {
            id: format!("{prefix}-{:x}{n:x}", random_u64() >> 16),
            created: unix_now(),
            model: self.config.model_name.clone(),
        }
    }

    /// Checks lengths and settings shared by both endpoints.
    fn prepare(
        &self,
        prompt: Vec<u32>,
        sampling: Sampling,
        mut output: OutputOptions,
        default_max: Option<usize>,
    ) -> Result<Prepared, ApiError> {
        let params = sampling.params(&self.engine.defaults)?;
        output.stop = sampling.stop()?;
        if prompt.is_empty() {
            return Err(ApiError::field("prompt", "the prompt is empty"));
        }
        let ctx = self.engine.model.info().max_context;
        if prompt.len() >= ctx {
            return Err(ApiError::invalid(format!(
                "the prompt has {} tokens but the model's context is {ctx} tokens; shorten the conversation",
                prompt.len()
            ))
            .with_code("context_length_exceeded"));
        }
        self.engine
            .prompt_state_fits(prompt.len())
            .map_err(|msg| ApiError::invalid(msg).with_code("insufficient_memory"))?;
        let room = ctx - prompt.len();
        let asked = sampling.max_tokens()?;
        let limit = self.config.max_tokens_limit.unwrap_or(usize::MAX);
        if let Some(n) = asked.filter(|&n| n > limit) {
            return Err(ApiError::field(
                "max_tokens",
                format!("max_tokens is {n} but this server generates at most {limit} tokens per request (--max-tokens-limit)"),
            ));
        }
        let max_tokens = asked.or(default_max).unwrap_or(room).min(room).min(limit);
        Ok(Prepared {
            prompt,
            sampling,
            params,
            max_tokens,
            output,
            checkpoint: None,
        })
    }

    /// [`App::prepare`] for a rendered chat prompt: its answer read for reasoning (harmony's
    /// channels for gpt-oss's template) and, when tools were offered, for tool calls; resumable
    /// from the conversation's checkpoint.
    fn prepare_chat(
        &self,
        prompt: sluice_engine::ChatPrompt,
        sampling: Sampling,
        tools: Option<Value>,
    ) -> Result<Prepared, ApiError> {
        let harmony = self.engine.chat_template.is_harmony();
        let output = OutputOptions {
            starts_in_reasoning: !harmony && prompt_opens_thinking(&prompt.text),
            parse_reasoning: true,
            parse_tool_calls: tools.is_some(),
            stop: Vec::new(),
            tools,
            harmony,
        };
        let mut prepared = self.prepare(prompt.tokens, sampling, output, None)?;
        prepared.checkpoint = prompt.checkpoint;
        Ok(prepared)
    }

    /// Queues the generation; the receiver yields its events, the guard cancels it when dropped.
    fn submit(&self, p: &Prepared) -> Result<(UnboundedReceiver<Event>, CancelOnDrop), ApiError> {
        let (events, rx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            prompt: p.prompt.clone(),
            params: p.params.clone(),
            max_tokens: p.max_tokens,
            ignore_eos: p.sampling.ignore_eos.unwrap_or(false),
            checkpoint: p.checkpoint,
            output: p.output.clone(),
            events,
            cancel: cancel.clone(),
            submitted: std::time::Instant::now(),
        };
        if !self.queue.submit(job) {
            return Err(ApiError::internal("the model thread has stopped"));
        }
        Ok((rx, CancelOnDrop(cancel)))
    }
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// `call_` + 24 alphanumerics, like OpenAI's tool-call ids.
fn tool_call_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let (mut a, b) = (random_u64(), random_u64());
    let mut id = String::from("call_");
    for i in 0..24 {
        if i == 12 {
            a = b;
        }
        id.push(ALPHABET[(a % 62) as usize] as char);
        a /= 62;
    }
    id
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is larger than the server's limit (sluice serve --max-body)"
                .to_string()
        } else {
            format!("could not read the request body: {}", e.body_text())
        };
        ApiError::invalid(message).with_status(status)
    })
}

fn usage(stats: &GenerationStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    })
}

fn failed<B: Backend>(app: &App<B>, e: ApiError) -> Response {
    app.metrics.requests_failed.fetch_add(1, Relaxed);
    e.into_response()
}

async fn chat_completions<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.metrics.requests_chat.fetch_add(1, Relaxed);
    match chat_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => failed(&app, e),
    }
}

async fn chat_inner<B: Backend + 'static>(
    app: &Arc<App<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let request: ChatRequest = api::parse_body(&body)?;
    let sampling: Sampling = api::parse_body(&body)?;
    request.check_unsupported()?;
    let messages = request.messages()?;
    let tools = request.tools()?;
    let extra = request.template_kwargs()?;
    let prompt = app
        .engine
        .chat_prompt(&messages, tools.as_ref(), &extra)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let prepared = app.prepare_chat(prompt, sampling, tools)?;
    let (rx, guard) = app.submit(&prepared)?;
    let reply = app.reply("chatcmpl");
    if prepared.sampling.stream() {
        return Ok(stream_reply(
            ChatChunks { tool_calls: 0 },
            reply,
            &prepared,
            rx,
            guard,
        ));
    }
    let (events, stats, _) = collect(rx, guard).await?;
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls = Vec::new();
    for e in events {
        match e {
            OutputEvent::Reasoning(t) => reasoning.push_str(&t),
            OutputEvent::Content(t) => content.push_str(&t),
            OutputEvent::ToolCall(c) => calls.push(json!({
                "id": c.id.unwrap_or_else(tool_call_id),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })),
        }
    }
    let mut message = Map::new();
    message.insert("role".into(), json!("assistant"));
    // OpenAI sends `null` content with tool calls; a model's "\n\n" before the call is not an
    // answer.
    let content = if content.trim().is_empty() && !calls.is_empty() {
        Value::Null
    } else {
        Value::String(content)
    };
    message.insert("content".into(), content);
    if !reasoning.is_empty() {
        message.insert("reasoning_content".into(), Value::String(reasoning));
    }
    let finish = openai_finish_reason(stats.finish, !calls.is_empty());
    if !calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    Ok(Json(json!({
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
        "usage": usage(&stats),
    }))
    .into_response())
}

async fn completions<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.metrics.requests_completion.fetch_add(1, Relaxed);
    match completion_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => failed(&app, e),
    }
}

/// OpenAI's legacy completions endpoint defaults to 16 tokens.
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

async fn completion_inner<B: Backend + 'static>(
    app: &Arc<App<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let request: CompletionRequest = api::parse_body(&body)?;
    let sampling: Sampling = api::parse_body(&body)?;
    if request.suffix.is_some() {
        return Err(ApiError::field("suffix", "suffix is not supported"));
    }
    let tokenizer = &app.engine.tokenizer;
    let (prompt, prompt_text) = match request.prompt {
        Prompt::Text(t) => (tokenizer.encode(&t, true), t),
        Prompt::Texts(v) if v.len() == 1 => (tokenizer.encode(&v[0], true), v[0].clone()),
        Prompt::Texts(v) => {
            return Err(ApiError::field(
                "prompt",
                format!("one prompt per request, got {}", v.len()),
            ))
        }
        Prompt::Tokens(ids) => {
            let vocab = app.engine.model.info().vocab_size;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::field(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            let text = tokenizer.decode(&ids, false).unwrap_or_default();
            (Ok(ids), text)
        }
    };
    let prompt = prompt.map_err(|e| ApiError::invalid(e.to_string()))?;
    let output = OutputOptions {
        starts_in_reasoning: false,
        parse_reasoning: false,
        parse_tool_calls: false,
        stop: Vec::new(),
        tools: None,
        harmony: false,
    };
    let prepared = app.prepare(
        prompt,
        sampling,
        output,
        Some(COMPLETION_DEFAULT_MAX_TOKENS),
    )?;
    let echo = request.echo.unwrap_or(false).then_some(prompt_text);
    let (rx, guard) = app.submit(&prepared)?;
    let reply = app.reply("cmpl");
    if prepared.sampling.stream() {
        return Ok(stream_reply(
            CompletionChunks { echo },
            reply,
            &prepared,
            rx,
            guard,
        ));
    }
    let (events, stats, _) = collect(rx, guard).await?;
    let mut text = echo.unwrap_or_default();
    for e in events {
        if let OutputEvent::Content(t) | OutputEvent::Reasoning(t) = e {
            text.push_str(&t);
        }
    }
    Ok(Json(json!({
        "id": reply.id,
        "object": "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": openai_finish_reason(stats.finish, false)}],
        "usage": usage(&stats),
    }))
    .into_response())
}

/// Waits for a whole generation. Dropping this future (the client went away) drops `guard`,
/// which cancels the generation.
/// Also returns the stop sequence that ended it, if one did.
async fn collect(
    mut rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> Result<(Vec<OutputEvent>, GenerationStats, Option<String>), ApiError> {
    let mut events = Vec::new();
    let result = loop {
        match rx.recv().await {
            Some(Event::Output(e)) => events.extend(e),
            Some(Event::Done {
                stats,
                stop_sequence,
            }) => break Ok((events, stats, stop_sequence)),
            Some(Event::Error(e)) => break Err(ApiError::internal(e)),
            None => break Err(ApiError::internal("the generation ended without a result")),
        }
    };
    drop(guard);
    result
}

struct Reply {
    id: String,
    created: u64,
    model: String,
}

/// An SSE response streaming the generation behind `rx` in `format`'s chunks.
fn stream_reply<F: ChunkFormat>(
    format: F,
    reply: Reply,
    prepared: &Prepared,
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> Response {
    let stream = ChunkStream {
        format,
        reply,
        include_usage: prepared.sampling.include_usage(),
        rx,
        _guard: guard,
        finished: false,
    };
    sse(stream.events())
}

fn sse(events: impl Stream<Item = SseEvent> + Send + 'static) -> Response {
    Sse::new(events.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn done_marker() -> SseEvent {
    SseEvent::default().data("[DONE]")
}

/// How one endpoint writes its streamed chunks.
trait ChunkFormat: Send + 'static {
    /// The `object` of every chunk.
    const OBJECT: &'static str;
    /// Chunks sent before the model's first output.
    fn opening(&mut self) -> Vec<Value>;
    /// The `choices[0]` of chunks for some model output.
    fn choices(&mut self, events: Vec<OutputEvent>) -> Vec<Value>;
    /// The `choices[0]` of the last chunk.
    fn closing(&mut self, finish: FinishReason) -> Value;
}

/// A streamed reply: the model thread's events as SSE chunks, then `finish_reason`, the usage
/// chunk when asked for, and `[DONE]`.
struct ChunkStream<F: ChunkFormat> {
    format: F,
    reply: Reply,
    include_usage: bool,
    rx: UnboundedReceiver<Event>,
    /// Dropped with the stream when the client disconnects: cancels the generation.
    _guard: CancelOnDrop,
    finished: bool,
}

impl<F: ChunkFormat> ChunkStream<F> {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let mut v = json!({
            "id": self.reply.id,
            "object": F::OBJECT,
            "created": self.reply.created,
            "model": self.reply.model,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        data(&v)
    }

    fn events(mut self) -> impl Stream<Item = SseEvent> + Send + 'static {
        let opening: Vec<SseEvent> = self
            .format
            .opening()
            .into_iter()
            .map(|c| self.chunk(json!([c]), None))
            .collect();
        let rest = stream::unfold(self, |mut s| async move {
            if s.finished {
                return None;
            }
            let out = match s.rx.recv().await {
                Some(Event::Output(events)) => s
                    .format
                    .choices(events)
                    .into_iter()
                    .map(|c| s.chunk(json!([c]), None))
                    .collect(),
                Some(Event::Done { stats, .. }) => {
                    s.finished = true;
                    let last = s.format.closing(stats.finish);
                    let mut out = vec![s.chunk(json!([last]), None)];
                    if s.include_usage {
                        out.push(s.chunk(json!([]), Some(usage(&stats))));
                    }
                    out.push(done_marker());
                    out
                }
                Some(Event::Error(e)) => {
                    s.finished = true;
                    vec![data(&ApiError::internal(e).body()), done_marker()]
                }
                None => return None,
            };
            Some((stream::iter(out), s))
        })
        .flatten();
        stream::iter(opening).chain(rest)
    }
}

/// `chat.completion.chunk`s: content, reasoning and tool-call deltas.
struct ChatChunks {
    tool_calls: usize,
}

impl ChunkFormat for ChatChunks {
    const OBJECT: &'static str = "chat.completion.chunk";

    fn opening(&mut self) -> Vec<Value> {
        vec![choice_delta(
            json!({"role": "assistant", "content": ""}),
            None,
        )]
    }

    fn choices(&mut self, events: Vec<OutputEvent>) -> Vec<Value> {
        events
            .into_iter()
            .map(|e| {
                let delta = match e {
                    OutputEvent::Content(t) => json!({"content": t}),
                    OutputEvent::Reasoning(t) => json!({"reasoning_content": t}),
                    OutputEvent::ToolCall(c) => {
                        let index = self.tool_calls;
                        self.tool_calls += 1;
                        json!({"tool_calls": [{
                            "index": index,
                            "id": c.id.unwrap_or_else(tool_call_id),
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }]})
                    }
                };
                choice_delta(delta, None)
            })
            .collect()
    }

    fn closing(&mut self, finish: FinishReason) -> Value {
        choice_delta(
            json!({}),
            Some(openai_finish_reason(finish, self.tool_calls > 0)),
        )
    }
}

/// OpenAI's `finish_reason` for how a generation ended. An answer that ended naturally after tool
/// calls finishes with `tool_calls`; only the handler, which parsed them, knows whether it made
/// any.
fn openai_finish_reason(finish: FinishReason, tool_calls: bool) -> &'static str {
    match finish {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::StopSequence if tool_calls => "tool_calls",
        FinishReason::Stop | FinishReason::StopSequence => "stop",
        // Never sent: a cancelled generation has no client left (see worker::Event::Done).
        FinishReason::Cancelled => "stop",
    }
}

fn choice_delta(delta: Value, finish: Option<&str>) -> Value {
    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
}

/// `text_completion` chunks: text pieces (after the prompt, with `echo`).
struct CompletionChunks {
    echo: Option<String>,
}

impl ChunkFormat for CompletionChunks {
    const OBJECT: &'static str = "text_completion";

    fn opening(&mut self) -> Vec<Value> {
        self.echo
            .take()
            .filter(|t| !t.is_empty())
            .map(|t| choice_text(&t, None))
            .into_iter()
            .collect()
    }

    fn choices(&mut self, events: Vec<OutputEvent>) -> Vec<Value> {
        events
            .into_iter()
            .filter_map(|e| match e {
                OutputEvent::Content(t) | OutputEvent::Reasoning(t) => Some(choice_text(&t, None)),
                OutputEvent::ToolCall(_) => None,
            })
            .collect()
    }

    fn closing(&mut self, finish: FinishReason) -> Value {
        choice_text("", Some(openai_finish_reason(finish, false)))
    }
}

fn choice_text(text: &str, finish: Option<&str>) -> Value {
    json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
}

#[cfg(test)]
mod live_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_map_to_openai_ones() {
        use FinishReason::*;
        assert_eq!(openai_finish_reason(Stop, false), "stop");
        assert_eq!(openai_finish_reason(StopSequence, false), "stop");
        assert_eq!(openai_finish_reason(Length, false), "length");
        assert_eq!(openai_finish_reason(Stop, true), "tool_calls");
        assert_eq!(openai_finish_reason(StopSequence, true), "tool_calls");
        // Cut off mid-answer: the tool calls may be incomplete, so it is not a tool-call finish.
        assert_eq!(openai_finish_reason(Length, true), "length");
    }

    #[test]
    fn tool_call_ids_look_like_openai_ones() {
        let id = tool_call_id();
        assert!(id.starts_with("call_"));
        assert_eq!(id.len(), 29);
        assert!(id[5..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(tool_call_id(), tool_call_id());
    }

    #[test]
    fn streamed_tool_calls_keep_the_models_own_id() {
        use sluice_engine::output::ParsedToolCall;
        let call = |id: Option<&str>| {
            OutputEvent::ToolCall(ParsedToolCall {
                name: "f".into(),
                arguments: "{}".into(),
                id: id.map(str::to_string),
            })
        };
        let mut chunks = ChatChunks { tool_calls: 0 };
        let out = chunks.choices(vec![call(Some("functions.f:0")), call(None)]);
        let ids: Vec<&str> = out
            .iter()
            .filter_map(|c| c["delta"]["tool_calls"][0]["id"].as_str())
            .collect();
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[0], "functions.f:0");
        assert!(ids[1].starts_with("call_"), "{}", ids[1]);
        assert_eq!(out[1]["delta"]["tool_calls"][0]["index"], 1);
    }

    #[test]
    fn keys_match_only_the_whole_key() {
        assert!(keys_match(b"secret", b"secret"));
        for wrong in [
            &b""[..],
            b"s",
            b"secre",
            b"secreT",
            b"secrets",
            b"xecret",
            b"secret\0",
        ] {
            assert!(!keys_match(wrong, b"secret"), "{wrong:?}");
        }
        assert!(keys_match(b"", b""));
        assert!(!keys_match(b"a", b""));
    }
}
