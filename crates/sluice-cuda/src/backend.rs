//! [`Backend`] on an NVIDIA GPU: one stream, every operation a kernel launch, nothing brought back
//! to the host but logits (and routing when experts stream).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
use sluice_backend::{
    Backend, BackendError, DeltaNetDims, ExpertKey, HostExpert, HostLinearState, HostMatrix,
    HostRouting, MemoryInfo,
};

use crate::kernels::Kernels;
use crate::mat::{describe, ExpertMats, Mat};

/// Freed device memory kept for reuse, by size. Everything runs on one stream, so a buffer
/// dropped on the host may be handed to the next allocation at once: the kernels that used it
/// come earlier in the stream than any that will.
pub(crate) struct BufCache {
    stream: Arc<CudaStream>,
    free: Mutex<HashMap<usize, Vec<u64>>>,
}

impl BufCache {
    /// Frees every cached buffer (before retrying an allocation that did not fit).
    fn release(&self) {
        let free = std::mem::take(&mut *self.free.lock().unwrap_or_else(|p| p.into_inner()));
        for ptr in free.into_values().flatten() {
            // SAFETY: a cached buffer belongs to no DevBuf; the free is ordered after the work
            // that used it.
            let _ = unsafe { result::free_async(ptr, self.stream.cu_stream()) };
        }
    }
}

impl Drop for BufCache {
    fn drop(&mut self) {
        self.release();
    }
}

/// Device memory owned by the backend; returned to the cache when dropped.
pub(crate) struct DevBuf {
    ptr: u64,
    bytes: usize,
    cache: Arc<BufCache>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let mut free = self.cache.free.lock().unwrap_or_else(|p| p.into_inner());
        free.entry(size_class(self.bytes))
            .or_default()
            .push(self.ptr);
    }
}

impl DevBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// Allocations are rounded up to 512 bytes so that nearby sizes share buffers.
fn size_class(bytes: usize) -> usize {
    bytes.max(4).next_multiple_of(512)
}

/// A kernel argument.
enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    Mat(Mat),
}

fn grid(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

/// The context, stream and kernels, and the first failure not yet reported.
pub(crate) struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cache: Arc<BufCache>,
    k: Kernels,
    error: Mutex<Option<BackendError>>,
    /// `SLUICE_CUDA_PROFILE=1`: every launch between two events, summed per kernel at the end.
    profile: Option<Mutex<Vec<(String, CudaEvent, CudaEvent)>>>,
}

fn device_error(what: &str, e: DriverError) -> BackendError {
    BackendError::Device(format!("CUDA {what}: {e}"))
}

/// Stream-ordered allocations come from the device's default pool, which by default returns freed
/// memory to the driver at every synchronisation: each token would map its activations afresh.
/// Keep what was freed for reuse instead.
fn keep_pool_memory(ctx: &CudaContext) -> Result<(), BackendError> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()
        .map_err(|e| device_error("binding the context", e))?;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    let mut keep = u64::MAX;
    // SAFETY: `pool` is written by the driver before it is read; the attribute takes a pointer to a
    // u64, as the driver documents for CU_MEMPOOL_ATTR_RELEASE_THRESHOLD.
    let r = unsafe {
        sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
            .result()
            .and_then(|_| {
                sys::cuMemPoolSetAttribute(
                    pool.assume_init(),
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep as *mut u64 as *mut c_void,
                )
                .result()
            })
    };
    r.map_err(|e| device_error("configuring the memory pool", e))
}

impl Device {
    pub fn new(ctx: Arc<CudaContext>) -> Result<Device, BackendError> {
        let stream = ctx.default_stream();
        let k = Kernels::load(&ctx).map_err(|e| {
            device_error(
                "could not load sluice's kernels (is the driver older than 550?)",
                e,
            )
        })?;
        keep_pool_memory(&ctx)?;
        let profile = std::env::var_os("SLUICE_CUDA_PROFILE").map(|_| Mutex::new(Vec::new()));
        let cache = Arc::new(BufCache {
            stream: stream.clone(),
            free: Mutex::new(HashMap::new()),
        });
        Ok(Device {
            ctx,
            stream,
            cache,
            k,
            error: Mutex::new(None),
            profile,
        })
    }

    fn record(&self, e: BackendError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
    }

