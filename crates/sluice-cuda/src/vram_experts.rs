//! Streamed experts on the GPU: the VRAM expert cache (tier 1, slots in one device allocation,
//! kept between calls) over the expert store's host cache (tier 2, page-locked by
//! [`CudaPinner`] so that copies run at the link's full speed) over the packed file (tier 3,
//! the store's reads).
//!
//! Copies run on the backend's one stream, so they are ordered after every launch that may still
//! read a slot they overwrite, and before the launches that use them; the host memory they read
//! is kept (the store's lease) until the stream has synchronised.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent};
use sluice_backend::{
    BackendError, ExpertCachePlan, ExpertCacheStats, ExpertKey, HostExpert, HostMatrix, HostPinner,
    MemoryInfo, PinnedRegion,
};

use crate::device::{DevBuf, Device, Lane};
use crate::expert_cache::{Claim, SlotHold, SlotTable};
use crate::mat::{describe, ExpertMats, Mat};

/// Device memory left for activations, KV caches and kernels' scratch when the expert cache is
/// sized.
pub const RESERVE_BYTES: u64 = 1 << 30;
/// Parts of an expert in a slot start on this boundary.
const PART_ALIGN: usize = 256;

/// An upload whose host memory must stay put until the stream has synchronised.
struct Pending {
    /// `Device::sync_count` when it was issued.
    issued_at: u64,
    _host: HostExpert,
    timing: Option<(CudaEvent, CudaEvent)>,
}

/// The VRAM tier: slots, what each holds, and the counters.
pub(crate) struct VramExperts {
    table: SlotTable,
    memory: Option<DevBuf>,
    slot_bytes: usize,
    /// The description of each slot's expert (valid while the table says it holds one).
    mats: Vec<ExpertMats>,
    pending: Vec<Pending>,
    stats: ExpertCacheStats,
}

/// An expert made usable on the device: in a slot (held while this lives) or uploaded for one
/// call.
pub(crate) struct Staged {
    pub mats: ExpertMats,
    pub parts: Vec<DevBuf>,
    pub hold: Option<SlotHold>,
}

/// The nine parts of an expert, in slot order.
fn parts(e: &HostExpert) -> [&HostMatrix; 3] {
    [&e.gate, &e.up, &e.down]
}

/// The bytes the expert cache may take, and why: `budget` less what is in use (`mem`, after
/// freed buffers went back) and the reserve, or the free memory less the reserve; a budget below
/// what is in use plus the reserve is an error that names the least that would do.
fn cache_bytes(budget: Option<u64>, mem: MemoryInfo) -> Result<(u64, String), BackendError> {
    let used = mem.total.saturating_sub(mem.free);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match budget {
        Some(b) => {
            let need = used + RESERVE_BYTES;
            if b < need {
                return Err(BackendError::Unsupported(format!(
                    "--vram-budget {:.2} GiB is less than the GPU memory in use with the resident \
                     weights ({:.2} GiB) plus {:.0} GiB for activations and caches: give at least \
                     {:.2} GiB",
                    gib(b),
                    gib(used),
                    gib(RESERVE_BYTES),
                    gib(need)
                )));
            }
            Ok((
                b - need,
                format!(
                    "--vram-budget {:.2} GiB minus {:.2} GiB in use and {:.0} GiB reserved",
                    gib(b),
                    gib(used),
                    gib(RESERVE_BYTES)
                ),
            ))
        }
        None => Ok((
            mem.free.saturating_sub(RESERVE_BYTES),
            format!(
                "free GPU memory {:.2} GiB minus {:.0} GiB reserved (--vram-budget to set)",
                gib(mem.free),
                gib(RESERVE_BYTES)
            ),
        )),
    }
}

/// How many slots of the VRAM expert cache `budget` buys (see
/// [`sluice_backend::Backend::plan_expert_cache`]), nothing allocated yet.
pub(crate) fn size_slots(
    d: &Device,
    budget: Option<u64>,
    expert_bytes: u64,
    experts: usize,
) -> Result<ExpertCachePlan, BackendError> {
    // Each of the nine parts may need up to one alignment's padding.
    let slot_bytes = (expert_bytes as usize + 9 * PART_ALIGN).next_multiple_of(PART_ALIGN);
    // Buffers freed earlier (loading, a bandwidth probe) would otherwise count as in use.
    d.trim()?;
    let (bytes, reason) = cache_bytes(budget, d.memory())?;
    let disabled = std::env::var("SLUICE_CUDA_EXPERT_CACHE").is_ok_and(|v| v == "0");
    let slots = if disabled {
        0
    } else {
        (bytes / slot_bytes as u64).min(experts as u64) as usize
    };
    let reason = if disabled {
        "off (SLUICE_CUDA_EXPERT_CACHE=0)".to_string()
    } else {
        reason
    };
    Ok(ExpertCachePlan {
        slots,
        slot_bytes: slot_bytes as u64,
        reason,
    })
}

