//! The kernels: PTX built ahead from `kernels/sluice.cu` (see `scripts/cuda/build_kernels.py`),
//! embedded here, JIT-compiled by the driver when the backend starts.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::Ptx;

/// The committed PTX; its first line records the hash of the source it was built from.
pub(crate) const PTX: &str = include_str!("../kernels/sluice.ptx");

/// The head sizes `attention_decode` is compiled for.
pub(crate) const DECODE_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The weight kinds the matrix kernels are compiled for (`K_*` in the source).
pub(crate) const KINDS: [&str; 5] = ["generic", "q4", "q8", "bf16", "mxfp4"];

/// The weight kinds of the exact-weight tensor-core kernels (`gemm_tq`, `moe_*_tq`).
pub(crate) const EXACT_KINDS: [&str; 4] = ["q4", "q8", "bf16", "mxfp4"];

/// The weight kinds of the 8-bit-activation tensor-core kernels (`gemm_iq`, `moe_*_iq`): the
/// affine ones of [`EXACT_KINDS`], at the same indices.
pub(crate) const INT8_KINDS: [&str; 2] = ["q4", "q8"];

/// One token's 4-bit kernels, exact or with 8-bit activations (the names' `suffix`).
pub(crate) struct Q4Decode {
    /// Products spread over the columns, several rows per thread (`*_s` in the source;
    /// `Mat::spread` and `Mat::spread_threads` say which shapes they take).
    pub gemv: CudaFunction,
    pub gemv_gated: CudaFunction,
    pub gemv_multi: CudaFunction,
    /// The MoE's gate/up with more loads in flight, and with a shared expert's pairs after the
    /// routed ones.
    pub moe_gate_up: CudaFunction,
    pub moe_gate_up_shared: CudaFunction,
    /// The MoE's down projections spread like `gemv`; `_s384` for blocks of at most
    /// [`crate::backend::MOE_DOWN_S384`] threads, four to a multiprocessor.
    pub moe_down: CudaFunction,
    pub moe_down_shared: CudaFunction,
    pub moe_down_s384: CudaFunction,
    pub moe_down_s384_shared: CudaFunction,
}

