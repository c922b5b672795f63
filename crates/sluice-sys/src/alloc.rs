//! [`LargePages`]: the global allocator of sluice's binary. Large buffers (a prompt pass's
//! activations, hundreds of MB each, allocated and freed every layer) come from their own
//! mappings marked for transparent huge pages; everything else from the system allocator.
//!
//! Why: a fresh buffer is faulted in 4 KiB at a time, and those faults do not scale with
//! threads. On the lent 16-core Xeon a norm over an 8192-token pass (64 MB out) took 32 ms
//! where its arithmetic needs ~2; with 2 MiB pages a buffer takes 512 times fewer faults.
//!
//! `SLUICE_HUGE_PAGES=0` keeps the mappings but asks for no huge pages (where the kernel's
//! compaction to find them stalls a machine short of memory).

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
#[cfg(target_os = "linux")]
use std::sync::atomic::{AtomicU8, Ordering};

/// Allocations from this size on get their own mapping.
const LARGE: usize = 4 << 20;
/// The largest alignment a mapping is known to have (a page).
const PAGE: usize = 4096;

/// See the module doc. Declared in the binary with `#[global_allocator]`.
pub struct LargePages;

fn large(layout: &Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= PAGE
}

/// Whether to ask for huge pages: 0 unknown yet, 1 yes, 2 no.
#[cfg(target_os = "linux")]
static HUGE: AtomicU8 = AtomicU8::new(0);

#[cfg(target_os = "linux")]
fn huge_pages() -> bool {
    match HUGE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // `getenv`, not `std::env`: an allocator must not allocate.
            // SAFETY: a NUL-terminated name; the value is read at once, before any other call.
            let off = unsafe {
                let v = libc::getenv(c"SLUICE_HUGE_PAGES".as_ptr());
                !v.is_null() && *v == b'0' as libc::c_char
            };
            HUGE.store(if off { 2 } else { 1 }, Ordering::Relaxed);
            !off
        }
    }
}

#[cfg(target_os = "linux")]
fn map(size: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping of `size` bytes at an address of the kernel's choice
    // touches no existing memory; failure is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    if huge_pages() {
        // SAFETY: `p..p + size` is the mapping just made; the advice only changes how it is
        // backed (and is ignored where transparent huge pages are off).
        unsafe { libc::madvise(p, size, libc::MADV_HUGEPAGE) };
    }
    p.cast()
}

// SAFETY: large blocks are whole mappings of at least their size, page-aligned (every alignment
// `large` admits), zeroed by the kernel, unmapped once with the size they were made with; the
// rest is the system allocator's.
#[cfg(target_os = "linux")]
unsafe impl GlobalAlloc for LargePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if large(&layout) {
            return map(layout.size());
        }
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if large(&layout) {
            // A fresh anonymous mapping reads as zeros.
            return map(layout.size());
        }
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if large(&layout) {
            // SAFETY: `ptr` came from `map(layout.size())` (the same layout, by the caller's
            // contract) and is unmapped once.
            unsafe { libc::munmap(ptr.cast(), layout.size()) };
            return;
        }
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract: `new_size` is valid for `layout.align()`.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (large(&layout), large(&new)) {
            (true, true) => {
                // SAFETY: `ptr` is a mapping of `layout.size()` bytes; the kernel moves its pages
                // (no copy) to a mapping of `new_size`, page-aligned, or fails with the old one
                // left as it was.
                let p = unsafe {
                    libc::mremap(ptr.cast(), layout.size(), new_size, libc::MREMAP_MAYMOVE)
                };
                if p == libc::MAP_FAILED {
                    std::ptr::null_mut()
                } else {
                    p.cast()
                }
            }
            // SAFETY: both blocks are the system allocator's.
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            _ => {
                // Across the threshold: a new block, the common bytes copied, the old one freed.
                // SAFETY: `new` is a valid layout of non-zero size (`new_size` > 0 by contract).
                let p = unsafe { self.alloc(new) };
                if !p.is_null() {
                    // SAFETY: both blocks hold at least the smaller size and do not overlap.
                    unsafe { std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size)) };
                    // SAFETY: `ptr` was allocated by `self` with `layout`.
                    unsafe { self.dealloc(ptr, layout) };
                }
                p
            }
        }
    }
}

// Elsewhere: the system allocator alone.
// SAFETY: every call is passed on to `System` unchanged.
#[cfg(not(target_os = "linux"))]
unsafe impl GlobalAlloc for LargePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_are_zeroed_grow_and_shrink_across_the_threshold() {
        let a = LargePages;
        for (from, to) in [
            (LARGE, 3 * LARGE + 123),
            (LARGE + 5, 100),
            (100, LARGE * 2),
            (64, 128),
        ] {
            let layout = Layout::from_size_align(from, 8).unwrap();
            // SAFETY: non-zero sizes; each block is written within its size and freed once with
            // its layout.
            unsafe {
                let p = a.alloc_zeroed(layout);
                assert!(!p.is_null());
                let s = std::slice::from_raw_parts_mut(p, from);
                assert!(s.iter().all(|&b| b == 0), "zeroed");
                s.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
                let q = a.realloc(p, layout, to);
                assert!(!q.is_null());
                let s = std::slice::from_raw_parts(q, from.min(to));
                assert!(s.iter().enumerate().all(|(i, &b)| b == i as u8), "kept");
                a.dealloc(q, Layout::from_size_align(to, 8).unwrap());
            }
        }
    }
}
