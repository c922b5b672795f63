//! The machine's limits that decode speed is bounded by: DRAM read bandwidth (dense weights and
//! cached experts) and raw disk read throughput (experts streamed from SSD).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde::Serialize;
use sluice_backend::Backend;

/// Default buffer for [`memory_read`]: 1 GiB, far larger than any cache.
pub const DEFAULT_MEMORY_BYTES: usize = 1 << 30;
/// Default random-read size for [`disk`]: about one expert's weights.
pub const DEFAULT_BLOCK: usize = 2 << 20;
/// Default queue depth of the deep random-read pattern.
pub const DEFAULT_QUEUE_DEPTH: usize = 8;
/// Default time budget per disk pattern, in seconds.
pub const DEFAULT_SECONDS: f64 = 2.0;
/// Request size of the sequential pattern.
pub const SEQUENTIAL_REQUEST: usize = 4 << 20;
/// Smallest file [`disk`] measures: smaller ones are served from caches too easily.
pub const MIN_DISK_FILE: u64 = 64 << 20;
/// Alignment of O_DIRECT offsets, lengths and buffers.
const ALIGN: usize = 4096;
/// Each pattern stops after this many bytes even when time is left.
const PATTERN_CAP: u64 = 8 << 30;

/// DRAM read bandwidth with `threads` threads.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    pub threads: usize,
    /// Best pass, in 10^9 bytes per second.
    pub gbps: f64,
    /// Bytes read per pass.
    pub bytes: usize,
}

/// Measures DRAM read bandwidth: a buffer of `bytes` (rounded down to a multiple of 64; at least
/// 64 KiB) is written first, then summed by a dedicated pool of `threads` threads (0: all
/// cores) with a loop the compiler vectorises; the best of five passes counts.
pub fn memory_read(threads: usize, bytes: usize) -> MemoryReport {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let words = (bytes.max(64 << 10) / 64) * 8;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("sluice-memread-{i}"))
        .build()
        .expect("building the memory-read thread pool");
    // Chunks of 512 KiB: enough work per task, and work stealing evens out the threads.
    const CHUNK: usize = 1 << 16;
    let mut buf: Vec<u64> = Vec::with_capacity(words);
    // Touch every page from the pool so that first-touch placement follows the readers.
    pool.install(|| {
        buf.spare_capacity_mut()[..words]
            .par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, w) in chunk.iter_mut().enumerate() {
                    w.write((c * CHUNK + i) as u64);
                }
            })
    });
    // SAFETY: the loop above initialised all `words` elements of the spare capacity.
    unsafe { buf.set_len(words) };

    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let s = pool.install(|| {
            buf.par_chunks(CHUNK)
                .map(sum_u64)
                .reduce(|| 0, u64::wrapping_add)
        });
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = words * 8;
    MemoryReport {
        threads,
        gbps: bytes as f64 / best.max(1e-9) / 1e9,
        bytes,
    }
}

/// Wrapping sum with eight independent accumulators, so that the loop is bound by loads rather
/// than by the add latency; the compiler turns it into vector adds.
fn sum_u64(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = c.chunks_exact(8);
    let tail = chunks.remainder();
    for ch in chunks {
        for j in 0..8 {
            acc[j] = acc[j].wrapping_add(ch[j]);
        }
    }
    let mut s = tail.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    for a in acc {
        s = s.wrapping_add(a);
    }
    s
}

/// What [`disk`] measures.
#[derive(Debug, Clone, Serialize)]
pub struct DiskOptions {
    /// The file to read; at least 64 MiB, ideally several GB (a model's largest shard).
    pub file: PathBuf,
    /// Random-read size (an expert block); rounded up to 4 KiB.
    pub block: usize,
    /// Requests in flight in the deep random pattern (that many threads doing `pread`).
    pub queue_depth: usize,
    /// Time budget per pattern, in seconds.
    pub seconds: f64,
}

impl DiskOptions {
    /// The defaults: 2 MiB blocks, queue depth 8, 2 s per pattern.
    pub fn new(file: impl Into<PathBuf>) -> Self {
        DiskOptions {
            file: file.into(),
            block: DEFAULT_BLOCK,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            seconds: DEFAULT_SECONDS,
        }
    }
}