impl Q4Decode {
    /// The kernels' names without the suffix, in the fields' order.
    const NAMES: [&'static str; 9] = [
        "gemv_q4_t1_s",
        "gemv_gated_q4_t1_s",
        "gemv_multi_q4_t1_s",
        "moe_gate_up_q4_w",
        "moe_gate_up_q4_w_shared",
        "moe_down_q4_s",
        "moe_down_q4_s_shared",
        "moe_down_q4_s384",
        "moe_down_q4_s384_shared",
    ];
    /// The exact set's suffix, and the 8-bit-activation set's.
    const SUFFIXES: [&'static str; 2] = ["", "_i8"];

    fn load(
        f: &dyn Fn(&str) -> Result<CudaFunction, DriverError>,
        suffix: &str,
    ) -> Result<Self, DriverError> {
        let [gemv, gemv_gated, gemv_multi, moe_gate_up, moe_gate_up_shared, moe_down, moe_down_shared, moe_down_s384, moe_down_s384_shared] =
            Self::NAMES.map(|n| format!("{n}{suffix}"));
        Ok(Q4Decode {
            gemv: f(&gemv)?,
            gemv_gated: f(&gemv_gated)?,
            gemv_multi: f(&gemv_multi)?,
            moe_gate_up: f(&moe_gate_up)?,
            moe_gate_up_shared: f(&moe_gate_up_shared)?,
            moe_down: f(&moe_down)?,
            moe_down_shared: f(&moe_down_shared)?,
            moe_down_s384: f(&moe_down_s384)?,
            moe_down_s384_shared: f(&moe_down_s384_shared)?,
        })
    }
}

/// Every kernel the backend launches.
pub(crate) struct Kernels {
    /// Kernel names by function handle (`{:?}` of it), for the profile.
    names: HashMap<String, String>,
    /// `gemv_b[kind][t - 1]` multiplies `t` tokens (1..=8), a block of 128 threads per row;
    /// `gemv_r2[kind]` one token, a warp per two rows (large matrices).
    pub gemv_b: Vec<Vec<CudaFunction>>,
    pub gemv_r2: Vec<CudaFunction>,
    /// `gemv_gated[kind][t - 1]`: a shared expert's down projection with its SwiGLU and gate,
    /// added onto the output.
    pub gemv_gated: Vec<Vec<CudaFunction>>,
    /// `gemv_multi[kind][t - 1]`: `gemv_b` over up to four matrices of one input.
    pub gemv_multi: Vec<Vec<CudaFunction>>,
    /// Many tokens on tensor cores: 3xTF32 for any format (`gemm_tc`), exact weights by
    /// [`EXACT_KINDS`] (`gemm_tq`).
    pub gemm_tc: CudaFunction,
    pub gemm_tq: Vec<CudaFunction>,
    /// Adds up the column splits of `gemm_tq`.
    pub sum_splits: CudaFunction,
    pub embed: CudaFunction,
    /// `embed` with up to eight token ids passed by value.
    pub embed_ids: CudaFunction,
    pub copy_words: CudaFunction,
    pub copy_words2: CudaFunction,
    pub fill_words: CudaFunction,
    pub count_experts: CudaFunction,
    /// Experts the host computes beside the device (`host_compute`).
    pub host_split_plan: CudaFunction,
    pub host_split_join: CudaFunction,
    pub rms_norm: CudaFunction,
    pub add_rms_norm: CudaFunction,
    pub rms_norm_gated: CudaFunction,
    pub add_assign: CudaFunction,
    pub swiglu: CudaFunction,
    pub sigmoid_mul: CudaFunction,
    pub add_bias: CudaFunction,
    pub route_sigmoid: CudaFunction,
    pub split_chunks: CudaFunction,
    pub join_chunks: CudaFunction,
    pub matmul_heads: CudaFunction,
    pub rope: CudaFunction,
    pub rms_norm_rope: CudaFunction,
    pub attention: CudaFunction,
    /// `attention` for heads of 257 to 768 values.
    pub attention_wide: CudaFunction,
    /// Prefill attention by head size 64, 128: 64 query rows of one kv head per block, register
    /// tiles.
    pub attention_tiles: Vec<CudaFunction>,
    /// Split decode attention by head size 64, 128, 256 (`DECODE_HEAD_DIMS`), optionally with
    /// the q/k norms, rotations and cache writes fused in.
    pub attention_decode: Vec<CudaFunction>,
    /// `attention_decode` for one token of each of several requests (`DECODE_HEAD_DIMS`).
    pub attention_decode_rows: Vec<CudaFunction>,
    /// `attention_decode` over a compact cache (f16, bf16, q8, q4; `DECODE_HEAD_DIMS`).
    pub attention_decode_kv: Vec<CudaFunction>,
    /// Compact caches: rows quantised into one, and the whole of one expanded to f32.
    pub kv_store: CudaFunction,
    pub kv_expand: CudaFunction,
    pub route: CudaFunction,
    /// The router's product and `route` in one launch, by weight kind.
    pub route_gemv: Vec<CudaFunction>,
    /// By weight kind.
    pub moe_gate_up: Vec<CudaFunction>,
    /// The down projections with a block per output row (few tokens).
    pub moe_down_b: Vec<CudaFunction>,
    /// One token's 4-bit products: `q4_decode[0]` exact, `[1]` with 8-bit activations (`_i8`
    /// in the source, the `fast` kernels).
    pub q4_decode: [Q4Decode; 2],
    pub argmax_parts: CudaFunction,
    pub qkv_norm_rope_append: CudaFunction,
    pub argmax_finish: CudaFunction,
    /// The best few columns of a row, sorted, and the values at named columns (one block).
    pub top_logits: CudaFunction,
    /// A wide row's `top_logits` in two stages: the best of each chunk, then of those.
    pub top_logits_parts: CudaFunction,
    pub top_logits_merge: CudaFunction,
    pub moe_down_q4_w: CudaFunction,
    /// Many tokens: pairs grouped by expert, tensor-core products per expert (by weight kind),
    /// and the weighted sum per token.
    pub moe_group: CudaFunction,
    pub moe_gate_up_tc: CudaFunction,
    /// `moe_gate_up_tc` with expert biases or another activation than SwiGLU (`struct Ffn`).
    pub moe_gate_up_tc_ffn: CudaFunction,
    pub moe_down_tc: CudaFunction,
    /// `[tile][exact kind]`, tiles of 32 pairs (0) or 16 (1).
    pub moe_gate_up_tq: Vec<Vec<CudaFunction>>,
    pub moe_down_tq: Vec<Vec<CudaFunction>>,
    pub moe_combine: CudaFunction,
    /// The `fast` prefill: activations to 8 bits per 32 columns, then integer tensor-core
    /// products by [`INT8_KINDS`] (`gemm_iq`; the MoE's `[tile][kind]`, tiles of 128 rows and 32 or 16
    /// pairs).
    pub quant_q8_rows: CudaFunction,
    pub gemm_iq: Vec<CudaFunction>,
    pub moe_gate_up_iq: Vec<Vec<CudaFunction>>,
    pub moe_down_iq: Vec<Vec<CudaFunction>>,
    pub causal_conv1d_silu: CudaFunction,
    pub gated_delta_rule: CudaFunction,
    /// Many tokens: the state-free inputs of every token, then the recurrence by rows.
    pub delta_prep: CudaFunction,
    pub gated_delta_rule_rows: CudaFunction,
    /// A few tokens: the DeltaNet core in two launches (convolution, norms and recurrence; then
    /// the gated norm and the window).
    pub gated_delta_step: CudaFunction,
    pub delta_norm_window: CudaFunction,
}

/// What the kernels' programmatic-launch markers read in the PTX (`PDL_*` in the source).
const PDL_MARKER: &str = "// sluice-pdl: ";

/// The PTX to load: as built (compute capability 8.0) or, with `programmatic` (9.0 and newer),
/// with the markers turned into `griddepcontrol` instructions, which need that target.
pub(crate) fn ptx(programmatic: bool) -> String {
    if !programmatic {
        return PTX.to_string();
    }
    PTX.replacen(".target sm_80", ".target sm_90", 1)
        .replace(PDL_MARKER, "")
}

impl Kernels {
    /// Loads the kernels; `programmatic`: for launches that may start before the previous
    /// kernel ends (compute capability 9.0 and newer).
    pub fn load(ctx: &Arc<CudaContext>, programmatic: bool) -> Result<Kernels, DriverError> {
        let module = ctx.load_module(Ptx::from_src(ptx(programmatic)))?;
        if let Some(mask) = std::env::var("SLUICE_CUDA_EARLY")
            .ok()
            .and_then(|v| v.parse::<i32>().ok())
        {
            // `early_loads` (every bit set in the PTX) as asked: which kernels fetch before
            // they wait.
            let stream = ctx.default_stream();
            let mut flag = module.get_global("early_loads", &stream)?;
            // SAFETY: `early_loads` is one `int` (4 bytes, as get_global reports).
            let mut flag = unsafe { flag.transmute_mut::<i32>(1) }.ok_or(DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            ))?;
            stream.memcpy_htod(&[mask], &mut flag)?;
            stream.synchronize()?;
        }
        let names = RefCell::new(HashMap::new());
        let f = |name: &str| {
            let func = module.load_function(name)?;
            names
                .borrow_mut()
                .insert(format!("{:?}", func.cu_function()), name.to_string());
            Ok::<_, DriverError>(func)
        };
        // `[tile][exact kind]`: tiles of 32 pairs (NJ = 4), then of 16 (NJ = 2).
        let by_tile_and_kind =
            |name: &str, kinds: &[&str]| -> Result<Vec<Vec<CudaFunction>>, DriverError> {
                [4, 2]
                    .iter()
                    .map(|n| {
                        kinds
                            .iter()
                            .map(|k| f(&format!("{name}_{k}_n{n}")))
                            .collect()
                    })
                    .collect()
            };
        Ok(Kernels {
            names: HashMap::new(),
            gemv_r2: KINDS
                .iter()
                .map(|k| f(&format!("gemv_{k}_t1_r2")))
                .collect::<Result<_, _>>()?,
            gemv_multi: KINDS
                .iter()
                .map(|k| {
                    (1..=8)
                        .map(|t| f(&format!("gemv_multi_{k}_t{t}")))
                        .collect()
                })
                .collect::<Result<_, _>>()?,
            gemv_b: KINDS
                .iter()
                .map(|k| (1..=8).map(|t| f(&format!("gemv_{k}_t{t}_b"))).collect())
                .collect::<Result<_, _>>()?,
            gemv_gated: KINDS
                .iter()
                .map(|k| {
                    (1..=8)
                        .map(|t| f(&format!("gemv_gated_{k}_t{t}")))
                        .collect()
                })
                .collect::<Result<_, _>>()?,

            gemm_tc: f("gemm_tc_generic")?,
            sum_splits: f("sum_splits")?,
            gemm_tq: EXACT_KINDS
                .iter()
                .map(|k| f(&format!("gemm_tq_{k}")))
                .collect::<Result<_, _>>()?,
            embed: f("embed")?,
            embed_ids: f("embed_ids")?,
            copy_words: f("copy_words")?,
            copy_words2: f("copy_words2")?,
            fill_words: f("fill_words")?,
            count_experts: f("count_experts")?,
            host_split_plan: f("host_split_plan")?,
            host_split_join: f("host_split_join")?,
            rms_norm: f("rms_norm")?,
            add_rms_norm: f("add_rms_norm")?,
            rms_norm_gated: f("rms_norm_gated")?,
            add_assign: f("add_assign")?,
            swiglu: f("swiglu")?,
            sigmoid_mul: f("sigmoid_mul")?,
            add_bias: f("add_bias")?,
            route_sigmoid: f("route_sigmoid")?,
            split_chunks: f("split_chunks")?,
            join_chunks: f("join_chunks")?,
            matmul_heads: f("matmul_heads")?,
            rope: f("rope")?,
            rms_norm_rope: f("rms_norm_rope")?,
            attention: f("attention")?,
            attention_wide: f("attention_wide")?,
            attention_tiles: [64, 128]
                .iter()
                .map(|h| f(&format!("attention_tiles_{h}")))
                .collect::<Result<_, _>>()?,
            attention_decode: DECODE_HEAD_DIMS
                .iter()
                .map(|h| f(&format!("attention_decode_{h}")))
                .collect::<Result<_, _>>()?,
            attention_decode_rows: DECODE_HEAD_DIMS
                .iter()
                .map(|h| f(&format!("attention_decode_rows_{h}")))
                .collect::<Result<_, _>>()?,
            attention_decode_kv: DECODE_HEAD_DIMS
                .iter()
                .map(|h| f(&format!("attention_decode_kv_{h}")))
                .collect::<Result<_, _>>()?,
            kv_store: f("kv_store")?,
            kv_expand: f("kv_expand")?,
            route: f("route")?,
            route_gemv: KINDS
                .iter()
                .map(|k| f(&format!("route_gemv_{k}")))
                .collect::<Result<_, _>>()?,
            moe_gate_up: KINDS
                .iter()
                .map(|k| f(&format!("moe_gate_up_{k}")))
                .collect::<Result<_, _>>()?,
            moe_group: f("moe_group")?,
            moe_gate_up_tc: f("moe_gate_up_tc_generic")?,
            moe_gate_up_tc_ffn: f("moe_gate_up_tc_ffn_generic")?,
            moe_down_tc: f("moe_down_tc_generic")?,
            moe_gate_up_tq: by_tile_and_kind("moe_gate_up_tq", &EXACT_KINDS)?,
            moe_down_tq: by_tile_and_kind("moe_down_tq", &EXACT_KINDS)?,
            quant_q8_rows: f("quant_q8_rows")?,
            gemm_iq: INT8_KINDS
                .iter()
                .map(|k| f(&format!("gemm_iq_{k}")))
                .collect::<Result<_, _>>()?,
            moe_gate_up_iq: by_tile_and_kind("moe_gate_up_iq", &INT8_KINDS)?,
            moe_down_iq: by_tile_and_kind("moe_down_iq", &INT8_KINDS)?,
            moe_combine: f("moe_combine")?,
            moe_down_b: KINDS
                .iter()
                .map(|k| f(&format!("moe_down_{k}_b")))
                .collect::<Result<_, _>>()?,
            q4_decode: [
                Q4Decode::load(&f, Q4Decode::SUFFIXES[0])?,
                Q4Decode::load(&f, Q4Decode::SUFFIXES[1])?,
            ],
            argmax_parts: f("argmax_parts")?,
            qkv_norm_rope_append: f("qkv_norm_rope_append")?,
            argmax_finish: f("argmax_finish")?,
            top_logits: f("top_logits")?,
            top_logits_parts: f("top_logits_parts")?,
            top_logits_merge: f("top_logits_merge")?,
            moe_down_q4_w: f("moe_down_q4_w")?,
            causal_conv1d_silu: f("causal_conv1d_silu")?,
            gated_delta_rule: f("gated_delta_rule")?,
            delta_prep: f("delta_prep")?,
            gated_delta_rule_rows: f("gated_delta_rule_rows")?,
            gated_delta_step: f("gated_delta_step")?,
            delta_norm_window: f("delta_norm_window")?,
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

    /// Every kernel waits for the kernels before it (`PDL_WAIT`, directly, through `PDL_START`, or
    /// in `spread_dots`) before it reads what they write: with programmatic launches a kernel that
    /// did not would race them.
    #[test]
    fn every_kernel_waits_for_the_previous_one() {
        let source = include_str!("../kernels/sluice.cu");
        let mut kernels = 0;
        for (at, _) in source.match_indices("extern \"C\" __global__") {
            let open = at + source[at..].find('{').expect("a kernel body");
            let body = &source[open..];
            let mut depth = 0;
            let end = body
                .char_indices()
                .find_map(|(i, c)| {
                    depth += match c {
                        '{' => 1,
                        '}' => -1,
                        _ => 0,
                    };
                    (depth == 0).then_some(i)
                })
                .expect("a closed kernel body");
            let body = &body[..end];
            // The name after `__launch_bounds__(..)`, if any.
            let head = &source[at..open];
            let head = head
                .find("__launch_bounds__(")
                .and_then(|b| head[b..].find(')').map(|e| &head[b + e + 1..]))
                .unwrap_or(head);
            let name = head.split('(').next().unwrap_or_default().trim();
            // (A macro's body may begin with a line continuation.)
            let first = body[1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
            // Statements after the first, whitespace and line continuations left out.
            let then: String = first
                .split_once(';')
                .map_or("", |(_, rest)| rest)
                .chars()
                .filter(|c| !c.is_whitespace() && *c != '\\')
                .collect();
            // One L2 prefetch (`prefetch_row`, `prefetch_table`: a prefetch reads nothing into
            // registers), then the wait.
            let prefetches_then_waits = then.starts_with("prefetch_")
                && then
                    .split_once(';')
                    .is_some_and(|(_, r)| r.starts_with("PDL_WAIT();"));
            // Kernels that read their weights (conv taps, norm weights, per-head constants)
            // between the two markers, reviewed one by one: nothing before their wait reads what
            // an earlier kernel writes (other than into L2, by prefetch_l2).
            let short = name.rsplit(' ').next().unwrap_or(name);
            let weights_then_waits = [
                "gated_delta_step",
                "delta_norm_window",
                "rms_norm",
                "add_rms_norm",
            ]
            .contains(&short)
                && body
                    .find("PDL_LAUNCH_DEPENDENTS();")
                    .is_some_and(|l| body.find("PDL_WAIT();").is_some_and(|w| l < w));
            // Device functions that wait themselves, reviewed: spread_gemv (weights), and
            // attention_decode (norm weights and frequencies; KV rows into L2 only).
            let callee_waits = body.contains("spread_gemv") || body.contains("attention_decode<");
            assert!(
                first.starts_with("PDL_START();")
                    || weights_then_waits
                    || (first.starts_with("PDL_LAUNCH_DEPENDENTS();")
                        && (callee_waits || prefetches_then_waits)),
                "{name}: a kernel must begin with PDL_START() (or, if it loads or prefetches \
                 weights before waiting, PDL_LAUNCH_DEPENDENTS() then a spread_gemv or \
                 attention_decode that waits, or one prefetch_* then PDL_WAIT(), or be one of \
                 the kernels reviewed to load only weights before PDL_WAIT())"
            );
            kernels += 1;
        }
        assert!(kernels > 40, "found {kernels} kernels");
        let spread = source
            .split("__device__ __forceinline__ void spread_dots")
            .nth(1)
            .expect("spread_dots");
        let wait = spread.find("PDL_WAIT();").expect("spread_dots waits");
        assert!(
            wait < spread
                .find("load_floats<SPREAD_CODES>(x")
                .expect("activation loads"),
            "spread_dots must wait before it reads the activations"
        );
        let attention = source
            .split("__device__ void attention_decode(")
            .nth(1)
            .expect("attention_decode");
        let wait = attention
            .find("PDL_WAIT();")
            .expect("attention_decode waits");
        assert!(
            wait < attention.find("*cached;").expect("the cache's length")
                && wait < attention.find("qh[").expect("q"),
            "attention_decode must wait before it reads the length or q"
        );
        // The loader's rewrite reaches every marker and the target.
        let patched = super::ptx(true);
        assert!(!patched.contains(super::PDL_MARKER) && patched.contains(".target sm_90"));
        assert!(patched.matches("griddepcontrol.wait;").count() >= kernels);
        assert_eq!(super::ptx(false), super::PTX);
    }

    /// Every kernel the loader names by weight kind is in the PTX (a kind added to the tables
    /// needs its instantiations; a missing one would fail only when a GPU loads the module).
    #[test]
    fn every_kind_has_its_kernels() {
        use super::{EXACT_KINDS, INT8_KINDS, KINDS};
        let mut names = vec!["moe_gate_up_tc_generic".to_string()];
        names.push("moe_gate_up_tc_ffn_generic".into());
        for k in KINDS {
            names.push(format!("gemv_{k}_t1_r2"));
            names.push(format!("route_gemv_{k}"));
            names.push(format!("moe_gate_up_{k}"));
            names.push(format!("moe_down_{k}_b"));
            for t in 1..=8 {
                names.push(format!("gemv_multi_{k}_t{t}"));
                names.push(format!("gemv_{k}_t{t}_b"));
                names.push(format!("gemv_gated_{k}_t{t}"));
            }
        }
        for k in EXACT_KINDS {
            names.push(format!("gemm_tq_{k}"));
            for n in [4, 2] {
                names.push(format!("moe_gate_up_tq_{k}_n{n}"));
                names.push(format!("moe_down_tq_{k}_n{n}"));
            }
        }
        for suffix in super::Q4Decode::SUFFIXES {
            names.extend(super::Q4Decode::NAMES.map(|n| format!("{n}{suffix}")));
        }
        for k in INT8_KINDS {
            names.push(format!("gemm_iq_{k}"));
            for n in [4, 2] {
                names.push(format!("moe_gate_up_iq_{k}_n{n}"));
                names.push(format!("moe_down_iq_{k}_n{n}"));
            }
        }
        for name in names {
            assert!(
                super::PTX.contains(&format!(".entry {name}(")),
                "no kernel {name} in the PTX"
            );
        }
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
