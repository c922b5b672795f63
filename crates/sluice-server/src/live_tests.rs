//! The web page's routes and the live statistics, over real HTTP against the demo model.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_cpu::CpuBackend;
use sluice_engine::streaming::StreamingOptions;
use sluice_engine::{Engine, LoadOptions};
use sluice_store::{ExpertEvent, ExpertMap};

use crate::{router_with, ServerConfig};

/// The demo model; its experts stream through a cache of `cache` bytes, or all stay resident.
fn demo(cache: Option<u64>) -> Engine<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
    let opts = LoadOptions {
        streaming: StreamingOptions {
            expert_cache: cache,
            stream_unpacked: cache.is_some(),
            ..Default::default()
        },
        ..Default::default()
    };
    Engine::load(&dir, Arc::new(CpuBackend::new()), &opts).unwrap()
}

/// A server on a free port; it runs until the runtime is dropped.
fn start(engine: Engine<CpuBackend>) -> (SocketAddr, tokio::runtime::Runtime) {
    // Its sender dropped: a server that never shuts down.
    start_with(engine, tokio::sync::watch::channel(false).1)
}

/// [`start`], told to shut down through `closing`.
fn start_with(
    engine: Engine<CpuBackend>,
    closing: tokio::sync::watch::Receiver<bool>,
) -> (SocketAddr, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let addr = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = router_with(engine, ServerConfig::new(addr, "demo"), closing).unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        addr
    });
    (addr, rt)
}

fn connect(addr: SocketAddr, request: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    s
}

/// A whole response: status, lower-cased head, body (not chunked: the routes tested here send
/// a length).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, Vec<u8>) {
    let mut s = connect(
        addr,
        &format!(
            "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status = head[9..12].parse().unwrap();
    (status, head, raw[split + 4..].to_vec())
}

fn header<'a>(head: &'a str, name: &str) -> &'a str {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap_or("")
}

/// The `data:` events of an SSE response, as JSON, as they come.
struct Events(BufReader<TcpStream>);

impl Events {
    fn open(addr: SocketAddr, path: &str) -> Events {
        let request = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        let s = connect(addr, &request);
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.contains(" 200 "), "{line}");
        Events(r)
    }

    fn next(&mut self) -> Value {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.0.read_line(&mut line).unwrap() > 0, "the stream ended");
            if let Some(data) = line.strip_prefix("data: ") {
                return serde_json::from_str(data.trim_end()).unwrap();
            }
        }
    }
}

