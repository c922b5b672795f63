//! sluice's logits against mlx-lm's fp32 logits on the tiny checkpoints in `tests/fixtures/`.
//!
//! For decode (one token per call, through the caches) and prefill (all tokens in one call):
//! the same argmax at every position, and max|diff| <= 1e-3 * max|ref|.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::{npy, Engine, LoadOptions, LogitsMode};

const RELATIVE_TOLERANCE: f32 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn reference_tokens(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn check(name: &str, mode: LogitsMode) {
    check_model(name, &fixture(name), &fixture(name), mode);
}

/// Compares the model in `model_dir` with the reference logits in `reference_dir`.
fn check_model(name: &str, model_dir: &Path, reference_dir: &Path, mode: LogitsMode) {
    let dir = reference_dir;
    let engine = Engine::load(
        model_dir,
        Arc::new(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap_or_else(|e| panic!("loading {name}: {e}"));
    let tokens = reference_tokens(dir);
    let file = match mode {
        LogitsMode::Decode => "logits_decode.npy",
        LogitsMode::Prefill => "logits_prefill.npy",
    };
    let (want, shape) = npy::read_f32(&dir.join(file)).unwrap();
    let vocab = engine.model.info().vocab_size;
    assert_eq!(shape, vec![tokens.len(), vocab], "{name}/{file}: shape");
    let got = engine.logits(&tokens, mode).unwrap();
    assert_eq!(got.len(), want.len());

    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        assert_eq!(
            argmax(g),
            argmax(w),
            "{name} {mode:?}: argmax differs at position {t}"
        );
    }
    assert!(
        max_diff <= RELATIVE_TOLERANCE * max_ref,
        "{name} {mode:?}: max|diff| {max_diff} > {RELATIVE_TOLERANCE} * max|ref| {max_ref}"
    );
    eprintln!("{name} {mode:?}: max|diff| {max_diff:.2e}, max|ref| {max_ref:.2}");
}

macro_rules! reference_tests {
    ($($test:ident: $name:literal,)*) => {
        mod decode {
            $(#[test] fn $test() { super::check($name, sluice_engine::LogitsMode::Decode); })*
        }
        mod prefill {
            $(#[test] fn $test() { super::check($name, sluice_engine::LogitsMode::Prefill); })*
        }
    };
}

reference_tests! {
    qwen3_moe_bf16: "qwen3_moe-bf16",
    qwen3_moe_q4: "qwen3_moe-q4",
    qwen3_moe_q8: "qwen3_moe-q8",
    qwen3_moe_q4g128: "qwen3_moe-q4g128",
    qwen3_moe_hf: "qwen3_moe-hf",
    qwen3_moe_transformers: "qwen3_moe-transformers",
    qwen3_5_moe_transformers: "qwen3_5_moe-transformers",
    qwen3_5_moe_bf16: "qwen3_5_moe-bf16",
    qwen3_5_moe_q4: "qwen3_5_moe-q4",
    qwen3_5_moe_q8: "qwen3_5_moe-q8",
    qwen3_next_bf16: "qwen3_next-bf16",
}

/// The bundled demo model (models/demo, trained, 4-bit) against mlx-lm
/// (scripts/make_demo_reference.py): an English sentence and the end of a tool-offering chat
/// prompt.
#[test]
fn demo_model_matches_mlx_lm() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
    let reference = fixture("demo-reference");
    check_model("demo", &model, &reference, LogitsMode::Decode);
    check_model("demo", &model, &reference, LogitsMode::Prefill);
}

/// A tied model uses its embeddings as the output head even when a (different) `lm_head` tensor
/// is stored, as mlx-lm (whose sanitize drops it) and transformers (which ties it) do.
#[test]
fn tied_model_ignores_a_stray_lm_head() {
    use sluice_format::{write_safetensors, StDtype};
    let src = fixture("qwen3_moe-q8");
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["tie_word_embeddings"], true, "fixture must be tied");
    let (vocab, hidden) = (
        config["vocab_size"].as_u64().unwrap() as usize,
        config["hidden_size"].as_u64().unwrap() as usize,
    );
    // A dense f32 head of ones: far from the embeddings, so using it would change every logit.
    let head: Vec<u8> = (0..vocab * hidden)
        .flat_map(|_| 1f32.to_le_bytes())
        .collect();
    let shard = "extra.safetensors";
    write_safetensors(
        &tmp.path().join(shard),
        &[(
            "lm_head.weight".into(),
            StDtype::F32,
            vec![vocab, hidden],
            &head,
        )],
        None,
    )
    .unwrap();
    let index_path = tmp.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["lm_head.weight"] = shard.into();
    std::fs::write(&index_path, index.to_string()).unwrap();

    let engine = Engine::load(
        tmp.path(),
        Arc::new(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap();
    let tokens = reference_tokens(&src);
    let (want, _) = npy::read_f32(&src.join("logits_prefill.npy")).unwrap();
    let got = engine.logits(&tokens, LogitsMode::Prefill).unwrap();
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_diff <= RELATIVE_TOLERANCE * max_ref,
        "stray lm_head was used: max|diff| {max_diff} vs max|ref| {max_ref}"
    );
}
