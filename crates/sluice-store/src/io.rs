//! The block reader: whole expert blocks from `experts.bin` (or slices of checkpoint shards)
//! into caller-provided memory, many reads in flight. Crate-private but for the options
//! ([`IoKind`], [`ReaderOptions`]): callers hand raw destinations to [`Reader::submit`].
//!
//! Two engines sit behind one [`Reader`]:
//! - **io_uring** (Linux, where the kernel and any seccomp policy allow it): reads go into a ring
//!   of `queue_depth` entries; one reaper thread waits for completions, resubmits short reads and
//!   refills the ring from a software queue.
//! - **a pread thread pool** (everywhere): `queue_depth` threads take requests from a shared
//!   queue and call `read_at`.
//!
//! [`IoKind::Auto`] tries io_uring (ring setup plus one no-op round trip) and falls back to the
//! thread pool; [`Reader::kind`] says which one runs. With `direct`, the file is opened with
//! O_DIRECT (bypassing the page cache) where the filesystem accepts it, buffered otherwise
//! ([`Reader::direct`] says which); either way, requests whose offset, length or destination is
//! not a multiple of [`ALIGN`] fail with `InvalidInput`, so callers behave the same on every
//! filesystem.
//!
//! Completions are collected in one queue that [`Reader::wait`] and [`Reader::poll`] drain, from
//! any thread. An I/O error fails only its own request's completion.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Alignment required of offsets, lengths and destinations when `direct` is requested.
pub(crate) const ALIGN: usize = 4096;
/// Largest single read handed to the kernel; longer requests are read in pieces.
const MAX_CHUNK: usize = 1 << 30;
/// How many times one request retries EINTR/EAGAIN before failing.
const MAX_RETRIES: u32 = 1000;
/// Upper bound on the queue depth (ring entries or pool threads).
const MAX_QUEUE_DEPTH: usize = 1024;

/// Which engine performs the reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// io_uring where it works, the thread pool otherwise.
    Auto,
    /// io_uring; opening fails where it is unavailable.
    Uring,
    /// The pread thread pool.
    Threads,
}

/// How to open the block reader.
#[derive(Debug, Clone)]
pub struct ReaderOptions {
    pub kind: IoKind,
    /// Bypass the page cache (O_DIRECT) where the filesystem allows it; requires aligned requests.
    pub direct: bool,
    /// Reads in flight at once in the kernel (ring entries, or pool threads); clamped to 1..=1024.
    pub queue_depth: usize,
    /// Faults to inject into the reads (tests of what happens when a disk misbehaves); None in
    /// normal use.
    pub faults: Option<Arc<dyn ReadFaults>>,
}

/// A fault that [`ReadFaults`] injects into one read as it returns from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFault {
    /// The read fails with this OS error number (`libc::EIO`, say).
    Error(i32),
    /// The read returns at most this many bytes (a short count; 0 reads as end of file). With
    /// O_DIRECT, a count that is not a multiple of 4 KiB reads as end of file, as the kernel
    /// returns one only there: inject multiples of 4 KiB to test reading on.
    Short(usize),
}

/// Injects faults into a reader's reads, both engines alike: asked once per read the kernel
/// finishes, after it finished, so the bytes it did read are real.
pub trait ReadFaults: Send + Sync + std::fmt::Debug {
    /// The fault for the read of `len` bytes at file `offset` that just returned, if any.
    fn fault(&self, offset: u64, len: usize) -> Option<ReadFault>;
}

/// A read's result after the fault, if any, that `faults` injects into it.
fn injected(
    faults: &Option<Arc<dyn ReadFaults>>,
    offset: u64,
    len: usize,
    r: io::Result<usize>,
) -> io::Result<usize> {
    let Some(f) = faults else {
        return r;
    };
    match (f.fault(offset, len), r) {
        (Some(ReadFault::Error(errno)), _) => Err(io::Error::from_raw_os_error(errno)),
        (Some(ReadFault::Short(max)), Ok(n)) => Ok(n.min(max)),
        (_, r) => r,
    }
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            kind: IoKind::Auto,
            direct: true,
            queue_depth: 16,
            faults: None,
        }
    }
}

/// One read: `len` bytes at file `offset` into `dst` (valid for writes of `len` bytes until the
/// completion for `tag` is returned; the caller guarantees that).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadRequest {
    pub(crate) tag: u64,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) dst: *mut u8,
}

// SAFETY: a `ReadRequest` is plain data; the pointer is only written through by the reader under
// the contract of `Reader::submit`, which makes the caller responsible for the memory.
unsafe impl Send for ReadRequest {}

/// The outcome of one [`ReadRequest`]. A short read (end of file) is an `UnexpectedEof` error
/// naming the offset and length.
#[derive(Debug)]
pub(crate) struct Completion {
    pub(crate) tag: u64,
    pub(crate) result: io::Result<()>,
}

