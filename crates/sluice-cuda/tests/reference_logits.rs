//! The reference-logit suite (`sluice-engine/tests/common/reference.rs`: every fixture, decode and
//! prefill, and the demo model, with the CPU's tolerance) on CUDA device 0.
//!
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda -- --ignored` (or run the built test binary with
//! `--ignored`, setting `SLUICE_REPO` to the repository when it runs elsewhere).

use std::sync::Arc;

#[path = "../../sluice-engine/tests/common/reference.rs"]
#[macro_use]
mod reference;

fn gpu() -> Arc<sluice_cuda::CudaBackend> {
    Arc::new(sluice_cuda::open(0).unwrap_or_else(|e| panic!("CUDA device 0: {e}")))
}

reference_suite!(gpu(); #[ignore = "needs an NVIDIA GPU: run with --ignored"]);
