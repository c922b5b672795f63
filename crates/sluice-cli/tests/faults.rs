//! Disk faults under the running server: `sluice serve`'s router (in this process, over
//! loopback) streaming a packed demo model with an expert cache of the minimum size, so every
//! request reads experts from `experts.bin`. Faults come two ways: injected into the reads as
//! they return from the kernel (EIO, short counts; [`ReadFaults`]), and done to the file itself
//! while the server runs (a block corrupted, the file truncated, the file deleted). Each request
//! that meets a fault must fail with an OpenAI-style 5xx that says what happened (a stream: an
//! error event, then `[DONE]`); the server must stay up; once the fault is gone the next
//! requests must give exactly the answer they gave before (greedy), so nothing leaked from the
//! failed ones. And `sluice pack` running out of room must fail cleanly and leave nothing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_cpu::CpuBackend;
use sluice_engine::streaming::StreamingOptions;
use sluice_engine::{Engine, LoadOptions};
use sluice_server::ServerConfig;
use sluice_store::{Manifest, ReadFault, ReadFaults, EXPERTS_FILE};

#[allow(dead_code)] // the helpers other tests use
mod common;

/// The fault to inject into every expert read from now on, and how many reads met one.
#[derive(Debug, Default)]
struct Faults {
    now: Mutex<Option<ReadFault>>,
    hits: AtomicUsize,
}

impl ReadFaults for Faults {
    fn fault(&self, _offset: u64, _len: usize) -> Option<ReadFault> {
        let f = *self.now.lock().unwrap();
        if f.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        f
    }
}

impl Faults {
    fn set(&self, f: Option<ReadFault>) {
        *self.now.lock().unwrap() = f;
        self.hits.store(0, Ordering::Relaxed);
    }
}

/// `sluice pack models/demo` into a fresh directory.
fn packed_demo(tmp: &Path) -> PathBuf {
    let out = tmp.join("demo-packed");
    let st = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["pack", "--out"])
        .arg(&out)
        .arg(common::repo().join("models/demo"))
        .output()
        .expect("running sluice pack");
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    out
}

/// Starts the server on `dir` with `faults` in its reads; returns its address.
fn serve(dir: &Path, faults: Arc<Faults>) -> SocketAddr {
    let opts = LoadOptions {
        streaming: StreamingOptions {
            // Raised to the minimum (the experts one token needs in one layer): nearly every
            // expert of every step is read from the file.
            expert_cache: Some(1),
            faults: Some(faults),
            ..StreamingOptions::default()
        },
        ..LoadOptions::default()
    };
    let engine = Engine::load(dir, Arc::new(CpuBackend::new()), &opts).expect("loading");
    assert!(engine.store.is_some(), "the packed model must stream");
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), "demo");
    // Every request computes its whole prompt: none resumes from a saved state.
    config.prompt_cache = 0;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        sluice_server::run(engine, config, move |addr| tx.send(addr).unwrap()).unwrap()
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the server started")
}

/// POSTs `body` to `path`; the status and the (de-chunked) body.
fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut c = TcpStream::connect(addr).expect("connecting");
    c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    c.read_to_end(&mut raw).expect("a complete reply");
    let text = String::from_utf8(raw).expect("a UTF-8 reply");
    let (head, rest) = text.split_once("\r\n\r\n").expect("headers");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, body)
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    out
}

const WHOLE: &str =
    r#"{"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true}"#;
const STREAM: &str = r#"{"messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stream": true}"#;

/// A non-streamed completion's text (status 200), or the error message of a failed one.
fn whole(addr: SocketAddr) -> Result<String, (u16, String)> {
    let (status, body) = post(addr, "/v1/completions", WHOLE);
    let v: serde_json::Value = serde_json::from_str(&body).expect("a JSON reply");
    if status == 200 {
        Ok(v["choices"][0]["text"].as_str().unwrap().to_string())
    } else {
        let msg = v["error"]["message"].as_str().expect("an error message");
        Err((status, msg.to_string()))
    }
}

