//! Shared by the tests that drive sluice from Python packages installed from PyPI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Held while a virtualenv is checked or made: the tests of one binary run on parallel threads,
/// and two of them making the same venv at once break each other's `ensurepip`.
static VENV_LOCK: Mutex<()> = Mutex::new(());

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A virtualenv named `name` under the cargo target directory with the pinned packages of
/// `requirements` (relative to the repository) installed; returns its python. It is made once
/// and remade when the requirements change. Needs `python3` with `venv` and network access to
/// PyPI: without them the calling test fails and says so, it does not skip.
pub fn python_with(requirements: &str, name: &str) -> PathBuf {
    let requirements = repo().join(requirements);
    let wanted = std::fs::read_to_string(&requirements).expect("reading the requirements file");
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let python = venv.join("bin/python");
    let stamp = venv.join("installed.txt");
    // A test that panicked while holding the lock leaves the venv unstamped, so it is remade.
    let _guard = VENV_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return python;
    }
    let status = Command::new("python3")
        .args(["-m", "venv", "--clear"])
        .arg(&venv)
        .status()
        .expect("this test needs python3 (with the venv module) to install its Python packages");
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
        "pip could not install the packages from PyPI (network needed): pip install -r {}",
        requirements.display()
    );
    std::fs::write(&stamp, wanted).unwrap();
    python
}
