//! `sluice serve` driven by the official `openai` and `anthropic` Python clients
//! (tests/server/openai_client.py, anthropic_client.py):
//! chat and completions, streaming, tool-call round trips, stop sequences, usage, the prompt
//! cache, cancel on disconnect and the error cases.
//!
//! The client is installed from PyPI into a virtualenv under the cargo target directory the first
//! time (pinned in tests/server/requirements.txt); that needs `python3` with `venv` and network
//! access to PyPI. Without them this test fails and says so: it does not skip.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod common;

use common::repo;

/// A virtualenv with the pinned `openai` and `anthropic` clients; returns its python.
fn python_with_openai() -> PathBuf {
    common::python_with("tests/server/requirements.txt", "openai-venv")
}

/// A running `sluice serve`, killed on drop.
struct Server {
    child: Child,
    base_url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .args(["--port", "0"])
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting sluice serve");
    // The server prints `... at http://ADDR/v1 ...` once it listens; keep draining stderr after.
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[server] {line}");
            if let Some(rest) = line.split("at http://").nth(1) {
                let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                let _ = tx.send(format!("http://{addr}"));
            }
        }
    });
    let base_url = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("sluice serve did not report its address");
    Server { child, base_url }
}

#[test]
fn openai_client_against_sluice_serve() {
    let python = python_with_openai();
    let model = repo().join("models/demo");
    // A small expert cache, so experts stream from disk during the run and the expert metrics
    // are exercised too.
    let server = start_server(&[
        "--model",
        model.to_str().unwrap(),
        "--api-key",
        "test-key",
        "--expert-cache",
        "4MiB",
    ]);
    let heldout = model.join("eval/weather_prompts.jsonl");
    run_client(
        &python,
        "tests/server/openai_client.py",
        &[
            "--base-url",
            &server.base_url,
            "--api-key",
            "test-key",
            "--expect-streaming",
            "--expect-tool-use",
            "--heldout",
            heldout.to_str().unwrap(),
        ],
    );
}

/// Runs a client check script of tests/server; all its checks must pass.
fn run_client(python: &std::path::Path, script: &str, args: &[&str]) {
    let out = Command::new(python)
        .arg(repo().join(script))
        .args(args)
        .output()
        .expect("running the client checks");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(" 0 failed"), "{stdout}");
}

/// The Messages API through the official `anthropic` client (tests/server/anthropic_client.py):
/// plain and streamed answers, a tool-use round trip both ways, stop sequences, count_tokens and
/// errors in Anthropic's shape.
#[test]
fn anthropic_client_against_sluice_serve() {
    let python = python_with_openai();
    let model = repo().join("models/demo");
    let server = start_server(&["--model", model.to_str().unwrap(), "--api-key", "test-key"]);
    let root = server.base_url.trim_end_matches("/v1");
    run_client(
        &python,
        "tests/server/anthropic_client.py",
        &[
            "--base-url",
            root,
            "--api-key",
            "test-key",
            "--expect-tool-use",
        ],
    );
}

