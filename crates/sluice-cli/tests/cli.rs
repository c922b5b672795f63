//! The `sluice` binary end to end: happy paths on a fixture checkpoint, and a one-line error (exit
//! code 1, no panic) for each kind of bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("running sluice")
}

/// Runs sluice expecting failure; returns stderr, checked to be one `error:` line.
fn sluice_fails(args: &[&str]) -> String {
    let out = sluice(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit 1, stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    stderr
}

/// `sluice generate --model MODEL --prompt x EXTRA...`, expected to fail; returns the error line.
fn generate_fails(model: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
    ];
    args.extend_from_slice(extra);
    sluice_fails(&args)
}

/// A writable copy of a fixture.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn generate_streams_text_and_reports_speed() {
    let model = fixture("qwen3_moe-q4");
    let out = sluice(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "The river",
        "-n",
        "12",
        "--temperature",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!out.stdout.is_empty(), "no text generated");
    assert!(
        stderr.contains("generation:") && stderr.contains("tok/s"),
        "{stderr}"
    );
}

#[test]
fn generate_is_deterministic_with_a_seed() {
    let model = fixture("qwen3_moe-q8");
    let run = || {
        let out = sluice(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Once upon a time",
            "-n",
            "10",
            "--temperature",
            "1.0",
            "--seed",
            "7",
            "--chat",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    assert_eq!(run(), run());
}

#[test]
fn logits_writes_npy_of_the_right_shape() {
    let model = fixture("qwen3_moe-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let out_path = tmp.path().join("l.npy");
    for mode in ["decode", "prefill"] {
        let out = sluice(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "1,2,3,4",
            "--mode",
            mode,
            "--out",
            out_path.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (data, shape) = sluice_engine::npy::read_f32(&out_path).unwrap();
        assert_eq!(shape.len(), 2);
        assert_eq!(shape[0], 4);
        assert!(data.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn missing_model_directory() {
    let err = sluice_fails(&[
        "logits",
        "--model",
        "/nonexistent/model",
        "--tokens",
        "1",
        "--out",
        "/tmp/x.npy",
    ]);
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn missing_tokenizer() {
    let dir = copy_fixture("qwen3_moe-q4");
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = generate_fails(dir.path(), &[]);
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn unsupported_model_type() {
    let dir = copy_fixture("qwen3_moe-q4");
    edit_config(dir.path(), |v| v["model_type"] = "llama4_moe".into());
    let err = generate_fails(dir.path(), &[]);
    assert!(
        err.contains("llama4_moe") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn config_disagrees_with_tensor_shapes() {
    let dir = copy_fixture("qwen3_moe-bf16");
    edit_config(dir.path(), |v| {
        let e = v["num_experts"].as_u64().unwrap();
        v["num_experts"] = (e * 2).into();
    });
    let err = generate_fails(dir.path(), &[]);
    assert!(err.contains("mlp"), "error should name the tensor: {err}");
}

#[test]
fn wrong_dtype_tensor() {
    // A norm weight stored as int32 instead of a float type.
    let dir = copy_fixture("qwen3_moe-bf16");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + hlen])
        .unwrap()
        .to_string();
    // Same byte length: two BF16 elements become one I32 with half the shape.
    let mut v: serde_json::Value = serde_json::from_str(header.trim_end()).unwrap();
    let t = &mut v["model.norm.weight"];
    assert_eq!(t["dtype"], "BF16", "fixture changed");
    let n = t["shape"][0].as_u64().unwrap();
    t["dtype"] = "I32".into();
    t["shape"] = serde_json::json!([n / 2]);
    let mut new_header = serde_json::to_string(&v).unwrap();
    while new_header.len() < hlen {
        new_header.push(' ');
    }
    assert!(new_header.len() <= hlen + 8);
    let mut out = (new_header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(new_header.as_bytes());
    out.extend_from_slice(&bytes[8 + hlen..]);
    std::fs::write(&path, out).unwrap();
    let err = generate_fails(dir.path(), &[]);
    assert!(err.contains("model.norm.weight"), "{err}");
}

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture("qwen3_moe-q4");
    let path = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len / 2).unwrap();
    let err = generate_fails(dir.path(), &[]);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn token_outside_the_vocabulary() {
    let model = fixture("qwen3_moe-q4");
    let err = sluice_fails(&[
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        "1,99999999",
        "--out",
        "/tmp/never.npy",
    ]);
    assert!(
        err.contains("99999999") && err.contains("vocabulary"),
        "{err}"
    );
}

#[test]
fn bad_experts_per_token() {
    let model = fixture("qwen3_moe-q4");
    let err = generate_fails(&model, &["--experts-per-token", "999"]);
    assert!(err.contains("experts per token"), "{err}");
}

#[test]
fn bad_sampling_settings() {
    let model = fixture("qwen3_moe-q4");
    let err = generate_fails(&model, &["--top-p", "1.5"]);
    assert!(err.contains("top_p") || err.contains("top-p"), "{err}");
}

#[test]
fn generate_runs_the_hybrid_models() {
    for name in ["qwen3_5_moe-q4", "qwen3_5_moe-bf16", "qwen3_next-bf16"] {
        let model = fixture(name);
        let out = sluice(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "The river",
            "-n",
            "8",
            "--chat",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        assert!(stderr.contains("generation:"), "{name}: {stderr}");
    }
}

#[test]
fn synth_tiny_presets_load_and_generate() {
    for preset in [
        "tiny-qwen3.5-moe",
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-glm4-moe",
        "tiny-deepseek-v3",
        "tiny-gpt-oss",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        let d = dir.to_str().unwrap();
        let out = sluice(&["synth", "--preset", preset, "-o", d, "--seed", "3"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!tmp.path().join("m.partial").exists());
        // A fixed seed: with the model's own sampling settings (top-k 20 at temperature 0.7) an
        // end-of-sequence token is drawn within 8 steps now and then (1 of 150 runs here).
        let out = sluice(&[
            "generate", "-m", d, "-p", "Hello", "-n", "8", "--chat", "--seed", "1",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("generation: 8 tokens"), "{stderr}");
        // Writing over an existing directory is refused, naming it.
        let err = sluice_fails(&["synth", "--preset", preset, "-o", d]);
        assert!(err.contains("already exists") && err.contains(d), "{err}");
    }
}

/// A Kimi K2 directory as released has `tiktoken.model` and no `tokenizer.json`: a synthetic
/// DeepSeek-V3 renamed `kimi_k2`, its tokenizer swapped for a tiktoken one (the 256 single bytes
/// and Kimi's 256 special ids after them), generates from a prompt and a chat.
#[test]
fn a_kimi_directory_with_only_tiktoken_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let d = dir.to_str().unwrap();
    let out = sluice(&[
        "synth",
        "--preset",
        "tiny-deepseek-v3",
        "-o",
        d,
        "--seed",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["model_type"] = "kimi_k2".into();
    config["eos_token_id"] = 257.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let ranks: String = (0..256usize)
        .map(|b| {
            // One byte in base64: two characters and the padding.
            let (hi, lo) = (B64[b >> 2] as char, B64[(b & 3) << 4] as char);
            format!("{hi}{lo}== {b}\n")
        })
        .collect();
    std::fs::write(dir.join("tiktoken.model"), ranks).unwrap();
    let tokenizer_config = serde_json::json!({
        "added_tokens_decoder": {
            "256": {"content": "[BOS]", "special": true},
            "257": {"content": "[EOS]", "special": true},
            "258": {"content": "<|im_user|>", "special": true},
            "259": {"content": "<|im_assistant|>", "special": true},
            "260": {"content": "<|im_middle|>", "special": true},
            "261": {"content": "<|im_end|>", "special": true},
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
    for chat in [false, true] {
        let mut args = vec![
            "generate",
            "-m",
            d,
            "-p",
            "the cat sat",
            "-n",
            "4",
            "--seed",
            "1",
        ];
        if chat {
            args.push("--chat");
        }
        let out = sluice(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("generation:"), "{stderr}");
    }
}

#[test]
fn synth_is_deterministic_per_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, seed: &str| {
        let d = tmp.path().join(name);
        let out = sluice(&[
            "synth",
            "--preset",
            "tiny-qwen3-moe",
            "-o",
            d.to_str().unwrap(),
            "--seed",
            seed,
        ]);
        assert!(out.status.success());
        std::fs::read(d.join("model.safetensors")).unwrap()
    };
    let (a, b, c) = (write("a", "1"), write("b", "1"), write("c", "2"));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn synth_rejects_bad_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    let d = d.to_str().unwrap();
    let err = sluice_fails(&["synth", "--preset", "qwen9", "-o", d]);
    assert!(
        err.contains("unknown preset") && err.contains("qwen3.5-35b-a3b"),
        "{err}"
    );
    let err = sluice_fails(&[
        "synth",
        "--preset",
        "tiny-qwen3-moe",
        "-o",
        d,
        "--layers",
        "9",
    ]);
    assert!(err.contains("--layers 9"), "{err}");
    let out = sluice(&[
        "synth",
        "--preset",
        "tiny-qwen3-moe",
        "-o",
        d,
        "--bits",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(2), "clap rejects --bits 3");
    assert!(!Path::new(d).exists());
}

#[test]
fn synth_lists_presets_with_sizes() {
    let out = sluice(&["synth", "--preset", "list"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("| qwen3.5-122b-a10b |"), "{stdout}");
    assert!(stdout.contains("| qwen3-235b-a22b |"), "{stdout}");
}

#[test]
fn bench_reports_runs_and_limits_as_json() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let m = model.to_str().unwrap();
    assert!(sluice(&["synth", "--preset", "tiny-qwen3.5-moe", "-o", m])
        .status
        .success());
    let out = sluice(&[
        "bench", "-m", m, "-p", "16", "-n", "4", "-r", "2", "-t", "1,2", "-k", "2,4", "--memory",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["limits"]["memory_read_gbps"].as_f64().unwrap() > 0.0);
    let runs = v["runs"].as_array().unwrap();
    // 2 K values x 2 thread counts x (pp16, tg4).
    assert_eq!(runs.len(), 8);
    for r in runs {
        assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["samples"].as_array().unwrap().len(), 2);
        assert!(r["fraction_of_limit"].as_f64().unwrap() > 0.0);
    }
    let tg = |k: u64| {
        runs.iter()
            .find(|r| r["test"] == "tg4" && r["experts_per_token"] == k)
            .unwrap()["bytes_per_token"]
            .as_f64()
            .unwrap()
    };
    // Two more experts per token read two more experts' bytes in each of the 4 layers.
    assert!(tg(4) > tg(2), "{} vs {}", tg(4), tg(2));
}

#[test]
fn bench_samples_when_asked_and_says_so() {
    // The demo model's generation_config.json samples (temperature, top-k, top-p): the rows say
    // "sampled", single and batched; an override implies --sample; bad settings are refused.
    let out = sluice(&[
        "bench", "-p", "0", "-n", "6", "-b", "1,3", "-r", "1", "--top-k", "5", "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{v}");
    for r in runs {
        assert_eq!(r["variant"], "sampled", "{r}");
        assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("top-k 5"), "{stderr}");
    let greedy = sluice(&["bench", "-p", "0", "-n", "4", "-r", "1", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&greedy.stdout).unwrap();
    assert_eq!(v["runs"][0]["variant"], "", "{v}");
    let err = bench_fails(&["bench", "-p", "0", "-n", "4", "-r", "1", "--top-p", "1.5"]);
    assert!(err.contains("sampling"), "{err}");
    let err = bench_fails(&[
        "bench",
        "-p",
        "0",
        "-n",
        "4",
        "--sample",
        "--speculate",
        "lookup",
    ]);
    assert!(err.contains("--sample"), "{err}");
}

/// Like `sluice_fails`, for commands that print progress lines before the error: exit 1, no
/// panic, and the error as the last line (returned).
fn bench_fails(args: &[&str]) -> String {
    let out = sluice(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let last = stderr.lines().last().unwrap_or("").to_string();
    assert!(last.starts_with("error: "), "{stderr}");
    last
}

#[test]
fn bad_sizes_are_rejected_naming_the_flag_and_the_units() {
    for (args, flag) in [
        (
            &["generate", "-p", "x", "--expert-cache", "5 furlongs"][..],
            "--expert-cache",
        ),
        (
            &["generate", "-p", "x", "--memory-budget", "lots"],
            "--memory-budget",
        ),
        (
            &["info", "-m", "x", "--expert-cache", "1.2.3GB"],
            "--expert-cache",
        ),
        (&["serve", "--max-body", "16 MeB"], "--max-body"),
        (
            &["bench", "--expert-cache", "off,4 parsecs"],
            "--expert-cache",
        ),
        (&["bench", "--disk", "--block", "2 blocks"], "--block"),
    ] {
        let out = sluice(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Rejected while parsing the command line (clap's usage error), before any work.
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let line = stderr.lines().next().unwrap_or("");
        assert!(
            line.starts_with("error: ") && line.contains(flag),
            "{args:?}: {stderr}"
        );
        assert!(
            line.contains("kB, MB, GB, TB, KiB, MiB, GiB, TiB"),
            "{args:?}: the accepted units: {stderr}"
        );
    }
}

#[test]
fn bench_measures_the_disk_and_rejects_bad_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("blob");
    std::fs::write(&file, vec![7u8; 64 << 20]).unwrap();
    let f = file.to_str().unwrap();
    let out = sluice(&["bench", "--disk", "--file", f, "--disk-seconds", "0.1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("| sequential") && stdout.contains("GB/s"),
        "{stdout}"
    );

    // With no model and no limit to measure, the bundled demo model is benchmarked.
    let out = sluice(&["bench", "-p", "8", "-n", "8", "-r", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("demo"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let small = tmp.path().join("small");
    std::fs::write(&small, b"tiny").unwrap();
    // Progress lines may precede the error; the error is still the last line.
    let out = sluice(&["bench", "--disk", "--file", small.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    let last = err.lines().last().unwrap();
    assert!(
        last.starts_with("error: ") && last.contains("too small"),
        "{err}"
    );
    let m = fixture("qwen3_moe-q4");
    let m = m.to_str().unwrap();
    let err = sluice_fails(&["bench", "-m", m, "-t", "0"]);
    assert!(err.contains("--threads"), "{err}");
    let err = bench_fails(&[
        "bench", "-m", m, "-k", "99", "-p", "4", "-n", "0", "-r", "1",
    ]);
    assert!(err.contains("99"), "{err}");
}

#[test]
fn pack_writes_a_streaming_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("packed");
    let o = out.to_str().unwrap();
    let m = fixture("qwen3_moe-q4");
    let m = m.to_str().unwrap();
    let run = sluice(&["pack", m, "-o", o]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("packed") && stderr.contains("blocks"),
        "{stderr}"
    );
    for f in [
        "model.safetensors",
        "experts.bin",
        "experts.json",
        "config.json",
        "tokenizer.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing: {stderr}");
    }
    assert!(!tmp.path().join("packed.partial").exists());
    // An existing output is kept unless --force.
    let err = sluice_fails(&["pack", m, "-o", o]);
    assert!(err.contains("--force"), "{err}");
    let run = sluice(&["pack", m, "-o", o, "--force"]);
    assert!(run.status.success());
}

#[test]
fn generate_streams_an_unpacked_model_when_given_a_cache() {
    let m = fixture("qwen3_5_moe-q4");
    let m = m.to_str().unwrap();
    let run = sluice(&[
        "generate",
        "-m",
        m,
        "--expert-cache",
        "1MiB",
        "--stats",
        "-p",
        "hi",
        "-n",
        "4",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("streaming experts from")
            && stderr.contains("unpacked")
            && stderr.contains("[stats]")
            && stderr.contains("experts: read"),
        "{stderr}"
    );
    // Without a cache flag an unpacked model keeps its experts memory-mapped.
    let run = sluice(&["generate", "-m", m, "--stats", "-p", "hi", "-n", "2"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(!stderr.contains("streaming experts from"), "{stderr}");
}

/// `sluice info` on the bundled demo model (18 MiB, every expert fits the default cache) needs no
/// disk measurement and ends well; with a cache too small for its experts it says the disk part
/// is not estimated on a file that small, instead of failing (it used to end with "too small to
/// measure" and exit 1).
#[test]
fn info_on_a_tiny_model_skips_the_disk_measurement() {
    let m = fixture("../../models/demo");
    let m = m.to_str().unwrap();
    for (extra, expect) in [
        (&[][..], "nothing from disk (the cache holds every expert)"),
        (
            &["--expert-cache", "4MiB"][..],
            "from disk, not estimated: ",
        ),
    ] {
        let mut args = vec!["info", "-m", m, "--memory-gbps", "20"];
        args.extend_from_slice(extra);
        let out = sluice(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {stdout}{stderr}");
        assert!(stdout.contains(expect), "{extra:?}: {stdout}");
    }
    // Given a bandwidth, the estimate is made.
    let out = sluice(&[
        "info",
        "-m",
        m,
        "--memory-gbps",
        "20",
        "--disk-gbps",
        "1",
        "--expert-cache",
        "4MiB",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("from disk at 1.00 GB/s"),
        "{stdout}"
    );
}

/// `sluice info --context N`: a request's state at N tokens (KV per token times N plus the
/// DeltaNet's fixed state, from the model's own sizes), and whether it fits the budget with the
/// weights and the expert cache; a context past the model's is an error.
#[test]
fn info_sizes_a_requests_state_at_a_context() {
    let m = fixture("qwen3_5_moe-q4");
    let m = m.to_str().unwrap();
    let info = |extra: &[&str]| {
        let mut args = vec!["info", "-m", m, "--memory-gbps", "20", "--disk-gbps", "1"];
        args.extend_from_slice(extra);
        sluice(&args)
    };
    // Three Gated DeltaNet layers and one attention layer with 2 KV heads of 32: keys and values,
    // 2 x 2 x 32 f32 per token.
    let out = info(&["--context", "100", "--memory-budget", "10MiB"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("KV cache 512 B per token (f32) + recurrent state"),
        "{stdout}"
    );
    assert!(stdout.contains("at 100 tokens"), "{stdout}");
    assert!(
        stdout.contains("memory at 100 tokens") && stdout.contains(": fits"),
        "{stdout}"
    );
    // The derived cache also leaves room for a prefill pass: of --ubatch tokens, at most the
    // context.
    assert!(stdout.contains("prefill pass of 100 tokens)"), "{stdout}");
    assert!(
        stdout.contains("prefill pass of 512 tokens (--ubatch)"),
        "{stdout}"
    );
    let out = info(&["--context", "100", "--memory-budget", "10MiB", "-u", "32"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("prefill pass of 32 tokens)"), "{stdout}");
    let out = info(&["--context", "512", "--memory-budget", "400KiB"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("does NOT fit"), "{stdout}");
    let out = info(&["--context", "100000"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("past the model's context"),
        "{stderr}"
    );
    // In q8, the 128 values per token take 128 code bytes and 4 f16 scales; q4 half the codes
    // and a scale and minimum per 32.
    for (format, bytes) in [("q8", 136), ("q4", 80), ("f16", 256)] {
        let out = info(&["--context", "100", "--kv-cache", format]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("KV cache {bytes} B per token ({format})")),
            "{stdout}"
        );
    }
}

/// Every KV cache format runs a model end to end; `perplexity --compare` measures what one
/// costs against the first (nothing, for the same format twice); an unknown format is a
/// one-line error.
#[test]
fn kv_cache_formats_run_and_compare() {
    let m = fixture("qwen3_5_moe-q4");
    let m = m.to_str().unwrap();
    for format in ["f16", "bf16", "q8", "q4"] {
        let out = sluice(&[
            "generate",
            "-m",
            m,
            "--device",
            "cpu",
            "-p",
            "hello",
            "-n",
            "8",
            "--kv-cache",
            format,
        ]);
        assert!(
            out.status.success(),
            "{format}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A usage error (clap's exit code 2), naming the choices.
    let out = sluice(&["generate", "-m", m, "-p", "x", "--kv-cache", "q3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("f32, f16, bf16, q8 or q4"), "{err}");
    let out = sluice(&[
        "perplexity",
        "-m",
        m,
        "--device",
        "cpu",
        "--kernels",
        "exact",
        "--random",
        "--window",
        "96",
        "--windows",
        "2",
        "--compare",
        "f32,q4",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |name: &str| -> Vec<String> {
        stdout
            .lines()
            .filter(|l| l.starts_with(&format!("| {name} |")))
            .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
            .nth(if name == "f32" { 1 } else { 0 })
            .unwrap_or_else(|| panic!("no {name} row: {stdout}"))
    };
    let same = row("f32");
    assert_eq!(same[3].parse::<f64>().unwrap(), 0.0, "{stdout}");
    assert_eq!(same[4], "100.00%", "{stdout}");
    assert_eq!(same[5], "190", "{stdout}");
    let q4: f64 = row("q4")[3].parse().unwrap();
    assert!(q4 > 0.0 && q4 < 1.0, "{stdout}");
    let err = sluice_fails(&["perplexity", "-m", m, "--random", "--window", "100000"]);
    assert!(err.contains("past the model's context"), "{err}");
}

#[test]
fn info_shows_the_plan_with_its_arithmetic() {
    let tmp = tempfile::tempdir().unwrap();
    let packed = tmp.path().join("p");
    let p = packed.to_str().unwrap();
    let src = fixture("qwen3_5_moe-q4");
    assert!(sluice(&["pack", src.to_str().unwrap(), "-o", p])
        .status
        .success());
    let out = sluice(&[
        "info",
        "-m",
        p,
        "--expert-cache",
        "64KiB",
        "--memory-gbps",
        "20",
        "--disk-gbps",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "bytes per token at K=3",
        "streamed layers (packed)",
        "expert cache",
        "estimate:",
    ] {
        assert!(stdout.contains(want), "missing `{want}` in:\n{stdout}");
    }
    // Unpacked: says how to stream it.
    let out = sluice(&[
        "info",
        "-m",
        src.to_str().unwrap(),
        "--memory-gbps",
        "20",
        "--disk-gbps",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("sluice pack"), "{stdout}");
    // A VRAM budget: the GPU plan, with the cache it leaves; too small a budget says so.
    let info = |budget: &str| {
        let out = sluice(&[
            "info",
            "-m",
            p,
            "--vram-budget",
            budget,
            "--pcie-gbps",
            "50",
            "--memory-gbps",
            "20",
            "--disk-gbps",
            "1",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let fits = info("2GiB");
    assert!(
        fits.contains("VRAM budget") && fits.contains("= 100% of the experts"),
        "{fits}"
    );
    let small = info("100MiB");
    assert!(
        small.contains("too small") && small.contains("need at least"),
        "{small}"
    );
}

/// `sluice chat` with the given stdin (not a terminal: plain line reading).
fn chat(model: &Path, input: &str) -> (String, String) {
    chat_with(model, &["-n", "5"], input)
}

/// [`chat`] with other flags.
fn chat_with(model: &Path, flags: &[&str], input: &str) -> (String, String) {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["chat", "--model", model.to_str().unwrap()])
        .args(flags)
        .env("RAYON_NUM_THREADS", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    (String::from_utf8_lossy(&out.stdout).to_string(), stderr)
}

/// The `[N tokens, ...; prompt P tokens, R reused...]` lines, as (P, R).
fn chat_turns(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.split("; prompt ").nth(1)?;
            let mut words = rest.split_whitespace();
            let prompt = words.next()?.parse().ok()?;
            let reused = words.nth(1)?.parse().ok()?;
            Some((prompt, reused))
        })
        .collect()
}

#[test]
fn chat_keeps_history_and_reuses_the_prompt() {
    let model = fixture("qwen3_5_moe-q4");
    let (_, stderr) = chat(&model, "hello there\nand again\n/quit\nnot read\n");
    let turns = chat_turns(&stderr);
    assert_eq!(turns.len(), 2, "{stderr}");
    // Turn 2's prompt holds turn 1 (history), most of which is reused from the saved state.
    assert!(turns[1].0 > turns[0].0 + 5, "{turns:?}");
    assert_eq!(turns[0].1, 0, "{turns:?}");
    assert!(turns[1].1 >= turns[0].0, "{turns:?}");
}

#[test]
fn chat_drafts_with_a_draft_model_and_answers_the_same() {
    let demo = fixture("../../models/demo");
    let draft = fixture("../../models/demo-draft");
    let input = "Tell me a story about a fox.\n/quit\n";
    let greedy = ["-n", "24", "--temperature", "0"];
    let (plain, _) = chat_with(&demo, &greedy, input);
    let flags = [&greedy[..], &["--draft-model", draft.to_str().unwrap()]].concat();
    let (drafted, stderr) = chat_with(&demo, &flags, input);
    assert_eq!(drafted, plain, "{stderr}");
    assert!(stderr.contains("of drafts kept"), "{stderr}");
}

#[test]
fn chat_commands_reset_and_set_the_system_message() {
    let model = fixture("qwen3_5_moe-q4");
    let (_, stderr) = chat(
        &model,
        "hello there\n/reset\nhello there\n/system Be brief.\nhello there\n/bogus\n",
    );
    let turns = chat_turns(&stderr);
    assert_eq!(turns.len(), 3, "{stderr}");
    assert!(stderr.contains("(conversation cleared)"), "{stderr}");
    assert!(stderr.contains("(system message set"), "{stderr}");
    assert!(stderr.contains("unknown command /bogus"), "{stderr}");
    // After /reset the prompt is turn 1's again; the system message makes it longer.
    assert_eq!(turns[1].0, turns[0].0, "{turns:?}");
    assert!(turns[2].0 > turns[0].0, "{turns:?}");
}

#[test]
fn the_bundled_demo_model_is_the_default_and_streams() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["generate", "-p", "Once upon a time", "-n", "24"])
        .args(["--expert-cache", "4MiB"])
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("SLUICE_MODEL")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("bundled demo model"), "{stderr}");
    // Experts were read from disk through the small cache.
    let experts = stderr
        .lines()
        .find(|l| l.starts_with("experts: read"))
        .unwrap_or_else(|| panic!("no streaming stats in:\n{stderr}"));
    assert!(!experts.starts_with("experts: read 0 B"), "{experts}");
    // A trained model writes words: mostly letters and spaces, several words.
    let text = stdout.trim();
    let letters = text
        .chars()
        .filter(|c| c.is_ascii_alphabetic() || *c == ' ')
        .count();
    assert!(
        text.split_whitespace().count() >= 8 && letters * 10 >= text.chars().count() * 8,
        "{text:?}"
    );
}

#[test]
fn sluice_model_names_the_default_model() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["generate", "-p", "x", "-n", "2"])
        .env("SLUICE_MODEL", fixture("qwen3_moe-q4"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("qwen3_moe-q4"), "{stderr}");
    assert!(!stderr.contains("bundled demo model"), "{stderr}");
}

#[test]
fn a_vram_budget_on_the_cpu_is_ignored_and_said_so() {
    let m = fixture("qwen3_moe-q4");
    let run = sluice(&[
        "generate",
        "-m",
        m.to_str().unwrap(),
        "--device",
        "cpu",
        "--vram-budget",
        "8GiB",
        "-p",
        "hi",
        "-n",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("--vram-budget is ignored on the CPU"),
        "{stderr}"
    );
    // Nothing streams because of it: the unpacked model keeps its experts mapped.
    assert!(!stderr.contains("streaming experts from"), "{stderr}");
}

#[cfg(unix)]
#[test]
fn printing_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    // A pipe whose reader is gone before sluice writes: like `sluice synth --list | head -0`.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["synth", "--list"])
        .stdout(writer)
        .output()
        .expect("running sluice");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "{stderr}");
    // Ended by SIGPIPE (13 on Linux and the BSDs), as `cat` would be; a panic exits with 101.
    assert_eq!(out.status.signal(), Some(13), "{:?}", out.status);
}

#[test]
fn info_describes_a_deltanet_gguf() {
    let gguf = fixture("qwen3_5_moe-gguf-q4_k_m").join("model.gguf");
    let out = sluice(&["info", "-m", gguf.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "(GGUF v3, qwen35moe)",
        "qwen35moe.full_attention_interval: ",
        "qwen35moe.ssm.group_count: ",
        "qwen35moe.ssm.time_step_rank: ",
        "qwen35moe.ssm.state_size: ",
        "qwen35moe.ssm.conv_kernel: ",
        "qwen35moe.expert_shared_feed_forward_length: ",
        "of weights in a ",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
}

#[test]
fn generate_drafts_with_a_draft_model_of_the_same_tokenizer() {
    let draft = fixture("../../models/demo-draft");
    let plain_args = [
        "generate",
        "--prompt",
        "Once upon a time",
        "-n",
        "24",
        "--temperature",
        "0",
    ];
    let out = sluice(&[&plain_args[..], &["--draft-model", draft.to_str().unwrap()]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The same text as without speculation.
    let plain = sluice(&plain_args);
    assert_eq!(out.stdout, plain.stdout, "{stderr}");
    assert!(
        stderr.contains("speculation (draft model, 4 tokens)"),
        "{stderr}"
    );
    // Another tokenizer is refused at load, naming both sizes.
    let other = fixture("qwen3-q4");
    let out = sluice(&[
        "generate",
        "--prompt",
        "hi",
        "--draft-model",
        other.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("500 tokens") && stderr.contains("8192"),
        "{stderr}"
    );
}

#[test]
fn generate_drafts_with_the_demo_models_mtp_layer() {
    let plain_args = [
        "generate",
        "--prompt",
        "Once upon a time",
        "-n",
        "24",
        "--temperature",
        "0",
    ];
    let out = sluice(&[&plain_args[..], &["--speculate", "mtp"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let plain = sluice(&plain_args);
    assert_eq!(out.stdout, plain.stdout, "{stderr}");
    assert!(stderr.contains("speculation (mtp, 3 tokens)"), "{stderr}");
    // A checkpoint without the layer says so, and what to use instead.
    let q4 = fixture("qwen3_5_moe-q4");
    let out = sluice(&[
        "generate",
        "--model",
        q4.to_str().unwrap(),
        "--prompt",
        "hi",
        "--speculate",
        "mtp",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no multi-token-prediction layer") && stderr.contains("--speculate lookup"),
        "{stderr}"
    );
}

#[test]
fn bench_speculate_runs_echo_tests_and_counts_what_was_kept() {
    // The bundled demo model (trained): its answer after S, its continuation G and S again
    // repeats G in part, so prompt lookup keeps some drafts.
    let out = sluice(&[
        "bench",
        "-p",
        "0",
        "-n",
        "32",
        "-r",
        "1",
        "--speculate",
        "off,lookup",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{v}");
    let (off, lookup) = (&runs[0]["speculation"], &runs[1]["speculation"]);
    assert!(runs.iter().all(|r| r["test"] == "tg32 echo"), "{v}");
    assert_eq!(off["method"], "off");
    assert_eq!(off["drafted"], 0);
    assert_eq!(off["tokens_per_pass"].as_f64(), Some(1.0));
    assert_eq!(lookup["method"], "lookup, 4 tokens");
    let (drafted, accepted) = (
        lookup["drafted"].as_u64().unwrap(),
        lookup["accepted"].as_u64().unwrap(),
    );
    assert!(accepted > 0 && accepted <= drafted, "{lookup}");
    assert!(
        lookup["tokens_per_pass"].as_f64().unwrap() > 1.0,
        "{lookup}"
    );
    // Fewer passes per token read fewer dense bytes per token.
    assert!(
        runs[1]["bytes_per_token"].as_f64() < runs[0]["bytes_per_token"].as_f64(),
        "{v}"
    );
    assert!(runs[1]["variant"]
        .as_str()
        .unwrap()
        .contains("speculate lookup"));

    for (args, flag) in [
        (&["--speculate", "lookup", "-b", "2"][..], "--batch"),
        (&["--draft-tokens", "4"][..], "--speculate"),
        (&["--speculate", "medusa"][..], "medusa"),
        (&["--speculate", "lookup", "-d", "64"][..], "--depth"),
        (&["--speculate", "draft"][..], "--draft-model"),
        (
            &["--draft-model", "models/demo-draft"][..],
            "--speculate draft",
        ),
    ] {
        let all: Vec<&str> = ["bench", "-p", "0", "-n", "4", "-r", "1"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let err = bench_fails(&all);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