    fn failed(&self) -> bool {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn take_error(&self) -> Option<BackendError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn peek_error(&self) -> Option<BackendError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| device_error("binding the context", e))
    }

    pub fn memory(&self) -> MemoryInfo {
        match self.bind().ok().and(self.ctx.mem_get_info().ok()) {
            Some((free, total)) => MemoryInfo {
                free: free as u64,
                total: total as u64,
            },
            None => MemoryInfo { free: 0, total: 1 },
        }
    }

    pub fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf, BackendError> {
        let class = size_class(bytes);
        let cached = self
            .cache
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&class)
            .and_then(Vec::pop);
        let buf = |ptr| DevBuf {
            ptr,
            bytes,
            cache: self.cache.clone(),
        };
        if let Some(ptr) = cached {
            return Ok(buf(ptr));
        }
        self.bind()?;
        // SAFETY: an allocation on our stream; the pointer is owned by the returned DevBuf.
        let fresh = || unsafe { result::malloc_async(self.stream.cu_stream(), class) };
        match fresh().or_else(|_| {
            // Cached buffers of other sizes may be what is missing.
            self.cache.release();
            fresh()
        }) {
            Ok(ptr) => Ok(buf(ptr)),
            Err(e) => {
                let free = self.memory().free;
                Err(BackendError::OutOfMemory {
                    memory: "device",
                    what: what.to_string(),
                    needed: bytes as u64,
                    free,
                    hint: format!(
                        "use a smaller model or context, or run on the CPU with --device cpu ({e})"
                    ),
                })
            }
        }
    }

    /// An allocation, or `None` after recording why not.
    fn alloc_or_record(&self, bytes: usize, what: &str) -> Option<DevBuf> {
        self.alloc(bytes, what).map_err(|e| self.record(e)).ok()
    }

    pub fn upload<T: Copy>(&self, data: &[T], what: &str) -> Result<DevBuf, BackendError> {
        // Every driver call binds the context first: the caller may be a thread (a thread pool's,
        // the server's) that has not bound it yet, and a cached allocation calls no driver.
        self.bind()?;
        let buf = self.alloc(size_of_val(data), what)?;
        if !data.is_empty() {
            // SAFETY: `buf` holds `size_of_val(data)` bytes; a copy from pageable memory returns
            // once the source has been read, so `data` may go away after the call.
            unsafe { result::memcpy_htod_async(buf.ptr, data, self.stream.cu_stream()) }
                .map_err(|e| device_error("copying to the device", e))?;
        }
        Ok(buf)
    }

    pub fn download<T: Copy + Default>(
        &self,
        buf: &DevBuf,
        len: usize,
    ) -> Result<Vec<T>, BackendError> {
        if let Some(e) = self.peek_error() {
            return Err(e);
        }
        assert!(len * size_of::<T>() <= buf.bytes);
        self.bind()?;
        let mut out = vec![T::default(); len];
        // SAFETY: `out` has room for `len` values, `buf` holds at least as many bytes; the stream is
        // synchronised before `out` is read.
        unsafe { result::memcpy_dtoh_async(&mut out, buf.ptr, self.stream.cu_stream()) }
            .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok(out)
    }

    pub fn sync(&self) -> Result<(), BackendError> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronising", e))
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        if let Err(e) = self.bind() {
            return self.record(e);
        }
        // SAFETY: callers pass ranges inside live allocations of this backend.
        let r = unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) };
        if let Err(e) = r {
            self.record(device_error("copying on the device", e));
        }
    }

    fn zero(&self, buf: &DevBuf) {
        if let Err(e) = self.bind() {
            return self.record(e);
        }
        // SAFETY: the whole allocation is written.
        let r = unsafe { result::memset_d8_async(buf.ptr, 0, buf.bytes, self.stream.cu_stream()) };
        if let Err(e) = r {
            self.record(device_error("clearing memory", e));
        }
    }

    fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) {
        if let Err(e) = self.bind() {
            return self.record(e);
        }
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(v) => v as *const u64 as *mut c_void,
                Arg::I32(v) => v as *const i32 as *mut c_void,
                Arg::I64(v) => v as *const i64 as *mut c_void,
                Arg::F32(v) => v as *const f32 as *mut c_void,
                Arg::Mat(v) => v as *const Mat as *mut c_void,
            })
            .collect();
        let events = self.profile.as_ref().and_then(|_| {
            let e = || {
                self.ctx
                    .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .ok()
            };
            let (start, end) = (e()?, e()?);
            start.record(&self.stream).ok()?;
            Some((start, end))
        });
        // SAFETY: `params` points into `args`, which outlives the call; each kernel's parameter
        // list matches the `Arg`s its wrapper passes (kernels/sluice.cu), and every pointer
        // argument is a live allocation of the sizes the kernel reads and writes.
        let r = unsafe {
            result::launch_kernel(
                f.cu_function(),
                grid,
                block,
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        };
        if let Err(e) = r {
            self.record(device_error("launching a kernel", e));
        }
        if let (Some(log), Some((start, end))) = (&self.profile, events) {
            if end.record(&self.stream).is_ok() {
                let name = format!("{:?}", f.cu_function());
                log.lock().unwrap_or_else(|p| p.into_inner()).push((
                    self.k.name_of(&name),
                    start,
                    end,
                ));
            }
        }
    }

    /// The per-kernel GPU time of every launch so far (`SLUICE_CUDA_PROFILE`), busiest first.
    pub fn profile_report(&self) -> Option<String> {
        let log = self.profile.as_ref()?;
        let log = std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()));
        self.sync().ok()?;
        let mut per: HashMap<String, (f64, usize)> = HashMap::new();
        for (name, start, end) in &log {
            let ms = start.elapsed_ms(end).unwrap_or(0.0) as f64;
            let e = per.entry(name.clone()).or_default();
            e.0 += ms;
            e.1 += 1;
        }
        let total: f64 = per.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = per.into_iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut out = format!(
            "CUDA kernel time, {} launches, {total:.2} ms on the GPU:\n",
            log.len()
        );
        for (name, (ms, n)) in rows {
            out += &format!(
                "  {name:20} {ms:9.3} ms {:5.1}%  {n:7} launches  {:7.2} us each\n",
                ms / total.max(1e-9) * 100.0,
                ms * 1e3 / n as f64
            );
        }
        Some(out)
    }
}

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
    table: DevBuf,
    inter: usize,
    kinds: (usize, usize),
    _parts: Vec<DevBuf>,
}