/// One read pattern's result.
#[derive(Debug, Clone, Serialize)]
pub struct PatternReport {
    /// "sequential", "random" or similar.
    pub name: String,
    pub request_bytes: usize,
    pub queue_depth: usize,
    pub requests: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// 10^9 bytes per second.
    pub gbps: f64,
    /// Mean time one request took, in milliseconds.
    pub mean_latency_ms: f64,
}

/// Raw read throughput of a file.
#[derive(Debug, Clone, Serialize)]
pub struct DiskReport {
    pub file: PathBuf,
    pub file_bytes: u64,
    /// Whether reads bypassed the page cache (O_DIRECT). When false, reads were buffered and the
    /// file's cached pages were dropped before each pattern, which the kernel may not fully do.
    pub direct: bool,
    /// Sequential reads of 4 MiB at queue depth 1.
    pub sequential: PatternReport,
    /// Random reads of one block at queue depth 1.
    pub random_qd1: PatternReport,
    /// Random reads of one block at the asked queue depth.
    pub random_qdn: PatternReport,
    /// Anything that makes the figures less than clean: buffered fallback, overlapping regions.
    pub notes: Vec<String>,
}

/// The largest `*.safetensors` file in a model directory, or a model given as one file (a
/// GGUF): the natural file for [`disk`].
pub fn default_disk_file(model_dir: &Path) -> Result<PathBuf> {
    if model_dir.is_file() {
        return Ok(model_dir.to_path_buf());
    }
    let entries = std::fs::read_dir(model_dir)
        .with_context(|| format!("reading model directory {}", model_dir.display()))?;
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.with_context(|| format!("reading {}", model_dir.display()))?;
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let meta = std::fs::metadata(&path)
            .with_context(|| format!("reading metadata of {}", path.display()))?;
        if meta.is_file() && best.as_ref().is_none_or(|(len, _)| meta.len() > *len) {
            best = Some((meta.len(), path));
        }
    }
    match best {
        Some((_, path)) => Ok(path),
        None => bail!("no *.safetensors file in {}", model_dir.display()),
    }
}

