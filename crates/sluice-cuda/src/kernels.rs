//! The kernels: PTX built ahead from `kernels/sluice.cu` (see `scripts/cuda/build_kernels.py`),
//! embedded here, JIT-compiled by the driver when the backend starts.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::Ptx;

/// The committed PTX; its first line records the hash of the source it was built from.
pub(crate) const PTX: &str = include_str!("../kernels/sluice.ptx");

/// A one-token matrix-vector variant (see `gemv_rows` in the source): its kernel, the rows each
/// warp computes, and whether it only takes 4-bit affine weights.
pub(crate) struct Gemv1 {
    pub f: CudaFunction,
    pub rows_per_warp: usize,
    pub q4_only: bool,
}

/// The one-token variants by `SLUICE_CUDA_GEMV` name (`t1` is the general kernel).
pub(crate) const GEMV1_VARIANTS: [(&str, usize, bool); 8] = [
    ("c8x1", 1, false),
    ("c8x2", 2, false),
    ("c8x4", 4, false),
    ("s32x1", 1, false),
    ("s32x2", 2, false),
    ("q4c8x1", 1, true),
    ("q4c8x2", 2, true),
    ("q4c8x4", 4, true),
];

/// Every kernel the backend launches.
pub(crate) struct Kernels {
    /// Kernel names by function handle (`{:?}` of it), for the profile.
    names: HashMap<String, String>,
    /// The one-token product `SLUICE_CUDA_GEMV` picks, if any.
    pub gemv1: Option<Gemv1>,
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
        let names = RefCell::new(HashMap::new());
        let f = |name: &str| {
            let func = module.load_function(name)?;
            names
                .borrow_mut()
                .insert(format!("{:?}", func.cu_function()), name.to_string());
            Ok::<_, DriverError>(func)
        };
        let gemv1 = match std::env::var("SLUICE_CUDA_GEMV").ok().as_deref() {
            None | Some("t1") => None,
            Some(name) => {
                let (v, rows_per_warp, q4_only) = GEMV1_VARIANTS
                    .into_iter()
                    .find(|v| v.0 == name)
                    .unwrap_or(("q4c8x2", 2, true));
                Some(Gemv1 {
                    f: f(&format!("gemv_{v}"))?,
                    rows_per_warp,
                    q4_only,
                })
            }
        };
        Ok(Kernels {
            names: HashMap::new(),
            gemv1,
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
        .map(|mut k: Kernels| {
            k.names = names.take();
            k
        })
    }

    /// The name of the kernel whose handle prints as `handle`.
    pub fn name_of(&self, handle: &str) -> String {
        self.names
            .get(handle)
            .cloned()
            .unwrap_or_else(|| handle.to_string())
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