/// A streamed expert uploaded for one call.
pub struct CudaStagedExpert {
    mats: ExpertMats,
    _parts: Vec<DevBuf>,
}

/// The expert choice, on the device: `ids` and `weights` `[rows, k]`.
pub struct CudaRouting {
    ids: Option<DevBuf>,
    weights: Option<DevBuf>,
    rows: usize,
    k: usize,
}

/// Keys and values of one attention layer, `[capacity, kv_heads * head_dim]` f32 each; grown by
/// doubling.
pub struct CudaKvCache {
    keys: Option<DevBuf>,
    values: Option<DevBuf>,
    len: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    device: Arc<Device>,
}

impl Clone for CudaKvCache {
    fn clone(&self) -> Self {
        let width = self.kv_heads * self.head_dim * 4;
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
    /// Rotary frequencies per (theta bits, rotary dims), computed on the host.
    inv_freq: Mutex<HashMap<(u32, usize), Arc<DevBuf>>>,
}

/// Limits of the kernels (checked where the shapes are first known).
const MAX_HEAD_DIM: usize = 256;
const MAX_ROUTED_EXPERTS: usize = 1024;
/// `MOE_MAX_K` in the kernels.
const MAX_EXPERTS_PER_TOKEN: usize = 16;
const MAX_CONV_KERNEL: usize = 8;

impl CudaBackend {
    pub(crate) fn with_device(d: Device, description: String) -> Self {
        CudaBackend {
            d: Arc::new(d),
            description,
            inv_freq: Mutex::new(HashMap::new()),
        }
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

    /// `theta^(-2i/d)` for `i < d/2`, in f32 exactly as the CPU backend computes it.
    fn rotary_frequencies(&self, theta: f32, rotary_dim: usize) -> Option<Arc<DevBuf>> {
        let mut cache = self.inv_freq.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = cache.get(&(theta.to_bits(), rotary_dim)) {
            return Some(b.clone());
        }
        let freq: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        let buf = Arc::new(
            self.d
                .upload(&freq, "rotary frequencies")
                .map_err(|e| self.d.record(e))
                .ok()?,
        );
        cache.insert((theta.to_bits(), rotary_dim), buf.clone());
        Some(buf)
    }

    fn vec_ptr(&self, v: &CudaVector) -> u64 {
        v.buf.ptr
    }

    /// `out[tokens, w.rows] = x W^T` into `out`.
    fn matmul_into(&self, x: u64, tokens: usize, w: &Mat, out: u64) {
        let k = &self.d.k;
        if tokens == 1 && w.rows >= 8192 {
            self.d.launch(
                &k.gemv_r2[w.kind()],
                (grid(w.rows as usize, 16), 1, 1),
                (256, 1, 1),
                &[Arg::Mat(*w), Arg::Ptr(x), Arg::Ptr(out)],
            );
        } else if tokens <= 8 {
            self.d.launch(
                &k.gemv_b[w.kind()][tokens - 1],
                (w.rows as u32, 1, 1),
                (128, 1, 1),
                &[Arg::Mat(*w), Arg::Ptr(x), Arg::Ptr(out)],
            );
        } else {
            self.d.launch(
                &k.gemm,
                (grid(w.rows as usize, 64), grid(tokens, 64), 1),
                (256, 1, 1),
                &[
                    Arg::Mat(*w),
                    Arg::Ptr(x),
                    Arg::Ptr(out),
                    Arg::I32(tokens as i32),
                ],
            );
        }
    }

    fn elementwise(&self, f: &CudaFunction, n: usize, args: &[Arg]) {
        self.d.launch(f, (grid(n, 256), 1, 1), (256, 1, 1), args);
    }

    /// Runs the MoE kernels over the routed pairs whose expert is described in `table` (all
    /// experts when `present` is `None`, else the ascending ids in `present`), adding into `out`.
    #[allow(clippy::too_many_arguments)]
    fn moe_into(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        table: u64,
        present: Option<(&DevBuf, usize)>,
        inter: usize,
        kinds: (usize, usize),
        out: &CudaAct,
    ) {
        let (Some(xp), Some(op), Some(ids), Some(weights)) =
            (x.ptr(), out.ptr(), &routing.ids, &routing.weights)
        else {
            return;
        };
        let pairs = routing.rows * routing.k;
        let Some(h) = self.d.alloc_or_record(pairs * inter * 4, "MoE activations") else {
            return;
        };
        let (present_ptr, n_present) = match present {
            Some((b, n)) => (b.ptr, n as i32),
            None => (0, -1),
        };
        let k = &self.d.k;
        // Measured on an H100 (Qwen3-30B-A3B shape): a block per output row wins for the down
        // projections of a few tokens (27 us vs 32 per layer), a warp per two rows for gate/up
        // (25 vs 37) and for batches.
        let (down, down_grid, down_threads) = if routing.rows <= 8 {
            (
                &k.moe_down_b[kinds.1],
                (x.cols as u32, routing.rows as u32, 1),
                128,
            )
        } else {
            (
                &k.moe_down[kinds.1],
                (grid(x.cols, 8), routing.rows as u32, 1),
                256,
            )
        };
        self.d.launch(
            &k.moe_gate_up[kinds.0],
            (grid(inter, 16), pairs as u32, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(table),
                Arg::Ptr(present_ptr),
                Arg::I32(n_present),
                Arg::Ptr(ids.ptr),
                Arg::I32(routing.k as i32),
                Arg::Ptr(xp),
                Arg::Ptr(h.ptr),
            ],
        );
        self.d.launch(
            down,
            down_grid,
            (down_threads, 1, 1),
            &[
                Arg::Ptr(table),
                Arg::Ptr(present_ptr),
                Arg::I32(n_present),
                Arg::Ptr(ids.ptr),
                Arg::Ptr(weights.ptr),
                Arg::I32(routing.k as i32),
                Arg::Ptr(h.ptr),
                Arg::Ptr(op),
                Arg::I32(x.cols as i32),
            ],
        );
    }

    fn ensure_capacity(&self, cache: &mut CudaKvCache, needed: usize) -> bool {
        if needed <= cache.capacity && cache.keys.is_some() {
            return true;
        }
        let capacity = needed.max(cache.capacity * 2).max(256);
        let width = cache.kv_heads * cache.head_dim * 4;
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
        if let Some(report) = self.d.profile_report() {
            eprint!("{report}");
        }
    }
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

    fn synchronize(&self) -> Result<(), BackendError> {
        let synced = self.d.sync();
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
        let inter = experts.first().map_or(0, |e| e.gate.rows);
        let kinds = table.first().map_or((0, 0), ExpertMats::kinds);
        Ok(CudaExperts {
            table: self.d.upload(&table, "the expert table")?,
            inter,
            kinds,
            _parts: parts,
        })
    }

    fn stage_expert(
        &self,
        _key: ExpertKey,
        host: HostExpert,
    ) -> Result<CudaStagedExpert, BackendError> {
        let mut parts = Vec::new();
        let mats = ExpertMats {
            gate: self.upload_matrix(&host.gate, &mut parts)?,
            up: self.upload_matrix(&host.up, &mut parts)?,
            down: self.upload_matrix(&host.down, &mut parts)?,
        };
        Ok(CudaStagedExpert {
            mats,
            _parts: parts,
        })
    }

    fn kv_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        _capacity: usize,
    ) -> Result<CudaKvCache, BackendError> {
        if head_dim > MAX_HEAD_DIM {
            return Err(BackendError::Unsupported(format!(
                "attention heads of {head_dim}: the CUDA kernels take at most {MAX_HEAD_DIM}"
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
            device: self.d.clone(),
        })
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

    fn embed(&self, table: &CudaWeight, tokens: &[u32]) -> CudaAct {
        let out = self.act(tokens.len(), table.mat.cols as usize);
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

    fn rope(
        &self,
        x: &mut CudaAct,
        head_dim: usize,
        rotary_dim: usize,
        theta: f32,
        first_position: usize,
    ) {
        assert!(rotary_dim <= head_dim && rotary_dim.is_multiple_of(2));
        assert!(x.cols.is_multiple_of(head_dim));
        let n = x.rows * (x.cols / head_dim) * (rotary_dim / 2);
        let Some(freq) = self.rotary_frequencies(theta, rotary_dim) else {
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

    fn attention(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        cache: &mut CudaKvCache,
        heads: usize,
        scale: f32,
    ) -> CudaAct {
        let (hd, kvh) = (cache.head_dim, cache.kv_heads);
        assert_eq!((k.cols, v.cols, q.cols), (kvh * hd, kvh * hd, heads * hd));
        assert!(heads.is_multiple_of(kvh));
        let rows = q.rows;
        let out = self.act(rows, q.cols);
        let width = kvh * hd * 4;
        let total = cache.len + rows;
        if !self.ensure_capacity(cache, total) {
            return self.poisoned(rows, q.cols);
        }
        let (Some(keys), Some(values)) = (&cache.keys, &cache.values) else {
            return self.poisoned(rows, q.cols);
        };
        if let (Some(kp), Some(vp)) = (k.ptr(), v.ptr()) {
            let at = (cache.len * width) as u64;
            self.d.copy(keys.ptr + at, kp, rows * width);
            self.d.copy(values.ptr + at, vp, rows * width);
        }
        cache.len = total;
        if let (Some(qp), Some(o)) = (q.ptr(), out.ptr()) {
            self.d.launch(
                &self.d.k.attention,
                (heads as u32, rows as u32, 1),
                (128, 1, 1),
                &[
                    Arg::Ptr(qp),
                    Arg::Ptr(keys.ptr),
                    Arg::Ptr(values.ptr),
                    Arg::Ptr(o),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(total as i32),
                    Arg::I32(rows as i32),
                    Arg::F32(scale),
                ],
            );
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

    fn read_routing(&self, routing: &CudaRouting) -> Result<HostRouting, BackendError> {
        let n = routing.rows * routing.k;
        let (Some(ids), Some(w)) = (&routing.ids, &routing.weights) else {
            return Err(self.d.peek_error().unwrap_or_else(|| {
                BackendError::Device("routing lost to an earlier failure".into())
            }));
        };
        Ok(HostRouting {
            k: routing.k,
            experts: self.d.download(ids, n)?,
            weights: self.d.download(w, n)?,
        })
    }

    fn moe(&self, x: &CudaAct, routing: &CudaRouting, experts: &CudaExperts) -> CudaAct {
        let out = self.zeros(x.rows, x.cols);
        self.moe_into(
            x,
            routing,
            experts.table.ptr,
            None,
            experts.inter,
            experts.kinds,
            &out,
        );
        out
    }

    fn moe_accumulate(
        &self,
        x: &CudaAct,
        routing: &CudaRouting,
        experts: &[(u32, &CudaStagedExpert)],
        out: &mut CudaAct,
    ) {
        assert!(
            experts.windows(2).all(|w| w[0].0 < w[1].0),
            "ascending expert ids"
        );
        let Some(first) = experts.first() else {
            return;
        };
        let ids: Vec<u32> = experts.iter().map(|e| e.0).collect();
        let mats: Vec<ExpertMats> = experts.iter().map(|e| e.1.mats).collect();
        let (table, present) = match (
            self.d.upload(&mats, "the expert table"),
            self.d.upload(&ids, "expert ids"),
        ) {
            (Ok(t), Ok(p)) => (t, p),
            (Err(e), _) | (_, Err(e)) => {
                self.d.record(e);
                out.buf = None;
                return;
            }
        };
        let inter = first.1.mats.gate.rows as usize;
        let kinds = first.1.mats.kinds();
        self.moe_into(
            x,
            routing,
            table.ptr,
            Some((&present, ids.len())),
            inter,
            kinds,
            out,
        );
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
            self.elementwise(
                &self.d.k.causal_conv1d_silu,
                c,
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
        if let (Some(qp), Some(ap), Some(bp), Some(o), Some(rec)) =
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
                ],
            );
        }
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