/// Measures raw read throughput of `opts.file`: sequential 4 MiB reads at queue depth 1, then
/// random `block` reads at distinct 4 KiB-aligned offsets at queue depth 1 and `queue_depth`.
/// Each pattern reads its own third of the file (when the file is large enough) so that one
/// does not hit what a cache below the page cache kept from another, runs for `seconds` or
/// until its region is read, and never reads a block twice. Reads use O_DIRECT where the
/// filesystem allows it, and buffered reads after dropping the file's cached pages otherwise.
#[cfg(unix)]
pub fn disk(opts: &DiskOptions) -> Result<DiskReport> {
    use std::os::unix::fs::FileExt;

    let path = &opts.file;
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("disk benchmark file {} does not exist", path.display())
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if !meta.is_file() {
        bail!(
            "disk benchmark file {} is not a regular file",
            path.display()
        );
    }
    let file_bytes = meta.len();
    if file_bytes < MIN_DISK_FILE {
        bail!(
            "{} is {}: too small to measure, pass a larger --file (at least {})",
            path.display(),
            sluice_sys::format_bytes_binary(file_bytes),
            sluice_sys::format_bytes_binary(MIN_DISK_FILE)
        );
    }
    if !(opts.seconds.is_finite() && opts.seconds > 0.0) {
        bail!(
            "disk benchmark time budget must be positive, got {}",
            opts.seconds
        );
    }
    let block = opts.block.max(1).next_multiple_of(ALIGN);
    let queue_depth = opts.queue_depth.max(1);
    let budget = Duration::from_secs_f64(opts.seconds);
    let mut notes = Vec::new();

    let (file, direct) = open_for_reading(path, &mut notes)?;

    // Three regions, one per pattern, each whole blocks of both sizes.
    let unit = block.max(SEQUENTIAL_REQUEST) as u64;
    let third = (file_bytes / 3) / unit * unit;
    let regions: [(u64, u64); 3] = if third >= unit {
        [
            (0, third),
            (third, third),
            (2 * third, file_bytes - 2 * third),
        ]
    } else {
        notes.push(format!(
            "file too small for a separate region per pattern at {} blocks: patterns overlap, \
             so later ones may read from caches",
            sluice_sys::format_bytes_binary(block as u64)
        ));
        [(0, file_bytes); 3]
    };

    let read_full = |buf: &mut [u8], offset: u64| -> std::io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            // O_DIRECT needs aligned lengths and offsets: a short read means end of file.
            if direct && !done.is_multiple_of(ALIGN) {
                break;
            }
        }
        Ok(done)
    };

    // Sequential.
    drop_cache(&file, direct);
    let (start, len) = regions[0];
    let sequential = {
        let mut buf = AlignedBuf::new(SEQUENTIAL_REQUEST);
        let end = start + len.min(PATTERN_CAP);
        let mut offset = start;
        let mut requests = 0u64;
        let mut bytes = 0u64;
        let mut busy = Duration::ZERO;
        let t0 = Instant::now();
        while offset < end && (requests == 0 || t0.elapsed() < budget) {
            let n = (SEQUENTIAL_REQUEST as u64).min(end - offset) as usize;
            let n = n.next_multiple_of(ALIGN).min(SEQUENTIAL_REQUEST);
            let t = Instant::now();
            let got = read_full(&mut buf.as_mut_slice()[..n], offset)
                .with_context(|| format!("reading {} at {offset}", path.display()))?;
            busy += t.elapsed();
            if got == 0 {
                break;
            }
            requests += 1;
            bytes += got as u64;
            offset += got as u64;
        }
        pattern(
            "sequential",
            SEQUENTIAL_REQUEST,
            1,
            requests,
            bytes,
            t0.elapsed(),
            busy,
        )
    };

    let random = |name: &str, depth: usize, (start, len): (u64, u64)| -> Result<PatternReport> {
        drop_cache(&file, direct);
        let blocks = (len.min(PATTERN_CAP) / block as u64).max(1);
        let order = shuffled(blocks, 0x5eed ^ start ^ depth as u64);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let t0 = Instant::now();
        let per_thread: Vec<Result<(u64, u64, Duration)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..depth)
                .map(|_| {
                    s.spawn(|| -> Result<(u64, u64, Duration)> {
                        let mut buf = AlignedBuf::new(block);
                        let (mut requests, mut bytes, mut busy) = (0u64, 0u64, Duration::ZERO);
                        loop {
                            // The first request always runs, so that every pattern measures something.
                            if requests > 0 && t0.elapsed() >= budget {
                                break;
                            }
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(&b) = order.get(i) else { break };
                            let offset = start + b * block as u64;
                            let t = Instant::now();
                            let got = read_full(buf.as_mut_slice(), offset).with_context(|| {
                                format!("reading {} at {offset}", path.display())
                            })?;
                            busy += t.elapsed();
                            requests += 1;
                            bytes += got as u64;
                        }
                        Ok((requests, bytes, busy))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("disk reader thread panicked"))
                .collect()
        });
        let elapsed = t0.elapsed();
        let (mut requests, mut bytes, mut busy) = (0u64, 0u64, Duration::ZERO);
        for r in per_thread {
            let (q, b, t) = r?;
            requests += q;
            bytes += b;
            busy += t;
        }
        Ok(pattern(name, block, depth, requests, bytes, elapsed, busy))
    };
    let random_qd1 = random("random", 1, regions[1])?;
    let random_qdn = random("random", queue_depth, regions[2])?;
    // Random reads of a few MiB cannot beat sequential ones on the same device at queue depth 1.
    if random_qd1.gbps > 1.5 * sequential.gbps {
        notes.push(format!(
            "random reads at queue depth 1 ({:.2} GB/s) beat sequential ones ({:.2} GB/s): a \
             cache below this system (a virtual disk's host) likely served them, so treat the \
             random figures as upper bounds",
            random_qd1.gbps, sequential.gbps
        ));
    }

    Ok(DiskReport {
        file: path.clone(),
        file_bytes,
        direct,
        sequential,
        random_qd1,
        random_qdn,
        notes,
    })
}

#[cfg(not(unix))]
pub fn disk(opts: &DiskOptions) -> Result<DiskReport> {
    bail!(
        "the disk benchmark needs a Unix system (pread); cannot measure {}",
        opts.file.display()
    )
}

