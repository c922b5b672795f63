//! sluice's CUDA backend: [`sluice_backend::Backend`] on an NVIDIA GPU (compute capability 8.0,
//! Ampere, or newer).
//!
//! Every operation of a forward pass is a kernel on one stream (`kernels/sluice.cu`, compiled
//! ahead to PTX and JIT-compiled by the driver at start): activations, KV caches, DeltaNet states
//! and the expert choice stay in device memory, and the host waits only where it reads something
//! back (logits; the routing when experts stream from disk). The MoE runs as one launch for the
//! gate and up projections of every routed (token, expert) pair, SwiGLU fused, and one for the
//! down projections with the routing weights, the expert ids read on the device. Weights keep
//! their stored format (dense, MLX affine, mxfp4), dequantised in registers by kernels compiled
//! per format; gpt-oss's parts ride along as uniform arguments: attention's sliding window (only
//! the visible positions are read) and sinks, the experts' biases and clamped SwiGLU. Launches are
//! recorded and issued when the host needs a result; a batch of launches seen before (a decode
//! step) is replayed as a CUDA graph with its changed parameters updated (`src/graph.rs`).
//!
//! Streamed experts (a model larger than the GPU) are kept in a VRAM expert cache of fixed slots
//! between calls, copied in from the expert store's page-locked host cache on a miss
//! (`src/vram_experts.rs`; the slot bookkeeping in `src/expert_cache.rs`), or read in place in
//! that cache when it holds them all (`src/in_place.rs`); then the CPU may compute part of each
//! decode layer's misses beside the GPU (`src/host_compute.rs`).
//!
//! The driver (`libcuda`) is loaded when a backend is opened, not linked: building needs no CUDA
//! toolkit, and the same binary runs on the CPU where there is no GPU. [`open`] turns every way
//! of failing there (no driver, no device, an old GPU or driver) into a one-line error.

mod backend;
mod device;
mod expert_cache;
mod graph;
mod host_compute;
mod in_place;
mod kernels;
mod mat;
mod vram_experts;

use cudarc::driver::CudaContext;
use sluice_backend::BackendError;

pub use backend::{
    CudaAct, CudaBackend, CudaExperts, CudaKvCache, CudaLinearState, CudaRouting, CudaStagedExpert,
    CudaVector, CudaWeight,
};
pub use host_compute::HostCompute;
pub use vram_experts::RESERVE_BYTES as VRAM_RESERVE_BYTES;

fn unusable(msg: String) -> BackendError {
    BackendError::Unsupported(msg)
}

/// Whether the NVIDIA driver library can be loaded at all.
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; nothing is called through it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices; 0 when there is no driver or no device.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Opens CUDA device `ordinal` with sluice's kernels loaded.
pub fn open(ordinal: usize) -> Result<CudaBackend, BackendError> {
    if !driver_present() {
        return Err(unusable(
            "no NVIDIA driver found (libcuda.so.1 could not be loaded): install the NVIDIA \
             driver, or run with --device cpu"
                .into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| {
            unusable(format!(
                "the NVIDIA driver found no usable GPU ({e}); run with --device cpu"
            ))
        })?
        .max(0) as usize;
    if ordinal >= count {
        return Err(unusable(format!(
            "cuda:{ordinal} does not exist: {count} CUDA device{} found",
            if count == 1 { "" } else { "s" }
        )));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| unusable(format!("cuda:{ordinal}: could not create a context: {e}")))?;
    // One stream: the safe layer's per-launch events would only cost time.
    // SAFETY: no CudaSlice of the safe layer is shared between streams.
    unsafe { ctx.disable_event_tracking() };
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
    if major < 8 {
        return Err(unusable(format!(
            "cuda:{ordinal} ({name}) has compute capability {major}.{minor}; sluice's CUDA \
             kernels need 8.0 (Ampere) or newer: run with --device cpu"
        )));
    }
    let total = ctx.total_mem().unwrap_or(0) as f64 / (1u64 << 30) as f64;
    let device = device::Device::new(ctx)?;
    Ok(CudaBackend::with_device(
        device,
        format!("cuda:{ordinal} ({name}, sm_{major}{minor}, {total:.0} GiB)"),
    ))
}
