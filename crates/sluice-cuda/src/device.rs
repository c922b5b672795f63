//! The device layer under the backend: the context and its one stream, the kernels, device
//! memory (a caching allocator over the stream-ordered pool), launches (deferred and replayed as
//! CUDA graphs, see [`crate::graph`]), the sticky first error, and the optional per-kernel
//! profile.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
use sluice_backend::{BackendError, MemoryInfo};

use crate::graph::{Flushed, Graphs, Launch};
use crate::kernels::Kernels;
use crate::mat::{Ffn, KvRows, Mat, MatSet, SharedExpert};

/// Freed device memory kept for reuse, by size. Everything runs on one stream, so a buffer
/// dropped on the host may be handed to the next allocation at once: the kernels that used it
/// come earlier in the stream than any that will. The lowest free address of a size is handed
/// out first, so that steps which allocate alike get the same buffers (last-in-first-out made
/// them wander from step to step, and a replayed graph then updates most of its nodes).
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
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    cache: Arc<BufCache>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let mut free = self.cache.free.lock().unwrap_or_else(|p| p.into_inner());
        // Kept in descending order, so that `pop` gives the lowest address.
        let list = free.entry(size_class(self.bytes)).or_default();
        let at = list.partition_point(|&p| p > self.ptr);
        list.insert(at, self.ptr);
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
#[derive(Clone, Debug)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    Mat(Mat),
    /// Up to eight token ids by value (`struct TokenIds`).
    Ids([u32; 8]),
    /// Boxed: it is large, and most arguments are not.
    MatSet(Box<MatSet>),
    /// Boxed likewise (`struct KvRows`).
    KvRows(Box<KvRows>),
    /// How routed experts compute (`struct Ffn`).
    Ffn(Ffn),
    /// A shared expert fused into the routed experts' kernels (`struct SharedExpert`).
    Shared(Box<SharedExpert>),
}

impl PartialEq for Arg {
    /// Bitwise: a graph node's parameters need updating exactly when their bytes differ.
    fn eq(&self, other: &Arg) -> bool {
        match (self, other) {
            (Arg::Ptr(a), Arg::Ptr(b)) => a == b,
            (Arg::I32(a), Arg::I32(b)) => a == b,
            (Arg::I64(a), Arg::I64(b)) => a == b,
            (Arg::F32(a), Arg::F32(b)) => a.to_bits() == b.to_bits(),
            (Arg::Mat(a), Arg::Mat(b)) => a == b,
            (Arg::Ids(a), Arg::Ids(b)) => a == b,
            (Arg::MatSet(a), Arg::MatSet(b)) => a == b,
            (Arg::KvRows(a), Arg::KvRows(b)) => a == b,
            (Arg::Ffn(a), Arg::Ffn(b)) => a == b,
            (Arg::Shared(a), Arg::Shared(b)) => a == b,
            _ => false,
        }
    }
}

impl Arg {
    /// The pointer the driver reads this argument's value through.
    pub(crate) fn as_param(&self) -> *mut c_void {
        match self {
            Arg::Ptr(v) => v as *const u64 as *mut c_void,
            Arg::I32(v) => v as *const i32 as *mut c_void,
            Arg::I64(v) => v as *const i64 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
            Arg::Mat(v) => v as *const Mat as *mut c_void,
            Arg::Ids(v) => v as *const [u32; 8] as *mut c_void,
            Arg::MatSet(v) => &**v as *const MatSet as *mut c_void,
            Arg::KvRows(v) => &**v as *const KvRows as *mut c_void,
            Arg::Ffn(v) => v as *const Ffn as *mut c_void,
            Arg::Shared(v) => &**v as *const SharedExpert as *mut c_void,
        }
    }
}

pub(crate) fn grid(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

/// The context, stream and kernels, and the first failure not yet reported.
pub(crate) struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cache: Arc<BufCache>,
    pub(crate) k: Kernels,
    /// Streaming multiprocessors: how many blocks fill the GPU.
    pub(crate) multiprocessors: usize,
    error: Mutex<Option<BackendError>>,
    /// `SLUICE_CUDA_PROFILE=1`: every launch between two events, summed per kernel at the end.
    profile: Option<Mutex<Vec<(String, CudaEvent, CudaEvent)>>>,
    /// Launches deferred and replayed as graphs; `None` (launch at once) when profiling or with
    /// `SLUICE_CUDA_GRAPHS=0`.
    graphs: Option<Mutex<Graphs>>,
    /// `SLUICE_CUDA_GRAPHS=stats`: how flushes ran, with host and GPU time.
    graph_stats: Option<Mutex<GraphStats>>,
    /// `SLUICE_CUDA_TWICE=NAME,...`: kernels whose name starts with one of these are recorded
    /// twice into the replayed graphs (for timing: a step's time grows by such a kernel's share of
    /// the chain; results are wrong where the kernel accumulates or rescales in place). No effect
    /// without graphs.
    twice: Vec<String>,
    /// Completed synchronisations of the stream: work issued before the `n`-th has finished
    /// once this exceeds `n - 1` (host memory lent to an asynchronous copy may then go back).
    syncs: AtomicU64,
    /// A second stream for copies that run beside the compute (the VRAM tier's placements of
    /// experts read in place), made on first use. Nothing orders it with the compute stream
    /// but events.
    copy_lane: OnceLock<Arc<CudaStream>>,
}