/// A streamed chat answer's text, or the message of the error event that ended it.
fn streamed(addr: SocketAddr) -> Result<String, String> {
    let (status, body) = post(addr, "/v1/chat/completions", STREAM);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "a stream must end with [DONE], even a failed one: {body}"
    );
    let mut text = String::new();
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON event");
        if let Some(msg) = v["error"]["message"].as_str() {
            return Err(msg.to_string());
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    Ok(text)
}

/// Both kinds of request fail, with messages that contain `what`.
fn both_fail(addr: SocketAddr, what: &str, when: &str) {
    let (status, msg) = whole(addr).expect_err(when);
    assert!(
        (500..600).contains(&status),
        "{when}: status {status} ({msg})"
    );
    assert!(msg.contains(what), "{when}: `{msg}` should say `{what}`");
    let msg = streamed(addr).expect_err(when);
    assert!(msg.contains(what), "{when}: `{msg}` should say `{what}`");
}

#[test]
fn disk_faults_fail_the_request_not_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = packed_demo(tmp.path());
    let faults = Arc::new(Faults::default());
    let addr = serve(&dir, faults.clone());
    let expected = (whole(addr).unwrap(), streamed(addr).unwrap());
    assert!(!expected.0.is_empty() && !expected.1.is_empty());
    let answers_as_before = |when: &str| {
        assert_eq!(whole(addr).expect(when), expected.0, "{when}");
        assert_eq!(streamed(addr).expect(when), expected.1, "{when}");
    };

    // The disk fails every read.
    faults.set(Some(ReadFault::Error(libc::EIO)));
    both_fail(addr, "Input/output error", "reads failing with EIO");
    assert!(faults.hits.load(Ordering::Relaxed) > 0);
    faults.set(None);
    answers_as_before("after EIO");

    // Short counts (legal for any read) are read on from where they stopped.
    faults.set(Some(ReadFault::Short(4096)));
    answers_as_before("reads returning 4 KiB at a time");
    assert!(faults.hits.load(Ordering::Relaxed) > 0);
    faults.set(None);

    // Every block corrupted on disk while serving: the checksums catch it.
    let file = dir.join(EXPERTS_FILE);
    let original = std::fs::read(&file).unwrap();
    let manifest = Manifest::open(&dir).unwrap().unwrap();
    let mut corrupt = original.clone();
    for l in &manifest.layers {
        for e in 0..l.experts {
            corrupt[l.block_offset(e) as usize + 100] ^= 0x5a;
        }
    }
    std::fs::write(&file, &corrupt).unwrap();
    both_fail(addr, "checksum", "blocks corrupted on disk");
    std::fs::write(&file, &original).unwrap();
    answers_as_before("after the blocks were mended");

    // The file truncated under the server: reads past the end fail.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(4096)
        .unwrap();
    both_fail(addr, "end of file", "experts.bin truncated");
    std::fs::write(&file, &original).unwrap();
    answers_as_before("after experts.bin was restored");

    // Deleted: the open file still reads (Unix keeps it until the last descriptor closes).
    std::fs::remove_file(&file).unwrap();
    answers_as_before("experts.bin deleted");
    std::fs::write(&file, &original).unwrap();

    // The health check still answers.
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    c.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

/// `sluice pack` whose writes fail part way (a file-size limit: EFBIG, as a full disk gives
/// ENOSPC) says so, exits with an error, and leaves neither the output nor its partial copy.
#[test]
fn pack_that_runs_out_of_room_leaves_nothing() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("packed");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(["pack", "--out"])
        .arg(&out)
        .arg(common::repo().join("models/demo"));
    // SAFETY: between fork and exec only async-signal-safe calls (setrlimit, signal).
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1 << 20,
                rlim_max: 1 << 20,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Ignored across exec: a write past the limit fails with EFBIG instead of killing.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let run = cmd.output().expect("running sluice pack");
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "pack must fail: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("File too large") && err.contains("packed.partial"),
        "the error should say what failed and where: {err}"
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