/// Counters since the reader was opened.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct IoStats {
    /// Bytes transferred into destinations (by successful and failed requests).
    pub(crate) bytes_read: u64,
    /// Requests completed successfully.
    pub(crate) reads: u64,
    /// Requests completed with an error.
    pub(crate) errors: u64,
    /// Wall time with at least one request submitted and not yet completed.
    pub(crate) busy_secs: f64,
    /// Most requests submitted and not yet completed at once.
    pub(crate) max_in_flight: usize,
}

/// A request being worked on: how far it got and how often it retried.
struct Op {
    req: ReadRequest,
    done: usize,
    retries: u32,
}

/// Everything the engines and the callers share, behind one mutex.
struct State {
    /// Completions not yet handed to a caller.
    done: VecDeque<Completion>,
    /// Requests submitted whose completion has not been returned by `wait`/`poll`.
    unreturned: usize,
    /// Requests submitted and not yet completed.
    active: usize,
    /// Requests not yet handed to the kernel (thread pool: all waiting requests; io_uring: those
    /// beyond the ring's depth, and resubmissions).
    queue: VecDeque<Op>,
    shutdown: bool,
    busy_since: Option<Instant>,
    busy: Duration,
    stats: IoStats,
    /// io_uring: ops in the ring, indexed by `user_data`.
    slots: Vec<Option<Op>>,
    free_slots: Vec<usize>,
    in_ring: usize,
}

struct Shared {
    file: File,
    /// Whether the file is open with O_DIRECT.
    direct: bool,
    /// Whether aligned requests are required (`direct` was requested).
    require_aligned: bool,
    queue_depth: usize,
    faults: Option<Arc<dyn ReadFaults>>,
    state: Mutex<State>,
    /// Signalled when a completion is queued or nothing is left unreturned.
    done_cv: Condvar,
    /// Signalled when work is queued or on shutdown.
    work_cv: Condvar,
    #[cfg(target_os = "linux")]
    ring: Option<io_uring::IoUring>,
}

/// The block reader. `Send + Sync`: submit from one thread, wait from another.
///
/// Dropping a reader waits for every submitted read to finish (the kernel must not write into
/// memory after the caller is told it may free it); completions not yet returned are discarded.
pub(crate) struct Reader {
    shared: Arc<Shared>,
    kind: IoKind,
    workers: Vec<JoinHandle<()>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panicking engine thread must not make the reader unusable: the state stays consistent
    // because every critical section only moves ops between containers.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn context(req: &ReadRequest, e: io::Error) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("read of {} bytes at offset {}: {e}", req.len, req.offset),
    )
}

fn eof_error(op: &Op) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!(
            "read of {} bytes at offset {}: end of file after {} bytes",
            op.req.len, op.req.offset, op.done
        ),
    )
}

impl Shared {
    /// Records a finished request (under the lock) and wakes waiters.
    fn finish(&self, st: &mut State, op: Op, result: io::Result<()>) {
        st.active -= 1;
        if st.active == 0 {
            if let Some(t) = st.busy_since.take() {
                st.busy += t.elapsed();
            }
        }
        st.stats.bytes_read += op.done as u64;
        match result {
            Ok(()) => st.stats.reads += 1,
            Err(_) => st.stats.errors += 1,
        }
        st.done.push_back(Completion {
            tag: op.req.tag,
            result,
        });
        self.done_cv.notify_all();
    }

    /// After `n` more bytes of `op` arrived: finished, failed at end of file, or to be continued.
    /// Returns the op when it has more to read.
    fn progress(&self, st: &mut State, mut op: Op, n: usize) -> Option<Op> {
        if n == 0 {
            let e = eof_error(&op);
            self.finish(st, op, Err(e));
            return None;
        }
        op.done += n;
        op.retries = 0;
        if op.done >= op.req.len {
            self.finish(st, op, Ok(()));
            return None;
        }
        if self.direct && !op.done.is_multiple_of(ALIGN) {
            // O_DIRECT returns an unaligned short count only at end of file; reading on from an
            // unaligned position would fail with EINVAL instead of saying so.
            let e = eof_error(&op);
            self.finish(st, op, Err(e));
            return None;
        }
        Some(op)
    }

    /// After a read of `op` failed with `e`: retried (returned) for EINTR/EAGAIN, failed otherwise.
    fn failed(&self, st: &mut State, mut op: Op, e: io::Error) -> Option<Op> {
        let transient = matches!(
            e.kind(),
            io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
        );
        if transient && op.retries < MAX_RETRIES {
            op.retries += 1;
            return Some(op);
        }
        let e = context(&op.req, e);
        self.finish(st, op, Err(e));
        None
    }
}

/// Positioned read (does not move a file cursor, so threads share the file).
#[cfg(unix)]
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(file, buf, offset)
}

#[cfg(windows)]
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::windows::fs::FileExt::seek_read(file, buf, offset)
}

