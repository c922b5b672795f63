//! [`Backend`] on an NVIDIA GPU: one stream, every operation a kernel launch, nothing brought back
//! to the host but logits (and routing when experts stream).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaFunction;
use sluice_backend::{
    Activation, AttentionSpec, Backend, BackendError, DeltaNetDims, DeltaNetWeights,
    ExpertCachePlan, ExpertCacheStats, ExpertFfn, ExpertKey, ExpertSource, FfnWeights, HostExpert,
    HostLinearState, HostMatrix, HostPinner, HostRouting, KvFormat, MemoryInfo, Rope,
    SigmoidRouting, TopLogits, ValueHeadOrder,
};

use sluice_cpu::{CpuBackend, Kernels};

use crate::device::{grid, Arg, DevBuf, Device};
use crate::expert_cache::SlotHold;
use crate::host_compute::{
    HostCompute, HostExperts, HostFfn, HostSplit, HostTally, JOIN_TIMEOUT_NS, MAX_PAIRS,
};
use crate::in_place::{InPlace, InPlaceLayer};
use crate::kernels::{DECODE_HEAD_DIMS, INT8_KINDS, KINDS};
use crate::mat::{
    describe, ExpertMats, Ffn, KvRows, Mat, MatSet, SharedExpert, Spread, KV_ROWS_MAX, MAT_SET_MAX,
    SPREAD_ROWS,
};
use crate::vram_experts::{
    device_address, is_pinned, size_slots, CudaPinner, PinnedRanges, Staged, VramExperts,
};

/// What tells one set of rotary frequencies from another ([`Rope::freq_key`]).
type RopeFreqKey = (usize, u32, Option<[u32; 5]>);

/// f32 activations `[rows, cols]` in device memory; `None` after a failure (the backend reports
/// it from the next host read).
pub struct CudaAct {
    buf: Option<DevBuf>,
    rows: usize,
    cols: usize,
}

impl CudaAct {
    fn ptr(&self) -> Option<u64> {
        self.buf.as_ref().map(DevBuf::ptr)
    }
}

/// A weight matrix in device memory, in its stored format.
pub struct CudaWeight {
    mat: Mat,
    _parts: Vec<DevBuf>,
}

/// A 1-D f32 parameter.
pub struct CudaVector {
    buf: DevBuf,
    len: usize,
}

/// The routed experts of one layer: every expert's matrices, and a device table of their
/// descriptions the MoE kernels index by expert id.
pub struct CudaExperts {
    /// The device table of `ExpertMats`, one entry per expert (a layer kept in host memory
    /// owns its own: `in_place`).
    table: Option<DevBuf>,
    count: usize,
    /// The first expert's matrices: the shapes and formats of all.
    sample: ExpertMats,
    _parts: Vec<DevBuf>,
    /// Experts read in place from host memory (see `in_place`).
    in_place: Option<Arc<InPlaceLayer>>,
}

impl CudaExperts {
    fn table_ptr(&self) -> u64 {
        match (&self.in_place, &self.table) {
            (Some(l), _) => l.table.ptr(),
            (None, Some(t)) => t.ptr(),
            (None, None) => 0,
        }
    }
}

/// A streamed expert on the device: in a slot of the VRAM expert cache (held while this lives),
/// or uploaded for one call.
pub struct CudaStagedExpert {
    mats: ExpertMats,
    _parts: Vec<DevBuf>,
    _hold: Option<SlotHold>,
}

impl From<Staged> for CudaStagedExpert {
    fn from(s: Staged) -> Self {
        CudaStagedExpert {
            mats: s.mats,
            _parts: s.parts,
            _hold: s.hold,
        }
    }
}

/// The expert choice, on the device: `ids` and `weights` `[rows, k]`.
pub struct CudaRouting {
    ids: Option<DevBuf>,
    weights: Option<DevBuf>,
    rows: usize,
    k: usize,
}

/// Keys and values of one attention layer, `capacity` rows of `kv_heads * head_dim` values each,
/// in `format` (f32, or compact as `kv_store` in the kernels lays it out); grown by doubling.
pub struct CudaKvCache {
    keys: Option<DevBuf>,
    values: Option<DevBuf>,
    len: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    format: KvFormat,
    /// The length as the decode kernels read and advance it on the device (one i32), so that a
    /// replayed decode step has no argument that changes from token to token ...
    device_len: Option<DevBuf>,
    /// ... and the value it holds when the host knows it (`len` when in step).
    device_len_value: Option<usize>,
    device: Arc<Device>,
}

impl CudaKvCache {
    /// Bytes of one position's keys (or values).
    fn row_bytes(&self) -> usize {
        self.format
            .bytes(self.kv_heads * self.head_dim, self.head_dim)
    }

    /// The format as the kernels name it (`KV_*` in the source); f32 caches never reach them.
    fn format_code(&self) -> i32 {
        match self.format {
            KvFormat::F32 => 0,
            KvFormat::F16 => 1,
            KvFormat::Bf16 => 2,
            KvFormat::Q8 => 3,
            KvFormat::Q4 => 4,
        }
    }

    fn is_compact(&self) -> bool {
        self.format != KvFormat::F32
    }
}

impl Clone for CudaKvCache {
    fn clone(&self) -> Self {
        let width = self.row_bytes();
        let dup = |b: &Option<DevBuf>| {
            let b = b.as_ref()?;
            let new = self
                .device
                .alloc_or_record(b.bytes, "a copy of a KV cache")?;
            self.device.copy(new.ptr, b.ptr, self.len * width);
            Some(new)
        };
        CudaKvCache {
            keys: dup(&self.keys),
            values: dup(&self.values),
            len: self.len,
            capacity: self.capacity,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            format: self.format,
            device_len: None,
            device_len_value: None,
            device: self.device.clone(),
        }
    }
}

/// One Gated DeltaNet layer's memory: the conv window `[kernel - 1, channels]` and the state
/// `[value_heads, value_dim, key_dim]`, laid out as [`HostLinearState`].
/// `None` parts were lost to a failure (recorded).
pub struct CudaLinearState {
    dims: DeltaNetDims,
    conv: Option<DevBuf>,
    recurrent: Option<DevBuf>,
    device: Arc<Device>,
}

impl Clone for CudaLinearState {
    fn clone(&self) -> Self {
        let dup = |b: &Option<DevBuf>| {
            let b = b.as_ref()?;
            let new = self
                .device
                .alloc_or_record(b.bytes, "a copy of a DeltaNet state")?;
            self.device.copy(new.ptr, b.ptr, b.bytes);
            Some(new)
        };
        CudaLinearState {
            dims: self.dims,
            conv: dup(&self.conv),
            recurrent: dup(&self.recurrent),
            device: self.device.clone(),
        }
    }
}

/// The CUDA backend on one GPU.
pub struct CudaBackend {
    d: Arc<Device>,
    description: String,
    /// Rotary frequencies per [`Rope::freq_key`], computed on the host.
    inv_freq: Mutex<HashMap<RopeFreqKey, Arc<DevBuf>>>,
    /// Counters of finished blocks for kernels whose last block finishes the work (zero between
    /// calls): split attention's per (head, token) from 0, fused routing's per token after.
    done_counters: Mutex<Option<Arc<DevBuf>>>,
    /// The VRAM tier of streamed experts, once planned.
    vram: Mutex<Option<VramExperts>>,
    /// Host memory page-locked through [`Backend::host_pinner`].
    pinned: PinnedRanges,
    /// Layers whose experts the kernels read in host memory, and their VRAM tier.
    in_place: Mutex<InPlace>,
    /// Many-token products of 4- and 8-bit weights with activations quantized to 8 bits
    /// (`gemm_iq`, `moe_*_iq`: llama.cpp's arithmetic) instead of exactly (`*_tq`).
    fast: bool,
    /// One token's 4-bit products on 8-bit activations with dp4a (`Q4Decode`'s `_i8` kernels).
    fast_decode: bool,
    /// Whether the host computes experts kept in host memory beside the device
    /// (`host_compute`), with this CPU backend; its mailbox and worker once a call needs them.
    host_mode: HostCompute,
    host_cpu: CpuBackend,
    /// With the share's climbing, and the lowest layer id seen (where a decode step starts).
    host: Mutex<Option<(HostExperts, HostSplit, usize)>>,
    host_tally: Arc<Mutex<HostTally>>,
}

/// Limits of the kernels (checked where the shapes are first known).
const MAX_HEAD_DIM: usize = 256;
/// The largest attention head the unfused kernels take (`attention_wide`: Multi-head Latent
/// Attention's absorbed head of 576).
const MAX_ATTENTION_HEAD_DIM: usize = 768;
/// `TOP_MAX` in the kernels: the most columns `top_logits` sorts on the device.
const TOP_LOGITS_MAX: usize = 1024;
const MAX_ROUTED_EXPERTS: usize = 1024;
/// `MOE_MAX_K` in the kernels.
const MAX_EXPERTS_PER_TOKEN: usize = 16;
const MAX_CONV_KERNEL: usize = 8;
/// Blocks each token's attention is split over when few tokens are decoded ...
const ATTENTION_SPLITS: usize = 16;
/// What `attention_decode` applies itself to one token's raw q and new key and value (device
/// addresses; none: q is ready and the cache holds the key and value).
#[derive(Default)]
struct Prelude {
    k: u64,
    v: u64,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
    eps: f32,
    rotary_dim: usize,
}

/// Blocks a token's positions are split over by `attention_decode` (each at least a pass of
/// 64-128 positions: up to a pass, one block and no combining). Measured on an H100 (Qwen3-30B-A3B
/// shape): 4 and 8 equal at 128 and 1024 positions, 16 slower.
const DECODE_SPLITS: usize = 8;
/// Positions per block that `long_decode_splits` aims at.
const LONG_DECODE_POSITIONS: usize = 1024;

/// Splits of a decoded token over a cache of `positions`: [`DECODE_SPLITS`], and more (a power of
/// two, at most the kernel's 32) once each block would take more than [`LONG_DECODE_POSITIONS`]
/// (a graph is rebuilt at each of those few steps). `SLUICE_CUDA_LONG_SPLITS=0` keeps
/// [`DECODE_SPLITS`] at every length, to measure against.
fn long_decode_splits(positions: usize) -> usize {
    static FIXED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *FIXED.get_or_init(|| std::env::var("SLUICE_CUDA_LONG_SPLITS").is_ok_and(|v| v == "0")) {
        return DECODE_SPLITS;
    }
    positions
        .div_ceil(LONG_DECODE_POSITIONS)
        .next_power_of_two()
        .clamp(DECODE_SPLITS, 32)
}

/// A sequence's rows up to which the Gated DeltaNet runs as `gated_delta_step` (each block
/// repeats its key head's convolution per token, and tokens run one after another in it).
const DELTA_STEP_ROWS: usize = 8;

/// `TOP_CHUNK` in the kernels: the columns a block of `top_logits_parts` takes.
const TOP_CHUNK: usize = 4096;

/// `SLUICE_CUDA_TOP_ONE_BLOCK=1`: `top_logits` in one block over any row, to measure against.
fn top_one_block() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_TOP_ONE_BLOCK").is_ok_and(|v| v == "1"))
}

/// Whether `moe_with_shared` may compute the shared expert in the routed experts' kernels;
/// `SLUICE_CUDA_SHARED_FUSED=0` keeps its own three launches (to measure against).
fn shared_fused_enabled() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("SLUICE_CUDA_SHARED_FUSED").is_ok_and(|v| v == "0"))
}

/// Whether `gated_delta_net` may take the two-launch path; `SLUICE_CUDA_DELTA_STEP=0` keeps the
/// four launches, to measure against.
fn fused_delta_step() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("SLUICE_CUDA_DELTA_STEP").is_ok_and(|v| v == "0"))
}

/// Threads of a block of `attention_decode` (`ATTN_WARPS` warps in the source).
const ATTENTION_DECODE_THREADS: u32 = 256;
/// ... that is, when there are fewer (head, token) pairs than this.
const SPLIT_ATTENTION_PAIRS: usize = 256;
/// Router product and routing run as one launch for at most this many tokens.
const FUSED_ROUTE_TOKENS: usize = 64;
/// Word of the block counters that counts a whole split-attention grid (after the per-head
/// counters and the router's); `attention_decode_rows` counts request `r`'s blocks in word
/// `ALL_DONE_COUNTER + r`.
const ALL_DONE_COUNTER: usize = SPLIT_ATTENTION_PAIRS + FUSED_ROUTE_TOKENS;
/// `Mat::kind` of 4-bit affine weights.
const KIND_Q4: usize = 1;
/// `Mat::kind` of mxfp4 weights.
const KIND_MXFP4: usize = 4;
/// The most threads a block of `moe_down_q4_s384` has (its launch bounds).
pub(crate) const MOE_DOWN_S384: usize = 384;
/// The most tokens whose MoE runs the decode kernels; more take the grouped (prefill) ones.
const MOE_DECODE_ROWS: usize = 8;

/// `MOE_DOWN_W_ROWS` in the kernels: output rows per block of `moe_down_q4_w`.
const MOE_DOWN_W_ROWS: usize = 4;
/// `MOE_DOWN_W_SLICE` and `MOE_DOWN_W_SLICES` in the kernels: how `moe_down_q4_w` cuts long rows
/// into column slices that warps take separately.
const MOE_DOWN_W_SLICE: usize = 2048;
const MOE_DOWN_W_SLICES: usize = 8;

/// One token's product with a matrix of at least this many rows (an output head) runs a warp per
/// two rows (`gemv_*_t1_r2`): faster there than the column-spread and block-per-row kernels.
const HEAD_ROWS: i32 = 8192;

/// What the MoE kernels do with their output buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MoeOut {
    /// Add onto what it holds.
    Add,
    /// Write it: its contents are undefined.
    Fresh,
}

/// Sliding windows of this many positions or more attend to every position (the kernels count
/// positions in i32).
const MAX_WINDOW: usize = 1 << 30;

/// An [`AttentionSpec`] as the attention kernels take it.
#[derive(Debug, Clone, Copy)]
struct Attn {
    heads: usize,
    scale: f32,
    /// The sliding window, positions (0: none).
    window: i32,
    /// The device address of the sink logits, one per query head (0: none).
    sinks: u64,
}

impl Attn {
    fn of(spec: &AttentionSpec<'_, CudaVector>) -> Attn {
        if let Some(s) = spec.sinks {
            assert_eq!(s.len, spec.heads, "one attention sink per query head");
        }
        Attn {
            heads: spec.heads,
            scale: spec.scale,
            window: match spec.window {
                Some(w) if w < MAX_WINDOW => w.max(1) as i32,
                _ => 0,
            },
            sinks: spec.sinks.map_or(0, |s| s.buf.ptr),
        }
    }

    /// The kernels' last two arguments: the window and the sinks.
    fn args(&self) -> [Arg; 2] {
        [Arg::I32(self.window), Arg::Ptr(self.sinks)]
    }
}

/// `ffn` as the MoE kernels take it, for experts of shapes `sample`, the biases (if any) of
/// `0..experts` at least.
fn ffn_of(ffn: &ExpertFfn<'_, CudaVector>, sample: &ExpertMats, experts: usize) -> Ffn {
    let mut f = match ffn.activation {
        Activation::Silu => Ffn::default(),
        Activation::ClampedSwiglu { alpha, limit } => Ffn {
            alpha,
            limit,
            clamped: 1,
            ..Ffn::default()
        },
    };
    if let Some(b) = ffn.biases {
        let (inter, hidden) = (sample.gate.rows as usize, sample.down.rows as usize);
        // The experts the three vectors cover.
        let covered = (b.gate.len.min(b.up.len) / inter.max(1)).min(b.down.len / hidden.max(1));
        assert!(
            covered >= experts,
            "expert biases of {}/{}/{} values for {experts} experts of [{inter}, {hidden}]",
            b.gate.len,
            b.up.len,
            b.down.len
        );
        (f.gate_bias, f.up_bias, f.down_bias) = (b.gate.buf.ptr, b.up.buf.ptr, b.down.buf.ptr);
        f.experts = covered.min(i32::MAX as usize) as i32;
    }
    f
}

impl CudaBackend {
    /// `e` described where the device reads it in host memory, when all of it is page-locked
    /// and mapped.
    fn mapped_mats(&self, e: &HostExpert) -> Result<Option<ExpertMats>, BackendError> {
        let mut mats = [Mat::default(); 3];
        for (m, mat) in [&e.gate, &e.up, &e.down].into_iter().zip(&mut mats) {
            m.as_ref().validate()?;
            *mat = describe(m)?;
            let mut ptrs = [0u64; 3];
            for (bytes, p) in [m.data.as_slice(), m.scales.as_slice(), m.biases.as_slice()]
                .into_iter()
                .zip(&mut ptrs)
            {
                if bytes.is_empty() {
                    continue;
                }
                // The kernels' widest loads are of 16 bytes.
                match device_address(&self.pinned, bytes) {
                    Some(at) if at % 16 == 0 => *p = at,
                    _ => return Ok(None),
                }
            }
            (mat.data, mat.scales, mat.biases) = (ptrs[0], ptrs[1], ptrs[2]);
        }
        Ok(Some(ExpertMats {
            gate: mats[0],
            up: mats[1],
            down: mats[2],
        }))
    }

