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
    let dir = fixture(name);
    let engine = Engine::load(&dir, Arc::new(CpuBackend::new()), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {name}: {e}"));
    let tokens = reference_tokens(&dir);
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