#[test]
fn the_stats_stream_shows_the_experts_a_generation_reads() {
    let (addr, _rt) = start(demo(Some(4 << 20)));
    let mut events = Events::open(addr, "/stats/stream");
    let first = events.next();
    assert_eq!(first["streaming"], true);
    assert_eq!(first["store"]["requests"], 0);
    let rows = first["experts"]["map"].as_array().unwrap();
    assert_eq!(rows.len(), 8, "one row per layer");
    assert!(
        rows.iter().all(|r| r.as_str().unwrap() == "0".repeat(32)),
        "nothing is cached before the first request: {rows:?}"
    );
    // Whole slots of the 4 MiB asked for.
    let cache = first["memory"]["expert_cache"].as_u64().unwrap();
    assert!(cache > 3 << 20 && cache <= 4 << 20, "{cache}");

    // The sampler's first snapshot: the next ones have rates.
    events.next();
    let (status, _, body) = http(
        addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": true}"#,
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    // The sampler's snapshots: the counters move, the map fills and records the events, and one
    // interval saw tokens generated.
    let (mut events_seen, mut fastest) = (HashSet::new(), 0.0f64);
    let mut cached;
    let deadline = Instant::now() + Duration::from_secs(30);
    let last = loop {
        let s = events.next();
        let digits: Vec<u32> = s["experts"]["map"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_str().unwrap().chars().map(|c| c.to_digit(32).unwrap()))
            .collect();
        cached = digits.iter().filter(|&&d| d & 1 != 0).count();
        let fresh = digits.iter().filter(|&&d| d as u8 & ExpertMap::FRESH != 0);
        events_seen.extend(fresh.filter_map(|&d| ExpertMap::event(d as u8)));
        fastest = fastest.max(s["rates"]["tok_s"].as_f64().unwrap_or(0.0));
        let done = s["tokens"]["generated"].as_u64() >= Some(24) && s["requests"]["running"] == 0;
        if done && fastest > 0.0 {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no snapshot showed the generation: {s}"
        );
    };
    let store = &last["store"];
    assert!(store["requests"].as_u64().unwrap() > 0, "{store}");
    assert!(store["bytes_read"].as_u64().unwrap() > 0, "{store}");
    assert!(cached > 0 && cached <= store["slots"].as_u64().unwrap() as usize);
    // A 73-slot cache over 256 experts reads on demand and evicts, and hits some.
    for event in [
        ExpertEvent::DemandRead,
        ExpertEvent::Evicted,
        ExpertEvent::Hit,
    ] {
        assert!(
            events_seen.contains(&event),
            "no {event:?} in {events_seen:?}"
        );
    }
    assert!(last["memory"]["expert_cache_used"].as_u64().unwrap() > 0);

    // The one-shot snapshot agrees.
    let (status, head, body) = http(addr, "GET", "/stats", "");
    assert_eq!(status, 200);
    assert!(header(&head, "content-type").starts_with("application/json"));
    let now: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(now["tokens"]["generated"], last["tokens"]["generated"]);
}

#[test]
fn a_resident_model_says_it_streams_nothing() {
    let (addr, _rt) = start(demo(None));
    let (status, _, body) = http(addr, "GET", "/stats", "");
    assert_eq!(status, 200);
    let s: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(s["streaming"], false);
    assert!(s["store"].is_null() && s["experts"].is_null(), "{s}");
    assert!(s["memory"]["weights"].as_u64().unwrap() > 10_000_000, "{s}");
}

#[test]
fn the_page_and_its_files_are_served() {
    let (addr, _rt) = start(demo(None));
    let (status, head, body) = http(addr, "GET", "/", "");
    assert_eq!(status, 200);
    assert_eq!(header(&head, "content-type"), "text/html; charset=utf-8");
    assert!(header(&head, "content-security-policy").contains("script-src 'self'"));
    let page = String::from_utf8(body).unwrap();
    assert!(page.contains(r#"<script type="module" src="/assets/app.js">"#));

    // Every file the page names, and every module a script imports, is there with its type.
    let mut wanted: Vec<String> = page
        .split(['"', '\''])
        .filter_map(|s| s.strip_prefix("/assets/"))
        .map(str::to_string)
        .collect();
    let mut i = 0;
    while i < wanted.len() {
        let name = wanted[i].clone();
        let (status, head, body) = http(addr, "GET", &format!("/assets/{name}"), "");
        assert_eq!(status, 200, "/assets/{name}");
        let kind = header(&head, "content-type");
        let expected = match name.rsplit('.').next() {
            Some("js") => "text/javascript; charset=utf-8",
            Some("css") => "text/css; charset=utf-8",
            Some("svg") => "image/svg+xml",
            other => panic!("unexpected file type {other:?}"),
        };
        assert_eq!(kind, expected, "/assets/{name}");
        if name.ends_with(".js") {
            let dir = name.rsplit_once('/').map_or("", |(d, _)| d);
            let text = String::from_utf8(body).unwrap();
            for import in text.split("from '").skip(1) {
                let path = import.split('\'').next().unwrap();
                let Some(rel) = path.strip_prefix("./") else {
                    continue;
                };
                let full = if dir.is_empty() {
                    rel.to_string()
                } else {
                    format!("{dir}/{rel}")
                };
                if !wanted.contains(&full) {
                    wanted.push(full);
                }
            }
        }
        i += 1;
    }
    assert!(wanted.len() >= 15, "{wanted:?}");
    let (status, _, _) = http(addr, "GET", "/assets/nothing.js", "");
    assert_eq!(status, 404);
    let (status, _, _) = http(addr, "GET", "/assets/../Cargo.toml", "");
    assert_eq!(status, 404);
}

#[test]
fn the_stats_stream_ends_when_the_server_shuts_down() {
    let (closing, rx) = tokio::sync::watch::channel(false);
    let (addr, _rt) = start_with(demo(None), rx);
    let mut events = Events::open(addr, "/stats/stream");
    events.next();
    events.next();
    closing.send_replace(true);
    // The rest of the response is its last chunk: the connection can close, and a graceful
    // shutdown need not wait for it.
    let mut rest = String::new();
    events
        .0
        .get_mut()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    events.0.read_to_string(&mut rest).ok();
    assert!(
        rest.contains("0\r\n\r\n"),
        "the stream did not end: {rest:?}"
    );
}
