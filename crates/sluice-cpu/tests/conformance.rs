//! The backend conformance suite (`sluice_backend::conformance`) on the CPU backend, at the SIMD
//! level this machine picks (`SLUICE_SIMD=scalar` runs it on the portable kernels).

sluice_backend::conformance_tests!(sluice_cpu::CpuBackend::new());