/// Offsets of the parts in a slot and the bytes they take.
pub(crate) fn slot_layout(e: &HostExpert) -> ([[usize; 3]; 3], usize) {
    let mut at = 0;
    let mut offsets = [[0; 3]; 3];
    for (m, off) in parts(e).iter().zip(&mut offsets) {
        for (bytes, o) in [m.data.as_slice(), m.scales.as_slice(), m.biases.as_slice()]
            .iter()
            .zip(off.iter_mut())
        {
            *o = at;
            at = (at + bytes.len()).next_multiple_of(PART_ALIGN);
        }
    }
    (offsets, at)
}

impl VramExperts {
    /// Sizes the cache (see [`sluice_backend::Backend::plan_expert_cache`]) and allocates it.
    pub(crate) fn plan(
        d: &Device,
        budget: Option<u64>,
        expert_bytes: u64,
        experts: usize,
    ) -> Result<(VramExperts, ExpertCachePlan), BackendError> {
        let plan = size_slots(d, budget, expert_bytes, experts)?;
        let (slots, slot_bytes) = (plan.slots, plan.slot_bytes as usize);
        let memory = match slots {
            0 => None,
            n => Some(d.alloc(n * slot_bytes, "the VRAM expert cache")?),
        };
        Ok((
            VramExperts {
                table: SlotTable::new(slots),
                memory,
                slot_bytes,
                mats: vec![ExpertMats::default(); slots],
                pending: Vec::new(),
                stats: ExpertCacheStats::default(),
            },
            plan,
        ))
    }

    pub(crate) fn stats(&mut self, d: &Device) -> ExpertCacheStats {
        self.release(d);
        self.stats.clone()
    }

    pub(crate) fn holds(&self, key: ExpertKey) -> bool {
        self.table.holds(key)
    }

    /// `key` if a slot holds it (one use counted either way).
    pub(crate) fn find(&mut self, key: ExpertKey) -> Option<Staged> {
        self.table.touch(key);
        let (slot, hold) = self.table.lookup(key)?;
        self.stats.hits += 1;
        Some(Staged {
            mats: self.mats[slot],
            parts: Vec::new(),
            hold: Some(hold),
        })
    }

    /// Uploads `host` into a slot, or for this call only when the cache decides against keeping
    /// it (or it does not fit a slot).
    pub(crate) fn stage(
        &mut self,
        d: &Device,
        key: ExpertKey,
        host: HostExpert,
        pinned: bool,
    ) -> Result<Staged, BackendError> {
        self.release(d);
        let (offsets, bytes) = slot_layout(&host);
        let claim = match &self.memory {
            Some(_) if bytes <= self.slot_bytes => self.table.claim(key),
            _ => Claim::Bypass,
        };
        let start = d.timing_event();
        let staged = match claim {
            Claim::Slot { slot, evicted } => {
                let base =
                    self.memory.as_ref().map_or(0, DevBuf::ptr) + (slot * self.slot_bytes) as u64;
                // One copy for the whole block where the parts lie together (the store's layout);
                // from pageable memory the driver stages it anyway.
                let copied = upload_expert(
                    d,
                    Lane::Compute,
                    &host,
                    base,
                    (self.slot_bytes, &offsets),
                    pinned,
                );
                match copied {
                    Ok(mats) => {
                        self.stats.misses += 1;
                        self.stats.evictions += evicted.is_some() as u64;
                        self.mats[slot] = mats;
                        Staged {
                            mats,
                            parts: Vec::new(),
                            hold: Some(self.table.hold(slot)),
                        }
                    }
                    Err(e) => {
                        self.table.clear(slot);
                        return Err(e);
                    }
                }
            }
            Claim::Bypass => {
                let mut parts = Vec::with_capacity(9);
                let mut mats = [Mat::default(); 3];
                for (m, mat) in self::parts(&host).iter().zip(&mut mats) {
                    m.as_ref().validate()?;
                    *mat = describe(m)?;
                    let mut ptrs = [0u64; 3];
                    for (bytes, p) in [m.data.as_slice(), m.scales.as_slice(), m.biases.as_slice()]
                        .iter()
                        .zip(&mut ptrs)
                    {
                        if bytes.is_empty() {
                            continue;
                        }
                        let buf = d.alloc(bytes.len(), "a streamed expert")?;
                        d.copy_to_device(buf.ptr, bytes)?;
                        *p = buf.ptr;
                        parts.push(buf);
                    }
                    (mat.data, mat.scales, mat.biases) = (ptrs[0], ptrs[1], ptrs[2]);
                }
                self.stats.bypassed += 1;
                Staged {
                    mats: ExpertMats {
                        gate: mats[0],
                        up: mats[1],
                        down: mats[2],
                    },
                    parts,
                    hold: None,
                }
            }
        };
        let end = d.timing_event();
        let moved: u64 = parts(&host)
            .iter()
            .map(|m| (m.data.len() + m.scales.len() + m.biases.len()) as u64)
            .sum();
        self.stats.bytes_uploaded += moved;
        if pinned {
            self.stats.bytes_pinned += moved;
        }
        self.pending.push(Pending {
            issued_at: d.sync_count(),
            _host: host,
            timing: start.zip(end),
        });
        Ok(staged)
    }

