//! Helpers shared by the fuzz targets: a scratch directory for parsers that read files, the
//! repository's fixtures, and a CPU backend.
//!
//! Every target feeds bytes to a parser of outside data and asserts only what must hold for any
//! input: no panic, no hang, no runaway allocation (libFuzzer's `-rss_limit_mb`), and where a
//! second path computes the same thing, the same answer.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use sluice_cpu::CpuBackend;

/// The repository root: `$SLUICE_REPO` where set (binaries run on another machine), else the
/// one they were built in.
pub fn repo() -> PathBuf {
    match std::env::var_os("SLUICE_REPO") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join(".."),
    }
}

/// A fixture directory of `tests/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures").join(name)
}

/// This process's scratch directory (in /dev/shm where there is one: files written on every
/// run should not reach a disk). Removed when the process exits normally.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let b = tempfile::Builder::new()
            .prefix("sluice-fuzz-")
            .tempdir_in(shm);
        b.or_else(|_| tempfile::Builder::new().prefix("sluice-fuzz-").tempdir())
            .expect("a scratch directory")
    })
    .path()
}

/// A fresh empty directory `name` inside the scratch directory.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    dir
}

/// Writes `bytes` to `dir/name`.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("writing a scratch file");
    path
}

/// Links `dir/name` to `target` (files the target does not fuzz).
pub fn link(dir: &Path, name: &str, target: &Path) {
    let target = target.canonicalize().expect("a fixture file");
    std::os::unix::fs::symlink(target, dir.join(name)).expect("linking a fixture file");
}

/// One CPU backend for the process, on one thread (the fuzzer runs one input at a time).
pub fn cpu() -> Arc<CpuBackend> {
    static CPU: OnceLock<Arc<CpuBackend>> = OnceLock::new();
    CPU.get_or_init(|| {
        sluice_cpu::set_thread_count(Some(1));
        Arc::new(CpuBackend::new())
    })
    .clone()
}

/// Lets the code under test catch panics on purpose (sluice turns the `tokenizers` crate's
/// panics on malformed files into errors): libFuzzer's panic hook aborts at any panic, caught
/// or not. With the default hook back, a panic nobody catches still reaches libfuzzer-sys,
/// which aborts on it.
pub fn allow_caught_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| drop(std::panic::take_hook()));
}

/// Splits `data` at the first `n - 1` zero bytes into at most `n` parts (inputs made of several
/// files).
pub fn parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    data.splitn(n, |&b| b == 0).collect()
}