/// `sluice synth ARGS -o DIR`, which must succeed.
fn synth(args: &[&str], dir: &std::path::Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("synth")
        .args(args)
        .arg("-o")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Adds `tokens` (text, special) to the synthetic tokenizer of model `dir`; returns their ids.
/// The synthetic tokenizer's ids end at 1006 and the embedding has 1024 rows: the tokens take the
/// next ids (the `tokenizers` crate renumbers added tokens that leave a gap).
fn add_tokens(dir: &std::path::Path, tokens: &[(&str, bool)]) -> Vec<u32> {
    let path = dir.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = tok["added_tokens"].as_array_mut().unwrap();
    let first = added
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .max()
        .unwrap()
        + 1;
    assert_eq!(first, 1007, "the synthetic tokenizer changed");
    let mut ids = Vec::new();
    for (i, (text, special)) in tokens.iter().enumerate() {
        let id = first as u32 + i as u32;
        added.push(serde_json::json!({
            "id": id, "content": text, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special,
        }));
        ids.push(id);
    }
    assert!(*ids.last().unwrap() < 1024);
    std::fs::write(&path, tok.to_string()).unwrap();
    ids
}

/// Runs tests/server/tool_formats_client.py with `cases` against a server for model `dir`;
/// checks that all `cases` passed.
fn tool_formats_client(
    python: &std::path::Path,
    dir: &std::path::Path,
    cases: Vec<serde_json::Value>,
) {
    let n = cases.len();
    let cases_file = dir.join("cases.json");
    std::fs::write(&cases_file, serde_json::Value::Array(cases).to_string()).unwrap();
    let server = start_server(&["--model", dir.to_str().unwrap(), "--api-key", "k"]);
    let out = Command::new(python)
        .arg(repo().join("tests/server/tool_formats_client.py"))
        .args(["--base-url", &server.base_url, "--api-key", "k", "--cases"])
        .arg(&cases_file)
        .output()
        .expect("running the client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("{n} formats passed")), "{stdout}");
}

/// Every family's tool-call format, end to end: a synthetic model whose tokenizer holds each
/// format's whole tool-call block as one token, made to write it by `logit_bias`, through the
/// server and the `openai` client (tests/server/tool_formats_client.py). gpt-oss's harmony
/// format runs against a second server, whose model has gpt-oss's chat template (so the server
/// reads its answers as harmony), harmony's special tokens and gpt-oss's end-of-sequence ids.
#[test]
fn tool_call_formats_through_the_openai_client() {
    let python = python_with_openai();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth(&["--preset", "tiny-qwen3-moe", "--seed", "5"], &dir);
    let args = r#"{"location": "Paris", "unit": "celsius"}"#;
    let blocks = [
        ("qwen3 json", format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {args}}}\n</tool_call>"), None),
        ("qwen3.5 xml", "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>".to_string(), None),
        ("glm-4.5", "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>".to_string(), None),
        ("deepseek-v3", format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), None),
        ("deepseek-v3.1", format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), None),
        ("kimi-k2", format!("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"), Some("functions.get_weather:0")),
    ];
    let texts: Vec<(&str, bool)> = blocks.iter().map(|b| (b.1.as_str(), false)).collect();
    let ids = add_tokens(&dir, &texts);
    let cases = blocks
        .iter()
        .zip(ids)
        .map(|((format, _, id), token)| {
            serde_json::json!({
                "format": format, "token": token, "name": "get_weather",
                "arguments": {"location": "Paris", "unit": "celsius"}, "id": id,
            })
        })
        .collect();
    tool_formats_client(&python, &dir, cases);

    // gpt-oss. The answers as it writes them after the prompt's `<|start|>assistant`; the
    // engine ends generation at `<|call|>` / `<|return|>`, so they are usually not in the text
    // (one case has `<|call|>` in its text anyway: the parser must not show it).
    let dir = tmp.path().join("gpt-oss");
    synth(&["--preset", "tiny-qwen3-moe", "--seed", "5"], &dir);
    const MARKERS: [&str; 7] = [
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
    ];
    let answers = [
        format!("<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{args}"),
        format!("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{args}<|call|>"),
        "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.".to_string(),
    ];
    let mut tokens: Vec<(&str, bool)> = MARKERS.iter().map(|m| (*m, true)).collect();
    tokens.extend(answers.iter().map(|a| (a.as_str(), false)));
    let ids = add_tokens(&dir, &tokens);
    let id = |text: &str| ids[tokens.iter().position(|t| t.0 == text).unwrap()];
    // gpt-oss's chat template (the server picks harmony from it), its `eos_token` and
    // generation_config.json's end-of-sequence ids: `<|return|>`, `<|endoftext|>`, `<|call|>`.
    std::fs::copy(
        repo().join("tests/server/gpt_oss_chat_template.jinja"),
        dir.join("chat_template.jinja"),
    )
    .unwrap();
    let edit = |file: &str, f: &dyn Fn(&mut serde_json::Value)| {
        let path = dir.join(file);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&path, v.to_string()).unwrap();
    };
    edit("tokenizer_config.json", &|v| {
        v["eos_token"] = "<|return|>".into()
    });
    edit("generation_config.json", &|v| {
        let endoftext = v["eos_token_id"][1].clone();
        v["eos_token_id"] = serde_json::json!([id("<|return|>"), endoftext, id("<|call|>")]);
    });
    let weather = serde_json::json!({"location": "Paris", "unit": "celsius"});
    let cases = vec![
        serde_json::json!({
            "format": "gpt-oss, recipient in the channel", "token": id(&answers[0]),
            "name": "get_weather", "arguments": weather,
            "reasoning": "The user wants the weather in Paris.",
        }),
        serde_json::json!({
            "format": "gpt-oss, recipient in the role", "token": id(&answers[1]),
            "name": "get_weather", "arguments": weather, "reasoning": "Need the weather.",
        }),
        serde_json::json!({
            "format": "gpt-oss, analysis then final", "token": id(&answers[2]),
            "reasoning": "User asks: \"What is 2 + 2?\" Simple arithmetic.",
            "content": "2 + 2 = 4.",
        }),
        serde_json::json!({"format": "gpt-oss <|return|> ends", "token": id("<|return|>"), "eos": true}),
        serde_json::json!({"format": "gpt-oss <|call|> ends", "token": id("<|call|>"), "eos": true}),
    ];
    tool_formats_client(&python, &dir, cases);
}