fn pattern(
    name: &str,
    request_bytes: usize,
    queue_depth: usize,
    requests: u64,
    bytes: u64,
    elapsed: Duration,
    busy: Duration,
) -> PatternReport {
    let seconds = elapsed.as_secs_f64();
    PatternReport {
        name: name.to_string(),
        request_bytes,
        queue_depth,
        requests,
        bytes,
        seconds,
        gbps: bytes as f64 / seconds.max(1e-9) / 1e9,
        mean_latency_ms: busy.as_secs_f64() * 1e3 / requests.max(1) as f64,
    }
}

/// Opens `path` with O_DIRECT where the filesystem allows it (checked with one aligned read),
/// buffered otherwise. Returns the file and whether it is direct.
#[cfg(unix)]
fn open_for_reading(path: &Path, notes: &mut Vec<String>) -> Result<(std::fs::File, bool)> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => {
                let mut probe = AlignedBuf::new(ALIGN);
                match f.read_at(probe.as_mut_slice(), 0) {
                    Ok(_) => return Ok((f, true)),
                    Err(e) => notes.push(format!(
                        "O_DIRECT reads failed ({e}): buffered reads, with the file's cached \
                         pages dropped before each pattern"
                    )),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => notes.push(
                "the filesystem rejects O_DIRECT: buffered reads, with the file's cached pages \
                 dropped before each pattern"
                    .to_string(),
            ),
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        }
    }
    #[cfg(not(target_os = "linux"))]
    notes.push("no O_DIRECT on this system: buffered reads, page cache not dropped".to_string());
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok((f, false))
}

