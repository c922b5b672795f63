//! HTTP request bodies of each endpoint, through the real server: `sluice serve`'s router over
//! loopback with the demo model, every request capped at 2 generated tokens
//! (`--max-tokens-limit`). The first input byte picks the endpoint; the rest is the body.
//!
//! Every body must get a complete HTTP response: a 2xx whose JSON or SSE stream is well formed,
//! or a 4xx with an OpenAI-style error object. A 5xx or a dropped connection (a handler that
//! panicked) is a finding.
#![no_main]
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sluice_engine::{Engine, LoadOptions};
use sluice_server::ServerConfig;

const PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// The server, started on first use on a thread of its own.
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        sluice_fuzz::allow_caught_panics();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let demo = sluice_fuzz::repo().join("models/demo");
            let engine = Engine::load(&demo, sluice_fuzz::cpu(), &LoadOptions::default())
                .expect("loading the demo model");
            let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), "demo");
            config.max_tokens_limit = Some(2);
            config.max_body_bytes = 1 << 20;
            sluice_server::run(engine, config, move |addr| tx.send(addr).unwrap())
                .expect("the server stopped");
        });
        rx.recv_timeout(Duration::from_secs(120))
            .expect("the server did not start")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let path = PATHS[which as usize % PATHS.len()];
    let mut conn = TcpStream::connect(server()).expect("connecting to the server");
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).unwrap();
    conn.write_all(body).unwrap();
    let mut reply = Vec::new();
    conn.read_to_end(&mut reply).expect("reading the reply");
    let split = reply.windows(4).position(|w| w == b"\r\n\r\n");
    let Some(split) = split else {
        panic!(
            "no complete response (did a handler panic?): {:?}",
            String::from_utf8_lossy(&reply)
        );
    };
    let head = String::from_utf8_lossy(&reply[..split]).to_string();
    let payload = dechunk(&reply[split + 4..]);
    let payload = String::from_utf8(payload).expect("a body that is not UTF-8");
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    assert!(status < 500, "{status} for {path}: {payload}");
    let lower = head.to_ascii_lowercase();
    if status >= 400 {
        let v: serde_json::Value = serde_json::from_str(&payload)
            .unwrap_or_else(|e| panic!("{status} body is not JSON ({e}): {payload:?}"));
        assert!(
            v["error"]["message"].is_string(),
            "{status} without an error message: {v}"
        );
    } else if lower.contains("text/event-stream") {
        assert!(
            payload.trim_end().ends_with("data: [DONE]"),
            "a stream that does not end in [DONE]: {payload:?}"
        );
        for line in payload.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line != "[DONE]" {
                serde_json::from_str::<serde_json::Value>(line)
                    .unwrap_or_else(|e| panic!("a malformed chunk ({e}): {line:?}"));
            }
        }
    } else {
        let v: serde_json::Value = serde_json::from_str(&payload)
            .unwrap_or_else(|e| panic!("a 200 body that is not JSON ({e}): {payload:?}"));
        assert!(v["choices"].is_array(), "a reply without choices: {v}");
    }
});

/// The body of a `Transfer-Encoding: chunked` response (or the bytes as they are if not).
fn dechunk(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return body.to_vec();
        };
        let size = std::str::from_utf8(&rest[..eol]).unwrap_or("");
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            return body.to_vec();
        };
        if n == 0 {
            return out;
        }
        let after = &rest[eol + 2..];
        if after.len() < n {
            return body.to_vec();
        }
        out.extend_from_slice(&after[..n]);
        rest = after[n..].strip_prefix(b"\r\n").unwrap_or(&after[n..]);
    }
}
