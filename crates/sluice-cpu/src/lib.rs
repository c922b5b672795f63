//! The CPU backend: SIMD kernels (AVX-512, AVX2, NEON, portable fallback; chosen at run time)
//! and the [`CpuBackend`] that implements [`sluice_backend::Backend`] with them.
//!
//! Weights are used in place (usually memory-mapped safetensors); nothing is repacked.

mod backend;
pub mod kernels;
mod kv;
mod profile;
mod team;

pub use backend::{CpuAct, CpuBackend};
pub use kernels::Kernels;
pub use kv::{prompt_scratch_bytes, CpuKvCache};
pub use profile::report as profile_report;
pub use team::{set_thread_count, thread_count};
