//! The batching suite (`sluice-engine/tests/common/batch.rs`: requests joining and leaving a
//! batch get their results alone, at the model and the engine level) on CUDA device 0.
//!
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda --test batch -- --ignored`.

use std::sync::Arc;

#[path = "../../sluice-engine/tests/common/reference.rs"]
#[allow(unused_macros)]
#[macro_use]
mod reference;

#[path = "../../sluice-engine/tests/common/batch.rs"]
#[macro_use]
mod batch;

fn gpu() -> Arc<sluice_cuda::CudaBackend> {
    Arc::new(sluice_cuda::open(0).unwrap_or_else(|e| panic!("CUDA device 0: {e}")))
}

batch_suite!(gpu(); #[ignore = "needs an NVIDIA GPU: run with --ignored"]);
