//! The multi-token-prediction layer on the CPU backend (the checks are `common/mtp.rs`, which
//! the CUDA backend's tests run too).

use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::speculate::Speculation;
use sluice_engine::{Engine, GenerateRequest, LoadOptions};

#[path = "common/speculate.rs"]
mod speculate;

#[path = "common/mtp.rs"]
mod mtp;

#[test]
fn the_mtp_layer_matches_transformers() {
    mtp::mtp_matches_the_reference(Arc::new(CpuBackend::new()));
}

#[test]
fn mtp_drafts_give_the_tokens_of_plain_decoding() {
    mtp::mtp_speculation_is_exact(Arc::new(CpuBackend::new()), 0.5);
}

/// A checkpoint without `mtp.*` (an mlx-community conversion) refuses `--speculate mtp` with
/// what to do instead.
#[test]
fn mtp_without_an_mtp_layer_is_refused() {
    let dir = speculate::fixture("qwen3_5_moe-q4");
    let mut engine =
        Engine::load(&dir, Arc::new(CpuBackend::new()), &LoadOptions::default()).unwrap();
    assert!(engine.model.mtp().is_none());
    engine.speculation = Speculation::Mtp { draft_tokens: 4 };
    let params = speculate::greedy();
    let request = GenerateRequest {
        prompt: &[1, 2, 3],
        params: &params,
        max_tokens: 4,
        cancel: None,
        ignore_eos: true,
        checkpoint: None,
    };
    let err = engine
        .generate_cached(None, &request, |_| std::ops::ControlFlow::Continue(()))
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("--speculate mtp") && err.contains("no multi-token-prediction layer"),
        "{err}"
    );
}