    /// Lets go of the host memory of uploads that have finished (the stream synchronised since),
    /// adding their copy time to the counters.
    pub(crate) fn release(&mut self, d: &Device) {
        // Reading the events needs the context on this thread (a server's metrics thread).
        if d.bind().is_err() {
            return;
        }
        let now = d.sync_count();
        self.pending.retain(|p| {
            if p.issued_at >= now {
                return true;
            }
            if let Some((a, b)) = &p.timing {
                if let Ok(ms) = a.elapsed_ms(b) {
                    self.stats.upload_secs += ms as f64 / 1e3;
                }
            }
            false
        });
    }
}

/// The block holding all of `host`'s parts (from the first to the end of the last), when they
/// are ranges of one buffer with little between them, as the expert store keeps them.
pub(crate) fn block_span(host: &HostExpert) -> Option<std::ops::Range<usize>> {
    let all: Vec<&sluice_backend::HostBytes> = parts(host)
        .iter()
        .flat_map(|m| [&m.data, &m.scales, &m.biases])
        .filter(|b| !b.is_empty())
        .collect();
    let first = all.first()?;
    if !all.iter().all(|b| b.same_buffer(first)) {
        return None;
    }
    let start = all.iter().map(|b| b.range().start).min()?;
    let end = all.iter().map(|b| b.range().end).max()?;
    let total: usize = all.iter().map(|b| b.len()).sum();
    // Only alignment padding between parts (the store aligns each to 64 bytes), and each part
    // where the kernels' widest loads may read it (16-byte aligned in the slot).
    let aligned = all.iter().all(|b| (b.range().start - start) % 16 == 0);
    (aligned && end - start <= total + 64 * all.len()).then_some(start..end)
}

/// Copies `host` into the slot of `slot_bytes` at `base`: in one copy where its parts lie together
/// (the store's layout), fit the slot and `whole` allows it, else part by part at `offsets`
/// ([`slot_layout`]).
pub(crate) fn upload_expert(
    d: &Device,
    lane: Lane,
    host: &HostExpert,
    base: u64,
    (slot_bytes, offsets): (usize, &[[usize; 3]; 3]),
    whole: bool,
) -> Result<ExpertMats, BackendError> {
    match block_span(host) {
        Some(span) if whole && span.len() <= slot_bytes => upload_block(d, lane, host, base, span),
        _ => upload_into(d, lane, host, base, offsets),
    }
}

/// Copies the block `span` of `host`'s buffer into the slot at `base` in one copy, and
/// describes each part at its offset there.
pub(crate) fn upload_block(
    d: &Device,
    lane: Lane,
    host: &HostExpert,
    base: u64,
    span: std::ops::Range<usize>,
) -> Result<ExpertMats, BackendError> {
    d.copy_to_device_in(lane, base, host.gate.data.buffer_slice(span.clone()))?;
    let at = |b: &sluice_backend::HostBytes| -> u64 {
        if b.is_empty() {
            0
        } else {
            base + (b.range().start - span.start) as u64
        }
    };
    let mut mats = [Mat::default(); 3];
    for (m, mat) in parts(host).iter().zip(&mut mats) {
        m.as_ref().validate()?;
        *mat = describe(m)?;
        (mat.data, mat.scales, mat.biases) = (at(&m.data), at(&m.scales), at(&m.biases));
    }
    Ok(ExpertMats {
        gate: mats[0],
        up: mats[1],
        down: mats[2],
    })
}

