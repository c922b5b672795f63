//! The CPU backend: SIMD kernels (AVX-512, AVX2, NEON, portable fallback; chosen at run time)
//! and the [`CpuBackend`] that implements [`sluice_backend::Backend`] with them.

pub mod kernels;
