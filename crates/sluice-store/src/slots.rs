//! The cache slots: their memory (one aligned allocation, [`Slab`]) and the life of each slot
//! (empty, loading, ready or failed; [`Status`]), with the tags that tie a completed read to the
//! assignment it was issued for.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::error::StoreError;
use crate::manifest::BLOCK_ALIGN;

/// Generations are carried in 24 bits of a read tag.
const GENERATION_MASK: u32 = 0xff_ffff;

/// Read tags: slot, part index (unpacked reads of one slot), generation.
pub(crate) fn tag(slot: usize, part: usize, generation: u32) -> u64 {
    (slot as u64) << 32 | (part as u64 & 0xff) << 24 | (generation & GENERATION_MASK) as u64
}

pub(crate) fn untag(tag: u64) -> (usize, usize, u32) {
    (
        (tag >> 32) as usize,
        ((tag >> 24) & 0xff) as usize,
        tag as u32 & GENERATION_MASK,
    )
}

/// Why a slot's block cannot be used.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failure {
    pub(crate) msg: String,
    /// Which of the block's reads failed (0 when the block as a whole is bad): locates the
    /// failure on disk when it is reported.
    pub(crate) part: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Status {
    Empty,
    /// Reads in flight: `parts_left` of the assignment's reads have not completed; `failure` is
    /// the first failure among those that have.
    Loading {
        parts_left: u32,
        failure: Option<Failure>,
    },
    Ready,
    Failed(Failure),
}

pub(crate) struct Slot {
    /// (index into the manifest's layers, expert).
    pub(crate) key: Option<(usize, u32)>,
    pub(crate) status: Status,
    /// Leases alive plus one while a prefetch holds it for its layer.
    pub(crate) pins: u32,
    pub(crate) last_use: u64,
    /// Bumped on every (re)assignment, carried in read tags (24 bits), so that a completion of
    /// an earlier assignment is ignored.
    pub(crate) generation: u32,
}

impl Slot {
    pub(crate) fn empty() -> Slot {
        Slot {
            key: None,
            status: Status::Empty,
            pins: 0,
            last_use: 0,
            generation: 0,
        }
    }

    pub(crate) fn is_loading(&self) -> bool {
        matches!(self.status, Status::Loading { .. })
    }

    pub(crate) fn unpin(&mut self) {
        self.pins = self.pins.saturating_sub(1);
    }

    /// Starts a new assignment to `key`, filled by `reads` reads (ready at once when there are
    /// none). Returns the key it held before (evicted) and the generation to tag the reads with.
    pub(crate) fn assign(
        &mut self,
        key: (usize, u32),
        reads: usize,
    ) -> (Option<(usize, u32)>, u32) {
        let evicted = self.key.replace(key);
        self.generation = self.generation.wrapping_add(1) & GENERATION_MASK;
        self.status = if reads == 0 {
            Status::Ready
        } else {
            Status::Loading {
                parts_left: reads as u32,
                failure: None,
            }
        };
        (evicted, self.generation)
    }

    /// Counts read `part` of assignment `generation` as completed with `result`. True when it
    /// was the assignment's last read (the block is then checked and [`Slot::finish`]ed).
    pub(crate) fn part_done(
        &mut self,
        generation: u32,
        part: usize,
        result: std::io::Result<()>,
    ) -> bool {
        if self.generation != generation {
            return false;
        }
        let Status::Loading {
            parts_left,
            failure,
        } = &mut self.status
        else {
            return false;
        };
        if *parts_left == 0 {
            return false;
        }
        *parts_left -= 1;
        if let Err(e) = result {
            failure.get_or_insert_with(|| Failure {
                msg: e.to_string(),
                part,
            });
        }
        *parts_left == 0
    }

    /// Ends the loading of assignment `generation`, all of whose reads are in: ready, or failed
    /// by its first failed read or else by what `checked` says (a bad checksum, a block that
    /// did not convert). `None` when the slot is no longer loading that assignment; else whether
    /// it failed.
    pub(crate) fn finish(&mut self, generation: u32, checked: Result<(), String>) -> Option<bool> {
        if self.generation != generation {
            return None;
        }
        let Status::Loading { failure, .. } = &mut self.status else {
            return None;
        };
        let failure = failure
            .take()
            .or_else(|| checked.err().map(|msg| Failure { msg, part: 0 }));
        let failed = failure.is_some();
        self.status = failure.map_or(Status::Ready, Status::Failed);
        Some(failed)
    }
}

/// The size of a transparent huge page on x86-64 and most arm64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// The slots' memory: one allocation, aligned for O_DIRECT.
pub(crate) struct Slab {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_bytes: usize,
    /// Page-locked for a device's copies (see [`Slab::pin`]); unlocked before the memory is freed.
    pinned: Option<Box<dyn sluice_backend::PinnedRegion>>,
}

