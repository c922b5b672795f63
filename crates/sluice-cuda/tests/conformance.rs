//! The backend conformance suite (`sluice_backend::conformance`) on CUDA device 0, with the CPU's
//! tolerance.
//!
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda -- --ignored`.

sluice_backend::conformance_tests!(
    sluice_cuda::open(0).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
);
