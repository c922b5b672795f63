//! Live statistics, for the web page's expert view and any other tool: `GET /stats` (one JSON
//! snapshot) and `GET /stats/stream` (server-sent events, a snapshot every [`INTERVAL`]).
//!
//! One sampler task serves every stream: it wakes every [`INTERVAL`], does nothing while nobody
//! listens, and otherwise reads the counters (atomics, and the store's lock for a moment) and the
//! expert map (one atomic byte per expert), clearing each byte's "fresh" bit so that each
//! snapshot marks the experts something happened to since the one before. Generation never waits on it. The snapshot's fields are
//! documented in the README ("Live statistics").

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use sluice_backend::Backend;
use sluice_store::{ExpertMap, StoreStats};
use tokio::sync::watch;

use crate::App;

/// How often the stream sends a snapshot.
pub const INTERVAL: Duration = Duration::from_millis(250);

/// The base-32 digit of each expert's byte in `experts.map` (bits 0-4, see [`ExpertMap`]).
const DIGITS: &[u8; 32] = b"0123456789abcdefghijklmnopqrstuv";

/// The sampler's latest snapshot, shared by the streams.
pub(crate) struct Live {
    started: Instant,
    latest: watch::Sender<Arc<str>>,
    /// True once the server shuts down: the streams end.
    closing: watch::Receiver<bool>,
}

impl Live {
    pub(crate) fn new(closing: watch::Receiver<bool>) -> Live {
        Live {
            started: Instant::now(),
            latest: watch::Sender::new(Arc::from("")),
            closing,
        }
    }
}

/// The counters a snapshot's rates are computed from.
#[derive(Clone)]
struct Counters {
    at: Instant,
    generated: u64,
    store: Option<StoreStats>,
}

/// Samples every [`INTERVAL`] while some stream listens; ends with the server.
pub(crate) fn start_sampler<B: Backend + 'static>(app: Weak<App<B>>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut prev: Option<Counters> = None;
        loop {
            tick.tick().await;
            let Some(app) = app.upgrade() else { return };
            if app.live.latest.receiver_count() == 0 {
                prev = None;
                continue;
            }
            let (snapshot, counters) = snapshot(&app, prev.as_ref(), true);
            prev = Some(counters);
            app.live
                .latest
                .send_replace(Arc::from(snapshot.to_string()));
        }
    });
}

/// `GET /stats`: the state now (the map's fresh bits: since the stream's last snapshot; no
/// rates).
pub(crate) async fn stats<B: Backend + 'static>(State(app): State<Arc<App<B>>>) -> Response {
    Json(snapshot(&app, None, false).0).into_response()
}

/// `GET /stats/stream`: a snapshot at once, then one every [`INTERVAL`], as SSE `data:` lines,
/// until the server shuts down.
pub(crate) async fn stream<B: Backend + 'static>(State(app): State<Arc<App<B>>>) -> Response {
    let first = snapshot(&app, None, false).0.to_string();
    let rx = app.live.latest.subscribe();
    let mut closing = app.live.closing.clone();
    drop(app);
    let closed = async move {
        // A server that never closes (its sender gone) leaves the stream open.
        if closing.wait_for(|&c| c).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let rest = stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        let text = rx.borrow_and_update().clone();
        Some((SseEvent::default().data(&*text), rx))
    });
    let events = stream::once(async move { SseEvent::default().data(first) }).chain(rest);
    crate::sse(events.take_until(closed))
}

