//! `bench/gguf_from_mlx.py` writes GGUFs that hold exactly the checkpoint's numbers: for each
//! architecture, a `sluice synth` checkpoint with centred biases becomes Q4_1 and one with ggml's
//! zero point (`--ggml-zero-point`) becomes Q4_0, and `--verify` dequantises every tensor with the
//! `gguf` package's own code and requires equality with mlx's `scale * q + bias`.
//!
//! The `gguf` package is installed from PyPI into a virtualenv under the cargo target directory
//! the first time (pinned in tests/gguf/requirements.txt): that needs `python3` with `venv` and
//! network access to PyPI. Without them this test fails and says so: it does not skip.
//! `sluice info` must then read each file with sluice's own GGUF reader. (llama.cpp's own logits
//! on these files are compared by bench/compare_llama_logits.py.)

use std::path::Path;
use std::process::Command;

mod common;

use common::repo;

#[test]
fn converted_ggufs_hold_the_checkpoints_numbers() {
    let python = common::python_with("tests/gguf/requirements.txt", "gguf-venv");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf-from-mlx");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for preset in ["tiny-qwen3-moe", "tiny-qwen3.5-moe"] {
        for (zero_point, expected) in [(false, "Q4_1"), (true, "Q4_0")] {
            let name = format!("{preset}-{}", if zero_point { "ggml" } else { "centred" });
            let model = dir.join(&name);
            let mut synth = Command::new(env!("CARGO_BIN_EXE_sluice"));
            synth.args(["synth", "--preset", preset, "-o"]).arg(&model);
            if zero_point {
                synth.arg("--ggml-zero-point");
            }
            let out = synth.output().expect("running sluice synth");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let gguf = dir.join(format!("{name}.gguf"));
            let out = Command::new(&python)
                .arg(repo().join("bench/gguf_from_mlx.py"))
                .arg(&model)
                .arg(&gguf)
                .arg("--verify")
                .output()
                .expect("running bench/gguf_from_mlx.py");
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{preset} (zero point {zero_point}): {log}"
            );
            assert!(
                log.contains("dequantise to the checkpoint's values exactly"),
                "{preset}: {log}"
            );
            // The 4-bit weights went into the exact type, not into F32 or the other 4-bit type.
            let types: Vec<&str> = log
                .lines()
                .filter_map(|l| l.trim().split_once(':'))
                .map(|(t, _)| t)
                .filter(|t| t.starts_with('Q') || *t == "F32")
                .collect();
            assert_eq!(types.first(), Some(&expected), "{preset}: {log}");
            assert!(
                !types.contains(&if zero_point { "Q4_1" } else { "Q4_0" }),
                "{log}"
            );
            // sluice's own GGUF reader reads what the gguf package wrote.
            let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
                .args(["info", "-m"])
                .arg(&gguf)
                .output()
                .expect("running sluice info");
            let info = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let arch = if preset == "tiny-qwen3-moe" {
                "qwen3moe"
            } else {
                "qwen35moe"
            };
            assert!(info.contains(&format!("(GGUF v3, {arch})")), "{info}");
            assert!(info.contains(&format!("    {expected}: ")), "{info}");
            let written = log
                .lines()
                .find_map(|l| l.split_once(&format!("arch {arch}, ")))
                .and_then(|(_, rest)| rest.split_once(" tensors"))
                .map(|(n, _)| n.to_string())
                .expect("the converter names its tensor count");
            assert!(info.contains(&format!("  {written} tensors, ")), "{info}");
        }
    }
}
