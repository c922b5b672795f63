//! Raw reader throughput, for `examples/read_bench.rs`: a safe entry point to the crate-private
//! block reader (`io::Reader`, whose `submit` is `unsafe`) that owns the read destinations. Not
//! part of the store's API.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::io::{IoKind, ReadRequest, Reader, ReaderOptions};
use crate::slots::Slab;

/// Offsets, lengths and destinations must be multiples of this for O_DIRECT reads.
pub const ALIGN: usize = crate::io::ALIGN;

/// What one [`read_blocks`] run did.
#[derive(Debug)]
pub struct ReadRun {
    /// The engine that ran and whether the file was open with O_DIRECT.
    pub kind: IoKind,
    pub direct: bool,
    /// Reads completed successfully, and the sum of their latencies.
    pub reads: u64,
    pub latency: Duration,
    pub bytes_read: u64,
    /// Wall time of the run, and the part of it with reads in flight.
    pub secs: f64,
    pub busy_secs: f64,
    /// Failed reads (no read is issued after the first failure).
    pub errors: Vec<io::Error>,
}

/// Reads `block` bytes at each offset taken from `offsets`, keeping `opts.queue_depth` reads
/// in flight, until `offsets` runs out or `seconds` have passed (reads in flight then finish).
/// Errors only when the file cannot be opened or the buffers allocated.
pub fn read_blocks(
    path: &Path,
    opts: &ReaderOptions,
    block: usize,
    offsets: &mut dyn Iterator<Item = u64>,
    seconds: f64,
) -> io::Result<ReadRun> {
    let qd = opts.queue_depth.max(1);
    let bufs = Slab::new(qd, block)
        .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e.to_string()))?;
    let reader = Reader::open(path, opts)?;
    let mut started = vec![Instant::now(); qd];
    let mut latency = Duration::ZERO;
    let mut reads = 0u64;
    let mut errors = Vec::new();
    // Slot `i` of `bufs` is the destination of the read tagged `i`.
    let mut take = |slot: usize| -> Option<ReadRequest> {
        Some(ReadRequest {
            tag: slot as u64,
            offset: offsets.next()?,
            len: block,
            dst: bufs.slot_ptr(slot),
        })
    };
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(seconds);
    let first: Vec<ReadRequest> = (0..qd).filter_map(&mut take).collect();
    for r in &first {
        started[r.tag as usize] = Instant::now();
    }
    // SAFETY: each request targets its own slot of `block` bytes, which outlives the reader
    // (dropped below, which waits for its reads) and is not touched until its completion
    // comes back.
    unsafe { reader.submit(&first) };
    loop {
        let done = reader.wait();
        if done.is_empty() {
            break;
        }
        let mut more = Vec::new();
        for c in done {
            let slot = c.tag as usize;
            if let Err(e) = c.result {
                errors.push(e);
                continue;
            }
            latency += started[slot].elapsed();
            reads += 1;
            if Instant::now() < deadline && errors.is_empty() {
                if let Some(r) = take(slot) {
                    started[slot] = Instant::now();
                    more.push(r);
                }
            }
        }
        // SAFETY: as above; a slot is reused only after its completion came back.
        unsafe { reader.submit(&more) };
    }
    let secs = t0.elapsed().as_secs_f64();
    let st = reader.stats();
    let run = ReadRun {
        kind: reader.kind(),
        direct: reader.direct(),
        reads,
        latency,
        bytes_read: st.bytes_read,
        secs,
        busy_secs: st.busy_secs,
        errors,
    };
    // The reader goes before the buffers it writes into.
    drop(reader);
    drop(bufs);
    Ok(run)
}