/// llama-server's routes without `/v1`, and CORS: off by default (a preflight gets 405), and
/// for the origins of `--cors-origin` a preflight answered 204 with what it may send, and
/// responses carrying `Access-Control-Allow-Origin`; another origin's preflight gets 403.
#[test]
fn unprefixed_routes_and_cors() {
    let model = repo().join("models/demo");
    let model = model.to_str().unwrap();
    let chat = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}"#;
    let preflight = [
        ("Origin", "http://app.example"),
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "content-type, x-api-key"),
    ];
    let server = start_server(&["--model", model]);
    let (status, _, body) = http_with(&server.base_url, "POST", "/chat/completions", &[], chat);
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http_with(
        &server.base_url,
        "POST",
        "/completions",
        &[],
        r#"{"prompt": "Hi", "max_tokens": 2}"#,
    );
    assert_eq!(status, 200, "{body}");
    let (status, head, _) = http_with(
        &server.base_url,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight,
        "",
    );
    assert_eq!(status, 405, "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("access-control"),
        "{head}"
    );
    drop(server);

    let server = start_server(&["--model", model, "--cors-origin", "http://app.example"]);
    let (status, head, _) = http_with(&server.base_url, "OPTIONS", "/v1/messages", &preflight, "");
    let head = head.to_ascii_lowercase();
    assert_eq!(status, 204, "{head}");
    assert!(
        head.contains("access-control-allow-origin: http://app.example"),
        "{head}"
    );
    assert!(
        head.contains("access-control-allow-methods: get, post, options"),
        "{head}"
    );
    assert!(
        head.contains("access-control-allow-headers: content-type, x-api-key"),
        "{head}"
    );
    let origin = [("Origin", "http://app.example")];
    let (status, head, body) = http_with(
        &server.base_url,
        "POST",
        "/v1/chat/completions",
        &origin,
        chat,
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("access-control-allow-origin: http://app.example"),
        "{head}"
    );
    let other = [
        ("Origin", "http://evil.example"),
        ("Access-Control-Request-Method", "POST"),
    ];
    let (status, head, body) = http_with(
        &server.base_url,
        "OPTIONS",
        "/v1/chat/completions",
        &other,
        "",
    );
    assert_eq!(status, 403, "{head}");
    assert!(body.contains("--cors-origin"), "{body}");
}

