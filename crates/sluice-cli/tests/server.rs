//! `sluice serve` driven by the official `openai` Python client (tests/server/openai_client.py):
//! chat and completions, streaming, tool-call round trips, stop sequences, usage, the prompt
//! cache, cancel on disconnect and the error cases.
//!
//! The client is installed from PyPI into a virtualenv under the cargo target directory the first
//! time (pinned in tests/server/requirements.txt); that needs `python3` with `venv` and network
//! access to PyPI. Without them this test fails and says so: it does not skip.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A virtualenv with the pinned `openai` client; returns its python.
fn python_with_openai() -> PathBuf {
    let requirements = repo().join("tests/server/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements).expect("reading requirements.txt");
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let stamp = venv.join("installed.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return python;
    }
    let status = Command::new("python3")
        .args(["-m", "venv", "--clear"])
        .arg(&venv)
        .status()
        .expect("this test needs python3 (with the venv module) to install the openai client");
    assert!(
        status.success(),
        "python3 -m venv {} failed",
        venv.display()
    );
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&requirements)
        .status()
        .expect("running pip");
    assert!(
        status.success(),
        "pip could not install the openai client from PyPI (network needed): pip install -r {}",
        requirements.display()
    );
    std::fs::write(&stamp, wanted).unwrap();
    python
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
    let out = Command::new(&python)
        .arg(repo().join("tests/server/openai_client.py"))
        .args(["--base-url", &server.base_url, "--api-key", "test-key"])
        .arg("--expect-streaming")
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