/// Asks the kernel to drop the file's cached pages (buffered reads only).
fn drop_cache(file: &std::fs::File, direct: bool) {
    if direct {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is open for the duration of the call; posix_fadvise only
        // reads its arguments. Failure merely leaves pages cached.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// `0..n` in a random order (xorshift-driven Fisher-Yates; deterministic per seed).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// A zeroed heap buffer aligned to 4096 bytes, as O_DIRECT needs.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(1), ALIGN)
            .expect("buffer size overflows when aligned");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `layout.size()` initialised (zeroed) bytes owned by `self`,
        // and the `&mut self` borrow makes this the only reference to them.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this same layout and is freed only here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The memory bandwidth of a device backend: a device-to-device copy of `bytes` of activations
/// (rows copied by [`Backend::slice_rows`]), bytes read plus bytes written per second, best of
/// five after a warm-up. For a GPU this is the limit its decode is held against.
pub fn backend_copy_gbps<B: Backend>(b: &B, bytes: usize) -> Result<f64> {
    let cols = 4096;
    let rows = (bytes / (cols * 4)).max(1);
    let src = b.zeros(rows, cols);
    drop(b.slice_rows(&src, 0, rows));
    b.synchronize().context("warming up the copy")?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        drop(b.slice_rows(&src, 0, rows));
        b.synchronize().context("timing the copy")?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (rows * cols * 4) as f64 / best / 1e9)
}

/// Host-to-device copy throughput of `bytes` (GB/s, best of five) from memory page-locked by
/// the backend's pinner (from ordinary memory where it has none): the link streamed experts
/// cross on a GPU.
pub fn backend_upload_gbps<B: Backend>(b: &B, bytes: usize) -> Result<f64> {
    let cols = 4096;
    let rows = (bytes / (cols * 4)).max(1);
    let host = vec![0.5f32; rows * cols];
    // Dropped before `host`.
    let pinned = match b.host_pinner() {
        Some(p) => Some(
            p.pin(host.as_ptr() as usize, host.len() * 4)
                .context("page-locking the copy's source")?,
        ),
        None => None,
    };
    drop(b.act_from_host(&host, rows, cols));
    b.synchronize().context("warming up the upload")?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        drop(b.act_from_host(&host, rows, cols));
        b.synchronize().context("timing the upload")?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    drop(pinned);
    Ok((rows * cols * 4) as f64 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_file(bytes: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let chunk: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            f.write_all(&chunk[..n]).unwrap();
            left -= n;
        }
        f.as_file().sync_all().unwrap();
        f
    }

    #[test]
    fn memory_read_measures_something() {
        let r = memory_read(2, 8 << 20);
        assert_eq!(r.threads, 2);
        assert_eq!(r.bytes, 8 << 20);
        assert!(r.gbps > 0.0 && r.gbps.is_finite(), "{r:?}");
        // Odd sizes round down to whole 64-byte lines; tiny ones grow to 64 KiB.
        assert_eq!(memory_read(1, (1 << 20) + 40).bytes, 1 << 20);
        assert_eq!(memory_read(1, 10).bytes, 64 << 10);
    }

    #[test]
    fn sum_u64_matches_plain_sum() {
        let v: Vec<u64> = (0..1003u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let plain = v.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        assert_eq!(sum_u64(&v), plain);
        assert_eq!(sum_u64(&[]), 0);
    }

    #[test]
    fn shuffled_is_a_permutation() {
        let mut v = shuffled(1000, 42);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
        assert_eq!(shuffled(1, 7), vec![0]);
    }

    #[test]
    fn disk_reads_a_64_mib_file() {
        let f = temp_file(64 << 20);
        let opts = DiskOptions {
            seconds: 0.2,
            queue_depth: 4,
            ..DiskOptions::new(f.path())
        };
        let r = disk(&opts).unwrap();
        assert_eq!(r.file_bytes, 64 << 20);
        for p in [&r.sequential, &r.random_qd1, &r.random_qdn] {
            assert!(p.requests > 0 && p.bytes > 0, "{p:?}");
            assert!(p.bytes <= 64 << 20, "{p:?}");
            // Anything from a slow disk to page cache; not zero, not absurd.
            assert!(p.gbps > 0.001 && p.gbps < 1000.0, "{p:?}");
            assert!(p.mean_latency_ms > 0.0, "{p:?}");
        }
        assert_eq!(r.sequential.request_bytes, 4 << 20);
        assert_eq!(r.random_qd1.queue_depth, 1);
        assert_eq!(r.random_qdn.queue_depth, 4);
        assert_eq!(r.random_qdn.request_bytes, 2 << 20);
        // A third of 64 MiB is 21 MiB: whole 4 MiB units give each pattern 20 MiB of its own.
        assert!(r.random_qd1.bytes <= 20 << 20, "{:?}", r.random_qd1);
        if !r.direct {
            assert!(!r.notes.is_empty());
        }
    }

    #[test]
    fn disk_rounds_blocks_and_overlaps_when_needed() {
        let f = temp_file(64 << 20);
        let opts = DiskOptions {
            block: 10_000,
            queue_depth: 0,
            seconds: 0.05,
            file: f.path().to_path_buf(),
        };
        let r = disk(&opts).unwrap();
        assert_eq!(r.random_qd1.request_bytes, 12288);
        assert_eq!(r.random_qdn.queue_depth, 1);
        assert!(r.random_qd1.bytes > 0 && r.random_qd1.bytes.is_multiple_of(12288));

        let opts = DiskOptions {
            block: 32 << 20,
            seconds: 0.05,
            ..DiskOptions::new(f.path())
        };
        let r = disk(&opts).unwrap();
        assert!(
            r.notes.iter().any(|n| n.contains("overlap")),
            "{:?}",
            r.notes
        );
        assert_eq!(r.random_qdn.bytes, r.random_qdn.requests * (32 << 20));
    }

    #[test]
    fn disk_rejects_small_and_missing_files() {
        let f = temp_file(1 << 20);
        let e = disk(&DiskOptions::new(f.path())).unwrap_err().to_string();
        assert!(
            e.contains("too small to measure, pass a larger --file"),
            "{e}"
        );
        assert!(e.contains(&f.path().display().to_string()), "{e}");

        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-model.safetensors");
        let e = disk(&DiskOptions::new(&missing)).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        assert!(e.contains(&missing.display().to_string()), "{e}");

        let e = disk(&DiskOptions::new(dir.path())).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn default_disk_file_picks_the_largest_shard() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.safetensors"), vec![0u8; 100]).unwrap();
        std::fs::write(dir.path().join("b.safetensors"), vec![0u8; 300]).unwrap();
        std::fs::write(dir.path().join("c.bin"), vec![0u8; 1000]).unwrap();
        assert_eq!(
            default_disk_file(dir.path()).unwrap(),
            dir.path().join("b.safetensors")
        );
        let empty = tempfile::tempdir().unwrap();
        let e = default_disk_file(empty.path()).unwrap_err().to_string();
        assert!(e.contains("no *.safetensors file"), "{e}");
    }
}