/// One HTTP/1.1 request with extra headers; returns (status, head, body).
fn http_with(
    base_url: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let addr = base_url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap();
    let mut stream = TcpStream::connect(addr).expect("connecting to the server");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{extra}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

/// One HTTP/1.1 request with the standard library; returns (status, body).
fn http(base_url: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let (status, _, body) = http_with(base_url, method, path, &[], body);
    (status, body)
}

fn chat_message(base_url: &str, request: serde_json::Value) -> serde_json::Value {
    let (status, body) = http(
        base_url,
        "POST",
        "/v1/chat/completions",
        &request.to_string(),
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["message"].clone()
}

/// Qwen3.5's template opens `<think>` in the generation prompt unless `enable_thinking` is
/// false: the answer is then reasoning until `</think>` (which a random model never writes).
#[test]
fn thinking_follows_the_template_kwargs() {
    // A tiny random checkpoint with Qwen3.5's real chat template.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&["--preset", "tiny-qwen3.5-moe", "--bits", "4"], &model);
    let server = start_server(&["--model", model.to_str().unwrap()]);
    let ask = |kwargs: serde_json::Value| {
        chat_message(
            &server.base_url,
            serde_json::json!({
                "messages": [{"role": "user", "content": "Why?"}],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": true,
                "chat_template_kwargs": kwargs,
            }),
        )
    };
    let thinking = ask(serde_json::json!({}));
    let reasoning = thinking["reasoning_content"].as_str().unwrap_or("");
    assert!(!reasoning.is_empty(), "{thinking}");
    let plain = ask(serde_json::json!({"enable_thinking": false}));
    assert!(plain.get("reasoning_content").is_none(), "{plain}");
    assert!(!plain["content"].as_str().unwrap().is_empty(), "{plain}");
    // Qwen3.5's template raises an exception for a conversation without a user turn: a 400 with
    // its message.
    let (status, body) = http(
        &server.base_url,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "system", "content": "only a system turn"}], "max_tokens": 2}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("chat template"), "{body}");
}

/// `sluice serve` with `args` on a tiny random Qwen3-MoE (in the returned directory).
fn tiny_server(args: &[&str]) -> (tempfile::TempDir, Server) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth(&["--preset", "tiny-qwen3-moe", "--seed", "5"], &dir);
    let mut all = vec!["-m", dir.to_str().unwrap()];
    all.extend_from_slice(args);
    let server = start_server(&all);
    (tmp, server)
}

/// Sends a streaming completion of exactly `max_tokens` tokens (`ignore_eos`) and returns the
/// raw response once the server closes the connection; `started` gets a message when the first
/// bytes arrive.
fn stream_completion(base_url: &str, max_tokens: usize, started: mpsc::Sender<()>) -> String {
    let addr = base_url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let body = serde_json::json!({
        "prompt": "a b", "stream": true, "max_tokens": max_tokens, "ignore_eos": true
    })
    .to_string();
    let mut stream = TcpStream::connect(&addr).expect("connecting to the server");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if response.is_empty() {
                    let _ = started.send(());
                }
                response.extend_from_slice(&buf[..n]);
            }
        }
    }
    String::from_utf8_lossy(&response).into_owned()
}

