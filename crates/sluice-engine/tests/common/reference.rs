//! The reference-logit suite, shared by every backend's tests (the CPU's in sluice-engine, the
//! GPU's in sluice-cuda include this file): sluice's logits against the reference
//! implementation's fp32 logits on the fixtures in `tests/fixtures/` and the demo model.
//!
//! For decode (one token per call, through the caches) and prefill (all tokens in one call): the
//! same argmax at every position, and max|diff| <= 1e-3 * max|ref|.
//!
//! The repository is found from the crate's source location, or from `$SLUICE_REPO` (test
//! binaries built on one machine and run on another).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_backend::Backend;
use sluice_engine::{npy, Engine, LoadOptions, LogitsMode};

pub const RELATIVE_TOLERANCE: f32 = 1e-3;

pub fn repo() -> PathBuf {
    std::env::var_os("SLUICE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

pub fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures").join(name)
}

pub fn reference_tokens(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Compares the model in `model_dir`, run on `backend`, with the reference logits in
/// `reference_dir`.
pub fn check_model<B: Backend + 'static>(
    backend: Arc<B>,
    name: &str,
    model_dir: &Path,
    reference_dir: &Path,
    mode: LogitsMode,
) {
    let dir = reference_dir;
    let engine = Engine::load(model_dir, backend, &LoadOptions::default())
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

/// One test per fixture and mode, plus the demo model, for the backend `$make` builds (an
/// `Arc<B>`); attributes after a `;` go on every test.
macro_rules! reference_suite {
    (@suite [$($attrs:tt)*] $make:expr; { $($list:tt)* }) => {
        mod decode {
            use super::*;
            reference_suite!(@tests [$($attrs)*] $make, sluice_engine::LogitsMode::Decode; $($list)*);
        }
        mod prefill {
            use super::*;
            reference_suite!(@tests [$($attrs)*] $make, sluice_engine::LogitsMode::Prefill; $($list)*);
        }

        /// The bundled demo model (models/demo, trained, 4-bit) against mlx-lm
        /// (scripts/make_demo_reference.py).
        $($attrs)*
        #[test]
        fn demo_model_matches_mlx_lm() {
            let model = reference::repo().join("models/demo");
            let refs = reference::fixture("demo-reference");
            for mode in [sluice_engine::LogitsMode::Decode, sluice_engine::LogitsMode::Prefill] {
                reference::check_model($make, "demo", &model, &refs, mode);
            }
        }
    };
    (@tests [$($attrs:tt)*] $make:expr, $mode:expr; $test:ident: $name:literal, $($rest:tt)*) => {
        $($attrs)*
        #[test]
        fn $test() {
            let dir = reference::fixture($name);
            // A GGUF fixture holds its model as one file beside the reference logits.
            let gguf = dir.join("model.gguf");
            let model = if gguf.is_file() { gguf } else { dir.clone() };
            reference::check_model($make, $name, &model, &dir, $mode);
        }
        reference_suite!(@tests [$($attrs)*] $make, $mode; $($rest)*);
    };
    (@tests [$($attrs:tt)*] $make:expr, $mode:expr;) => {};
    ($make:expr $(; $(#[$attr:meta])*)?) => {
        reference_suite!(@suite [$($(#[$attr])*)?] $make; {
            qwen3_moe_bf16: "qwen3_moe-bf16",
            qwen3_moe_q4: "qwen3_moe-q4",
            qwen3_moe_q8: "qwen3_moe-q8",
            qwen3_moe_q4g128: "qwen3_moe-q4g128",
            qwen3_moe_hf: "qwen3_moe-hf",
            qwen3_moe_transformers: "qwen3_moe-transformers",
            qwen3_q4: "qwen3-q4",
            qwen3_hf: "qwen3-hf",
            qwen3_5_moe_transformers: "qwen3_5_moe-transformers",
            qwen3_5_moe_bf16: "qwen3_5_moe-bf16",
            qwen3_5_moe_q4: "qwen3_5_moe-q4",
            qwen3_5_moe_q8: "qwen3_5_moe-q8",
            qwen3_5_q4: "qwen3_5-q4",
            qwen3_next_bf16: "qwen3_next-bf16",
            qwen3_moe_gguf_q4_k_m: "qwen3_moe-gguf-q4_k_m",
            qwen3_gguf_q8_0: "qwen3-gguf-q8_0",
            qwen3_gguf_q4_k_m: "qwen3-gguf-q4_k_m",
            qwen3_moe_gguf_q3_k_m: "qwen3_moe-gguf-q3_k_m",
            qwen3_moe_gguf_q2_k: "qwen3_moe-gguf-q2_k",
            qwen3_moe_gguf_legacy: "qwen3_moe-gguf-legacy",
            qwen3_moe_gguf_codebooks: "qwen3_moe-gguf-codebooks",
            qwen3_moe_gguf_iq4: "qwen3_moe-gguf-iq4",
            qwen3_5_moe_gguf_q4_k_m: "qwen3_5_moe-gguf-q4_k_m",
            qwen3_next_gguf_q4_k_m: "qwen3_next-gguf-q4_k_m",
            mixtral_gguf_q4_k_m: "mixtral-gguf-q4_k_m",
            gpt_oss_gguf_mxfp4: "gpt_oss-gguf-mxfp4",
            glm4_moe_gguf_q4_k_m: "glm4_moe-gguf-q4_k_m",
            deepseek_v3_gguf_q4_k_m: "deepseek_v3-gguf-q4_k_m",
            mixtral_q4: "mixtral-q4",
            mixtral_hf: "mixtral-hf",
            mixtral_transformers: "mixtral-transformers",
            glm4_moe_q4: "glm4_moe-q4",
            glm4_moe_hf: "glm4_moe-hf",
            glm4_moe_transformers: "glm4_moe-transformers",
            deepseek_v3_q4: "deepseek_v3-q4",
            deepseek_v3_hf: "deepseek_v3-hf",
            deepseek_v3_transformers: "deepseek_v3-transformers",
            gpt_oss_q4: "gpt_oss-q4",
            gpt_oss_mxfp4: "gpt_oss-mxfp4",
            gpt_oss_hf: "gpt_oss-hf",
            gpt_oss_transformers: "gpt_oss-transformers",
            gpt_oss_transformers_dense: "gpt_oss-transformers-dense",
        });
    };
}