/// The snapshot as JSON, and the counters for the next one's rates. `clear` resets the expert
/// map's fresh bits (the sampler only).
fn snapshot<B: Backend + 'static>(
    app: &App<B>,
    prev: Option<&Counters>,
    clear: bool,
) -> (Value, Counters) {
    let engine = &app.engine;
    let metrics = &app.metrics;
    let now = Instant::now();
    let counters = Counters {
        at: now,
        generated: metrics.generated_tokens.load(Relaxed),
        store: engine.store.as_ref().map(|s| s.stats()),
    };
    let info = engine.model.info();
    let map = engine.store.as_ref().map(|s| {
        let m = s.expert_map();
        (
            m.layers().map(|(l, _)| l).collect::<Vec<_>>(),
            m.snapshot(clear),
        )
    });
    let plan = engine.cache_plan.as_ref();
    let (cache_bytes, slots) = engine
        .store
        .as_ref()
        .map_or((0, 0), |s| (s.cache_bytes(), s.slots()));
    let cached = map.as_ref().map_or(0, |(_, m)| {
        m.iter()
            .flatten()
            .filter(|&&b| b & ExpertMap::IN_CACHE != 0)
            .count()
    });
    let weights = match plan {
        Some(p) => p.resident_bytes,
        None => (info.dense_bytes + info.expert_bytes) as u64,
    };
    let memory = json!({
        "weights": weights,
        "expert_cache": cache_bytes,
        "expert_cache_used": (cached as u64 * cache_bytes).checked_div(slots as u64).unwrap_or(0),
        "experts_total": plan.map_or(info.expert_bytes as u64, |p| p.expert_bytes),
        "state_per_token": info.state_bytes_per_token,
        "state_fixed": info.state_bytes_fixed,
        "plan": plan.map(|p| p.reason.as_str()),
        "rss": sluice_sys::current_rss_bytes(),
        "available": sluice_sys::mem_available_bytes(),
    });
    let store = engine
        .store
        .as_ref()
        .zip(counters.store.as_ref())
        .map(|(s, st)| {
            let mut v = serde_json::to_value(st).unwrap_or(Value::Null);
            v["hit_rate"] = json!(st.hit_rate());
            v["slots"] = json!(slots);
            v["slot_bytes"] = json!(s.manifest().max_stride());
            v["io"] = json!(s.io_description());
            v
        });
    let experts = map.map(|(layers, m)| {
        let rows: Vec<String> = m
            .iter()
            .map(|row| {
                row.iter()
                    .map(|&b| DIGITS[(b & 31) as usize] as char)
                    .collect()
            })
            .collect();
        json!({"layers": layers, "map": rows})
    });
    let rates = prev.map(|p| rates(p, &counters));
    let v = json!({
        "time": now.duration_since(app.live.started).as_secs_f64(),
        "model": app.config.model_name,
        "device": engine.model.backend().describe(),
        "streaming": engine.store.is_some(),
        "layers": info.layers,
        "experts_per_layer": info.experts,
        "experts_per_token": info.experts_per_token,
        "requests": {
            "running": metrics.running.load(Relaxed),
            "queued": metrics.queue_depth.load(Relaxed),
            "finished": metrics.requests_finished.load(Relaxed),
            "cancelled": metrics.requests_cancelled.load(Relaxed),
        },
        "tokens": {
            "generated": counters.generated,
            "prompt": metrics.prompt_tokens.load(Relaxed),
        },
        "rates": rates,
        "memory": memory,
        "store": store,
        "experts": experts,
    });
    (v, counters)
}

/// What happened between two samples, per second of wall time.
fn rates(prev: &Counters, now: &Counters) -> Value {
    let secs = now.at.duration_since(prev.at).as_secs_f64().max(1e-6);
    let tokens = now.generated.saturating_sub(prev.generated);
    let mut v = json!({
        "interval": secs,
        "tok_s": tokens as f64 / secs,
        "read_gb_s": 0.0,
        "hit_rate": null,
        "io_wait": 0.0,
    });
    if let (Some(a), Some(b)) = (&prev.store, &now.store) {
        let d = b.since(a);
        v["read_gb_s"] = json!(d.bytes_read as f64 / secs / 1e9);
        v["io_wait"] = json!((d.io_wait_secs / secs).min(1.0));
        if d.requests > 0 {
            v["hit_rate"] = json!(d.hit_rate());
        }
    }
    v
}