/// Sends SIGTERM to the server and waits up to `limit` for it to exit; its exit status.
fn terminate(server: &mut Server, limit: Duration) -> std::process::ExitStatus {
    let pid = server.child.id().to_string();
    let kill = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(kill.success(), "kill -TERM {pid}");
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < limit,
            "the server did not exit within {limit:?} of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A tiny model's server run with `--shutdown-timeout grace`: starts a `max_tokens` stream,
/// sends SIGTERM once its first bytes arrive, and returns the server's exit status (it must
/// exit within `exit_within`) and the stream as the client received it.
fn stream_then_sigterm(
    grace: &str,
    max_tokens: usize,
    exit_within: Duration,
) -> (std::process::ExitStatus, String) {
    let (_model, mut server) = tiny_server(&["--shutdown-timeout", grace]);
    let (tx, rx) = mpsc::channel();
    let url = server.base_url.clone();
    let client = std::thread::spawn(move || stream_completion(&url, max_tokens, tx));
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the stream started");
    let status = terminate(&mut server, exit_within);
    (status, client.join().unwrap())
}

/// SIGTERM while a request streams: the request runs to its end, then the server exits 0.
#[test]
fn sigterm_lets_a_running_request_finish_then_exits_0() {
    let (status, response) = stream_then_sigterm("60", 3000, Duration::from_secs(90));
    assert!(status.success(), "exit status {status}");
    let tail: String = response
        .chars()
        .rev()
        .take(400)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    assert!(
        response.contains("\"finish_reason\":\"length\"") && response.contains("data: [DONE]"),
        "the running request was cut: ...{tail}"
    );
}

/// SIGTERM with a request that outlasts --shutdown-timeout: the server exits 0 at the end of
/// the grace period, and the request's stream ends unfinished.
#[test]
fn sigterm_exits_at_the_end_of_the_grace_period() {
    // About 4000 tokens: seconds on any machine, far past the 0.2 s of grace.
    let (status, response) = stream_then_sigterm("0.2", 4000, Duration::from_secs(30));
    assert!(status.success(), "exit status {status}");
    assert!(
        !response.contains("data: [DONE]"),
        "the request finished within 0.2 s of grace: the test proves nothing"
    );
}

/// --max-tokens-limit: a request asking for more gets a 400 naming the field; one that does not
/// say generates at most the limit.
#[test]
fn max_tokens_limit_caps_and_rejects() {
    let (_model, server) = tiny_server(&["--max-tokens-limit", "7"]);
    let ask = |extra: serde_json::Value| {
        let mut body = serde_json::json!({"prompt": "a b", "ignore_eos": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        http(
            &server.base_url,
            "POST",
            "/v1/completions",
            &body.to_string(),
        )
    };
    let (status, body) = ask(serde_json::json!({"max_tokens": 8}));
    assert_eq!(status, 400, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["param"], "max_tokens", "{body}");
    assert!(body.contains("--max-tokens-limit"), "{body}");
    for (extra, want) in [
        (serde_json::json!({}), 7),
        (serde_json::json!({"max_tokens": 7}), 7),
        (serde_json::json!({"max_tokens": 3}), 3),
    ] {
        let (status, body) = ask(extra.clone());
        assert_eq!(status, 200, "{extra}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], want, "{extra}: {body}");
    }
}

/// A request whose headers exceed the server's limit gets 431 (or its connection closed) and
/// never reaches a handler; the server keeps answering.
#[test]
fn oversized_headers_are_refused_and_the_server_stays_up() {
    let (_model, server) = tiny_server(&[]);
    let addr = server.base_url.trim_start_matches("http://").to_string();
    let addr = addr.split('/').next().unwrap();
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let big = "x".repeat(1 << 20);
    // The server may answer and close before the whole header is written: ignore write errors.
    let _ = write!(
        stream,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nX-Big: {big}\r\nConnection: close\r\n\r\n"
    );
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    assert!(
        response.is_empty() || response.starts_with("HTTP/1.1 431"),
        "a 1 MiB header was accepted: {}",
        &response[..response.len().min(200)]
    );
    let (status, body) = http(&server.base_url, "GET", "/health", "");
    assert_eq!(status, 200, "{body}");
}

/// `serve --speculate lookup` answers a greedy completion with the text of a server without it,
/// and `/metrics` counts the drafted and kept tokens.
#[test]
fn speculation_in_serve_keeps_the_answer_and_is_counted() {
    let list = "apple, banana, cherry, date, elderberry, fig, grape.";
    let body = serde_json::json!({
        "prompt": format!("A list: {list} The same list: {list} Once more: apple, banana,"),
        "max_tokens": 48,
        "temperature": 0,
    })
    .to_string();
    let answer = |args: &[&str]| {
        let server = start_server(args);
        let (status, text) = http(&server.base_url, "POST", "/v1/completions", &body);
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let root = server.base_url.trim_end_matches("/v1").to_string();
        let (status, metrics) = http(&root, "GET", "/metrics", "");
        assert_eq!(status, 200);
        let counter = |name: &str| -> u64 {
            let line = metrics
                .lines()
                .find(|l| l.starts_with(&format!("sluice_{name} ")))
                .unwrap_or_else(|| panic!("no {name} in /metrics:\n{metrics}"));
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        };
        let counts = [
            counter("speculative_passes_total"),
            counter("draft_tokens_total"),
            counter("draft_tokens_accepted_total"),
        ];
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            counts,
        )
    };
    let (plain, [passes, ..]) = answer(&[]);
    assert_eq!(passes, 0, "no speculation without --speculate");
    let (text, [passes, drafted, kept]) = answer(&["--speculate", "lookup", "--draft-tokens", "4"]);
    assert_eq!(text, plain, "speculation changed a greedy answer");
    assert!(
        passes > 0 && drafted >= passes && kept > 0 && kept <= drafted,
        "{passes} {drafted} {kept}"
    );
}