/// Copies the nine parts of `host` into the slot at `base` and describes them there.
pub(crate) fn upload_into(
    d: &Device,
    lane: Lane,
    host: &HostExpert,
    base: u64,
    offsets: &[[usize; 3]; 3],
) -> Result<ExpertMats, BackendError> {
    let mut mats = [Mat::default(); 3];
    for ((m, off), mat) in parts(host).iter().zip(offsets).zip(&mut mats) {
        m.as_ref().validate()?;
        *mat = describe(m)?;
        let mut ptrs = [0u64; 3];
        for ((bytes, o), p) in [m.data.as_slice(), m.scales.as_slice(), m.biases.as_slice()]
            .iter()
            .zip(off)
            .zip(&mut ptrs)
        {
            if bytes.is_empty() {
                continue;
            }
            *p = base + *o as u64;
            d.copy_to_device_in(lane, *p, bytes)?;
        }
        (mat.data, mat.scales, mat.biases) = (ptrs[0], ptrs[1], ptrs[2]);
    }
    Ok(ExpertMats {
        gate: mats[0],
        up: mats[1],
        down: mats[2],
    })
}

/// Host memory page-locked by a [`CudaPinner`] and not yet unlocked: (address, length, the
/// address the device reads it at when the driver mapped it).
pub(crate) type PinnedRanges = Arc<Mutex<Vec<(usize, usize, Option<u64>)>>>;

/// The range of `ranges` that holds all of `bytes`.
fn pinned_range(ranges: &PinnedRanges, bytes: &[u8]) -> Option<(usize, usize, Option<u64>)> {
    let (a, n) = (bytes.as_ptr() as usize, bytes.len());
    let r = ranges.lock().unwrap_or_else(|p| p.into_inner());
    r.iter()
        .find(|&&(start, len, _)| a >= start && a + n <= start + len)
        .copied()
}

/// Whether `bytes` lies in one of `ranges`.
pub(crate) fn is_pinned(ranges: &PinnedRanges, bytes: &[u8]) -> bool {
    pinned_range(ranges, bytes).is_some()
}

/// Where the device reads `bytes` in place, when they lie in one of `ranges` and it is mapped.
pub(crate) fn device_address(ranges: &PinnedRanges, bytes: &[u8]) -> Option<u64> {
    let (start, _, device) = pinned_range(ranges, bytes)?;
    Some(device? + (bytes.as_ptr() as usize - start) as u64)
}

/// Page-locks host memory with the driver (`cuMemHostRegister`).
pub(crate) struct CudaPinner {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) ranges: PinnedRanges,
}

struct CudaPinned {
    ctx: Arc<CudaContext>,
    addr: usize,
    ranges: PinnedRanges,
}

impl PinnedRegion for CudaPinned {}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        self.ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|r| r.0 != self.addr);
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `addr` was registered by `CudaPinner::pin` and not yet unregistered; the
            // owner of the memory drops this region before freeing it.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.addr as *mut _) };
        }
    }
}

