//! The multi-token-prediction layer on CUDA device 0: against transformers on the
//! `qwen3_5_moe-mtp` fixture, and `--speculate mtp` giving plain decoding's tokens on the GPU
//! (the checks are the CPU's, `sluice-engine/tests/common/mtp.rs`).
//!
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda --test mtp -- --ignored`.

use std::sync::Arc;

#[path = "../../sluice-engine/tests/common/speculate.rs"]
mod speculate;

#[path = "../../sluice-engine/tests/common/mtp.rs"]
mod mtp;

fn gpu() -> Arc<sluice_cuda::CudaBackend> {
    Arc::new(sluice_cuda::open(0).unwrap_or_else(|e| panic!("CUDA device 0: {e}")))
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn the_mtp_layer_on_the_gpu_matches_transformers() {
    mtp::mtp_matches_the_reference(gpu());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn mtp_drafts_on_the_gpu_give_the_tokens_of_plain_decoding() {
    mtp::mtp_speculation_is_exact(gpu(), 0.3);
}