    pub(crate) fn with_device(d: Device, description: String) -> Self {
        CudaBackend {
            d: Arc::new(d),
            description,
            inv_freq: Mutex::new(HashMap::new()),
            done_counters: Mutex::new(None),
            vram: Mutex::new(None),
            pinned: PinnedRanges::default(),
            in_place: Mutex::new(InPlace::default()),
            fast: false,
            fast_decode: false,
            host_mode: HostCompute::Off,
            host_cpu: CpuBackend::new(),
            host: Mutex::new(None),
            host_tally: Arc::default(),
        }
    }

    /// Whether the host computes some of the decode steps' experts that are kept in host
    /// memory and held in no VRAM slot (see `host_compute`), with the CPU's `kernels`.
    pub fn with_host_compute(mut self, mode: HostCompute, kernels: Kernels) -> Self {
        self.host_mode = mode;
        self.host_cpu = CpuBackend::with_kernels(kernels);
        self
    }

    /// With `fast`, products of many tokens with 4- and 8-bit weights quantize the activations
    /// to 8 bits per 32 columns and multiply in integers (as llama.cpp does; the CPU's `fast`
    /// kernels do the same for decode); without, they are exact to f32 rounding (the default).
    /// One token's products follow only with `SLUICE_CUDA_FAST_DECODE=1` (see
    /// [`Self::with_fast_decode`]).
    pub fn with_fast_kernels(mut self, fast: bool) -> Self {
        self.fast = fast;
        self.fast_decode = fast && std::env::var("SLUICE_CUDA_FAST_DECODE").is_ok_and(|v| v == "1");
        self
    }

    /// With `on`, one token's 4-bit products quantize the activations to 8 bits per 16 columns
    /// and multiply in integers (dp4a; `Q4Decode`'s `_i8` kernels). Off by default: these kernels
    /// have not yet run on a GPU (`tests/fast_prefill.rs` bounds them against the exact ones).
    pub fn with_fast_decode(mut self, on: bool) -> Self {
        self.fast_decode = on;
        self
    }

    /// The one-token 4-bit kernels this backend runs (exact, or `fast_decode`).
    fn q4(&self) -> &crate::kernels::Q4Decode {
        &self.d.k.q4_decode[self.fast_decode as usize]
    }

    /// The `INT8_KINDS` index of the 8-bit-activation kernels for weights of this exact kind,
    /// when the fast prefill is on.
    fn int8_kind(&self, exact: usize) -> Option<usize> {
        (self.fast && exact < INT8_KINDS.len()).then_some(exact)
    }

    /// Quantizes `rows` rows of `cols` values at `x` (with `glu`, the MoE's pairs: rows of
    /// `2 cols`, gate then up, quantizing their activation with the biases of the pair's expert,
    /// its id at the address given, as the [`Ffn`] says) to 8 bits per 32 columns, for the
    /// `INT8_KINDS` kernels of `kind` (4-bit weights read the values in nibble order): the buffer,
    /// and the addresses of the values, the scales and the sums in it.
    fn quantize_rows(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        glu: Option<(&Ffn, u64)>,
        kind: usize,
    ) -> Option<(DevBuf, [u64; 3])> {
        let values = (rows * cols).next_multiple_of(16);
        let blocks = rows * cols / 32;
        let buf = self
            .d
            .alloc_or_record(values + 2 * blocks * 4, "8-bit activations")?;
        let parts = [
            buf.ptr,
            buf.ptr + values as u64,
            buf.ptr + (values + blocks * 4) as u64,
        ];
        // Eight threads per 32 columns.
        self.d.launch(
            &self.d.k.quant_q8_rows,
            (grid(blocks, 32), 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(x),
                Arg::I64(rows as i64),
                Arg::I32(cols as i32),
                Arg::I32(glu.is_some() as i32),
                Arg::I32((INT8_KINDS[kind] == "q4") as i32),
                Arg::Ptr(parts[0]),
                Arg::Ptr(parts[1]),
                Arg::Ptr(parts[2]),
                Arg::Ffn(glu.map_or(Ffn::default(), |g| *g.0)),
                Arg::Ptr(glu.map_or(0, |g| g.1)),
            ],
        );
        Some((buf, parts))
    }

