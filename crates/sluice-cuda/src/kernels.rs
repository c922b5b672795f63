//! The kernels: PTX built ahead from `kernels/sluice.cu` (see `scripts/cuda/build_kernels.py`),
//! embedded here, JIT-compiled by the driver when the backend starts.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::Ptx;

/// The committed PTX; its first line records the hash of the source it was built from.
pub(crate) const PTX: &str = include_str!("../kernels/sluice.ptx");

/// Every kernel the backend launches.
pub(crate) struct Kernels {
    /// `gemv[t - 1]` multiplies `t` tokens (1..=8).
    pub gemv: Vec<CudaFunction>,
    pub gemm: CudaFunction,
    pub embed: CudaFunction,
    pub rms_norm: CudaFunction,
    pub add_rms_norm: CudaFunction,
    pub rms_norm_gated: CudaFunction,
    pub add_assign: CudaFunction,
    pub swiglu: CudaFunction,
    pub sigmoid_mul: CudaFunction,
    pub split_chunks: CudaFunction,
    pub rope: CudaFunction,
    pub attention: CudaFunction,
    pub route: CudaFunction,
    pub moe_gate_up: CudaFunction,
    pub moe_down: CudaFunction,
    pub causal_conv1d_silu: CudaFunction,
    pub gated_delta_rule: CudaFunction,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, DriverError> {
        let module = ctx.load_module(Ptx::from_src(PTX))?;
        let f = |name: &str| module.load_function(name);
        Ok(Kernels {
            gemv: (1..=8)
                .map(|t| f(&format!("gemv_t{t}")))
                .collect::<Result<_, _>>()?,
            gemm: f("gemm")?,
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            add_rms_norm: f("add_rms_norm")?,
            rms_norm_gated: f("rms_norm_gated")?,
            add_assign: f("add_assign")?,
            swiglu: f("swiglu")?,
            sigmoid_mul: f("sigmoid_mul")?,
            split_chunks: f("split_chunks")?,
            rope: f("rope")?,
            attention: f("attention")?,
            route: f("route")?,
            moe_gate_up: f("moe_gate_up")?,
            moe_down: f("moe_down")?,
            causal_conv1d_silu: f("causal_conv1d_silu")?,
            gated_delta_rule: f("gated_delta_rule")?,
        })
    }
}

#[cfg(test)]
mod tests {
    /// FNV-1a 64, as `scripts/cuda/build_kernels.py` computes it.
    fn fnv1a64(data: &[u8]) -> u64 {
        data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        })
    }

    #[test]
    fn the_embedded_ptx_was_built_from_the_current_source() {
        let source = include_bytes!("../kernels/sluice.cu");
        let stamp = format!("// sluice-source-fnv1a64: {:016x}", fnv1a64(source));
        assert!(
            super::PTX.starts_with(&stamp),
            "crates/sluice-cuda/kernels/sluice.ptx is stale: run scripts/cuda/build_kernels.py"
        );
    }
}