/// Thread-pool worker: take a request, read it whole, report, repeat.
fn worker(shared: Arc<Shared>) {
    let mut st = lock(&shared.state);
    loop {
        let Some(mut op) = st.queue.pop_front() else {
            if st.shutdown {
                return;
            }
            st = shared.work_cv.wait(st).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        drop(st);
        // Read without the lock until the request finishes or fails.
        loop {
            let want = (op.req.len - op.done).min(MAX_CHUNK);
            // SAFETY: the caller of `Reader::submit` guarantees `dst` is valid for writes of
            // `len` bytes and untouched until this request's completion is returned; `done <
            // len`, so `dst + done .. dst + done + want` lies inside that range.
            let buf = unsafe { std::slice::from_raw_parts_mut(op.req.dst.add(op.done), want) };
            let offset = op.req.offset + op.done as u64;
            let r = injected(
                &shared.faults,
                offset,
                want,
                read_at(&shared.file, buf, offset),
            );
            st = lock(&shared.state);
            let next = match r {
                Ok(n) => shared.progress(&mut st, op, n),
                Err(e) => shared.failed(&mut st, op, e),
            };
            match next {
                Some(o) => {
                    drop(st);
                    op = o;
                }
                None => break,
            }
        }
    }
}

#[cfg(target_os = "linux")]
mod uring {
    use super::*;
    use io_uring::{opcode, types, IoUring};
    use std::os::fd::AsRawFd;

    /// Sets up a ring and checks it works end to end with one no-op (seccomp policies may allow
    /// `io_uring_setup` but not `io_uring_enter`, or the reverse).
    pub(super) fn setup(entries: usize) -> io::Result<IoUring> {
        let ring = IoUring::new(entries as u32)?;
        let nop = opcode::Nop::new().build().user_data(u64::MAX);
        // SAFETY: this thread is the ring's only user here; a no-op references no memory.
        unsafe {
            let mut sq = ring.submission_shared();
            sq.push(&nop)
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        // SAFETY: as above, nothing else touches the completion queue yet.
        let cqe = unsafe { ring.completion_shared().next() };
        match cqe {
            Some(c) if c.result() >= 0 => Ok(ring),
            Some(c) => Err(io::Error::from_raw_os_error(-c.result())),
            None => Err(io::Error::other("io_uring no-op did not complete")),
        }
    }

    /// Moves queued ops into the ring (up to the queue depth) and submits them. Lock held.
    pub(super) fn fill(shared: &Shared, ring: &IoUring, st: &mut State) {
        let fd = types::Fd(shared.file.as_raw_fd());
        let mut pushed = false;
        {
            // SAFETY: all submission-queue access happens with the state mutex held (`st`
            // proves it), so this is the only live handle to the submission queue.
            let mut sq = unsafe { ring.submission_shared() };
            while st.in_ring < shared.queue_depth && !sq.is_full() {
                let Some(op) = st.queue.pop_front() else {
                    break;
                };
                let slot = st
                    .free_slots
                    .pop()
                    .expect("a free slot below the queue depth");
                let want = (op.req.len - op.done).min(MAX_CHUNK);
                // SAFETY: the caller of `Reader::submit` guarantees `dst` is valid for writes of
                // `len` bytes until the completion is returned; `done < len`.
                let ptr = unsafe { op.req.dst.add(op.done) };
                let entry = opcode::Read::new(fd, ptr, want as u32)
                    .offset(op.req.offset + op.done as u64)
                    .build()
                    .user_data(slot as u64);
                // SAFETY: the entry's buffer stays valid until its completion (caller contract
                // above), and the file descriptor lives in `shared`, which outlives the ring's
                // use (the reaper holds an `Arc` and is joined before the reader goes away).
                if unsafe { sq.push(&entry) }.is_err() {
                    st.free_slots.push(slot);
                    st.queue.push_front(op);
                    break;
                }
                st.slots[slot] = Some(op);
                st.in_ring += 1;
                pushed = true;
            }
        }
        if pushed {
            // Errors here (EAGAIN, EINTR) leave the entries in the submission queue; the
            // reaper's next `submit_and_wait` submits them.
            let _ = ring.submit();
            shared.work_cv.notify_all();
        }
    }

    /// The reaper: waits in the kernel for completions (without the lock), then handles them.
    pub(super) fn reaper(shared: Arc<Shared>) {
        let ring = shared.ring.as_ref().expect("io_uring reader has a ring");
        let mut st = lock(&shared.state);
        loop {
            if st.in_ring == 0 {
                if st.queue.is_empty() && st.shutdown {
                    return;
                }
                if !st.queue.is_empty() {
                    fill(&shared, ring, &mut st);
                    continue;
                }
                st = shared.work_cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            drop(st);
            // Submits anything left in the submission queue and waits for one completion.
            // Only this thread consumes completions, so an event it waits for cannot be taken
            // by another thread first.
            if let Err(e) = ring.submit_and_wait(1) {
                if !matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) && e.raw_os_error() != Some(libc::EBUSY)
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            st = lock(&shared.state);
            reap(&shared, ring, &mut st);
            fill(&shared, ring, &mut st);
        }
    }

    /// Handles every available completion. Lock held.
    fn reap(shared: &Shared, ring: &IoUring, st: &mut State) {
        // SAFETY: only the reaper consumes completions, and only with the state mutex held, so
        // this is the only live handle to the completion queue.
        let cq = unsafe { ring.completion_shared() };
        let cqes: Vec<(u64, i32)> = cq.map(|c| (c.user_data(), c.result())).collect();
        for (slot, res) in cqes {
            let slot = slot as usize;
            let Some(op) = st.slots.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            st.free_slots.push(slot);
            st.in_ring -= 1;
            let r = if res >= 0 {
                Ok(res as usize)
            } else {
                Err(io::Error::from_raw_os_error(-res))
            };
            let (offset, want) = (op.req.offset + op.done as u64, op.req.len - op.done);
            let next = match injected(&shared.faults, offset, want.min(MAX_CHUNK), r) {
                Ok(n) => shared.progress(st, op, n),
                Err(e) => shared.failed(st, op, e),
            };
            if let Some(op) = next {
                // Resubmit the remainder (or the retry) before newer requests.
                st.queue.push_front(op);
            }
        }
    }
}

/// Opens `path` for reading, with O_DIRECT if asked and accepted. Returns the file and whether
/// it is direct.
fn open_file(path: &Path, direct: bool) -> io::Result<(File, bool)> {
    #[cfg(target_os = "linux")]
    if direct {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => {
                // Some filesystems accept the flag at open and reject the reads: probe one.
                let layout =
                    std::alloc::Layout::from_size_align(ALIGN, ALIGN).expect("valid layout");
                // SAFETY: the layout has non-zero size.
                let p = unsafe { std::alloc::alloc(layout) };
                if p.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                // SAFETY: `p` is a fresh allocation of `ALIGN` bytes, exclusively ours.
                let buf = unsafe { std::slice::from_raw_parts_mut(p, ALIGN) };
                let probe = f.read_at(buf, 0);
                // SAFETY: `p` was allocated above with `layout` and `buf` is no longer used.
                unsafe { std::alloc::dealloc(p, layout) };
                match probe {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    _ => return Ok((f, true)),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    let _ = direct;
    Ok((File::open(path)?, false))
}

impl Reader {
    /// Opens `path` with the engine and flags of `opts`.
    pub(crate) fn open(path: &Path, opts: &ReaderOptions) -> io::Result<Reader> {
        let queue_depth = opts.queue_depth.clamp(1, MAX_QUEUE_DEPTH);
        let (file, direct) = open_file(path, opts.direct)?;

        #[cfg(target_os = "linux")]
        let ring = match opts.kind {
            IoKind::Threads => None,
            IoKind::Uring => Some(
                uring::setup(queue_depth)
                    .map_err(|e| io::Error::new(e.kind(), format!("io_uring unavailable: {e}")))?,
            ),
            IoKind::Auto => uring::setup(queue_depth).ok(),
        };
        #[cfg(target_os = "linux")]
        let kind = if ring.is_some() {
            IoKind::Uring
        } else {
            IoKind::Threads
        };
        #[cfg(not(target_os = "linux"))]
        let kind = match opts.kind {
            IoKind::Uring => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "io_uring is only available on Linux",
                ))
            }
            _ => IoKind::Threads,
        };

        let uring = kind == IoKind::Uring;
        let state = State {
            done: VecDeque::new(),
            unreturned: 0,
            active: 0,
            queue: VecDeque::new(),
            shutdown: false,
            busy_since: None,
            busy: Duration::ZERO,
            stats: IoStats::default(),
            slots: if uring {
                (0..queue_depth).map(|_| None).collect()
            } else {
                Vec::new()
            },
            free_slots: if uring {
                (0..queue_depth).rev().collect()
            } else {
                Vec::new()
            },
            in_ring: 0,
        };
        let shared = Arc::new(Shared {
            file,
            direct,
            require_aligned: opts.direct,
            queue_depth,
            faults: opts.faults.clone(),
            state: Mutex::new(state),
            done_cv: Condvar::new(),
            work_cv: Condvar::new(),
            #[cfg(target_os = "linux")]
            ring,
        });

        let mut workers = Vec::new();
        let spawn = |name: String, f: fn(Arc<Shared>), s: Arc<Shared>| {
            std::thread::Builder::new().name(name).spawn(move || f(s))
        };
        let result = (|| -> io::Result<()> {
            if uring {
                #[cfg(target_os = "linux")]
                workers.push(spawn("sluice-uring".into(), uring::reaper, shared.clone())?);
            } else {
                for i in 0..queue_depth {
                    workers.push(spawn(format!("sluice-io-{i}"), worker, shared.clone())?);
                }
            }
            Ok(())
        })();
        let reader = Reader {
            shared,
            kind,
            workers,
        };
        result.map(|()| reader)
    }

    /// The engine in use: [`IoKind::Uring`] or [`IoKind::Threads`].
    pub(crate) fn kind(&self) -> IoKind {
        self.kind
    }

    /// Whether the file is open with O_DIRECT.
    pub(crate) fn direct(&self) -> bool {
        self.shared.direct
    }

    /// Queues reads; never blocks for long (reads beyond the queue depth wait in a software
    /// queue). Invalid requests (unaligned when `direct` was requested, or a destination that is
    /// null) complete at once with an `InvalidInput` error; an empty read completes at once.
    ///
    /// # Safety
    /// For each request, `dst` must be valid for writes of `len` bytes, and that memory must not
    /// be read, written or freed by anyone else until the completion for the request's `tag` has
    /// been returned by [`Reader::wait`] or [`Reader::poll`] (or the reader has been dropped,
    /// which waits for all reads to finish).
    pub(crate) unsafe fn submit(&self, reqs: &[ReadRequest]) {
        if reqs.is_empty() {
            return;
        }
        let shared = &*self.shared;
        let mut st = lock(&shared.state);
        for req in reqs {
            st.unreturned += 1;
            if st.active == 0 {
                st.busy_since = Some(Instant::now());
            }
            st.active += 1;
            st.stats.max_in_flight = st.stats.max_in_flight.max(st.active);
            let op = Op {
                req: *req,
                done: 0,
                retries: 0,
            };
            let invalid = if req.dst.is_null() {
                Some("null destination")
            } else if shared.require_aligned
                && !(req.offset.is_multiple_of(ALIGN as u64)
                    && req.len.is_multiple_of(ALIGN)
                    && (req.dst as usize).is_multiple_of(ALIGN))
            {
                Some("direct reads need offset, length and destination aligned to 4096 bytes")
            } else {
                None
            };
            if let Some(msg) = invalid {
                let e = io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "read of {} bytes at offset {} into {:p}: {msg}",
                        req.len, req.offset, req.dst
                    ),
                );
                shared.finish(&mut st, op, Err(e));
            } else if req.len == 0 {
                shared.finish(&mut st, op, Ok(()));
            } else {
                st.queue.push_back(op);
            }
        }
        #[cfg(target_os = "linux")]
        if let Some(ring) = &shared.ring {
            uring::fill(shared, ring, &mut st);
            return;
        }
        shared.work_cv.notify_all();
    }

    /// Takes every queued completion and updates the unreturned count. Lock held.
    fn take(&self, st: &mut State) -> Vec<Completion> {
        let out: Vec<Completion> = st.done.drain(..).collect();
        st.unreturned -= out.len();
        if st.unreturned == 0 {
            // Other waiters must not sleep on requests this call took.
            self.shared.done_cv.notify_all();
        }
        out
    }

    /// Blocks until at least one completion is available and returns all available ones;
    /// returns an empty vector at once if nothing is in flight.
    pub(crate) fn wait(&self) -> Vec<Completion> {
        let mut st = lock(&self.shared.state);
        loop {
            if !st.done.is_empty() {
                return self.take(&mut st);
            }
            if st.unreturned == 0 {
                return Vec::new();
            }
            st = self
                .shared
                .done_cv
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Completions available now, without blocking.
    pub(crate) fn poll(&self) -> Vec<Completion> {
        let mut st = lock(&self.shared.state);
        self.take(&mut st)
    }

    /// Requests submitted whose completion has not yet been returned by `wait`/`poll`.
    pub(crate) fn in_flight(&self) -> usize {
        lock(&self.shared.state).unreturned
    }

    /// Counters since the reader was opened.
    pub(crate) fn stats(&self) -> IoStats {
        let st = lock(&self.shared.state);
        let mut s = st.stats.clone();
        let busy = st.busy + st.busy_since.map_or(Duration::ZERO, |t| t.elapsed());
        s.busy_secs = busy.as_secs_f64();
        s
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        {
            let mut st = lock(&self.shared.state);
            st.shutdown = true;
            self.shared.work_cv.notify_all();
        }
        // Engines finish every queued read before exiting, so no write lands after this returns.
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const MIB: usize = 1 << 20;
    const FILE_BYTES: usize = 32 * MIB;

    /// Zeroed heap memory aligned to `ALIGN`.
    struct AlignedBuf {
        ptr: *mut u8,
        layout: std::alloc::Layout,
    }

    impl AlignedBuf {
        fn new(len: usize) -> Self {
            let layout = std::alloc::Layout::from_size_align(len.max(1), ALIGN).unwrap();
            // SAFETY: the layout has non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            assert!(!ptr.is_null());
            AlignedBuf { ptr, layout }
        }
        fn slice(&self, at: usize, len: usize) -> &[u8] {
            assert!(at + len <= self.layout.size());
            // SAFETY: in bounds (checked), and only read once the reads into it completed.
            unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
        }
        fn at(&self, at: usize) -> *mut u8 {
            assert!(at <= self.layout.size());
            // SAFETY: in bounds of the allocation (checked).
            unsafe { self.ptr.add(at) }
        }
    }

    impl Drop for AlignedBuf {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr, self.layout) }
        }
    }

    fn pattern_byte(i: usize) -> u8 {
        let w = ((i / 8) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed;
        w.to_le_bytes()[i % 8]
    }

    fn test_file(bytes: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..bytes).map(pattern_byte).collect();
        f.write_all(&data).unwrap();
        f.flush().unwrap();
        f
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    fn opts(kind: IoKind, qd: usize) -> ReaderOptions {
        ReaderOptions {
            kind,
            direct: true,
            queue_depth: qd,
            faults: None,
        }
    }

    /// Engines to test: always the thread pool; io_uring where this kernel allows it, and if it
    /// does not, `Auto` must have fallen back to the thread pool.
    fn engines() -> Vec<IoKind> {
        let f = test_file(ALIGN);
        let mut kinds = vec![IoKind::Threads];
        match Reader::open(f.path(), &opts(IoKind::Uring, 4)) {
            Ok(r) => {
                assert_eq!(r.kind(), IoKind::Uring);
                let auto = Reader::open(f.path(), &opts(IoKind::Auto, 4)).unwrap();
                assert_eq!(auto.kind(), IoKind::Uring);
                kinds.push(IoKind::Uring);
            }
            Err(e) => {
                eprintln!("io_uring unavailable here ({e}); checking the fallback");
                let auto = Reader::open(f.path(), &opts(IoKind::Auto, 4)).unwrap();
                assert_eq!(auto.kind(), IoKind::Threads);
            }
        }
        kinds
    }

    fn wait_all(r: &Reader, n: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        while out.len() < n {
            let got = r.wait();
            assert!(
                !got.is_empty(),
                "wait returned nothing with reads in flight"
            );
            out.extend(got);
        }
        assert_eq!(r.in_flight(), 0);
        assert!(r.wait().is_empty());
        out
    }

    fn random_blocks(kind: IoKind) {
        let f = test_file(FILE_BYTES);
        let r = Reader::open(f.path(), &opts(kind, 8)).unwrap();
        assert_eq!(r.kind(), kind);
        let n = 64;
        let buf = AlignedBuf::new(n * MIB);
        let mut rng = Rng(0x1234_5678 + kind as u64);
        let blocks = (FILE_BYTES - MIB) / ALIGN;
        let offsets: Vec<u64> = (0..n)
            .map(|_| (rng.next() as usize % blocks * ALIGN) as u64)
            .collect();
        let reqs: Vec<ReadRequest> = offsets
            .iter()
            .enumerate()
            .map(|(i, &offset)| ReadRequest {
                tag: i as u64,
                offset,
                len: MIB,
                dst: buf.at(i * MIB),
            })
            .collect();
        // SAFETY: `buf` outlives the reads (all completions are collected below) and is not
        // touched until then; every request has its own megabyte of it.
        unsafe { r.submit(&reqs) };
        let done = wait_all(&r, n);
        let mut seen = vec![false; n];
        for c in done {
            c.result.unwrap();
            assert!(!std::mem::replace(&mut seen[c.tag as usize], true));
        }
        for (i, &off) in offsets.iter().enumerate() {
            let got = buf.slice(i * MIB, MIB);
            let off = off as usize;
            for (j, &b) in got.iter().enumerate() {
                assert_eq!(b, pattern_byte(off + j), "block {i} at {off}, byte {j}");
            }
        }
        let s = r.stats();
        assert_eq!(s.reads, n as u64);
        assert_eq!(s.errors, 0);
        assert_eq!(s.bytes_read, (n * MIB) as u64);
        assert!(s.max_in_flight >= 1 && s.max_in_flight <= n);
        assert!(s.busy_secs > 0.0);
    }

    /// Injects its fault into every read, counting them.
    #[derive(Debug)]
    struct Inject(ReadFault, std::sync::atomic::AtomicUsize);
    impl ReadFaults for Inject {
        fn fault(&self, _offset: u64, _len: usize) -> Option<ReadFault> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(self.0)
        }
    }

    /// Injected faults act the same in both engines: an error fails its request (naming the
    /// read); short counts are read on to the end and every byte is right.
    #[test]
    fn injected_faults_in_every_engine() {
        for kind in engines() {
            for (fault, fails) in [
                (ReadFault::Error(libc::EIO), true),
                (ReadFault::Short(ALIGN), false),
            ] {
                let f = test_file(4 * MIB);
                let inject = Arc::new(Inject(fault, Default::default()));
                let o = ReaderOptions {
                    faults: Some(inject.clone()),
                    ..opts(kind, 4)
                };
                let r = Reader::open(f.path(), &o).unwrap();
                let buf = AlignedBuf::new(2 * MIB);
                let reqs: Vec<ReadRequest> = (0..2)
                    .map(|i| ReadRequest {
                        tag: i,
                        offset: (i as usize * MIB + MIB) as u64,
                        len: MIB,
                        dst: buf.at(i as usize * MIB),
                    })
                    .collect();
                // SAFETY: `buf` outlives the reads (all completions are collected below), each
                // request has its own megabyte of it.
                unsafe { r.submit(&reqs) };
                for c in wait_all(&r, 2) {
                    match (&c.result, fails) {
                        (Err(e), true) => {
                            assert_eq!(e.raw_os_error(), None, "wrapped with the read's place");
                            assert!(e.to_string().contains("Input/output error"), "{e}");
                            assert!(e.to_string().contains("at offset"), "{e}");
                        }
                        (Ok(()), false) => {}
                        (r, _) => panic!("{kind:?} {fault:?}: {r:?}"),
                    }
                }
                let calls = inject.1.load(std::sync::atomic::Ordering::Relaxed);
                if fails {
                    assert_eq!(calls, 2, "{kind:?}: one fault per request");
                } else {
                    // 4 KiB at a time: 256 returns per megabyte.
                    assert_eq!(calls, 2 * MIB / ALIGN, "{kind:?}");
                    for (i, &b) in buf.slice(0, 2 * MIB).iter().enumerate() {
                        assert_eq!(b, pattern_byte(MIB + i), "{kind:?} byte {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn threads_read_random_blocks_direct() {
        random_blocks(IoKind::Threads);
    }

    #[test]
    fn uring_reads_random_blocks_direct_or_auto_falls_back() {
        if engines().contains(&IoKind::Uring) {
            random_blocks(IoKind::Uring);
        }
    }

    #[test]
    fn out_of_range_and_past_end_reads_fail_their_completion_only() {
        for kind in engines() {
            let f = test_file(4 * MIB);
            let r = Reader::open(f.path(), &opts(kind, 4)).unwrap();
            let buf = AlignedBuf::new(3 * MIB);
            let reqs = [
                // Wholly beyond the end.
                ReadRequest {
                    tag: 1,
                    offset: (64 * MIB) as u64,
                    len: MIB,
                    dst: buf.at(0),
                },
                // Straddling the end: the first half exists.
                ReadRequest {
                    tag: 2,
                    offset: (4 * MIB - MIB / 2) as u64,
                    len: MIB,
                    dst: buf.at(MIB),
                },
                // Fine.
                ReadRequest {
                    tag: 3,
                    offset: MIB as u64,
                    len: MIB,
                    dst: buf.at(2 * MIB),
                },
            ];
            // SAFETY: `buf` outlives the reads and each request has its own range.
            unsafe { r.submit(&reqs) };
            let mut done = wait_all(&r, 3);
            done.sort_by_key(|c| c.tag);
            for c in &done[..2] {
                let e = c.result.as_ref().unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{kind:?}: {e}");
                assert!(e.to_string().contains("at offset"), "{e}");
            }
            done[2].result.as_ref().unwrap();
            assert_eq!(
                buf.slice(2 * MIB, 8),
                &(MIB..MIB + 8).map(pattern_byte).collect::<Vec<_>>()[..]
            );
            let s = r.stats();
            assert_eq!((s.reads, s.errors), (1, 2));

            // The reader still works after errors.
            // SAFETY: as above.
            unsafe { r.submit(&reqs[2..]) };
            wait_all(&r, 1)[0].result.as_ref().unwrap();
        }
    }

    #[test]
    fn more_requests_than_queue_depth_all_complete() {
        for kind in engines() {
            let f = test_file(4 * MIB);
            let r = Reader::open(f.path(), &opts(kind, 2)).unwrap();
            let n = 200;
            let len = 16 * ALIGN;
            let buf = AlignedBuf::new(n * len);
            let reqs: Vec<ReadRequest> = (0..n)
                .map(|i| ReadRequest {
                    tag: i as u64,
                    offset: ((i * 7919) % (4 * MIB / len) * len) as u64,
                    len,
                    dst: buf.at(i * len),
                })
                .collect();
            // SAFETY: `buf` outlives the reads and each request has its own range.
            unsafe { r.submit(&reqs) };
            assert!(r.in_flight() > 0);
            let done = wait_all(&r, n);
            assert_eq!(done.len(), n);
            assert!(done.iter().all(|c| c.result.is_ok()));
            for q in &reqs {
                let at = q.tag as usize * len;
                let off = q.offset as usize;
                assert_eq!(buf.slice(at, len)[len - 1], pattern_byte(off + len - 1));
                assert_eq!(buf.slice(at, len)[0], pattern_byte(off));
            }
            assert_eq!(r.stats().reads, n as u64);
        }
    }

    #[test]
    fn unaligned_direct_requests_are_rejected() {
        for kind in engines() {
            let f = test_file(MIB);
            let r = Reader::open(f.path(), &opts(kind, 4)).unwrap();
            let buf = AlignedBuf::new(4 * ALIGN);
            // Requests 0 and 1 write far from request 2's destination: the buffered reads
            // below run concurrently, and the check reads what request 2 wrote.
            let reqs = [
                ReadRequest {
                    tag: 0,
                    offset: 100,
                    len: ALIGN,
                    dst: buf.at(2 * ALIGN),
                },
                ReadRequest {
                    tag: 1,
                    offset: 0,
                    len: ALIGN + 1,
                    dst: buf.at(2 * ALIGN),
                },
                ReadRequest {
                    tag: 2,
                    offset: 0,
                    len: ALIGN,
                    dst: buf.at(8),
                },
                ReadRequest {
                    tag: 3,
                    offset: 0,
                    len: ALIGN,
                    dst: std::ptr::null_mut(),
                },
            ];
            // SAFETY: these requests are rejected before any I/O; `buf` outlives them anyway.
            unsafe { r.submit(&reqs) };
            let done = wait_all(&r, reqs.len());
            for c in done {
                let e = c.result.unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
            }
            // Buffered readers accept unaligned requests.
            let rb = Reader::open(
                f.path(),
                &ReaderOptions {
                    direct: false,
                    ..opts(kind, 4)
                },
            )
            .unwrap();
            assert!(!rb.direct());
            // SAFETY: as above; request 2 writes `ALIGN` bytes at `buf + 8`, requests 0 and 1 at
            // most `ALIGN + 1` at `buf + 2 * ALIGN`, all inside `buf`.
            unsafe { rb.submit(&reqs[..3]) };
            for c in wait_all(&rb, 3) {
                c.result.unwrap();
            }
            assert_eq!(
                buf.slice(8, 4),
                &(0..4).map(pattern_byte).collect::<Vec<_>>()[..]
            );
        }
    }

    #[test]
    fn submit_on_one_thread_while_another_waits() {
        for kind in engines() {
            let f = test_file(8 * MIB);
            let r = Arc::new(Reader::open(f.path(), &opts(kind, 4)).unwrap());
            let n = 96;
            let len = 64 * 1024;
            let buf = AlignedBuf::new(n * len);
            let base = buf.at(0) as usize;
            let waiter = {
                let r = r.clone();
                std::thread::spawn(move || {
                    let mut tags = Vec::new();
                    while tags.len() < n {
                        for c in r.wait() {
                            c.result.unwrap();
                            tags.push(c.tag);
                        }
                        // `wait` returns at once while nothing is in flight yet.
                        std::thread::yield_now();
                    }
                    tags
                })
            };
            for chunk in 0..n / 8 {
                let reqs: Vec<ReadRequest> = (chunk * 8..chunk * 8 + 8)
                    .map(|i| ReadRequest {
                        tag: i as u64,
                        offset: ((i * 37) % (8 * MIB / len) * len) as u64,
                        len,
                        dst: (base + i * len) as *mut u8,
                    })
                    .collect();
                // SAFETY: `buf` outlives the reads (the waiter is joined before it drops) and
                // each request has its own range.
                unsafe { r.submit(&reqs) };
                if chunk % 3 == 0 {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            let mut tags = waiter.join().unwrap();
            tags.sort_unstable();
            assert_eq!(tags, (0..n as u64).collect::<Vec<_>>());
            for i in 0..n {
                let off = (i * 37) % (8 * MIB / len) * len;
                assert_eq!(buf.slice(i * len + 100, 1)[0], pattern_byte(off + 100));
            }
        }
    }

    #[test]
    fn dropping_with_reads_in_flight_waits_for_them() {
        for kind in engines() {
            let f = test_file(8 * MIB);
            let buf = AlignedBuf::new(8 * MIB);
            {
                let r = Reader::open(f.path(), &opts(kind, 2)).unwrap();
                let reqs: Vec<ReadRequest> = (0..8)
                    .map(|i| ReadRequest {
                        tag: i,
                        offset: i * MIB as u64,
                        len: MIB,
                        dst: buf.at(i as usize * MIB),
                    })
                    .collect();
                // SAFETY: `buf` outlives the reader, whose drop waits for the reads.
                unsafe { r.submit(&reqs) };
            }
            assert_eq!(buf.slice(8 * MIB - 1, 1)[0], pattern_byte(8 * MIB - 1));
        }
    }

    #[test]
    fn reader_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Reader>();
    }
}