    /// Lets go of the host memory of expert uploads that have finished.
    fn release_uploads(&self) {
        if let Some(v) = self.vram.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            v.release(&self.d);
        }
    }

    /// The finished-block counters, zeroed when first made.
    fn done_counters(&self) -> Option<Arc<DevBuf>> {
        let mut slot = self.done_counters.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            let buf = self
                .d
                .alloc_or_record((ALL_DONE_COUNTER + KV_ROWS_MAX) * 4, "block counters")?;
            self.d.zero(&buf);
            *slot = Some(Arc::new(buf));
        }
        slot.clone()
    }

    fn act(&self, rows: usize, cols: usize) -> CudaAct {
        let buf = if self.d.failed() {
            None
        } else {
            self.d.alloc_or_record(rows * cols * 4, "activations")
        };
        CudaAct { buf, rows, cols }
    }

    fn poisoned(&self, rows: usize, cols: usize) -> CudaAct {
        CudaAct {
            buf: None,
            rows,
            cols,
        }
    }

    /// Uploads the parts of `m` and describes them.
    fn upload_matrix(&self, m: &HostMatrix, parts: &mut Vec<DevBuf>) -> Result<Mat, BackendError> {
        m.as_ref().validate()?;
        let mut mat = describe(m)?;
        let mut up = |bytes: &[u8]| -> Result<u64, BackendError> {
            if bytes.is_empty() {
                return Ok(0);
            }
            let b = self.d.upload(bytes, "weights")?;
            let p = b.ptr;
            parts.push(b);
            Ok(p)
        };
        mat.data = up(m.data.as_slice())?;
        mat.scales = up(m.scales.as_slice())?;
        mat.biases = up(m.biases.as_slice())?;
        Ok(mat)
    }

    /// [`Rope::inv_freq`] on the device, exactly as the CPU backend computes it; one buffer per
    /// distinct set of frequencies.
    fn rotary_frequencies(&self, rope: Rope) -> Option<Arc<DevBuf>> {
        let mut cache = self.inv_freq.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = cache.get(&rope.freq_key()) {
            return Some(b.clone());
        }
        let buf = Arc::new(
            self.d
                .upload(&rope.inv_freq(), "rotary frequencies")
                .map_err(|e| self.d.record(e))
                .ok()?,
        );
        cache.insert(rope.freq_key(), buf.clone());
        Some(buf)
    }

    fn vec_ptr(&self, v: &CudaVector) -> u64 {
        v.buf.ptr
    }

    /// `out[tokens, w.rows] = x W^T` into `out`.
    fn matmul_into(&self, x: u64, tokens: usize, w: &Mat, out: u64) {
        self.matmul_into_q(x, tokens, w, out, None);
    }

    /// `matmul_into`, with x already quantized for the 8-bit-activation kernels of `w`'s kind
    /// when `quantized` holds its parts (`quantize_rows`).
    fn matmul_into_q(&self, x: u64, tokens: usize, w: &Mat, out: u64, quantized: Option<[u64; 3]>) {
        let k = &self.d.k;
        if tokens == 1 && w.rows >= HEAD_ROWS {
            self.d.launch(
                &k.gemv_r2[w.kind()],
                (grid(w.rows as usize, 16), 1, 1),
                (256, 1, 1),
                &[Arg::Mat(*w), Arg::Ptr(x), Arg::Ptr(out)],
            );
        } else if let Some(s) = Self::spread(w, tokens) {
            self.d.launch(
                &self.q4().gemv,
                (grid(w.rows as usize, s.rows_per_block()), 1, 1),
                (s.block_threads(), 1, 1),
                &[Arg::Mat(*w), Arg::Ptr(x), Arg::Ptr(out)],
            );
        } else if tokens <= 8 {
            self.d.launch(
                &k.gemv_b[w.kind()][tokens - 1],
                (w.rows as u32, 1, 1),
                (128, 1, 1),
                &[Arg::Mat(*w), Arg::Ptr(x), Arg::Ptr(out)],
            );
        } else if let Some(e) = w.exact_kind() {
            // A grid of fewer than ~2 blocks per multiprocessor (k/v projections, routers) splits
            // the columns too, in whole 128-column runs (groups of up to 128 stay whole), and
            // sums the partial products in a fixed order.
            let (rows, cols) = (w.rows as usize, w.cols as usize);
            let blocks = grid(rows, 64) as usize * grid(tokens, 64) as usize;
            let wanted = (2 * self.d.multiprocessors)
                .div_ceil(blocks)
                .min(cols / 256)
                .max(1);
            let kc = cols.div_ceil(wanted).div_ceil(128) * 128;
            let splits = cols.div_ceil(kc);
            let part = if splits > 1 {
                match self
                    .d
                    .alloc_or_record(splits * tokens * rows * 4, "partial products")
                {
                    Some(b) => Some(b),
                    None => return,
                }
            } else {
                None
            };
            let y = part.as_ref().map_or(out, |p| p.ptr);
            let launch_grid = (grid(rows, 64), grid(tokens, 64), splits as u32);
            let tail = [Arg::Ptr(y), Arg::I32(tokens as i32), Arg::I32(kc as i32)];
            if let Some(i) = self.int8_kind(e) {
                let mut _own = None;
                let [xq, xd, xs] = match quantized {
                    Some(parts) => parts,
                    None => match self.quantize_rows(x, tokens, cols, None, i) {
                        Some((buf, parts)) => {
                            _own = Some(buf);
                            parts
                        }
                        None => return,
                    },
                };
                let mut args = vec![Arg::Mat(*w), Arg::Ptr(xq), Arg::Ptr(xd), Arg::Ptr(xs)];
                args.extend(tail);
                self.d
                    .launch(&k.gemm_iq[i], launch_grid, (128, 1, 1), &args);
            } else {
                let mut args = vec![Arg::Mat(*w), Arg::Ptr(x)];
                args.extend(tail);
                self.d
                    .launch(&k.gemm_tq[e], launch_grid, (128, 1, 1), &args);
            }
            if let Some(part) = part {
                let n = tokens * rows;
                self.elementwise(
                    &k.sum_splits,
                    n,
                    &[
                        Arg::Ptr(part.ptr),
                        Arg::Ptr(out),
                        Arg::I64(n as i64),
                        Arg::I32(splits as i32),
                    ],
                );
            }
        } else {
            self.d.launch(
                &k.gemm_tc,
                (grid(w.rows as usize, 64), grid(tokens, 64), 1),
                (128, 1, 1),
                &[
                    Arg::Mat(*w),
                    Arg::Ptr(x),
                    Arg::Ptr(out),
                    Arg::I32(tokens as i32),
                ],
            );
        }
    }

    /// The layout when `matmul_into` multiplies `tokens` by `w` with `gemv_q4_t1_s` (one token, a
    /// 4-bit matrix that fits it, not an output head).
    fn spread(w: &Mat, tokens: usize) -> Option<Spread> {
        if tokens != 1 || w.rows >= HEAD_ROWS {
            return None;
        }
        w.spread()
    }

    fn elementwise(&self, f: &CudaFunction, n: usize, args: &[Arg]) {
        self.d.launch(f, (grid(n, 256), 1, 1), (256, 1, 1), args);
    }

    /// Runs the MoE kernels over the routed pairs whose expert is described in `table` (all
    /// `slots` experts when `present` is `None`, else the `slots` ascending ids in `present`),
    /// each computing as `ffn` says, adding into `out`, or writing it when `out` is `Fresh` (its
    /// contents undefined). With `shared`, the 4-bit decode kernels compute it too, as one more
    /// expert of every row, where they run (plain SwiGLU, the routed experts' shape): returns
    /// whether they did (else the caller adds it).
    #[allow(clippy::too_many_arguments)]
    fn moe_into(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        table: u64,
        present: Option<u64>,
        slots: usize,
        sample: &ExpertMats,
        ffn: &Ffn,
        out: &CudaAct,
        into: MoeOut,
        shared: Option<SharedExpert>,
    ) -> bool {
        let inter = sample.gate.rows as usize;
        let kinds = sample.kinds();
        // The kind-generic kernels read no mxfp4 weights (those have kernels of their own), and
        // experts whose parts mix mxfp4 with another format would reach them.
        let parts = [&sample.gate, &sample.up, &sample.down];
        let exact = sample.exact_kinds();
        if parts.iter().any(|m| m.kind() == KIND_MXFP4)
            && (sample.gate.kind() != sample.up.kind() || exact.0.is_none() || exact.1.is_none())
        {
            self.d.record(BackendError::Unsupported(format!(
                "experts of mxfp4 mixed with other formats (gate {}, up {}, down {}): the \
                 CUDA kernels take gate and up of one format and every part with exact kernels",
                KINDS[sample.gate.kind()],
                KINDS[sample.up.kind()],
                KINDS[sample.down.kind()]
            )));
            return false;
        }
        let (Some(xp), Some(op), Some(ids), Some(weights)) =
            (x.ptr(), out.ptr(), &routing.ids, &routing.weights)
        else {
            return false;
        };
        let pairs = routing.rows * routing.k;
        let (present_ptr, n_present) = match present {
            Some(p) => (p, slots as i32),
            None => (0, -1),
        };
        let ffn = &Ffn {
            table: slots as i32,
            ..*ffn
        };
        // The 4-bit kernels write a fresh output themselves; every other path adds onto zeros.
        let q4_gate_up =
            kinds.0 == KIND_Q4 && sample.gate.cols % 16 == 0 && sample.gate.group >= 16;
        let q4_down = kinds.1 == KIND_Q4;
        let decode_writes = routing.rows <= MOE_DECODE_ROWS && q4_down;
        if into == MoeOut::Fresh && !decode_writes {
            if let Some(b) = &out.buf {
                self.d.zero(b);
            }
        }
        if routing.rows > MOE_DECODE_ROWS {
            self.moe_grouped(
                x,
                routing,
                table,
                (present_ptr, n_present),
                slots,
                sample,
                ffn,
                out,
            );
            return false;
        }
        // The shared expert rides along where the kernels below are the 4-bit ones, its group of
        // threads in the down kernel's blocks included.
        let shared = shared.filter(|_| {
            q4_gate_up
                && routing.k < MAX_EXPERTS_PER_TOKEN
                && sample.down.spread_threads().is_some_and(|g| {
                    let block = g * (routing.k + 1);
                    block <= 1024 && block.is_multiple_of(32)
                })
        });
        let shared_rows = if shared.is_some() { routing.rows } else { 0 };
        let Some(h) = self
            .d
            .alloc_or_record((pairs + shared_rows) * inter * 4, "MoE activations")
        else {
            return false;
        };
        let k = &self.d.k;
        let gate_up_args = [
            Arg::Ptr(table),
            Arg::Ptr(present_ptr),
            Arg::I32(n_present),
            Arg::Ptr(ids.ptr),
            Arg::I32(routing.k as i32),
            Arg::Ptr(xp),
            Arg::Ptr(h.ptr),
            Arg::Ffn(*ffn),
        ];
        if let Some(sh) = shared {
            let mut args = gate_up_args.to_vec();
            args.push(Arg::Shared(Box::new(sh)));
            self.d.launch(
                &self.q4().moe_gate_up_shared,
                (grid(inter, 8), (pairs + shared_rows) as u32, 1),
                (128, 1, 1),
                &args,
            );
        } else if q4_gate_up {
            // 4 warps of 2 rows each.
            self.d.launch(
                &self.q4().moe_gate_up,
                (grid(inter, 8), pairs as u32, 1),
                (128, 1, 1),
                &gate_up_args,
            );
        } else {
            self.d.launch(
                &k.moe_gate_up[kinds.0],
                (grid(inter, 16), pairs as u32, 1),
                (256, 1, 1),
                &gate_up_args,
            );
        }
        // The 4-bit kernels take one more argument before `ffn`: whether to add onto `out`.
        let down_args = |q4: bool| {
            let mut args = vec![
                Arg::Ptr(table),
                Arg::Ptr(present_ptr),
                Arg::I32(n_present),
                Arg::Ptr(ids.ptr),
                Arg::Ptr(weights.ptr),
                Arg::I32(routing.k as i32),
                Arg::Ptr(h.ptr),
                Arg::Ptr(op),
                Arg::I32(x.cols as i32),
            ];
            if q4 {
                args.push(Arg::I32((into == MoeOut::Add) as i32));
            }
            args.push(Arg::Ffn(*ffn));
            if let Some(sh) = shared {
                args.push(Arg::Shared(Box::new(sh)));
            }
            args
        };
        // A block of K x (inter / 16) threads per 4 output rows, in whole warps.
        let spread_down = sample
            .down
            .spread_threads()
            .map(|g| g * (routing.k + shared.is_some() as usize))
            .filter(|&b| q4_down && b <= 1024 && b.is_multiple_of(32));
        if let Some(block) = spread_down {
            // Blocks small enough for four per multiprocessor take the kernel whose registers are
            // capped for that (one wave instead of one and a part, for Qwen3-30B-A3B's shape).
            let small = block <= MOE_DOWN_S384;
            self.d.launch(
                match (small, shared.is_some()) {
                    (true, false) => &self.q4().moe_down_s384,
                    (false, false) => &self.q4().moe_down,
                    (true, true) => &self.q4().moe_down_s384_shared,
                    (false, true) => &self.q4().moe_down_shared,
                },
                (grid(x.cols, SPREAD_ROWS), routing.rows as u32, 1),
                (block as u32, 1, 1),
                &down_args(true),
            );
        } else if q4_down {
            // A warp per (expert, column slice): eight warps where there are eight such pairs.
            let slices = (sample.down.cols as usize)
                .div_ceil(MOE_DOWN_W_SLICE)
                .clamp(1, MOE_DOWN_W_SLICES);
            let threads = if routing.k * slices >= 8 { 256 } else { 128 };
            self.d.launch(
                &k.moe_down_q4_w,
                (grid(x.cols, MOE_DOWN_W_ROWS), routing.rows as u32, 1),
                (threads, 1, 1),
                &down_args(true),
            );
        } else {
            // Measured on an H100 (Qwen3-30B-A3B shape): a block per output row wins for the
            // down projections of a few tokens (27 us vs 32 per layer).
            self.d.launch(
                &k.moe_down_b[kinds.1],
                (x.cols as u32, routing.rows as u32, 1),
                (128, 1, 1),
                &down_args(false),
            );
        }
        shared.is_some()
    }

    /// The routed experts of `routing` (all in VRAM) from zero into a new output, with `shared`
    /// inside their launches where `moe_into` can; says whether it did.
    fn moe_fresh(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &CudaExperts,
        desc: &Ffn,
        shared: Option<SharedExpert>,
    ) -> (CudaAct, bool) {
        let out = self.act(x.rows, x.cols);
        let fused = self.moe_into(
            x,
            routing,
            experts.table_ptr(),
            None,
            experts.count,
            &experts.sample,
            desc,
            &out,
            MoeOut::Fresh,
            shared,
        );
        (out, fused)
    }

    /// `moe_into` over the experts `ids` (ascending) whose table entries are `words`: the table
    /// and the ids after it go up in one upload.
    #[allow(clippy::too_many_arguments)]
    fn moe_present(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        mut words: Vec<u32>,
        ids: &[u32],
        sample: &ExpertMats,
        ffn: &Ffn,
        out: &CudaAct,
        into: MoeOut,
    ) -> Result<(), BackendError> {
        let table_bytes = words.len() * 4;
        words.extend_from_slice(ids);
        let both = self.d.upload(&words, "the expert table")?;
        self.moe_into(
            x,
            routing,
            both.ptr,
            Some(both.ptr + table_bytes as u64),
            ids.len(),
            sample,
            ffn,
            out,
            into,
            None,
        );
        Ok(())
    }

    /// The MoE of many tokens of a layer whose experts are read in place (a prompt): the routed
    /// experts that no slot holds are copied into the staging slots in bulk and the grouped
    /// kernels read those copies, in runs of ascending expert ids when they do not all fit
    /// (each run adding onto the last: the same bits as one call). `None`: no staging here (the
    /// kernels then read in place).
    fn moe_staged(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &CudaExperts,
        layer: &Arc<InPlaceLayer>,
        ids: &DevBuf,
        ffn: &Ffn,
    ) -> Option<CudaAct> {
        let mut in_place = self.in_place.lock().unwrap_or_else(|p| p.into_inner());
        if !in_place.stages(layer) {
            return None;
        }
        let out = self.act(x.rows, x.cols);
        let result = (|| -> Result<(), BackendError> {
            let n = routing.rows * routing.k;
            let pairs: Vec<u32> = self.d.download(ids, n)?;
            let mut routed = pairs.clone();
            routed.sort_unstable();
            routed.dedup();
            let current: Vec<u32> = self.d.download(&layer.table, layer.table.bytes / 4)?;
            let runs = in_place.stage_runs(layer, &routed);
            for (i, run) in runs.iter().enumerate() {
                let words = in_place.stage(&self.d, layer, run, &pairs, &current)?;
                let into = if i == 0 { MoeOut::Fresh } else { MoeOut::Add };
                self.moe_present(x, routing, words, run, &experts.sample, ffn, &out, into)?;
            }
            if runs.is_empty() {
                if let Some(b) = &out.buf {
                    self.d.zero(b);
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            self.d.record(e);
        }
        Some(out)
    }

    /// The MoE of a few tokens of a layer whose experts are read in place, with the host
    /// computing some of the routed experts that no VRAM slot holds while the device computes
    /// the rest (see `host_compute`): `host_split_plan` picks the host's experts on the device
    /// and hands them over through the mailbox, the MoE kernels skip them, `host_split_join`
    /// adds the host's sum. No synchronisation (but once per layer where the experts have
    /// biases: the host's copies of them are read back then). `None`: not here (no split asked
    /// for, or a call larger than the mailbox). Both sides compute as `ffn` says (`desc`: its
    /// kernels' description).
    fn moe_beside_host(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &CudaExperts,
        layer: &Arc<InPlaceLayer>,
        (ffn, desc): (&ExpertFfn<'_, CudaVector>, &Ffn),
    ) -> Option<CudaAct> {
        if self.host_mode == HostCompute::Off {
            return None;
        }
        let n = routing.rows * routing.k;
        if n > MAX_PAIRS {
            return None;
        }
        let (Some(xp), Some(ids), Some(weights)) = (x.ptr(), &routing.ids, &routing.weights) else {
            return None;
        };
        let mut guard = self.host.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let split = HostSplit::new(self.host_mode)?;
            let capacity = MOE_DECODE_ROWS * x.cols;
            match HostExperts::start(
                &self.d,
                split.share(),
                self.host_cpu,
                capacity,
                self.host_tally.clone(),
            ) {
                Ok(h) => {
                    self.in_place
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .set_host_tally(self.host_tally.clone());
                    *guard = Some((h, split, layer.id()));
                }
                Err(e) => {
                    self.d.record(e);
                    return Some(self.poisoned(x.rows, x.cols));
                }
            }
        }
        let (host, split, first_layer) = guard.as_mut()?;
        if x.rows * x.cols > host.capacity() {
            return None;
        }
        // A decode step starts at its first layer read in place: the share is measured by the
        // steps' times.
        *first_layer = (*first_layer).min(layer.id());
        if layer.id() == *first_layer {
            if let Some(share) = split.step_starts(std::time::Instant::now()) {
                host.set_share(share);
            }
        }
        if let Some(why) = host.failure() {
            self.d.record(BackendError::Device(format!(
                "experts computed by the CPU beside the GPU: {why} (--cpu-experts off reads them \
                 all over the link instead)"
            )));
            return Some(self.poisoned(x.rows, x.cols));
        }
        host.register(layer);
        // The worker computes as the device does: the activation, and host copies of the biases
        // (read back once per layer).
        let from = ffn.biases.map_or((0, 0, 0), |b| {
            (b.gate.buf.ptr, b.up.buf.ptr, b.down.buf.ptr)
        });
        if !host.has_ffn(layer.id(), ffn.activation, from) {
            let biases = match ffn.biases {
                None => None,
                Some(b) => {
                    let read = |v: &CudaVector| self.vector_to_host(v);
                    match (read(&b.gate), read(&b.up), read(&b.down)) {
                        (Ok(gate), Ok(up), Ok(down)) => Some(FfnWeights { gate, up, down }),
                        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                            self.d.record(e);
                            return Some(self.poisoned(x.rows, x.cols));
                        }
                    }
                }
            };
            host.set_ffn(
                layer.id(),
                HostFfn {
                    activation: ffn.activation,
                    biases,
                    from,
                },
            );
        }
        let (lo, hi) = self
            .in_place
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .slots_range();
        let (mailbox, sums) = host.device_addresses();
        let skipped = CudaRouting {
            ids: self.d.alloc_or_record(n * 4, "the device's routing"),
            weights: self.d.alloc_or_record(n * 4, "the device's routing"),
            rows: routing.rows,
            k: routing.k,
        };
        let (Some(gpu_ids), Some(gpu_weights)) = (&skipped.ids, &skipped.weights) else {
            return Some(self.poisoned(x.rows, x.cols));
        };
        self.d.launch(
            &self.d.k.host_split_plan,
            (1, 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(ids.ptr),
                Arg::Ptr(weights.ptr),
                Arg::Ptr(xp),
                Arg::Ptr(experts.table_ptr()),
                Arg::Ptr(lo),
                Arg::Ptr(hi),
                Arg::I32(routing.rows as i32),
                Arg::I32(routing.k as i32),
                Arg::I32(x.cols as i32),
                Arg::I32(layer.id() as i32),
                Arg::Ptr(host.state.ptr()),
                Arg::Ptr(mailbox),
                Arg::Ptr(gpu_ids.ptr),
                Arg::Ptr(gpu_weights.ptr),
            ],
        );
        let (out, _) = self.moe_fresh(x, &skipped, experts, desc, None);
        if let Some(op) = out.ptr() {
            self.d.launch(
                &self.d.k.host_split_join,
                (1, 1, 1),
                (1024, 1, 1),
                &[
                    Arg::Ptr(host.state.ptr()),
                    Arg::Ptr(mailbox),
                    Arg::Ptr(sums),
                    Arg::Ptr(op),
                    Arg::I32((x.rows * x.cols) as i32),
                    Arg::Ptr(JOIN_TIMEOUT_NS),
                ],
            );
        }
        Some(out)
    }

    /// The MoE of many tokens: pairs grouped by expert on the device, then per expert tensor-core
    /// products over its pairs (each expert's weights read once per tile of 16-64 pairs), then the weighted
    /// sum per token in ascending expert id (the order of the few-token kernels); biases and the
    /// activation as `ffn` says.
    #[allow(clippy::too_many_arguments)]
    fn moe_grouped(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        table: u64,
        (present_ptr, n_present): (u64, i32),
        slots: usize,
        sample: &ExpertMats,
        ffn: &Ffn,
        out: &CudaAct,
    ) {
        let (Some(xp), Some(op), Some(ids)) = (x.ptr(), out.ptr(), &routing.ids) else {
            return;
        };
        let pairs = routing.rows * routing.k;
        let (hidden, inter) = (x.cols, sample.gate.rows as usize);
        // The exact-weight kernels when gate/up and down all take them (they keep gate and up
        // apart, [pairs, 2 inter], with their biases, and the down kernel applies the
        // activation; the 8-bit-activation ones add the biases where they quantize the
        // activation); else the 3xTF32 kernels (64 x 64 tiles), whose gate/up kernel writes the
        // activation, [pairs, inter]. The down biases join in `moe_combine`.
        let exact = match sample.exact_kinds() {
            (Some(g), Some(d)) => Some((g, d)),
            _ => None,
        };
        let h_cols = if exact.is_some() { 2 * inter } else { inter };
        let int8 = exact.and_then(|(g, d)| Some((self.int8_kind(g)?, self.int8_kind(d)?)));
        // An expert has at most one pair per token (top-k picks distinct experts).
        // Tall tiles of few pairs when experts have few (~32 at 512 tokens, 128 experts, top 8).
        let tile = usize::from(pairs < 24 * slots);
        let (pairs_per_tile, rows_per_tile) = match (int8, exact) {
            (Some(_), _) => [(32, 128), (16, 128)][tile],
            (None, Some(_)) => [(32, 128), (16, 256)][tile],
            (None, None) => (64, 64),
        };
        // Blocks are launched per tile of pairs of an expert that has some (moe_group's map):
        // at most this many, over grid y (at most 65535) and z.
        let max_tiles = pairs.div_ceil(pairs_per_tile) + slots;
        let tiles_z = max_tiles.div_ceil(65535);
        let tiles_y = max_tiles.div_ceil(tiles_z);
        let max_tiles = tiles_y * tiles_z;
        // offsets [slots + 1], sorted pairs [pairs], ranks [pairs], the tile map [3 max_tiles];
        // the activations; the down outputs.
        let (Some(groups), Some(h), Some(d)) = (
            self.d.alloc_or_record(
                (slots + 1 + 2 * pairs + 3 * max_tiles) * 4,
                "MoE expert groups",
            ),
            self.d
                .alloc_or_record(pairs * h_cols * 4, "MoE activations"),
            self.d.alloc_or_record(pairs * hidden * 4, "MoE outputs"),
        ) else {
            return;
        };
        let offsets = groups.ptr;
        let sorted = offsets + (slots as u64 + 1) * 4;
        let ranks = sorted + pairs as u64 * 4;
        let tiles = ranks + pairs as u64 * 4;
        let k = &self.d.k;
        self.d.launch(
            &k.moe_group,
            (1, 1, 1),
            (1024, 1, 1),
            &[
                Arg::Ptr(present_ptr),
                Arg::I32(n_present),
                Arg::Ptr(ids.ptr),
                Arg::I32(pairs as i32),
                Arg::I32(slots as i32),
                Arg::Ptr(offsets),
                Arg::Ptr(sorted),
                Arg::Ptr(ranks),
                Arg::I32(pairs_per_tile as i32),
                Arg::I32(max_tiles as i32),
                Arg::Ptr(tiles),
            ],
        );
        let (n_tiles, tiles_z) = (tiles_y as u32, tiles_z as u32);
        if let Some((g, dk)) = int8 {
            let Some((_xq, [xq, xd, xs])) = self.quantize_rows(xp, routing.rows, hidden, None, g)
            else {
                return;
            };
            self.d.launch(
                &k.moe_gate_up_iq[tile][g],
                (2 * grid(inter, rows_per_tile), n_tiles, tiles_z),
                (128, 1, 1),
                &[
                    Arg::Ptr(table),
                    Arg::Ptr(tiles),
                    Arg::Ptr(sorted),
                    Arg::I32(routing.k as i32),
                    Arg::Ptr(xq),
                    Arg::Ptr(xd),
                    Arg::Ptr(xs),
                    Arg::Ptr(h.ptr),
                ],
            );
            let Some((_hq, [hq, hd, hs])) =
                self.quantize_rows(h.ptr, pairs, inter, Some((ffn, ids.ptr)), dk)
            else {
                return;
            };
            self.d.launch(
                &k.moe_down_iq[tile][dk],
                (grid(hidden, rows_per_tile), n_tiles, tiles_z),
                (128, 1, 1),
                &[
                    Arg::Ptr(table),
                    Arg::Ptr(tiles),
                    Arg::Ptr(sorted),
                    Arg::Ptr(hq),
                    Arg::Ptr(hd),
                    Arg::Ptr(hs),
                    Arg::Ptr(d.ptr),
                ],
            );
            self.moe_combine(
                routing,
                table,
                (present_ptr, n_present),
                ffn,
                d.ptr,
                op,
                hidden,
            );
            return;
        }
        let (gate_up, down, gate_up_grid_x) = match exact {
            Some((g, d)) => (
                &k.moe_gate_up_tq[tile][g],
                &k.moe_down_tq[tile][d],
                2 * grid(inter, rows_per_tile),
            ),
            None if ffn.is_plain() => (&k.moe_gate_up_tc, &k.moe_down_tc, grid(inter, 64)),
            None => (&k.moe_gate_up_tc_ffn, &k.moe_down_tc, grid(inter, 64)),
        };
        self.d.launch(
            gate_up,
            (gate_up_grid_x, n_tiles, tiles_z),
            (128, 1, 1),
            &[
                Arg::Ptr(table),
                Arg::Ptr(tiles),
                Arg::Ptr(sorted),
                Arg::I32(routing.k as i32),
                Arg::Ptr(xp),
                Arg::Ptr(h.ptr),
                Arg::Ptr(ids.ptr),
                Arg::Ffn(*ffn),
            ],
        );
        // The exact kernel applies the activation to its input ([gate | up]); the 3xTF32 one
        // reads it applied.
        let mut down_args = vec![
            Arg::Ptr(table),
            Arg::Ptr(tiles),
            Arg::Ptr(sorted),
            Arg::Ptr(h.ptr),
            Arg::Ptr(d.ptr),
        ];
        if exact.is_some() {
            down_args.push(Arg::Ffn(*ffn));
        }
        self.d.launch(
            down,
            (grid(hidden, rows_per_tile), n_tiles, tiles_z),
            (128, 1, 1),
            &down_args,
        );
        self.moe_combine(
            routing,
            table,
            (present_ptr, n_present),
            ffn,
            d.ptr,
            op,
            hidden,
        );
    }

    /// out[t] += the routing-weighted down outputs `d` of token t's pairs (with their experts'
    /// down biases, `ffn`), in ascending expert id.
    #[allow(clippy::too_many_arguments)]
    fn moe_combine(
        &self,
        routing: &CudaRouting,
        table: u64,
        (present_ptr, n_present): (u64, i32),
        ffn: &Ffn,
        d: u64,
        out: u64,
        hidden: usize,
    ) {
        let (Some(ids), Some(weights)) = (&routing.ids, &routing.weights) else {
            return;
        };
        self.d.launch(
            &self.d.k.moe_combine,
            (routing.rows as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(table),
                Arg::Ptr(present_ptr),
                Arg::I32(n_present),
                Arg::Ptr(ids.ptr),
                Arg::Ptr(weights.ptr),
                Arg::I32(routing.k as i32),
                Arg::Ptr(d),
                Arg::Ptr(out),
                Arg::I32(hidden as i32),
                Arg::Ffn(*ffn),
            ],
        );
    }

    /// How `attend` runs `rows` queries: `Some(splits)` with the one-row kernel (`splits > 1`:
    /// decode), `None` with the many-row kernel (head sizes 64 and 128 only).
    fn attend_plan(rows: usize, heads: usize, kv_heads: usize, hd: usize) -> Option<usize> {
        // (Head size 256 keeps the one-row kernel: its query tile would not fit in shared memory,
        // and an earlier 8-row kernel measured slower there on an H100.)
        if matches!(hd, 64 | 128) && rows >= 16 && 64 % (heads / kv_heads) == 0 {
            return None;
        }
        // Few (head, token) pairs cannot fill the GPU: split each token's positions over blocks
        // (a fixed number, so that a replayed decode graph keeps its shape as the cache grows).
        Some(if heads * rows >= SPLIT_ATTENTION_PAIRS {
            1
        } else if DECODE_HEAD_DIMS.contains(&hd) {
            DECODE_SPLITS
        } else {
            ATTENTION_SPLITS
        })
    }

    /// The cache's length on the device, brought up to `cache.len` first if it is not (after a
    /// prefill, a truncation, a copy): what the decode kernels read instead of arguments.
    fn device_len(&self, cache: &mut CudaKvCache) -> Option<u64> {
        if cache.device_len.is_none() {
            cache.device_len = self.d.alloc_or_record(4, "a KV cache's length");
            cache.device_len_value = None;
        }
        let ptr = cache.device_len.as_ref()?.ptr;
        if cache.device_len_value != Some(cache.len) {
            self.d.launch(
                &self.d.k.fill_words,
                (1, 1, 1),
                (32, 1, 1),
                &[Arg::Ptr(ptr), Arg::I32(cache.len as i32), Arg::I64(1)],
            );
            cache.device_len_value = Some(cache.len);
        }
        Some(ptr)
    }

    /// Causal grouped-query attention of `q` (the queries of the cache's last `q.rows`
    /// positions, already appended) over what is cached, as `attn` says (each row within its
    /// window, the sinks in its softmax). With `device_len` (the cache's length on the device
    /// before those rows; split decode only) the kernel reads the length there and advances it.
    fn attend(
        &self,
        q: &CudaAct,
        cache: &CudaKvCache,
        attn: Attn,
        device_len: Option<u64>,
    ) -> CudaAct {
        let (heads, scale) = (attn.heads, attn.scale);
        let (hd, kvh) = (cache.head_dim, cache.kv_heads);
        let rows = q.rows;
        let total = cache.len;
        let out = self.act(rows, q.cols);
        let (Some(keys), Some(values)) = (&cache.keys, &cache.values) else {
            return self.poisoned(rows, q.cols);
        };
        let plan = Self::attend_plan(rows, heads, kvh, hd);
        let decode = plan.is_some_and(|s| s > 1) && self.decode_kernel(hd, cache.format).is_some();
        let compact_decode = cache.is_compact() && decode;
        let splits = match decode {
            true => long_decode_splits(total),
            false => plan.unwrap_or(1),
        };
        // The other kernels read f32 caches: a compact one is expanded for them.
        let expanded = match cache.is_compact() && !compact_decode {
            true => match self.kv_expand(cache, total) {
                Some(e) => Some(e),
                None => return self.poisoned(rows, q.cols),
            },
            false => None,
        };
        let (keys, values) = match &expanded {
            Some((k, v)) => (k.ptr, v.ptr),
            None => (keys.ptr, values.ptr),
        };
        assert!(
            device_len.is_none() || splits > 1,
            "the device length is for split decode"
        );
        let (partial, done) = if splits > 1 {
            let (Some(p), Some(c)) = (
                self.d
                    .alloc_or_record(rows * heads * splits * (hd + 2) * 4, "attention splits"),
                self.done_counters(),
            ) else {
                return self.poisoned(rows, q.cols);
            };
            (Some(p), Some(c))
        } else {
            (None, None)
        };
        let group = heads / kvh;
        let (Some(qp), Some(o)) = (q.ptr(), out.ptr()) else {
            return out;
        };
        if plan.is_none() {
            let which = usize::from(hd == 128);
            // Prefill: 64 query rows of one kv head per block, keys and values shared.
            let [window, sinks] = attn.args();
            self.d.launch(
                &self.d.k.attention_tiles[which],
                (kvh as u32, grid(rows, 64 / group), 1),
                (128, 1, 1),
                &[
                    Arg::Ptr(qp),
                    Arg::Ptr(keys),
                    Arg::Ptr(values),
                    Arg::Ptr(o),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(total as i32),
                    Arg::I32(rows as i32),
                    Arg::F32(scale),
                    window,
                    sinks,
                ],
            );
        } else {
            let all_done = done
                .as_ref()
                .map_or(0, |d| d.ptr + 4 * ALL_DONE_COUNTER as u64);
            let total = (if device_len.is_some() { rows } else { total }) as i32;
            let partial = partial.as_ref().map_or(0, DevBuf::ptr);
            let done = done.as_ref().map_or(0, |d| d.ptr);
            let all_done = if device_len.is_some() { all_done } else { 0 };
            if compact_decode {
                let [window, sinks] = attn.args();
                self.d.launch(
                    self.decode_kernel(hd, cache.format).expect("checked above"),
                    (heads as u32, rows as u32, splits as u32),
                    (ATTENTION_DECODE_THREADS, 1, 1),
                    &[
                        Arg::Ptr(qp),
                        Arg::Ptr(keys),
                        Arg::Ptr(values),
                        Arg::Ptr(o),
                        Arg::I32(cache.format_code()),
                        Arg::I32(heads as i32),
                        Arg::I32(kvh as i32),
                        Arg::I32(total),
                        Arg::I32(rows as i32),
                        Arg::F32(scale),
                        Arg::Ptr(partial),
                        Arg::Ptr(done),
                        Arg::Ptr(0),
                        Arg::Ptr(0),
                        window,
                        sinks,
                    ],
                );
                return out;
            }
            match self.decode_kernel(hd, KvFormat::F32).filter(|_| splits > 1) {
                Some(kernel) => self.launch_attention_decode(
                    kernel,
                    (rows, splits),
                    qp,
                    None,
                    cache,
                    o,
                    total,
                    attn,
                    (partial, done),
                    (device_len.unwrap_or(0), all_done),
                ),
                None => {
                    let [window, sinks] = attn.args();
                    self.d.launch(
                        match hd > MAX_HEAD_DIM {
                            true => &self.d.k.attention_wide,
                            false => &self.d.k.attention,
                        },
                        (heads as u32, rows as u32, splits as u32),
                        (128, 1, 1),
                        &[
                            Arg::Ptr(qp),
                            Arg::Ptr(keys),
                            Arg::Ptr(values),
                            Arg::Ptr(o),
                            Arg::I32(heads as i32),
                            Arg::I32(kvh as i32),
                            Arg::I32(hd as i32),
                            Arg::I32(total),
                            Arg::I32(rows as i32),
                            Arg::F32(scale),
                            Arg::Ptr(partial),
                            Arg::Ptr(done),
                            Arg::Ptr(device_len.unwrap_or(0)),
                            Arg::Ptr(all_done),
                            window,
                            sinks,
                        ],
                    )
                }
            }
        }
        out
    }

    /// Runs `attention_decode` (`kernel`, from `decode_kernel`) for `rows` queries at `q` over
    /// `cache` into `out`, as `attn` says, its positions split over `splits` blocks per (head,
    /// row); with a `prelude` q is raw and the kernel normalises and rotates it, and the new key
    /// and value (one row), writing them into the cache. `total`, `partial`/`done` and the device
    /// length with its counter as the `attention` kernel takes them.
    #[allow(clippy::too_many_arguments)]
    fn launch_attention_decode(
        &self,
        kernel: &CudaFunction,
        (rows, splits): (usize, usize),
        q: u64,
        prelude: Option<Prelude>,
        cache: &CudaKvCache,
        out: u64,
        total: i32,
        attn: Attn,
        (partial, done): (u64, u64),
        (device_len, all_done): (u64, u64),
    ) {
        let (Some(keys), Some(values)) = (&cache.keys, &cache.values) else {
            return;
        };
        let (heads, scale) = (attn.heads, attn.scale);
        let [window, sinks] = attn.args();
        let p = prelude.unwrap_or_default();
        self.d.launch(
            kernel,
            (heads as u32, rows as u32, splits as u32),
            (ATTENTION_DECODE_THREADS, 1, 1),
            &[
                Arg::Ptr(q),
                Arg::Ptr(p.k),
                Arg::Ptr(p.v),
                Arg::Ptr(p.q_norm),
                Arg::Ptr(p.k_norm),
                Arg::Ptr(p.inv_freq),
                Arg::F32(p.eps),
                Arg::I32(p.rotary_dim as i32),
                Arg::Ptr(keys.ptr),
                Arg::Ptr(values.ptr),
                Arg::Ptr(out),
                Arg::I32(heads as i32),
                Arg::I32(cache.kv_heads as i32),
                Arg::I32(total),
                Arg::I32(rows as i32),
                Arg::F32(scale),
                Arg::Ptr(partial),
                Arg::Ptr(done),
                Arg::Ptr(device_len),
                Arg::Ptr(all_done),
                window,
                sinks,
                Arg::I32(cache.capacity as i32),
            ],
        );
    }

    /// The one-launch attention of one token whose q, k and v rows (already the shapes
    /// `attention_rope` checked) are at the first three pointers, written to the fourth: the
    /// norms, rotations and cache writes inside the kernel. `None`, with nothing done, where that
    /// kernel does not apply; `Some(false)` after a failure (recorded).
    #[allow(clippy::too_many_arguments)]
    fn attention_rope_token(
        &self,
        (qp, kp, vp, o): (u64, u64, u64, u64),
        norms: (&CudaVector, &CudaVector),
        eps: f32,
        rope: Rope,
        cache: &mut CudaKvCache,
        attn: Attn,
    ) -> Option<bool> {
        let heads = attn.heads;
        let rotary_dim = rope.rotary_dim;
        let (hd, kvh) = (cache.head_dim, cache.kv_heads);
        Self::attend_plan(1, heads, kvh, hd).filter(|&s| s > 1)?;
        let kernel = self.decode_kernel(hd, KvFormat::F32)?;
        let first = cache.len;
        let splits = long_decode_splits(first + 1);
        if !self.ensure_capacity(cache, first + 1) {
            return Some(false);
        }
        let device_len = self.device_len(cache);
        let (Some(freq), Some(partial), Some(done)) = (
            self.rotary_frequencies(rope),
            self.d
                .alloc_or_record(heads * splits * (hd + 2) * 4, "attention splits"),
            self.done_counters(),
        ) else {
            return Some(false);
        };
        let prelude = Prelude {
            k: kp,
            v: vp,
            q_norm: self.vec_ptr(norms.0),
            k_norm: self.vec_ptr(norms.1),
            inv_freq: freq.ptr,
            eps,
            rotary_dim,
        };
        self.launch_attention_decode(
            kernel,
            (1, splits),
            qp,
            Some(prelude),
            cache,
            o,
            (if device_len.is_some() { 1 } else { first + 1 }) as i32,
            attn,
            (partial.ptr, done.ptr),
            (
                device_len.unwrap_or(0),
                device_len.map_or(0, |_| done.ptr + 4 * ALL_DONE_COUNTER as u64),
            ),
        );
        cache.len = first + 1;
        if device_len.is_some() {
            cache.device_len_value = Some(cache.len);
        }
        Some(true)
    }

    /// One token of each request of `caches` (at most `KV_ROWS_MAX`, whose shapes
    /// `attention_rope_token` takes) in one launch: request `r`'s rows of q, k, v and out at the
    /// pointers, attending through its own cache, as `attn` says. False after a failure
    /// (recorded).
    #[allow(clippy::too_many_arguments)]
    fn attention_rows(
        &self,
        (qp, kp, vp, o): (u64, u64, u64, u64),
        norms: (&CudaVector, &CudaVector),
        eps: f32,
        rope: Rope,
        caches: &mut [&mut CudaKvCache],
        attn: Attn,
    ) -> bool {
        let (heads, scale) = (attn.heads, attn.scale);
        let rotary_dim = rope.rotary_dim;
        let (hd, kvh) = (caches[0].head_dim, caches[0].kv_heads);
        let (Some(_), Some(kernel)) = (
            Self::attend_plan(1, heads, kvh, hd),
            DECODE_HEAD_DIMS
                .iter()
                .position(|&d| d == hd)
                .and_then(|i| self.d.k.attention_decode_rows.get(i)),
        ) else {
            return false;
        };
        let mut table = KvRows::default();
        for (r, cache) in caches.iter_mut().enumerate() {
            let first = cache.len;
            if !self.ensure_capacity(cache, first + 1) {
                return false;
            }
            let device_len = self.device_len(cache);
            let (Some(keys), Some(values)) = (&cache.keys, &cache.values) else {
                return false;
            };
            table.keys[r] = keys.ptr;
            table.values[r] = values.ptr;
            table.cached[r] = device_len.unwrap_or(0);
            table.total[r] = if device_len.is_some() {
                1
            } else {
                first as i32 + 1
            };
        }
        let n = caches.len();
        let splits = long_decode_splits(caches.iter().map(|c| c.len + 1).max().unwrap_or(1));
        let [window, sinks] = attn.args();
        let (Some(freq), Some(partial), Some(done)) = (
            self.rotary_frequencies(rope),
            self.d
                .alloc_or_record(n * heads * splits * (hd + 2) * 4, "attention splits"),
            self.done_counters(),
        ) else {
            return false;
        };
        self.d.launch(
            kernel,
            (heads as u32, n as u32, splits as u32),
            (ATTENTION_DECODE_THREADS, 1, 1),
            &[
                Arg::Ptr(qp),
                Arg::Ptr(kp),
                Arg::Ptr(vp),
                Arg::Ptr(self.vec_ptr(norms.0)),
                Arg::Ptr(self.vec_ptr(norms.1)),
                Arg::Ptr(freq.ptr),
                Arg::F32(eps),
                Arg::I32(rotary_dim as i32),
                Arg::KvRows(Box::new(table)),
                Arg::Ptr(o),
                Arg::I32(heads as i32),
                Arg::I32(kvh as i32),
                Arg::F32(scale),
                Arg::Ptr(partial.ptr),
                Arg::Ptr(done.ptr),
                Arg::Ptr(done.ptr + 4 * ALL_DONE_COUNTER as u64),
                window,
                sinks,
            ],
        );
        for cache in caches.iter_mut() {
            cache.len += 1;
            if cache.device_len.is_some() {
                cache.device_len_value = Some(cache.len);
            }
        }
        true
    }

    /// The first `n` positions of a compact cache as f32 keys and values `[n, width]` (for the
    /// kernels that read f32): what it holds, exactly. `None` after a failure (recorded).
    fn kv_expand(&self, cache: &CudaKvCache, n: usize) -> Option<(DevBuf, DevBuf)> {
        let (keys, values) = (cache.keys.as_ref()?, cache.values.as_ref()?);
        let width = cache.kv_heads * cache.head_dim;
        let k = self
            .d
            .alloc_or_record(n * width * 4, "an expanded KV cache")?;
        let v = self
            .d
            .alloc_or_record(n * width * 4, "an expanded KV cache")?;
        self.d.launch(
            &self.d.k.kv_expand,
            (grid(2 * n * width, 256).clamp(1, 8192), 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(keys.ptr),
                Arg::Ptr(values.ptr),
                Arg::Ptr(k.ptr),
                Arg::Ptr(v.ptr),
                Arg::I32(n as i32),
                Arg::I32(width as i32),
                Arg::I32(KvFormat::group(cache.head_dim) as i32),
                Arg::I32(cache.format_code()),
            ],
        );
        Some((k, v))
    }

    /// The split decode attention kernel for head size `hd` over a cache in `format` (f32:
    /// `attention_decode`, which may fuse the prelude; compact: `attention_decode_kv`), if it is
    /// compiled for it.
    fn decode_kernel(&self, hd: usize, format: KvFormat) -> Option<&CudaFunction> {
        let i = DECODE_HEAD_DIMS.iter().position(|&d| d == hd)?;
        match format {
            KvFormat::F32 => self.d.k.attention_decode.get(i),
            _ => self.d.k.attention_decode_kv.get(i),
        }
    }

    fn ensure_capacity(&self, cache: &mut CudaKvCache, needed: usize) -> bool {
        if needed <= cache.capacity && cache.keys.is_some() {
            return true;
        }
        let capacity = needed.max(cache.capacity * 2).max(256);
        let width = cache.row_bytes();
        let grow = |old: &Option<DevBuf>| -> Option<DevBuf> {
            let new = self.d.alloc_or_record(capacity * width, "the KV cache")?;
            if let Some(o) = old {
                self.d.copy(new.ptr, o.ptr, cache.len * width);
            }
            Some(new)
        };
        let (keys, values) = (grow(&cache.keys), grow(&cache.values));
        if keys.is_none() || values.is_none() {
            return false;
        }
        cache.keys = keys;
        cache.values = values;
        cache.capacity = capacity;
        true
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Copies may still be reading host memory the expert store is about to free.
        let _ = self.d.sync_all();
        if let Some(report) = self.d.profile_report() {
            eprint!("{report}");
        }
        if let Some(report) = self.d.graph_report() {
            eprint!("{report}");
        }
    }
}

/// Whether `attention_rope`'s shapes let one launch do the norms, rotations and cache writes.
fn rope_fuses(
    (q, k, v): (&CudaAct, &CudaAct, &CudaAct),
    norms: (&CudaVector, &CudaVector),
    Rope {
        head_dim,
        rotary_dim,
        ..
    }: Rope,
    cache: &CudaKvCache,
    heads: usize,
) -> bool {
    let (hd, kvh) = (cache.head_dim, cache.kv_heads);
    // A compact cache is written by `kv_store` after the norms and rotations, op by op.
    !cache.is_compact()
        && head_dim == hd
        && hd <= MAX_HEAD_DIM
        && (norms.0.len, norms.1.len) == (hd, hd)
        && (k.cols, v.cols, q.cols) == (kvh * hd, kvh * hd, heads * hd)
        && (k.rows, v.rows) == (q.rows, q.rows)
        && heads.is_multiple_of(kvh)
        && rotary_dim <= hd
        && rotary_dim.is_multiple_of(2)
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Vector = CudaVector;
    type Experts = CudaExperts;
    type StagedExpert = CudaStagedExpert;
    type Routing = CudaRouting;
    type KvCache = CudaKvCache;
    type LinearState = CudaLinearState;

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn memory(&self) -> MemoryInfo {
        self.d.memory()
    }

    fn has_device_memory(&self) -> bool {
        true
    }

    /// Up to 8 rows the products, the MoE and attention run their decode kernels; past that
    /// the prompt kernels (tensor cores, and 8-bit activations with fast prefill).
    fn decode_rows(&self) -> usize {
        MOE_DECODE_ROWS
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        let synced = self.d.sync();
        self.release_uploads();
        match self.d.take_error() {
            Some(e) => Err(e),
            None => synced,
        }
    }

    fn weight(&self, m: HostMatrix) -> Result<CudaWeight, BackendError> {
        let mut parts = Vec::new();
        let mat = self.upload_matrix(&m, &mut parts)?;
        Ok(CudaWeight { mat, _parts: parts })
    }

    fn vector(&self, v: &[f32]) -> Result<CudaVector, BackendError> {
        Ok(CudaVector {
            buf: self.d.upload(v, "a vector")?,
            len: v.len(),
        })
    }

    fn vector_to_host(&self, v: &CudaVector) -> Result<Vec<f32>, BackendError> {
        self.d.download(&v.buf, v.len)
    }

    fn experts(&self, experts: Vec<HostExpert>) -> Result<CudaExperts, BackendError> {
        let mut parts = Vec::new();
        let mut table = Vec::with_capacity(experts.len());
        for e in &experts {
            table.push(ExpertMats {
                gate: self.upload_matrix(&e.gate, &mut parts)?,
                up: self.upload_matrix(&e.up, &mut parts)?,
                down: self.upload_matrix(&e.down, &mut parts)?,
            });
        }
        if experts.len() > MAX_ROUTED_EXPERTS {
            return Err(BackendError::Unsupported(format!(
                "{} routed experts per layer; the CUDA kernels route at most {MAX_ROUTED_EXPERTS}",
                experts.len()
            )));
        }
        Ok(CudaExperts {
            table: Some(self.d.upload(&table, "the expert table")?),
            count: table.len(),
            sample: table.first().copied().unwrap_or_default(),
            _parts: parts,
            in_place: None,
        })
    }

    fn stage_expert(
        &self,
        key: ExpertKey,
        host: HostExpert,
    ) -> Result<CudaStagedExpert, BackendError> {
        let mut vram = self.vram.lock().unwrap_or_else(|p| p.into_inner());
        let Some(vram) = vram.as_mut() else {
            // No expert cache planned: an upload for this call, from memory nobody page-locked
            // through this backend (so the copy has read it when the call returns).
            let mut parts = Vec::new();
            let mats = ExpertMats {
                gate: self.upload_matrix(&host.gate, &mut parts)?,
                up: self.upload_matrix(&host.up, &mut parts)?,
                down: self.upload_matrix(&host.down, &mut parts)?,
            };
            if is_pinned(&self.pinned, host.gate.data.as_slice()) {
                // From page-locked memory the copies may still be reading `host`.
                self.d.sync()?;
            }
            return Ok(CudaStagedExpert {
                mats,
                _parts: parts,
                _hold: None,
            });
        };
        let pinned = is_pinned(&self.pinned, host.gate.data.as_slice());
        Ok(vram.stage(&self.d, key, host, pinned)?.into())
    }

    fn staged_expert(&self, key: ExpertKey) -> Option<CudaStagedExpert> {
        let mut vram = self.vram.lock().unwrap_or_else(|p| p.into_inner());
        Some(vram.as_mut()?.find(key)?.into())
    }

    fn holds_expert(&self, key: ExpertKey) -> bool {
        let vram = self.vram.lock().unwrap_or_else(|p| p.into_inner());
        vram.as_ref().is_some_and(|v| v.holds(key))
    }

    fn plan_expert_cache(
        &self,
        budget: Option<u64>,
        expert_bytes: u64,
        experts: usize,
    ) -> Result<Option<ExpertCachePlan>, BackendError> {
        let mut vram = self.vram.lock().unwrap_or_else(|p| p.into_inner());
        // A new plan replaces the old cache (its memory freed first, so that it can be reused),
        // once no copy into it or from the host memory it holds is in flight.
        self.d.sync()?;
        *vram = None;
        let mut in_place = self.in_place.lock().unwrap_or_else(|p| p.into_inner());
        if !in_place.is_empty() {
            // The experts stay in host memory: the slots cache the most used of them.
            let mut plan = size_slots(&self.d, budget, expert_bytes, experts)?;
            let staging = in_place.staging_slots(plan.slots);
            plan.slots -= staging;
            in_place.plan(&self.d, plan.slots, staging, plan.slot_bytes as usize)?;
            plan.reason += "; the rest read in place from page-locked host memory";
            if staging > 0 {
                plan.reason += &format!(
                    "; {staging} more slots ({:.2} GiB) stage a prompt's experts",
                    (staging as u64 * plan.slot_bytes) as f64 / (1u64 << 30) as f64
                );
            }
            return Ok(Some(plan));
        }
        let (cache, plan) = VramExperts::plan(&self.d, budget, expert_bytes, experts)?;
        *vram = Some(cache);
        Ok(Some(plan))
    }

    fn expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        let mut in_place = self.in_place.lock().unwrap_or_else(|p| p.into_inner());
        if in_place.has_tier() {
            let mut stats = in_place.stats();
            drop(in_place);
            let host = self.host.lock().unwrap_or_else(|p| p.into_inner());
            stats.host_share = host.as_ref().map(|(_, split, _)| split.share());
            return Some(stats);
        }
        drop(in_place);
        let mut vram = self.vram.lock().unwrap_or_else(|p| p.into_inner());
        Some(vram.as_mut()?.stats(&self.d))
    }

    fn experts_in_host(
        &self,
        source: &Arc<dyn ExpertSource>,
        layer: usize,
    ) -> Result<Option<CudaExperts>, BackendError> {
        let off = std::env::var("SLUICE_CUDA_IN_PLACE").is_ok_and(|v| v == "0");
        let Some(info) = source.layer(layer) else {
            return Ok(None);
        };
        if off || !source.can_hold_all() || info.experts == 0 || info.experts > MAX_ROUTED_EXPERTS {
            return Ok(None);
        }
        let ids: Vec<u32> = (0..info.experts as u32).collect();
        let fetch = |run: &[u32]| {
            source
                .fetch(layer, run)
                .map_err(|e| BackendError::Device(format!("{}: layer {layer}: {e}", source.name())))
        };
        // One expert first: memory the device cannot read in place (not page-locked, or not
        // mapped) is known before the whole layer is read. Then stream the layer instead.
        let mut host = fetch(&ids[..1])?;
        match host.first() {
            Some(first) if self.mapped_mats(first)?.is_some() => {}
            _ => return Ok(None),
        }
        for run in ids[1..].chunks(source.max_fetch().max(1)) {
            host.extend(fetch(run)?);
        }
        let mut in_host = Vec::with_capacity(host.len());
        for e in &host {
            match self.mapped_mats(e)? {
                Some(m) => in_host.push(m),
                None => return Ok(None),
            }
        }
        if in_host.len() != info.experts {
            return Err(BackendError::Device(format!(
                "{}: layer {layer}: {} experts fetched of {}",
                source.name(),
                in_host.len(),
                info.experts
            )));
        }
        let table = self.d.upload(&in_host, "the expert table")?;
        let sample = in_host[0];
        let layer = self
            .in_place
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .register(&self.d, host, in_host, table);
        Ok(Some(CudaExperts {
            table: None,
            count: info.experts,
            sample,
            _parts: Vec::new(),
            in_place: Some(layer),
        }))
    }

    fn host_pinner(&self) -> Option<Arc<dyn HostPinner>> {
        if std::env::var("SLUICE_CUDA_PIN").is_ok_and(|v| v == "0") {
            return None;
        }
        Some(Arc::new(CudaPinner {
            ctx: self.d.context().clone(),
            ranges: self.pinned.clone(),
        }))
    }

    fn kv_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        _capacity: usize,
        format: KvFormat,
    ) -> Result<CudaKvCache, BackendError> {
        if head_dim > MAX_ATTENTION_HEAD_DIM {
            return Err(BackendError::Unsupported(format!(
                "attention heads of {head_dim}: the CUDA kernels take at most \
                 {MAX_ATTENTION_HEAD_DIM}"
            )));
        }
        // Allocated at the first append and grown by doubling: the model's context may be far
        // larger than any request.
        Ok(CudaKvCache {
            keys: None,
            values: None,
            len: 0,
            capacity: 0,
            kv_heads,
            head_dim,
            format,
            device_len: None,
            device_len_value: None,
            device: self.d.clone(),
        })
    }

    fn kv_formats(&self) -> &'static [KvFormat] {
        &KvFormat::ALL
    }

    fn kv_len(&self, cache: &CudaKvCache) -> usize {
        cache.len
    }

    fn kv_truncate(&self, cache: &mut CudaKvCache, len: usize) {
        cache.len = cache.len.min(len);
    }

    fn linear_state(&self, dims: &DeltaNetDims) -> Result<CudaLinearState, BackendError> {
        self.linear_state_from_host(HostLinearState::new(dims))
    }

    fn linear_state_to_host(&self, s: &CudaLinearState) -> Result<HostLinearState, BackendError> {
        let fresh = HostLinearState::new(&s.dims);
        let (Some(conv), Some(recurrent)) = (&s.conv, &s.recurrent) else {
            return Err(self.d.peek_error().unwrap_or_else(|| {
                BackendError::Device("a DeltaNet state lost to an earlier failure".into())
            }));
        };
        Ok(HostLinearState {
            dims: s.dims,
            conv: self.d.download(conv, fresh.conv.len())?,
            recurrent: self.d.download(recurrent, fresh.recurrent.len())?,
        })
    }

    fn linear_state_from_host(&self, s: HostLinearState) -> Result<CudaLinearState, BackendError> {
        let d = s.dims;
        if !d.key_dim.is_multiple_of(32)
            || d.key_dim > 256
            || d.conv_kernel > MAX_CONV_KERNEL
            || d.conv_kernel == 0
            || d.value_dim * d.key_dim / 32 > 1024
            || !d.value_heads.is_multiple_of(d.key_heads.max(1))
        {
            return Err(BackendError::Unsupported(format!(
                "Gated DeltaNet dims {d:?}: the CUDA kernels need key_dim a multiple of 32 up to \
                 256, value_dim * key_dim / 32 <= 1024 and a conv kernel of 1 to {MAX_CONV_KERNEL}"
            )));
        }
        Ok(CudaLinearState {
            dims: d,
            conv: Some(self.d.upload(&s.conv, "a DeltaNet state")?),
            recurrent: Some(self.d.upload(&s.recurrent, "a DeltaNet state")?),
            device: self.d.clone(),
        })
    }

    fn zeros(&self, rows: usize, cols: usize) -> CudaAct {
        let a = self.act(rows, cols);
        if let Some(b) = &a.buf {
            self.d.zero(b);
        }
        a
    }

    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> CudaAct {
        assert_eq!(data.len(), rows * cols);
        match self.d.upload(data, "activations") {
            Ok(buf) => CudaAct {
                buf: Some(buf),
                rows,
                cols,
            },
            Err(e) => {
                self.d.record(e);
                self.poisoned(rows, cols)
            }
        }
    }

    fn to_host(&self, a: &CudaAct) -> Result<Vec<f32>, BackendError> {
        match &a.buf {
            Some(b) => self.d.download(b, a.rows * a.cols),
            None => Err(self.d.peek_error().unwrap_or_else(|| {
                BackendError::Device("activations lost to an earlier failure".into())
            })),
        }
    }

    fn shape(&self, a: &CudaAct) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn slice_rows(&self, a: &CudaAct, start: usize, len: usize) -> CudaAct {
        assert!(start + len <= a.rows);
        let out = self.act(len, a.cols);
        if let (Some(src), Some(dst)) = (a.ptr(), out.ptr()) {
            self.d
                .copy(dst, src + (start * a.cols * 4) as u64, len * a.cols * 4);
        }
        out
    }

    fn concat_rows(&self, parts: &[&CudaAct]) -> CudaAct {
        let cols = parts.first().expect("concat_rows of no parts").cols;
        assert!(
            parts.iter().all(|p| p.cols == cols),
            "concat_rows: widths differ"
        );
        let out = self.act(parts.iter().map(|p| p.rows).sum(), cols);
        if let Some(dst) = out.ptr() {
            let mut at = 0;
            for p in parts {
                let bytes = p.rows * cols * 4;
                match p.ptr() {
                    Some(src) if bytes > 0 => self.d.copy(dst + at as u64, src, bytes),
                    Some(_) => {}
                    // An earlier failure is recorded; the result is poisoned with it.
                    None => return self.poisoned(out.rows, cols),
                }
                at += bytes;
            }
        }
        out
    }

    fn embed(&self, table: &CudaWeight, tokens: &[u32]) -> CudaAct {
        let out = self.act(tokens.len(), table.mat.cols as usize);
        if tokens.is_empty() {
            return out;
        }
        if tokens.len() <= 8 {
            // By value: a decode step needs no upload, and its graph only a parameter update.
            let mut ids = [0u32; 8];
            ids[..tokens.len()].copy_from_slice(tokens);
            if let Some(o) = out.ptr() {
                self.d.launch(
                    &self.d.k.embed_ids,
                    (tokens.len() as u32, 1, 1),
                    (256, 1, 1),
                    &[Arg::Mat(table.mat), Arg::Ids(ids), Arg::Ptr(o)],
                );
            }
            return out;
        }
        let ids = match self.d.upload(tokens, "token ids") {
            Ok(b) => b,
            Err(e) => {
                self.d.record(e);
                return self.poisoned(tokens.len(), table.mat.cols as usize);
            }
        };
        if let Some(o) = out.ptr() {
            self.d.launch(
                &self.d.k.embed,
                (tokens.len() as u32, 1, 1),
                (256, 1, 1),
                &[Arg::Mat(table.mat), Arg::Ptr(ids.ptr), Arg::Ptr(o)],
            );
        }
        out
    }

    fn matmul(&self, x: &CudaAct, w: &CudaWeight) -> CudaAct {
        assert_eq!(x.cols, w.mat.cols as usize, "matmul: input width");
        let out = self.act(x.rows, w.mat.rows as usize);
        if let (Some(xp), Some(o)) = (x.ptr(), out.ptr()) {
            if x.rows > 0 {
                self.matmul_into(xp, x.rows, &w.mat, o);
            }
        }
        out
    }

    fn matmuls<const N: usize>(&self, x: &CudaAct, weights: [&CudaWeight; N]) -> [CudaAct; N] {
        let kind = weights.first().map(|w| w.mat.kind());
        let total: usize = weights.iter().map(|w| w.mat.rows as usize).sum();
        if N < 2
            || N > MAT_SET_MAX
            || x.rows == 0
            || x.rows > 8
            || total == 0
            || total > i32::MAX as usize
            || weights
                .iter()
                .any(|w| w.mat.cols as usize != x.cols || Some(w.mat.kind()) != kind)
        {
            // Many tokens through the 8-bit-activation kernels: x quantized once for all.
            let int8 = weights
                .iter()
                .map(|w| w.mat.exact_kind().and_then(|e| self.int8_kind(e)))
                .reduce(|a, b| if a == b { a } else { None })
                .flatten();
            if let (Some(i), Some(xp), true) = (int8, x.ptr(), x.rows > 8) {
                if weights.iter().all(|w| w.mat.cols as usize == x.cols) {
                    if let Some((_q, parts)) = self.quantize_rows(xp, x.rows, x.cols, None, i) {
                        return weights.map(|w| {
                            let out = self.act(x.rows, w.mat.rows as usize);
                            if let Some(o) = out.ptr() {
                                self.matmul_into_q(xp, x.rows, &w.mat, o, Some(parts));
                            }
                            out
                        });
                    }
                }
            }
            return weights.map(|w| self.matmul(x, w));
        }
        let outs = weights.map(|w| self.act(x.rows, w.mat.rows as usize));
        let Some(xp) = x.ptr() else {
            return outs;
        };
        // One token and matrices the spread kernel takes: `first` counts its blocks, not rows
        // (the matrices have the same width, so the same row groups per block).
        let spread = weights[0]
            .mat
            .spread()
            .filter(|_| x.rows == 1 && weights.iter().all(|w| w.mat.spread().is_some()));
        let rows_per_block = spread.map_or(1, |s| s.rows_per_block());
        let mut set = MatSet {
            n: N as i32,
            ..MatSet::default()
        };
        for (i, (w, o)) in weights.iter().zip(&outs).enumerate() {
            let Some(op) = o.ptr() else {
                return outs;
            };
            set.m[i] = w.mat;
            set.out[i] = op;
            set.first[i + 1] = set.first[i] + grid(w.mat.rows as usize, rows_per_block) as i32;
        }
        for i in N + 1..=MAT_SET_MAX {
            set.first[i] = set.first[N];
        }
        let blocks = set.first[N] as u32;
        let args = [Arg::MatSet(Box::new(set)), Arg::Ptr(xp)];
        match spread {
            Some(s) => self.d.launch(
                &self.q4().gemv_multi,
                (blocks, 1, 1),
                (s.block_threads(), 1, 1),
                &args,
            ),
            None => self.d.launch(
                &self.d.k.gemv_multi[kind.unwrap_or(0)][x.rows - 1],
                (blocks, 1, 1),
                (128, 1, 1),
                &args,
            ),
        }
        outs
    }

    fn add_shared_expert(
        &self,
        y: &mut CudaAct,
        x: &CudaAct,
        w: &FfnWeights<CudaWeight>,
        gate: &CudaWeight,
    ) {
        let (tokens, down) = (x.rows, &w.down.mat);
        // Where the down projection alone would run `gemv_b` or `gemv_q4_t1_s` (see
        // `matmul_into`).
        let fused = (1..=8).contains(&tokens)
            && !(tokens == 1 && down.rows >= HEAD_ROWS)
            && gate.mat.rows == 1
            && (y.rows, y.cols) == (tokens, down.rows as usize)
            && down.cols == w.up.mat.rows
            && w.gate.mat.rows == w.up.mat.rows;
        let [g, u] = self.matmuls(x, [&w.gate, &w.up]);
        let scale = self.matmul(x, gate);
        if !fused {
            // The trait's default, in steps (an override cannot call it).
            let mut s = self.matmul(&self.swiglu(&g, &u), &w.down);
            self.sigmoid_mul(&mut s, &scale);
            self.add_assign(y, &s);
            return;
        }
        match (y.ptr(), g.ptr(), u.ptr(), scale.ptr()) {
            (Some(yp), Some(gp), Some(up), Some(sp)) => {
                let args = [
                    Arg::Mat(*down),
                    Arg::Ptr(gp),
                    Arg::Ptr(up),
                    Arg::Ptr(sp),
                    Arg::Ptr(yp),
                ];
                // The kernel `matmul_into` would run the down projection with, fused.
                match Self::spread(down, tokens) {
                    Some(s) => self.d.launch(
                        &self.q4().gemv_gated,
                        (grid(down.rows as usize, s.rows_per_block()), 1, 1),
                        (s.block_threads(), 1, 1),
                        &args,
                    ),
                    None => self.d.launch(
                        &self.d.k.gemv_gated[down.kind()][tokens - 1],
                        (down.rows as u32, 1, 1),
                        (128, 1, 1),
                        &args,
                    ),
                }
            }
            _ => y.buf = None,
        }
    }

    fn rms_norm(&self, x: &CudaAct, weight: &CudaVector, eps: f32) -> CudaAct {
        let n = weight.len;
        assert!(x.cols.is_multiple_of(n));
        let out = self.act(x.rows, x.cols);
        if let (Some(xp), Some(o)) = (x.ptr(), out.ptr()) {
            self.d.launch(
                &self.d.k.rms_norm,
                ((x.rows * x.cols / n) as u32, 1, 1),
                (n.min(1024).next_multiple_of(32) as u32, 1, 1),
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(self.vec_ptr(weight)),
                    Arg::Ptr(o),
                    Arg::I32(n as i32),
                    Arg::F32(eps),
                ],
            );
        }
        out
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols));
        let n = x.rows * x.cols;
        match (x.ptr(), y.ptr()) {
            (Some(xp), Some(yp)) => self.elementwise(
                &self.d.k.add_assign,
                n,
                &[Arg::Ptr(xp), Arg::Ptr(yp), Arg::I64(n as i64)],
            ),
            _ => x.buf = None,
        }
    }

    fn add_bias(&self, x: &mut CudaAct, bias: &CudaVector) {
        assert_eq!(x.cols, bias.len, "one bias per column");
        let n = x.rows * x.cols;
        match x.ptr() {
            Some(xp) => self.elementwise(
                &self.d.k.add_bias,
                n,
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(self.vec_ptr(bias)),
                    Arg::I64(n as i64),
                    Arg::I32(x.cols as i32),
                ],
            ),
            None => x.buf = None,
        }
    }

    fn add_rms_norm(&self, h: &mut CudaAct, y: &CudaAct, weight: &CudaVector, eps: f32) -> CudaAct {
        let n = weight.len;
        assert_eq!((h.rows, h.cols), (y.rows, y.cols));
        assert!(h.cols.is_multiple_of(n));
        let out = self.act(h.rows, h.cols);
        match (h.ptr(), y.ptr(), out.ptr()) {
            (Some(hp), Some(yp), Some(o)) => self.d.launch(
                &self.d.k.add_rms_norm,
                ((h.rows * h.cols / n) as u32, 1, 1),
                (n.min(1024).next_multiple_of(32) as u32, 1, 1),
                &[
                    Arg::Ptr(hp),
                    Arg::Ptr(yp),
                    Arg::Ptr(self.vec_ptr(weight)),
                    Arg::Ptr(o),
                    Arg::I32(n as i32),
                    Arg::F32(eps),
                ],
            ),
            _ => h.buf = None,
        }
        out
    }

    fn swiglu(&self, gate: &CudaAct, up: &CudaAct) -> CudaAct {
        assert_eq!((gate.rows, gate.cols), (up.rows, up.cols));
        let n = gate.rows * gate.cols;
        let out = self.act(gate.rows, gate.cols);
        if let (Some(g), Some(u), Some(o)) = (gate.ptr(), up.ptr(), out.ptr()) {
            self.elementwise(
                &self.d.k.swiglu,
                n,
                &[Arg::Ptr(g), Arg::Ptr(u), Arg::Ptr(o), Arg::I64(n as i64)],
            );
        }
        out
    }

    fn rope(&self, x: &mut CudaAct, rope: Rope, first_position: usize) {
        let (head_dim, rotary_dim) = (rope.head_dim, rope.rotary_dim);
        assert!(rotary_dim <= head_dim && rotary_dim.is_multiple_of(2));
        assert!(x.cols.is_multiple_of(head_dim));
        let n = x.rows * (x.cols / head_dim) * (rotary_dim / 2);
        let Some(freq) = self.rotary_frequencies(rope) else {
            x.buf = None;
            return;
        };
        if let Some(xp) = x.ptr() {
            self.elementwise(
                &self.d.k.rope,
                n,
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(freq.ptr),
                    Arg::I32(x.rows as i32),
                    Arg::I32(x.cols as i32),
                    Arg::I32(head_dim as i32),
                    Arg::I32(rotary_dim as i32),
                    Arg::I32(first_position as i32),
                ],
            );
        }
    }

    fn rms_norm_rope(
        &self,
        x: &CudaAct,
        weight: &CudaVector,
        eps: f32,
        rope: Rope,
        first_position: usize,
    ) -> CudaAct {
        let (head_dim, rotary_dim) = (rope.head_dim, rope.rotary_dim);
        assert_eq!(weight.len, head_dim, "one norm weight per head value");
        assert!(rotary_dim <= head_dim && rotary_dim.is_multiple_of(2));
        assert!(x.cols.is_multiple_of(head_dim));
        if head_dim > MAX_HEAD_DIM {
            let mut y = self.rms_norm(x, weight, eps);
            self.rope(&mut y, rope, first_position);
            return y;
        }
        let out = self.act(x.rows, x.cols);
        let Some(freq) = self.rotary_frequencies(rope) else {
            return self.poisoned(x.rows, x.cols);
        };
        if let (Some(xp), Some(o)) = (x.ptr(), out.ptr()) {
            self.d.launch(
                &self.d.k.rms_norm_rope,
                ((x.rows * x.cols / head_dim) as u32, 1, 1),
                (head_dim.next_multiple_of(32) as u32, 1, 1),
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(self.vec_ptr(weight)),
                    Arg::Ptr(freq.ptr),
                    Arg::Ptr(o),
                    Arg::I32(head_dim as i32),
                    Arg::F32(eps),
                    Arg::I32((x.cols / head_dim) as i32),
                    Arg::I32(rotary_dim as i32),
                    Arg::I32(first_position as i32),
                ],
            );
        }
        out
    }

    fn attention(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        cache: &mut CudaKvCache,
        spec: AttentionSpec<'_, CudaVector>,
    ) -> CudaAct {
        let attn = Attn::of(&spec);
        let heads = attn.heads;
        let (hd, kvh) = (cache.head_dim, cache.kv_heads);
        assert_eq!((k.cols, v.cols, q.cols), (kvh * hd, kvh * hd, heads * hd));
        assert!(heads.is_multiple_of(kvh));
        let rows = q.rows;
        let width = kvh * hd * 4;
        let total = cache.len + rows;
        if !self.ensure_capacity(cache, total) {
            return self.poisoned(rows, q.cols);
        }
        let (Some(keys), Some(values)) = (&cache.keys, &cache.values) else {
            return self.poisoned(rows, q.cols);
        };
        if cache.is_compact() {
            if let (Some(kp), Some(vp)) = (k.ptr(), v.ptr()) {
                let group = KvFormat::group(hd);
                let threads = 2 * rows * (kvh * hd / group);
                self.d.launch(
                    &self.d.k.kv_store,
                    (grid(threads, 128), 1, 1),
                    (128, 1, 1),
                    &[
                        Arg::Ptr(kp),
                        Arg::Ptr(vp),
                        Arg::Ptr(keys.ptr),
                        Arg::Ptr(values.ptr),
                        Arg::I32(rows as i32),
                        Arg::I32((kvh * hd) as i32),
                        Arg::I32(group as i32),
                        Arg::I32(cache.format_code()),
                        Arg::I32(cache.len as i32),
                        Arg::Ptr(0),
                    ],
                );
            }
        } else if let (Some(kp), Some(vp)) = (k.ptr(), v.ptr()) {
            let at = (cache.len * width) as u64;
            let words = rows * width / 4;
            self.d.launch(
                &self.d.k.copy_words2,
                (grid(2 * words, 1024).min(4096), 1, 1),
                (256, 1, 1),
                &[
                    Arg::Ptr(keys.ptr + at),
                    Arg::Ptr(kp),
                    Arg::Ptr(values.ptr + at),
                    Arg::Ptr(vp),
                    Arg::I64(words as i64),
                ],
            );
        }
        cache.len = total;
        self.attend(q, cache, attn, None)
    }

    fn attention_rope(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        norms: Option<(&CudaVector, &CudaVector)>,
        eps: f32,
        rope: Rope,
        cache: &mut CudaKvCache,
        spec: AttentionSpec<'_, CudaVector>,
    ) -> CudaAct {
        let attn = Attn::of(&spec);
        let heads = attn.heads;
        let rotary_dim = rope.rotary_dim;
        let (hd, kvh) = (cache.head_dim, cache.kv_heads);
        // The fused kernels normalise q and k; attention without the norms runs op by op.
        let fused = norms.filter(|&n| rope_fuses((q, k, v), n, rope, cache, heads));
        let Some(norms) = fused else {
            let (q, k) = sluice_backend::norm_rope_qk(self, q, k, norms, eps, rope, cache.len);
            return self.attention(&q, &k, v, cache, spec);
        };
        // One token: the norms, rotations and cache writes inside the attention kernel.
        if q.rows == 1 {
            let out = self.act(1, q.cols);
            if let (Some(qp), Some(kp), Some(vp), Some(o)) = (q.ptr(), k.ptr(), v.ptr(), out.ptr())
            {
                match self.attention_rope_token((qp, kp, vp, o), norms, eps, rope, cache, attn) {
                    Some(true) => return out,
                    Some(false) => return self.poisoned(1, q.cols),
                    None => {}
                }
            }
        }
        // One launch for the norms, the rotations and the cache writes of q, k and v.
        let rows = q.rows;
        let first = cache.len;
        if !self.ensure_capacity(cache, first + rows) {
            return self.poisoned(rows, q.cols);
        }
        let device_len = match Self::attend_plan(rows, heads, kvh, hd) {
            Some(splits) if splits > 1 => self.device_len(cache),
            _ => None,
        };
        let (Some(keys), Some(values), Some(freq)) =
            (&cache.keys, &cache.values, self.rotary_frequencies(rope))
        else {
            return self.poisoned(rows, q.cols);
        };
        let q_rot = self.act(rows, q.cols);
        if let (Some(qp), Some(kp), Some(vp), Some(o)) = (q.ptr(), k.ptr(), v.ptr(), q_rot.ptr()) {
            self.d.launch(
                &self.d.k.qkv_norm_rope_append,
                ((rows * (heads + 2 * kvh)) as u32, 1, 1),
                (hd.next_multiple_of(32) as u32, 1, 1),
                &[
                    Arg::Ptr(qp),
                    Arg::Ptr(kp),
                    Arg::Ptr(vp),
                    Arg::Ptr(self.vec_ptr(norms.0)),
                    Arg::Ptr(self.vec_ptr(norms.1)),
                    Arg::Ptr(freq.ptr),
                    Arg::Ptr(o),
                    Arg::Ptr(keys.ptr),
                    Arg::Ptr(values.ptr),
                    Arg::I32(hd as i32),
                    Arg::F32(eps),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(rotary_dim as i32),
                    Arg::I32(if device_len.is_some() {
                        0
                    } else {
                        first as i32
                    }),
                    Arg::Ptr(device_len.unwrap_or(0)),
                ],
            );
        }
        cache.len = first + rows;
        let out = self.attend(&q_rot, cache, attn, device_len);
        if device_len.is_some() {
            cache.device_len_value = Some(cache.len);
        }
        out
    }

    fn attention_rope_segments(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        norms: Option<(&CudaVector, &CudaVector)>,
        eps: f32,
        rope: Rope,
        caches: &mut [&mut CudaKvCache],
        rows: &[usize],
        spec: AttentionSpec<'_, CudaVector>,
    ) -> CudaAct {
        let attn = Attn::of(&spec);
        let heads = attn.heads;
        // Requests decoding a token each: every token attends where its rows are, through its
        // own cache, with no rows cut out or stacked (those copies were 31% of an 8-request
        // step's GPU time, Qwen3-30B-A3B shape).
        let in_place = norms.filter(|&n| {
            rows.len() > 1
                && q.rows == rows.len()
                && rows.iter().all(|&n| n == 1)
                && caches.iter().all(|c| {
                    rope_fuses((q, k, v), n, rope, c, heads)
                        && Self::attend_plan(1, heads, c.kv_heads, c.head_dim)
                            .is_some_and(|s| s > 1)
                        && self.decode_kernel(c.head_dim, KvFormat::F32).is_some()
                })
        });
        let Some(norms) = in_place else {
            return sluice_backend::attention_rope_by_parts(
                self, q, k, v, norms, eps, rope, caches, rows, spec,
            );
        };
        let out = self.act(q.rows, q.cols);
        let (Some(qp), Some(kp), Some(vp), Some(o)) = (q.ptr(), k.ptr(), v.ptr(), out.ptr()) else {
            return self.poisoned(q.rows, q.cols);
        };
        if rows.len() <= KV_ROWS_MAX && rows.len() * heads <= SPLIT_ATTENTION_PAIRS {
            return match self.attention_rows((qp, kp, vp, o), norms, eps, rope, caches, attn) {
                true => out,
                false => self.poisoned(q.rows, q.cols),
            };
        }
        for (i, cache) in caches.iter_mut().enumerate() {
            let row = |p: u64, cols: usize| p + (i * cols * 4) as u64;
            let ptrs = (
                row(qp, q.cols),
                row(kp, k.cols),
                row(vp, v.cols),
                row(o, q.cols),
            );
            if self.attention_rope_token(ptrs, norms, eps, rope, cache, attn) != Some(true) {
                return self.poisoned(q.rows, q.cols);
            }
        }
        out
    }

    fn sigmoid_mul(&self, x: &mut CudaAct, gate: &CudaAct) {
        assert_eq!(x.rows, gate.rows);
        assert!(gate.cols == 1 || gate.cols == x.cols);
        let n = x.rows * x.cols;
        match (x.ptr(), gate.ptr()) {
            (Some(xp), Some(g)) => self.elementwise(
                &self.d.k.sigmoid_mul,
                n,
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(g),
                    Arg::I64(n as i64),
                    Arg::I32(x.cols as i32),
                    Arg::I32(gate.cols as i32),
                ],
            ),
            _ => x.buf = None,
        }
    }

    fn join_chunks(&self, a: &CudaAct, a_chunk: usize, b: &CudaAct, b_chunk: usize) -> CudaAct {
        assert!(a_chunk > 0 && b_chunk > 0 && a.rows == b.rows);
        assert!(a.cols.is_multiple_of(a_chunk) && b.cols.is_multiple_of(b_chunk));
        assert_eq!(
            a.cols / a_chunk,
            b.cols / b_chunk,
            "join_chunks: chunk counts differ"
        );
        let out = self.act(a.rows, a.cols + b.cols);
        let n = out.rows * out.cols;
        if let (Some(ap), Some(bp), Some(o)) = (a.ptr(), b.ptr(), out.ptr()) {
            self.elementwise(
                &self.d.k.join_chunks,
                n,
                &[
                    Arg::Ptr(ap),
                    Arg::Ptr(bp),
                    Arg::Ptr(o),
                    Arg::I64(n as i64),
                    Arg::I32(a_chunk as i32),
                    Arg::I32(b_chunk as i32),
                ],
            );
        }
        out
    }

    fn matmul_heads(&self, x: &CudaAct, w: &CudaWeight, heads: usize) -> CudaAct {
        let (rows, inp) = (w.mat.rows as usize, w.mat.cols as usize);
        assert!(
            heads > 0 && rows.is_multiple_of(heads),
            "matmul_heads: rows per head"
        );
        assert_eq!(x.cols, heads * inp, "matmul_heads: input width");
        let out = self.act(x.rows, rows);
        let warps = x.rows * rows;
        if let (Some(xp), Some(o), true) = (x.ptr(), out.ptr(), warps > 0) {
            self.d.launch(
                &self.d.k.matmul_heads,
                (warps.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                &[
                    Arg::Mat(w.mat),
                    Arg::Ptr(xp),
                    Arg::Ptr(o),
                    Arg::I32(x.rows as i32),
                    Arg::I32((rows / heads) as i32),
                ],
            );
        }
        out
    }

    fn split_chunks(&self, x: &CudaAct, chunk: usize, first: usize) -> (CudaAct, CudaAct) {
        assert!(first <= chunk && x.cols.is_multiple_of(chunk));
        let chunks = x.cols / chunk;
        let a = self.act(x.rows, chunks * first);
        let b = self.act(x.rows, chunks * (chunk - first));
        let n = x.rows * x.cols;
        if let (Some(xp), Some(ap), Some(bp)) = (x.ptr(), a.ptr(), b.ptr()) {
            self.elementwise(
                &self.d.k.split_chunks,
                n,
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(ap),
                    Arg::Ptr(bp),
                    Arg::I64(n as i64),
                    Arg::I32(chunk as i32),
                    Arg::I32(first as i32),
                ],
            );
        }
        (a, b)
    }

    fn route_sigmoid(
        &self,
        logits: &CudaAct,
        bias: &CudaVector,
        k: usize,
        how: SigmoidRouting,
    ) -> CudaRouting {
        let (rows, experts) = (logits.rows, logits.cols);
        assert_eq!(experts, bias.len, "one bias per expert");
        assert!(k >= 1 && k <= experts);
        assert!(how.groups >= 1 && experts.is_multiple_of(how.groups));
        assert!(how.top_groups >= 1 && how.top_groups <= how.groups);
        let mut routing = CudaRouting {
            ids: None,
            weights: None,
            rows,
            k,
        };
        if experts > MAX_ROUTED_EXPERTS
            || k > MAX_EXPERTS_PER_TOKEN
            || how.groups > 32
            || (how.groups > 1 && experts / how.groups < 2)
        {
            self.d.record(BackendError::Unsupported(format!(
                "sigmoid routing, top {k} of {experts} experts in {} groups: the CUDA kernel \
                 takes at most {MAX_EXPERTS_PER_TOKEN} of {MAX_ROUTED_EXPERTS}, in at most 32 \
                 groups of 2 or more",
                how.groups
            )));
            return routing;
        }
        let Some(lp) = logits.ptr() else {
            return routing;
        };
        routing.ids = self.d.alloc_or_record(rows * k * 4, "routing");
        routing.weights = self.d.alloc_or_record(rows * k * 4, "routing");
        if let (Some(ids), Some(w)) = (&routing.ids, &routing.weights) {
            self.d.launch(
                &self.d.k.route_sigmoid,
                (grid(rows, 4), 1, 1),
                (128, 1, 1),
                &[
                    Arg::Ptr(lp),
                    Arg::Ptr(self.vec_ptr(bias)),
                    Arg::I32(rows as i32),
                    Arg::I32(experts as i32),
                    Arg::I32(k as i32),
                    Arg::I32(how.groups as i32),
                    Arg::I32(how.top_groups as i32),
                    Arg::I32(how.normalize as i32),
                    Arg::F32(how.scale),
                    Arg::Ptr(ids.ptr),
                    Arg::Ptr(w.ptr),
                ],
            );
        }
        routing
    }

    fn route(&self, logits: &CudaAct, k: usize, normalize: bool) -> CudaRouting {
        let (rows, experts) = (logits.rows, logits.cols);
        assert!(k >= 1 && k <= experts);
        let mut routing = CudaRouting {
            ids: None,
            weights: None,
            rows,
            k,
        };
        if experts > MAX_ROUTED_EXPERTS || k > MAX_EXPERTS_PER_TOKEN {
            self.d.record(BackendError::Unsupported(format!(
                "routing top {k} of {experts} experts: the CUDA kernels take at most \
                 {MAX_EXPERTS_PER_TOKEN} of {MAX_ROUTED_EXPERTS}"
            )));
            return routing;
        }
        let Some(lp) = logits.ptr() else {
            return routing;
        };
        routing.ids = self.d.alloc_or_record(rows * k * 4, "routing");
        routing.weights = self.d.alloc_or_record(rows * k * 4, "routing");
        if let (Some(ids), Some(w)) = (&routing.ids, &routing.weights) {
            self.d.launch(
                &self.d.k.route,
                (grid(rows, 4), 1, 1),
                (128, 1, 1),
                &[
                    Arg::Ptr(lp),
                    Arg::I32(rows as i32),
                    Arg::I32(experts as i32),
                    Arg::I32(k as i32),
                    Arg::I32(normalize as i32),
                    Arg::Ptr(ids.ptr),
                    Arg::Ptr(w.ptr),
                ],
            );
        }
        routing
    }

    fn route_matmul(
        &self,
        x: &CudaAct,
        gate: &CudaWeight,
        k: usize,
        normalize: bool,
    ) -> CudaRouting {
        let (rows, experts) = (x.rows, gate.mat.rows as usize);
        if rows == 0
            || rows > FUSED_ROUTE_TOKENS
            || experts > MAX_ROUTED_EXPERTS
            || k > MAX_EXPERTS_PER_TOKEN
        {
            return self.route(&self.matmul(x, gate), k, normalize);
        }
        assert_eq!(x.cols, gate.mat.cols as usize, "route_matmul: input width");
        assert!(k >= 1 && k <= experts);
        let mut routing = CudaRouting {
            ids: None,
            weights: None,
            rows,
            k,
        };
        let (Some(xp), Some(counters)) = (x.ptr(), self.done_counters()) else {
            return routing;
        };
        let Some(logits) = self.d.alloc_or_record(rows * experts * 4, "router logits") else {
            return routing;
        };
        routing.ids = self.d.alloc_or_record(rows * k * 4, "routing");
        routing.weights = self.d.alloc_or_record(rows * k * 4, "routing");
        if let (Some(ids), Some(w)) = (&routing.ids, &routing.weights) {
            self.d.launch(
                &self.d.k.route_gemv[gate.mat.kind()],
                (experts as u32, rows as u32, 1),
                (128, 1, 1),
                &[
                    Arg::Mat(gate.mat),
                    Arg::Ptr(xp),
                    Arg::I32(k as i32),
                    Arg::I32(normalize as i32),
                    Arg::Ptr(logits.ptr),
                    Arg::Ptr(counters.ptr + (SPLIT_ATTENTION_PAIRS * 4) as u64),
                    Arg::Ptr(ids.ptr),
                    Arg::Ptr(w.ptr),
                ],
            );
        }
        routing
    }

    fn argmax_rows(&self, logits: &CudaAct) -> Result<Vec<u32>, BackendError> {
        let (rows, cols) = (logits.rows, logits.cols);
        if rows == 0 || cols == 0 {
            return Ok(vec![0; rows]);
        }
        if cols > i32::MAX as usize {
            let host = self.to_host(logits)?;
            return Ok(host
                .chunks(cols)
                .map(sluice_backend::reference::argmax)
                .collect());
        }
        // About 2048 columns a block (8 per thread), in at most 128 blocks a row.
        let parts = cols.div_ceil(2048).min(128);
        let chunk = cols.div_ceil(parts);
        let lost = || {
            self.d
                .peek_error()
                .unwrap_or_else(|| BackendError::Device("logits lost to an earlier failure".into()))
        };
        let xp = logits.ptr().ok_or_else(lost)?;
        let values = self
            .d
            .alloc_or_record(rows * parts * 4, "argmax")
            .ok_or_else(lost)?;
        let index = self
            .d
            .alloc_or_record(rows * parts * 4, "argmax")
            .ok_or_else(lost)?;
        let ids = self
            .d
            .alloc_or_record(rows * 4, "argmax")
            .ok_or_else(lost)?;
        let k = &self.d.k;
        self.d.launch(
            &k.argmax_parts,
            (parts as u32, rows as u32, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(xp),
                Arg::I32(cols as i32),
                Arg::I32(chunk as i32),
                Arg::Ptr(values.ptr),
                Arg::Ptr(index.ptr),
            ],
        );
        self.d.launch(
            &k.argmax_finish,
            (rows as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(values.ptr),
                Arg::Ptr(index.ptr),
                Arg::I32(parts as i32),
                Arg::Ptr(ids.ptr),
            ],
        );
        self.d.download(&ids, rows)
    }

    fn top_logits(
        &self,
        logits: &CudaAct,
        row: usize,
        n: usize,
        cols: &[u32],
    ) -> Result<TopLogits, BackendError> {
        let mut one = self.top_logits_rows(logits, &[(row, n, cols)])?;
        Ok(one.pop().expect("one answer"))
    }

    fn top_logits_rows(
        &self,
        logits: &CudaAct,
        requests: &[(usize, usize, &[u32])],
    ) -> Result<Vec<TopLogits>, BackendError> {
        let (rows, width) = (logits.rows, logits.cols);
        for &(row, _, _) in requests {
            assert!(row < rows, "top_logits: row {row} of {rows}");
        }
        let beyond = |&(_, n, cols): &(usize, usize, &[u32])| {
            let n = n.min(width);
            n == 0 || n > TOP_LOGITS_MAX || width > i32::MAX as usize || cols.len() > 1 << 20
        };
        if requests.iter().any(beyond) {
            // Beyond the kernel (a sampler asking for this many reads the row anyway).
            let host = self.to_host(logits)?;
            return Ok(requests
                .iter()
                .map(|&(row, n, cols)| {
                    let x = &host[row * width..(row + 1) * width];
                    sluice_backend::reference::top_logits(x, n.min(width), cols)
                })
                .collect());
        }
        let lost = || {
            self.d
                .peek_error()
                .unwrap_or_else(|| BackendError::Device("logits lost to an earlier failure".into()))
        };
        let xp = logits.ptr().ok_or_else(lost)?;
        // A wide row in two stages: the best n of each TOP_CHUNK columns by a block each, then of
        // those by one block (one block over a 248K-column row took 518 us on an H100).
        let parts = if width > 2 * TOP_CHUNK && !top_one_block() {
            width.div_ceil(TOP_CHUNK)
        } else {
            0
        };
        // Every request's answer (columns, values, values at its columns) one after another,
        // then the stages' scratch: one buffer, one upload of the columns, one download.
        let answers: Vec<usize> = requests
            .iter()
            .map(|&(_, n, cols)| 2 * n.min(width) + cols.len())
            .collect();
        let words: usize = answers.iter().sum();
        let scratch: usize = requests
            .iter()
            .map(|&(_, n, _)| 2 * parts * n.min(width))
            .sum();
        let all_cols: Vec<u32> = requests.iter().flat_map(|r| r.2.iter().copied()).collect();
        let at = if all_cols.is_empty() {
            None
        } else {
            Some(self.d.upload(&all_cols, "top_logits columns")?)
        };
        let out = self
            .d
            .alloc_or_record((words + scratch) * 4, "top_logits")
            .ok_or_else(lost)?;
        let (mut answer, mut part, mut col) = (0, words, 0);
        for (&(row, n, cols), &size) in requests.iter().zip(&answers) {
            let n = n.min(width);
            let x = xp + (row * width * 4) as u64;
            let at_ptr = at.as_ref().map_or(0, |b| b.ptr + 4 * col as u64);
            let word = |w: usize| Arg::Ptr(out.ptr + 4 * w as u64);
            let outs = [word(answer), word(answer + n), word(answer + 2 * n)];
            let at_args = [Arg::Ptr(at_ptr), Arg::I32(cols.len() as i32)];
            if parts == 0 {
                let args = [Arg::Ptr(x), Arg::I32(width as i32), Arg::I32(n as i32)];
                self.d.launch(
                    &self.d.k.top_logits,
                    (1, 1, 1),
                    (1024, 1, 1),
                    &[args.as_slice(), &at_args, &outs].concat(),
                );
            } else {
                let (part_cols, part_vals) = (word(part), word(part + parts * n));
                self.d.launch(
                    &self.d.k.top_logits_parts,
                    (parts as u32, 1, 1),
                    (1024, 1, 1),
                    &[
                        Arg::Ptr(x),
                        Arg::I32(width as i32),
                        Arg::I32(n as i32),
                        part_cols,
                        part_vals,
                    ],
                );
                let args = [
                    word(part),
                    word(part + parts * n),
                    Arg::I32((parts * n) as i32),
                    Arg::I32(n as i32),
                    Arg::Ptr(x),
                    Arg::I32(width as i32),
                ];
                self.d.launch(
                    &self.d.k.top_logits_merge,
                    (1, 1, 1),
                    (1024, 1, 1),
                    &[args.as_slice(), &at_args, &outs].concat(),
                );
                part += 2 * parts * n;
            }
            answer += size;
            col += cols.len();
        }
        let got: Vec<u32> = self.d.download(&out, words)?;
        let mut answer = 0;
        Ok(requests
            .iter()
            .map(|&(_, n, cols)| {
                let (n, g) = (n.min(width), &got[answer..]);
                answer += 2 * n + cols.len();
                TopLogits {
                    top: (0..n).map(|i| (g[i], f32::from_bits(g[n + i]))).collect(),
                    at: g[2 * n..2 * n + cols.len()]
                        .iter()
                        .map(|&v| f32::from_bits(v))
                        .collect(),
                }
            })
            .collect())
    }

    fn read_routing(&self, routing: &CudaRouting) -> Result<HostRouting, BackendError> {
        let n = routing.rows * routing.k;
        let (Some(ids), Some(w)) = (&routing.ids, &routing.weights) else {
            return Err(self.d.peek_error().unwrap_or_else(|| {
                BackendError::Device("routing lost to an earlier failure".into())
            }));
        };
        let (experts, weights) = self.d.download2(ids, n, w, n)?;
        let routing = HostRouting {
            k: routing.k,
            experts,
            weights,
        };
        // The stream has synchronised: the expert source's memory that earlier uploads read
        // goes back before it is asked for this layer's experts.
        self.release_uploads();
        Ok(routing)
    }

    fn moe(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &CudaExperts,
        ffn: ExpertFfn<'_, CudaVector>,
    ) -> CudaAct {
        let desc = ffn_of(&ffn, &experts.sample, experts.count);
        if let (Some(layer), Some(ids)) = (&experts.in_place, &routing.ids) {
            let mut in_place = self.in_place.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = in_place.before_call(&self.d, layer, ids.ptr, routing.rows * routing.k)
            {
                self.d.record(e);
            }
            drop(in_place);
            let call = if routing.rows > MOE_DECODE_ROWS {
                self.moe_staged(x, routing, experts, layer, ids, &desc)
            } else {
                self.moe_beside_host(x, routing, experts, layer, (&ffn, &desc))
            };
            if let Some(out) = call {
                return out;
            }
        }
        self.moe_fresh(x, routing, experts, &desc, None).0
    }

    fn moe_with_shared(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &CudaExperts,
        ffn: ExpertFfn<'_, CudaVector>,
        shared: &FfnWeights<CudaWeight>,
        gate: &CudaWeight,
    ) -> CudaAct {
        // The shared expert as one more expert of each row: it must compute as the routed
        // experts do (plain SwiGLU, their shape; the 4-bit kernels check the formats), its gate
        // one row of the input's width, the experts all in VRAM.
        let (e, sh) = (
            &experts.sample,
            [&shared.gate.mat, &shared.up.mat, &shared.down.mat],
        );
        let same_shape = |a: &Mat, b: &Mat| {
            (a.rows, a.cols, a.kind(), a.group) == (b.rows, b.cols, b.kind(), b.group)
        };
        let fusable = shared_fused_enabled()
            && experts.in_place.is_none()
            && matches!(ffn.activation, Activation::Silu)
            && ffn.biases.is_none()
            && same_shape(sh[0], &e.gate)
            && same_shape(sh[1], &e.up)
            && same_shape(sh[2], &e.down)
            && gate.mat.rows == 1
            && gate.mat.cols == e.gate.cols
            && gate.mat.cols % 8 == 0
            && gate.mat.kind() != KIND_MXFP4;
        let weight = if fusable {
            self.d.alloc_or_record(x.rows * 4, "shared expert weights")
        } else {
            None
        };
        let Some(weight) = weight else {
            let mut y = self.moe(x, routing, experts, ffn);
            self.add_shared_expert(&mut y, x, shared, gate);
            return y;
        };
        let fused = SharedExpert {
            gate: *sh[0],
            up: *sh[1],
            down: *sh[2],
            scale: gate.mat,
            weight: weight.ptr,
        };
        let desc = ffn_of(&ffn, e, experts.count);
        let (mut out, done) = self.moe_fresh(x, routing, experts, &desc, Some(fused));
        if !done {
            self.add_shared_expert(&mut out, x, shared, gate);
        }
        out
    }

    fn moe_accumulate(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &[(u32, &CudaStagedExpert)],
        ffn: ExpertFfn<'_, CudaVector>,
        out: &mut CudaAct,
    ) {
        assert!(
            experts.windows(2).all(|w| w[0].0 < w[1].0),
            "ascending expert ids"
        );
        let (Some(first), Some(last)) = (experts.first(), experts.last()) else {
            return;
        };
        let mut words: Vec<u32> = Vec::with_capacity(experts.len() * (ExpertMats::WORDS + 1));
        for (_, s) in experts {
            s.mats.push_words(&mut words);
        }
        let ids: Vec<u32> = experts.iter().map(|e| e.0).collect();
        let sample = first.1.mats;
        // The biases of every expert up to the last id here.
        let desc = ffn_of(&ffn, &sample, last.0 as usize + 1);
        if let Err(e) = self.moe_present(x, routing, words, &ids, &sample, &desc, out, MoeOut::Add)
        {
            self.d.record(e);
            out.buf = None;
        }
    }

    fn causal_conv1d_silu(
        &self,
        x: &CudaAct,
        weight: &CudaVector,
        state: &mut CudaLinearState,
    ) -> CudaAct {
        let (c, k) = (state.dims.conv_channels(), state.dims.conv_kernel);
        assert_eq!((x.cols, weight.len), (c, c * k));
        let out = self.act(x.rows, c);
        if let (Some(xp), Some(o), Some(window)) = (x.ptr(), out.ptr(), &state.conv) {
            self.d.launch(
                &self.d.k.causal_conv1d_silu,
                (grid(c, 32), 1, 1),
                (256, 1, 1),
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(self.vec_ptr(weight)),
                    Arg::Ptr(window.ptr),
                    Arg::Ptr(o),
                    Arg::I32(x.rows as i32),
                    Arg::I32(c as i32),
                    Arg::I32(k as i32),
                ],
            );
        }
        out
    }

    fn gated_delta_rule(
        &self,
        qkv: &CudaAct,
        a: &CudaAct,
        b: &CudaAct,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        state: &mut CudaLinearState,
    ) -> CudaAct {
        let d = state.dims;
        assert_eq!(qkv.cols, d.conv_channels());
        assert_eq!((a.cols, b.cols), (d.value_heads, d.value_heads));
        let out = self.act(qkv.rows, d.value_heads * d.value_dim);
        let threads = (d.value_dim * d.key_dim / 32).next_multiple_of(32);
        let (hk, hv, dk, dv) = (d.key_heads, d.value_heads, d.key_dim, d.value_dim);
        let tiled = (d.value_order == ValueHeadOrder::Tiled) as i32;
        // The state-free work for all tokens first, then the recurrence with a block per group
        // of value rows and no barrier per token (the same bits as the one-kernel path, which
        // needs dv >= 32 for that). Measured on an H100 (Qwen3.5-35B-A3B shape): the one-kernel
        // path, a block per head, took 39 us per layer to decode one token.
        let many = dv >= 32 && dk % 32 == 0 && dk <= 256;
        if let (Some(qp), Some(ap), Some(bp), Some(o), Some(rec), true) = (
            qkv.ptr(),
            a.ptr(),
            b.ptr(),
            out.ptr(),
            &state.recurrent,
            many,
        ) {
            let Some(prep) = self
                .d
                .alloc_or_record(qkv.rows * (2 * hk * dk + 2 * hv) * 4, "delta rule inputs")
            else {
                return self.poisoned(out.rows, out.cols);
            };
            let dims = [hk, hv, dk, dv].map(|v| Arg::I32(v as i32));
            let k = &self.d.k;
            // A warp per key head (hk / 4 blocks a token), so that one token's prep is parallel.
            self.d.launch(
                &k.delta_prep,
                (qkv.rows as u32, grid(hk, 4), 1),
                (128, 1, 1),
                &[
                    [
                        Arg::Ptr(qp),
                        Arg::Ptr(ap),
                        Arg::Ptr(bp),
                        Arg::Ptr(self.vec_ptr(a_log)),
                        Arg::Ptr(self.vec_ptr(dt_bias)),
                        Arg::Ptr(prep.ptr),
                    ]
                    .as_slice(),
                    &dims,
                ]
                .concat(),
            );
            // Few tokens: smaller blocks, so that more multiprocessors share the state.
            let block = if qkv.rows <= 8 { 64 } else { 128 };
            let rows_per_block = block / (dk / 32);
            self.d.launch(
                &k.gated_delta_rule_rows,
                (hv as u32, grid(dv, rows_per_block), 1),
                (block as u32, 1, 1),
                &[
                    [
                        Arg::Ptr(qp),
                        Arg::Ptr(prep.ptr),
                        Arg::Ptr(rec.ptr),
                        Arg::Ptr(o),
                        Arg::I32(qkv.rows as i32),
                    ]
                    .as_slice(),
                    &dims,
                    &[Arg::I32(tiled)],
                ]
                .concat(),
            );
        } else if let (Some(qp), Some(ap), Some(bp), Some(o), Some(rec)) =
            (qkv.ptr(), a.ptr(), b.ptr(), out.ptr(), &state.recurrent)
        {
            self.d.launch(
                &self.d.k.gated_delta_rule,
                (d.value_heads as u32, 1, 1),
                (threads as u32, 1, 1),
                &[
                    Arg::Ptr(qp),
                    Arg::Ptr(ap),
                    Arg::Ptr(bp),
                    Arg::Ptr(self.vec_ptr(a_log)),
                    Arg::Ptr(self.vec_ptr(dt_bias)),
                    Arg::Ptr(rec.ptr),
                    Arg::Ptr(o),
                    Arg::I32(qkv.rows as i32),
                    Arg::I32(d.key_heads as i32),
                    Arg::I32(d.value_heads as i32),
                    Arg::I32(d.key_dim as i32),
                    Arg::I32(d.value_dim as i32),
                    Arg::I32(tiled),
                ],
            );
        }
        out
    }

    fn gated_delta_net(
        &self,
        qkv: &CudaAct,
        z: &CudaAct,
        a: &CudaAct,
        b: &CudaAct,
        w: DeltaNetWeights<'_, CudaVector>,
        state: &mut CudaLinearState,
    ) -> CudaAct {
        let d = state.dims;
        let (hk, hv, dk, dv, k) = (
            d.key_heads,
            d.value_heads,
            d.key_dim,
            d.value_dim,
            d.conv_kernel,
        );
        let fits = dk % 32 == 0 && dk <= 256 && (2..=8).contains(&k) && dv <= 1024;
        if qkv.rows > DELTA_STEP_ROWS || !fits || !fused_delta_step() {
            let x = self.causal_conv1d_silu(qkv, w.conv1d, state);
            let y = self.gated_delta_rule(&x, a, b, w.a_log, w.dt_bias, state);
            return self.rms_norm_gated(&y, z, w.norm, w.eps);
        }
        assert_eq!(qkv.cols, d.conv_channels());
        assert_eq!((a.cols, b.cols), (hv, hv));
        assert_eq!((z.rows, z.cols, w.norm.len), (qkv.rows, hv * dv, dv));
        let (y, out) = (self.act(qkv.rows, hv * dv), self.act(qkv.rows, hv * dv));
        let (Some(xp), Some(zp), Some(ap), Some(bp), Some(yp), Some(o), Some(rec), Some(window)) = (
            qkv.ptr(),
            z.ptr(),
            a.ptr(),
            b.ptr(),
            y.ptr(),
            out.ptr(),
            &state.recurrent,
            &state.conv,
        ) else {
            return out;
        };
        let dims = [hk, hv, dk, dv, k].map(|v| Arg::I32(v as i32));
        let tiled = (d.value_order == ValueHeadOrder::Tiled) as i32;
        // Each thread convolves at most 4 of q's and k's 2 dk channels (`DELTA_STEP_QK`); for a
        // 128-wide key, 64 threads and 16 rows a block: 256 blocks for Qwen3.5-35B-A3B's 32 heads.
        let threads = (dk / 2).max(32);
        let rows_per_block = threads / (dk / 32);
        let kern = &self.d.k;
        self.d.launch(
            &kern.gated_delta_step,
            (hv as u32, grid(dv, rows_per_block), 1),
            (threads as u32, 1, 1),
            &[
                [
                    Arg::Ptr(xp),
                    Arg::Ptr(self.vec_ptr(w.conv1d)),
                    Arg::Ptr(window.ptr),
                    Arg::Ptr(ap),
                    Arg::Ptr(bp),
                    Arg::Ptr(self.vec_ptr(w.a_log)),
                    Arg::Ptr(self.vec_ptr(w.dt_bias)),
                    Arg::Ptr(rec.ptr),
                    Arg::Ptr(yp),
                    Arg::I32(qkv.rows as i32),
                ]
                .as_slice(),
                &dims,
                &[Arg::I32(tiled)],
            ]
            .concat(),
        );
        self.d.launch(
            &kern.delta_norm_window,
            (hv as u32, 1, 1),
            (dv.next_multiple_of(32) as u32, 1, 1),
            &[
                [
                    Arg::Ptr(yp),
                    Arg::Ptr(zp),
                    Arg::Ptr(self.vec_ptr(w.norm)),
                    Arg::Ptr(o),
                    Arg::Ptr(xp),
                    Arg::Ptr(window.ptr),
                    Arg::I32(qkv.rows as i32),
                ]
                .as_slice(),
                &dims,
                &[Arg::F32(w.eps)],
            ]
            .concat(),
        );
        out
    }

    fn rms_norm_gated(&self, x: &CudaAct, z: &CudaAct, weight: &CudaVector, eps: f32) -> CudaAct {
        let n = weight.len;
        assert_eq!((x.rows, x.cols), (z.rows, z.cols));
        let out = self.act(x.rows, x.cols);
        if let (Some(xp), Some(zp), Some(o)) = (x.ptr(), z.ptr(), out.ptr()) {
            self.d.launch(
                &self.d.k.rms_norm_gated,
                ((x.rows * x.cols / n) as u32, 1, 1),
                (n.min(1024).next_multiple_of(32) as u32, 1, 1),
                &[
                    Arg::Ptr(xp),
                    Arg::Ptr(zp),
                    Arg::Ptr(self.vec_ptr(weight)),
                    Arg::Ptr(o),
                    Arg::I32(n as i32),
                    Arg::F32(eps),
                ],
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prefill attention takes the tiled kernel only where it computes the right thing: head
    /// sizes 64 and 128, and query heads per kv head dividing its 64 rows.
    #[test]
    fn attention_plans() {
        let tiles = |rows, heads, kv_heads, hd| CudaBackend::attend_plan(rows, heads, kv_heads, hd);
        for (heads, kv_heads, hd) in [(32, 4, 128), (16, 1, 64), (64, 1, 128), (8, 8, 64)] {
            assert_eq!(
                tiles(512, heads, kv_heads, hd),
                None,
                "{heads}/{kv_heads} of {hd}"
            );
        }
        // A group of 3 or 128, head sizes 256 and 32, and few rows keep the one-row kernel.
        assert_eq!(tiles(512, 24, 8, 128), Some(1));
        assert_eq!(tiles(512, 128, 1, 128), Some(1));
        assert_eq!(tiles(512, 16, 2, 256), Some(1));
        assert_eq!(tiles(512, 16, 4, 32), Some(1));
        assert_eq!(tiles(15, 32, 4, 128), Some(1));
        assert_eq!(tiles(15, 8, 2, 128), Some(DECODE_SPLITS));
        assert_eq!(tiles(1, 32, 4, 128), Some(DECODE_SPLITS));
        // Head sizes `attention_decode` is not compiled for keep the older split kernel.
        assert_eq!(tiles(1, 32, 4, 96), Some(ATTENTION_SPLITS));
        assert_eq!(tiles(1, 16, 2, 256), Some(DECODE_SPLITS));
    }

    /// The block limit the host picks `moe_down_q4_s384` by is the kernel's launch bound: a larger
    /// block would fail to launch.
    #[test]
    fn moe_down_s384_bounds() {
        let source = include_str!("../kernels/sluice.cu");
        for names in [
            "moe_down_q4_s384, moe_down_q4_s384_shared",
            "moe_down_q4_s384_i8, moe_down_q4_s384_shared_i8",
        ] {
            assert!(
                source.contains(&format!(
                    "({names}, __launch_bounds__({MOE_DOWN_S384}, 4), "
                )),
                "{names}: launch bounds differ from MOE_DOWN_S384"
            );
        }
    }
}