/// The stream a copy runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// After every launch so far, before every later one.
    Compute,
    /// Beside the compute stream (see `Device::copy_lane`).
    Copy,
}

/// Per kind of flush: count, host seconds, and the GPU time of each (events read at the end).
#[derive(Default)]
struct GraphStats {
    per: HashMap<&'static str, (u64, f64)>,
    /// Nodes updated by replays, per kernel name.
    updated: HashMap<String, u64>,
    gpu: Vec<(&'static str, CudaEvent, CudaEvent)>,
}

/// Flushes whose GPU time is kept for the report.
const MAX_TIMED_FLUSHES: usize = 100_000;

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
        // Hopper and newer start a graph's next kernel before the previous one ends (see
        // PDL_WAIT in the kernels); SLUICE_CUDA_PDL=0 turns it off.
        let programmatic = ctx.compute_capability().is_ok_and(|(major, _)| major >= 9)
            && !std::env::var("SLUICE_CUDA_PDL").is_ok_and(|v| v == "0");
        let k = Kernels::load(&ctx, programmatic).map_err(|e| {
            device_error(
                "could not load sluice's kernels (is the driver older than 550?)",
                e,
            )
        })?;
        keep_pool_memory(&ctx)?;
        let multiprocessors = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| device_error("reading the multiprocessor count", e))?
            .max(1) as usize;
        let profile = std::env::var_os("SLUICE_CUDA_PROFILE").map(|_| Mutex::new(Vec::new()));
        let graphs_off = std::env::var("SLUICE_CUDA_GRAPHS").is_ok_and(|v| v == "0");
        let graphs =
            (profile.is_none() && !graphs_off).then(|| Mutex::new(Graphs::new(programmatic)));
        let graph_stats = (graphs.is_some()
            && std::env::var("SLUICE_CUDA_GRAPHS").is_ok_and(|v| v == "stats"))
        .then(|| Mutex::new(GraphStats::default()));
        let cache = Arc::new(BufCache {
            stream: stream.clone(),
            free: Mutex::new(HashMap::new()),
        });
        Ok(Device {
            ctx,
            stream,
            cache,
            k,
            multiprocessors,
            error: Mutex::new(None),
            profile,
            graphs,
            graph_stats,
            twice: std::env::var("SLUICE_CUDA_TWICE")
                .map(|v| {
                    v.split(',')
                        .filter(|n| !n.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            syncs: AtomicU64::new(0),
            copy_lane: OnceLock::new(),
        })
    }

    /// Issues every deferred launch (before the host reads, waits, or writes device memory that
    /// they may use).
    pub(crate) fn flush(&self) {
        let Some(graphs) = &self.graphs else {
            return;
        };
        let mut g = graphs.lock().unwrap_or_else(|p| p.into_inner());
        if !g.has_pending() {
            return;
        }
        if let Err(e) = self.bind() {
            return self.record(e);
        }
        let timing = self
            .graph_stats
            .as_ref()
            .map(|_| (std::time::Instant::now(), self.timing_event()));
        match g.flush(self.stream.cu_stream()) {
            Ok(how) => {
                if let (Some(stats), Some((start, event))) = (&self.graph_stats, timing) {
                    let name = match how {
                        Flushed::Issued => "issued launch by launch",
                        Flushed::Built => "built into a graph",
                        Flushed::Replayed => "replayed as a graph",
                    };
                    let mut stats = stats.lock().unwrap_or_else(|p| p.into_inner());
                    if how == Flushed::Replayed {
                        for f in &g.updated {
                            let kernel = self
                                .k
                                .name_of(&format!("{:?}", *f as cudarc::driver::sys::CUfunction));
                            *stats.updated.entry(kernel).or_default() += 1;
                        }
                    }
                    let e = stats.per.entry(name).or_default();
                    e.0 += 1;
                    e.1 += start.elapsed().as_secs_f64();
                    let end = self.timing_event();
                    if let (Some(a), Some(b)) = (event, end) {
                        if stats.gpu.len() < MAX_TIMED_FLUSHES {
                            stats.gpu.push((name, a, b));
                        }
                    }
                }
            }
            Err(e) => self.record(device_error("launching kernels", e)),
        }
    }

    /// `SLUICE_CUDA_GRAPHS=stats`: per kind of flush, how many, host and GPU time each.
    pub(crate) fn graph_report(&self) -> Option<String> {
        let stats = self.graph_stats.as_ref()?;
        let stats = std::mem::take(&mut *stats.lock().unwrap_or_else(|p| p.into_inner()));
        self.sync().ok()?;
        let mut gpu: HashMap<&str, f64> = HashMap::new();
        for (name, a, b) in &stats.gpu {
            *gpu.entry(name).or_default() += a.elapsed_ms(b).unwrap_or(0.0) as f64;
        }
        let mut out = String::from("CUDA launch batches:\n");
        let replays = stats
            .per
            .get("replayed as a graph")
            .map_or(0, |r| r.0)
            .max(1);
        let mut updated: Vec<_> = stats.updated.into_iter().collect();
        updated.sort_by_key(|u| std::cmp::Reverse(u.1));
        out += &format!(
            "  nodes updated per replay: {:.1} ({})\n",
            updated.iter().map(|u| u.1).sum::<u64>() as f64 / replays as f64,
            updated
                .iter()
                .map(|(k, n)| format!("{k} {:.1}", *n as f64 / replays as f64))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (name, (n, host)) in stats.per {
            out += &format!(
                "  {name:24} {n:7}  host {:8.3} ms each  GPU {:8.3} ms each\n",
                host * 1e3 / n as f64,
                gpu.get(name).copied().unwrap_or(0.0) / n as f64
            );
        }
        Some(out)
    }

    pub(crate) fn record(&self, e: BackendError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
    }

    pub(crate) fn failed(&self) -> bool {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    pub(crate) fn take_error(&self) -> Option<BackendError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    pub(crate) fn peek_error(&self) -> Option<BackendError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn bind(&self) -> Result<(), BackendError> {
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
            // Cached buffers of other sizes may be what is missing; deferred launches may still
            // use them.
            self.flush();
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
    pub(crate) fn alloc_or_record(&self, bytes: usize, what: &str) -> Option<DevBuf> {
        self.alloc(bytes, what).map_err(|e| self.record(e)).ok()
    }

    pub fn upload<T: Copy>(&self, data: &[T], what: &str) -> Result<DevBuf, BackendError> {
        // Every driver call binds the context first: the caller may be a thread (a thread pool's,
        // the server's) that has not bound it yet, and a cached allocation calls no driver.
        // The copy runs at once: deferred launches that use the memory it may land in go first.
        self.flush();
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
        self.flush();
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

    /// `len_a` values of `a` and `len_b` of `b`, read back with one synchronisation.
    pub fn download2<T: Copy + Default, U: Copy + Default>(
        &self,
        a: &DevBuf,
        len_a: usize,
        b: &DevBuf,
        len_b: usize,
    ) -> Result<(Vec<T>, Vec<U>), BackendError> {
        self.flush();
        if let Some(e) = self.peek_error() {
            return Err(e);
        }
        assert!(len_a * size_of::<T>() <= a.bytes && len_b * size_of::<U>() <= b.bytes);
        self.bind()?;
        let mut out_a = vec![T::default(); len_a];
        let mut out_b = vec![U::default(); len_b];
        // SAFETY: each output has room for its length, each buffer holds at least as many bytes;
        // the stream is synchronised before either output is read.
        unsafe {
            result::memcpy_dtoh_async(&mut out_a, a.ptr, self.stream.cu_stream())
                .and_then(|_| result::memcpy_dtoh_async(&mut out_b, b.ptr, self.stream.cu_stream()))
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok((out_a, out_b))
    }

    pub fn sync(&self) -> Result<(), BackendError> {
        self.flush();
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronising", e))?;
        self.syncs.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// [`Device::sync`], and waits for the copies beside the compute too (before host memory
    /// they may read goes back).
    pub(crate) fn sync_all(&self) -> Result<(), BackendError> {
        self.sync()?;
        if let Some(lane) = self.copy_lane.get() {
            lane.synchronize()
                .map_err(|e| device_error("synchronising the copy stream", e))?;
        }
        Ok(())
    }

    /// Returns every cached and pooled buffer no allocation holds to the driver, so that the
    /// driver's free memory counts only what is in use (before sizing the VRAM expert cache).
    pub(crate) fn trim(&self) -> Result<(), BackendError> {
        use cudarc::driver::sys;
        self.sync()?;
        self.cache.release();
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronising", e))?;
        let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: `pool` is written by the driver before it is read; trimming releases only
        // memory no allocation holds.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), self.ctx.cu_device())
                .result()
                .and_then(|_| sys::cuMemPoolTrimTo(pool.assume_init(), 0).result())
        }
        .map_err(|e| device_error("trimming the memory pool", e))
    }

    /// Synchronisations so far (see `syncs`).
    pub(crate) fn sync_count(&self) -> u64 {
        self.syncs.load(Ordering::Acquire)
    }

    /// Starts copying `src` to device memory at `dst` (room for it, owned by the caller), after
    /// every deferred launch (which may still read the old contents). The copy is asynchronous:
    /// from page-locked memory it may still be reading `src` after the call, so the caller keeps
    /// `src` alive and unchanged until the next [`Device::sync`].
    pub(crate) fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.flush();
        self.bind()?;
        // SAFETY: the caller owns `src.len()` bytes of device memory at `dst` and keeps `src`
        // alive until the stream has synchronised (see above).
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| device_error("copying to the device", e))
    }

    /// [`Device::copy_to_device`] on `lane`.
    pub(crate) fn copy_to_device_in(
        &self,
        lane: Lane,
        dst: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        match lane {
            Lane::Compute => self.copy_to_device(dst, src),
            Lane::Copy => self.copy_to_device_beside(dst, src),
        }
    }

    /// Starts copying `src` to device memory at `dst` on the copy lane, beside the compute
    /// stream: the caller orders it with the compute stream through events ([`Device::event`])
    /// and keeps `src` alive and unchanged until an event recorded after it has completed.
    pub(crate) fn copy_to_device_beside(&self, dst: u64, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let lane = self.lane(Lane::Copy)?;
        // SAFETY: the caller owns `src.len()` bytes of device memory at `dst` that no launch
        // uses until an event after this copy has completed, and keeps `src` alive until then.
        unsafe { result::memcpy_htod_async(dst, src, lane.cu_stream()) }
            .map_err(|e| device_error("copying to the device", e))
    }

    fn lane(&self, lane: Lane) -> Result<&Arc<CudaStream>, BackendError> {
        match lane {
            Lane::Compute => Ok(&self.stream),
            Lane::Copy => {
                if let Some(s) = self.copy_lane.get() {
                    return Ok(s);
                }
                let s = self
                    .ctx
                    .new_stream()
                    .map_err(|e| device_error("creating a copy stream", e))?;
                Ok(self.copy_lane.get_or_init(|| s))
            }
        }
    }

    /// A timing event recorded on `lane` after everything issued there so far (deferred
    /// launches included).
    pub(crate) fn event(&self, lane: Lane) -> Result<CudaEvent, BackendError> {
        if lane == Lane::Compute {
            self.flush();
        }
        self.bind()?;
        let stream = self.lane(lane)?;
        let e = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| device_error("creating an event", e))?;
        e.record(stream)
            .map_err(|e| device_error("recording an event", e))?;
        Ok(e)
    }

    /// An event recorded on the stream now (for timing work between two of them).
    pub(crate) fn timing_event(&self) -> Option<CudaEvent> {
        let e = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .ok()?;
        e.record(&self.stream).ok()?;
        Some(e)
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Copies `bytes` (a multiple of 4) between live allocations of this backend. A kernel, not
    /// a memcpy, so that it can be a node of a replayed graph whose pointers change.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        assert!(bytes.is_multiple_of(4), "copies are of whole 4-byte words");
        let words = bytes / 4;
        self.launch(
            &self.k.copy_words,
            (grid(words, 1024).min(4096), 1, 1),
            (256, 1, 1),
            &[Arg::Ptr(dst), Arg::Ptr(src), Arg::I64(words as i64)],
        );
    }

    /// Zeroes the whole of `buf` (its size a multiple of 4 bytes).
    pub(crate) fn zero(&self, buf: &DevBuf) {
        assert!(
            buf.bytes.is_multiple_of(4),
            "zeroed buffers hold 4-byte words"
        );
        let words = buf.bytes / 4;
        self.launch(
            &self.k.fill_words,
            (grid(words, 1024).min(4096), 1, 1),
            (256, 1, 1),
            &[Arg::Ptr(buf.ptr), Arg::I32(0), Arg::I64(words as i64)],
        );
    }

    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) {
        let launch = Launch {
            f: f.clone(),
            grid,
            block,
            args: args.to_vec(),
        };
        if let Some(graphs) = &self.graphs {
            let mut g = graphs.lock().unwrap_or_else(|p| p.into_inner());
            if !self.twice.is_empty() {
                let name = self.k.name_of(&format!("{:?}", f.cu_function()));
                if self.twice.iter().any(|t| name.starts_with(t.as_str())) {
                    g.record(launch.clone());
                }
            }
            g.record(launch);
            return;
        }
        if let Err(e) = self.bind() {
            return self.record(e);
        }
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
        if let Err(e) = launch.issue(self.stream.cu_stream()) {
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