impl HostPinner for CudaPinner {
    fn pin(&self, addr: usize, len: usize) -> Result<Box<dyn PinnedRegion>, BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| BackendError::Device(format!("CUDA binding the context: {e}")))?;
        use cudarc::driver::sys;
        // Mapped too, so that kernels can read experts in place (see `in_place`).
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller owns `len` bytes at `addr` and keeps them allocated while the
        // returned region lives (it unregisters them when dropped).
        unsafe { sys::cuMemHostRegister_v2(addr as *mut _, len, flags) }
            .result()
            .map_err(|e| {
                BackendError::Device(format!(
                    "could not page-lock the {:.2} GiB expert cache for GPU copies ({e}); copies \
                     from it will be slower",
                    len as f64 / (1u64 << 30) as f64
                ))
            })?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `addr` was registered with DEVICEMAP just above; the driver writes `device`.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, addr as *mut _, 0) }
            .result()
            .is_ok();
        self.ranges.lock().unwrap_or_else(|p| p.into_inner()).push((
            addr,
            len,
            mapped.then_some(device),
        ));
        Ok(Box::new(CudaPinned {
            ctx: self.ctx.clone(),
            addr,
            ranges: self.ranges.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_backend::{Dtype, FfnWeights, HostBytes, WeightFormat};

    /// A bf16 matrix `[rows, cols]` at `start` of `buffer`.
    fn bf16(buffer: &Arc<Vec<u8>>, start: usize, rows: usize, cols: usize) -> HostMatrix {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = buffer.clone();
        HostMatrix::new(
            WeightFormat::Dense(Dtype::Bf16),
            rows,
            cols,
            HostBytes::new(owner, start..start + rows * cols * 2),
            HostBytes::empty(),
            HostBytes::empty(),
        )
        .unwrap()
    }

    /// An expert of three [8, 16] bf16 parts (256 bytes each) at `starts` of one buffer.
    fn expert_at(starts: [usize; 3]) -> HostExpert {
        let buffer = Arc::new(vec![0u8; 4096]);
        FfnWeights {
            gate: bf16(&buffer, starts[0], 8, 16),
            up: bf16(&buffer, starts[1], 8, 16),
            down: bf16(&buffer, starts[2], 8, 16),
        }
    }

    #[test]
    fn a_block_is_one_span_from_its_first_part_to_its_last() {
        // The store's layout: parts one after another, 64-byte aligned.
        assert_eq!(block_span(&expert_at([128, 384, 640])), Some(128..896));
        // Alignment padding between parts is allowed.
        assert_eq!(block_span(&expert_at([0, 320, 640])), Some(0..896));
    }

    #[test]
    fn scattered_or_misaligned_parts_are_copied_one_by_one() {
        // Far apart: the span would copy mostly bytes that are no part.
        assert_eq!(block_span(&expert_at([0, 1024, 3072])), None);
        // A part the kernels could not load from its offset in the slot.
        assert_eq!(block_span(&expert_at([0, 264, 520])), None);
        // Parts of different buffers.
        let mut e = expert_at([0, 256, 512]);
        e.up = bf16(&Arc::new(vec![0u8; 512]), 0, 8, 16);
        assert_eq!(block_span(&e), None);
    }

    #[test]
    fn the_cache_gets_what_the_budget_leaves() {
        const GIB: u64 = 1 << 30;
        // 80 GiB card, 3 GiB in use (context and resident weights), 77 free.
        let mem = MemoryInfo {
            free: 77 * GIB,
            total: 80 * GIB,
        };
        let (bytes, why) = cache_bytes(Some(8 * GIB), mem).unwrap();
        assert_eq!(bytes, 8 * GIB - 3 * GIB - RESERVE_BYTES);
        assert!(
            why.contains("--vram-budget 8.00 GiB minus 3.00 GiB in use"),
            "{why}"
        );
        let (bytes, why) = cache_bytes(None, mem).unwrap();
        assert_eq!(bytes, 77 * GIB - RESERVE_BYTES);
        assert!(why.contains("free GPU memory"), "{why}");
        // Exactly what is in use plus the reserve: an empty cache, not an error.
        assert_eq!(
            cache_bytes(Some(3 * GIB + RESERVE_BYTES), mem).unwrap().0,
            0
        );
        let err = cache_bytes(Some(2 * GIB), mem).unwrap_err().to_string();
        assert!(err.contains("give at least 4.00 GiB"), "{err}");
        assert!(
            !err.contains('\n') && !err.contains("  "),
            "one tidy line: {err}"
        );
    }

    #[test]
    fn host_bytes_are_found_in_their_locked_range_and_mapped_at_its_offset() {
        let buf = vec![0u8; 4096];
        let base = buf.as_ptr() as usize;
        let ranges = PinnedRanges::default();
        ranges
            .lock()
            .unwrap()
            .extend([(base, 1024, Some(0x7000_0000)), (base + 2048, 1024, None)]);
        // Inside the mapped range: the device address at the same offset.
        assert_eq!(
            device_address(&ranges, &buf[100..200]),
            Some(0x7000_0000 + 100)
        );
        assert!(is_pinned(&ranges, &buf[100..200]));
        // Running past the range's end: not locked as a whole.
        assert_eq!(device_address(&ranges, &buf[1000..1100]), None);
        assert!(!is_pinned(&ranges, &buf[1000..1100]));
        // Locked but not mapped: copies are fast, the kernels cannot read it in place.
        assert!(is_pinned(&ranges, &buf[2048..2100]));
        assert_eq!(device_address(&ranges, &buf[2048..2100]), None);
    }

    #[test]
    fn the_slot_layout_aligns_every_part() {
        let (offsets, bytes) = slot_layout(&expert_at([0, 256, 512]));
        // Data only (bf16 has no scales or biases): 256 bytes each, on 256-byte boundaries.
        assert_eq!(offsets[0][0], 0);
        assert_eq!(offsets[1][0], 256);
        assert_eq!(offsets[2][0], 512);
        assert!(offsets.iter().flatten().all(|o| o % PART_ALIGN == 0));
        assert_eq!(bytes, 768);
    }
}
