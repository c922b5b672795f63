//! Which expert blocks are checked against their checksums after a read.
//!
//! The checksums are there to catch a damaged or changed blocks file: an interrupted copy, a
//! file rewritten under a running server. Checking every read costs a pass over every byte read
//! (xxh3 of ~100 MB a token on the thread about to use them, bound by one core's memory reads);
//! checking a block only the first time it is read catches the same damage, provided the
//! record of what was checked is forgotten whenever the file changes. The file's identity,
//! size and modification and change times are compared after every batch of reads; a read that
//! was assigned before a change is checked again.
//!
//! A change the file's times cannot show (the same bytes count rewritten within one tick of the
//! kernel's coarse clock, a few milliseconds, after the last comparison; a disk returning other
//! bytes without an error) is caught only by [`Verify::Always`].

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::Mutex;

use crate::manifest::Manifest;

/// When a block read from a packed directory is checked against its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// Never.
    Off,
    /// The first time each block is read, and again after the blocks file changes.
    #[default]
    Once,
    /// Every read.
    Always,
}

/// What makes a file "the same" between two looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(path: &std::path::Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// The blocks checked since the file last changed ([`Verify::Once`]).
///
/// Epochs count the changes seen. A block is marked with the epoch it was checked in (plus one:
/// zero is "never"), and each slot with the epoch its reads were assigned in; a read may skip
/// the check only when both equal the epoch seen after it completed, that is when no change was
/// seen between its assignment and its completion.
pub(crate) struct Checked {
    path: PathBuf,
    /// First block index of each manifest layer.
    first: Vec<usize>,
    done: Box<[AtomicU32]>,
    assigned: Box<[AtomicU32]>,
    /// The last stamp seen; the current epoch beside it, read without the lock on the path of
    /// every read and changed only under it.
    seen: Mutex<Option<Stamp>>,
    epoch: AtomicU32,
}

impl Checked {
    pub(crate) fn new(path: PathBuf, manifest: &Manifest, slots: usize) -> Checked {
        let mut first = Vec::with_capacity(manifest.layers.len());
        let mut total = 0;
        for l in &manifest.layers {
            first.push(total);
            total += l.experts;
        }
        let seen = stamp(&path);
        Checked {
            path,
            first,
            done: (0..total).map(|_| AtomicU32::new(0)).collect(),
            assigned: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            seen: Mutex::new(seen),
            epoch: AtomicU32::new(0),
        }
    }

    fn epoch(&self) -> u32 {
        self.epoch.load(SeqCst)
    }

    /// Notes that `slot`'s reads are being assigned now.
    pub(crate) fn assigning(&self, slot: usize) {
        self.assigned[slot].store(self.epoch(), Relaxed);
    }

    /// Looks at the file again and returns the epoch: a new one when it changed, or when it
    /// cannot be looked at (then nothing is taken as checked).
    pub(crate) fn refresh(&self) -> u32 {
        let now = stamp(&self.path);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if now.is_none() || now != *seen {
            *seen = now;
            self.epoch.fetch_add(1, SeqCst);
        }
        self.epoch()
    }

    /// Whether the block `(li, e)` just read into `slot` needs no check in `epoch`.
    pub(crate) fn skips(&self, epoch: u32, slot: usize, (li, e): (usize, u32)) -> bool {
        self.assigned[slot].load(Relaxed) == epoch
            && self.done[self.first[li] + e as usize].load(Relaxed) == epoch.wrapping_add(1)
    }

    /// Records that the block read into `slot` checked out, if no change was seen since its
    /// reads were assigned.
    pub(crate) fn passed(&self, epoch: u32, slot: usize, (li, e): (usize, u32)) {
        if self.assigned[slot].load(Relaxed) == epoch {
            self.done[self.first[li] + e as usize].store(epoch.wrapping_add(1), Relaxed);
        }
    }
}