// SAFETY: the slab is plain memory; which thread may touch which slot is governed by the store's
// state (a slot is written only while Loading and unpinned, read only while pinned and Ready).
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Slab {
    /// Memory for `slots` slots of `slot_bytes` each (left uninitialised: every slot is written
    /// before it is handed out).
    pub(crate) fn new(slots: usize, slot_bytes: usize) -> Result<Slab, StoreError> {
        let size = slots.max(1) * slot_bytes.max(1);
        // Huge-page aligned when large enough to hold one, so that the kernel can back it with
        // transparent huge pages (below): far fewer page faults while the cache first fills,
        // and fewer TLB misses while the kernels stream cached experts.
        let align = if size >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            BLOCK_ALIGN as usize
        };
        let layout = Layout::from_size_align(size, align)
            .map_err(|e| StoreError::Memory(format!("expert cache layout: {e}")))?;
        // SAFETY: the layout has a non-zero size. The memory is left uninitialised: every slot is
        // written by a read before it is handed out.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            StoreError::Memory(format!(
                "could not allocate an expert cache of {} bytes; lower --expert-cache",
                layout.size()
            ))
        })?;
        #[cfg(target_os = "linux")]
        if align == HUGE_PAGE {
            // SAFETY: the range is exactly the allocation just made. The advice changes only
            // how the kernel backs the pages; failure (THP disabled) leaves 4 KiB pages.
            unsafe {
                libc::madvise(ptr.as_ptr().cast(), layout.size(), libc::MADV_HUGEPAGE);
            }
        }
        Ok(Slab {
            ptr,
            layout,
            slot_bytes,
            pinned: None,
        })
    }

    /// Page-locks the whole slab with `pinner` (a GPU backend's), so that experts copy from it
    /// to the device at the link's full speed.
    pub(crate) fn pin(&mut self, pinner: &dyn sluice_backend::HostPinner) -> Result<(), String> {
        let region = pinner
            .pin(self.ptr.as_ptr() as usize, self.layout.size())
            .map_err(|e| e.to_string())?;
        self.pinned = Some(region);
        Ok(())
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes allocated.
    pub(crate) fn size(&self) -> usize {
        self.layout.size()
    }

    /// The first byte of slot `slot` (`slot` < the number of slots).
    pub(crate) fn slot_ptr(&self, slot: usize) -> *mut u8 {
        // SAFETY: `slot < slots`, so the offset stays inside the allocation.
        unsafe { self.ptr.as_ptr().add(slot * self.slot_bytes) }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // Unlocked while the memory is still allocated.
        drop(self.pinned.take());
        // SAFETY: allocated in `Slab::new` with exactly this layout; no lease outlives the
        // store's Inner, which owns the slab (leases hold an Arc to it).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_wrap_the_generation() {
        assert_eq!(untag(tag(7, 3, 42)), (7, 3, 42));
        assert_eq!(untag(tag(1 << 20, 8, GENERATION_MASK)).2, GENERATION_MASK);
        assert_eq!(untag(tag(0, 0, GENERATION_MASK + 1)).2, 0);
    }

    #[test]
    fn a_slot_keeps_its_first_failure_and_ignores_stale_reads() {
        let mut s = Slot::empty();
        let (evicted, g) = s.assign((0, 5), 3);
        assert_eq!(evicted, None);
        assert!(s.is_loading());
        // A completion of an earlier assignment changes nothing.
        assert!(!s.part_done(g.wrapping_sub(1), 0, Ok(())));
        assert!(!s.part_done(g, 0, Ok(())));
        let eof = || Err(std::io::Error::other("end of file"));
        assert!(!s.part_done(g, 2, eof()));
        assert!(s.part_done(g, 1, Err(std::io::Error::other("later"))));
        assert_eq!(s.finish(g + 1, Ok(())), None);
        assert_eq!(s.finish(g, Ok(())), Some(true));
        assert_eq!(
            s.status,
            Status::Failed(Failure {
                msg: "end of file".into(),
                part: 2
            })
        );
        // Reassigned: the old key is evicted, a bad checksum fails the block.
        let (evicted, g) = s.assign((1, 0), 1);
        assert_eq!(evicted, Some((0, 5)));
        assert!(s.part_done(g, 0, Ok(())));
        assert_eq!(s.finish(g, Err("checksum mismatch".into())), Some(true));
        assert!(matches!(&s.status, Status::Failed(f) if f.msg == "checksum mismatch"));
        let (_, g) = s.assign((1, 0), 1);
        assert!(s.part_done(g, 0, Ok(())));
        assert_eq!(s.finish(g, Ok(())), Some(false));
        assert_eq!(s.status, Status::Ready);
        // No reads: ready at once.
        s.assign((2, 0), 0);
        assert_eq!(s.status, Status::Ready);
    }
}
