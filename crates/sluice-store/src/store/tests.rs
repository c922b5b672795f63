use super::*;
use crate::io::IoKind;
use crate::manifest::{LayerExperts, Manifest, EXPERTS_FILE, MANIFEST_FILE};
use sluice_backend::{Dtype, WeightFormat};

/// A packed directory with one layer of `experts` tiny bf16 experts; block `e` is filled
/// with byte `e`.
fn tiny_store(experts: usize) -> (tempfile::TempDir, Manifest) {
    let dir = tempfile::tempdir().unwrap();
    let f = WeightFormat::Dense(Dtype::Bf16);
    let projs = vec![
        ("gate_proj".to_string(), 4, 64, f),
        ("up_proj".to_string(), 4, 64, f),
        ("down_proj".to_string(), 64, 4, f),
    ];
    let mut l = LayerExperts::plan(0, "model.layers.0.mlp".into(), experts, 0, &projs);
    let mut bytes = Vec::new();
    for e in 0..experts {
        let block = vec![e as u8; l.stride as usize];
        l.checksums.push(checksum(&block));
        bytes.extend(block);
    }
    std::fs::write(dir.path().join(EXPERTS_FILE), bytes).unwrap();
    let m = Manifest::new(vec![l]);
    std::fs::write(
        dir.path().join(MANIFEST_FILE),
        serde_json::to_string(&m).unwrap(),
    )
    .unwrap();
    (dir, m)
}

fn open(dir: &Path, slots: usize, policy: Policy) -> ExpertStore {
    open_with(dir, slots, policy, None)
}

fn open_with(dir: &Path, slots: usize, policy: Policy, pinner: Option<Pinner>) -> ExpertStore {
    open_verifying(dir, slots, policy, pinner, Verify::Once)
}

fn open_verifying(
    dir: &Path,
    slots: usize,
    policy: Policy,
    pinner: Option<Pinner>,
    verify: Verify,
) -> ExpertStore {
    let m = Manifest::open(dir).unwrap().unwrap();
    let opts = StoreOptions {
        cache_bytes: slots as u64 * m.max_stride(),
        policy,
        io: ReaderOptions {
            kind: IoKind::Auto,
            direct: true,
            queue_depth: 4,
            faults: None,
        },
        verify,
        min_slots: 1,
        pinner,
    };
    ExpertStore::open(dir, &opts).unwrap()
}

#[test]
fn fetched_blocks_hold_their_expert_and_stay_pinned() {
    let (dir, _) = tiny_store(8);
    let store = open(dir.path(), 2, Policy::Lru);
    let got = store.fetch(0, &[3, 5]).unwrap();
    assert_eq!(got[0].gate.data.as_slice()[0], 3);
    assert_eq!(got[1].down.data.as_slice()[7], 5);
    // Both slots are pinned by `got`: a third expert cannot be placed.
    let err = store.fetch(0, &[6]).err().expect("no free slot");
    assert!(err.to_string().contains("slots"), "{err}");
    drop(got);
    let again = store.fetch(0, &[6]).unwrap();
    assert_eq!(again[0].up.data.as_slice()[0], 6);
    let s = store.stats();
    // The refused request counts as asked for and missed, but read nothing.
    assert_eq!((s.requests, s.misses, s.blocks_read), (4, 4, 3));
    assert!(store.fetch(0, &[8]).is_err(), "expert out of range");
    assert!(store.fetch(1, &[0]).is_err(), "layer without experts");
}

#[test]
fn frequency_policy_keeps_a_hot_expert_through_scans_that_flush_lru() {
    // Expert 0 is used between scans of 4 distinct cold experts; the cache has 4 slots.
    let (dir, _) = tiny_store(16);
    let mut hits = Vec::new();
    for policy in [Policy::Lru, Policy::Frequency] {
        let store = open(dir.path(), 4, policy);
        let mut cold = 1u32;
        for _ in 0..40 {
            drop(store.fetch(0, &[0]).unwrap());
            for _ in 0..4 {
                drop(store.fetch(0, &[cold]).unwrap());
                cold = cold % 15 + 1;
            }
        }
        hits.push(store.stats().hits);
    }
    let (lru, freq) = (hits[0], hits[1]);
    assert!(lru <= 2, "LRU hits {lru}");
    assert!(freq >= 35, "frequency hits {freq}");
}

#[test]
fn prefetched_blocks_are_used_by_the_next_fetch() {
    let (dir, _) = tiny_store(8);
    let store = open(dir.path(), 4, Policy::Frequency);
    store.prefetch(0, &[1, 2]);
    let got = store.fetch(0, &[1, 2, 3]).unwrap();
    assert_eq!(got[2].gate.data.as_slice()[0], 3);
    let s = store.stats();
    assert_eq!(s.prefetch_issued, 2);
    assert_eq!(s.prefetch_useful, 2);
    assert_eq!(s.misses, 1);
    assert_eq!(s.blocks_read, 3, "no block read twice");
}

#[test]
fn a_corrupt_block_is_an_error_and_is_not_cached() {
    let (dir, m) = tiny_store(4);
    let path = dir.path().join(EXPERTS_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[m.layers[0].block_offset(2) as usize + 100] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let store = open(dir.path(), 2, Policy::Lru);
    let err = store.fetch(0, &[1, 2]).err().expect("corrupt").to_string();
    assert!(
        err.contains("expert 2") && err.contains("checksum mismatch"),
        "{err}"
    );
    // The good block still works, and the bad one fails again rather than being served.
    assert!(store.fetch(0, &[1]).is_ok());
    assert!(store.fetch(0, &[2]).is_err());
    assert_eq!(store.stats().errors, 2);
}

#[test]
fn a_request_refused_for_lack_of_slots_leaves_its_misses_readable() {
    let (dir, _) = tiny_store(8);
    let store = open(dir.path(), 2, Policy::Lru);
    let held = store.fetch(0, &[0]).unwrap();
    // Expert 1 gets the free slot, expert 2 none: the request is refused.
    assert!(store.fetch(0, &[1, 2]).is_err());
    drop(held);
    let got = store.fetch(0, &[1]).expect("expert 1 was read, not lost");
    assert_eq!(got[0].gate.data.as_slice()[0], 1);
    assert_eq!(store.stats().errors, 0);
}

/// A pinner that records what it locks and when each region is let go (or refuses).
struct FakePinner {
    log: Arc<Mutex<Vec<String>>>,
    refuse: bool,
}

struct FakeRegion {
    log: Arc<Mutex<Vec<String>>>,
    addr: usize,
    len: usize,
}

impl sluice_backend::PinnedRegion for FakeRegion {}

impl Drop for FakeRegion {
    fn drop(&mut self) {
        self.log
            .lock()
            .unwrap()
            .push(format!("unpin {:#x} {}", self.addr, self.len));
    }
}

impl HostPinner for FakePinner {
    fn pin(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<Box<dyn sluice_backend::PinnedRegion>, sluice_backend::BackendError> {
        if self.refuse {
            return Err(sluice_backend::BackendError::Device(
                "no locked memory left".into(),
            ));
        }
        self.log
            .lock()
            .unwrap()
            .push(format!("pin {addr:#x} {len}"));
        Ok(Box::new(FakeRegion {
            log: self.log.clone(),
            addr,
            len,
        }))
    }
}

fn open_pinned(dir: &Path, slots: usize, pinner: FakePinner) -> ExpertStore {
    open_with(
        dir,
        slots,
        Policy::Frequency,
        Some(Pinner(Arc::new(pinner))),
    )
}

#[test]
fn the_cache_is_pinned_whole_and_unpinned_when_the_store_goes() {
    let (dir, m) = tiny_store(4);
    let log = Arc::new(Mutex::new(Vec::new()));
    let store = open_pinned(
        dir.path(),
        3,
        FakePinner {
            log: log.clone(),
            refuse: false,
        },
    );
    assert_eq!(store.pinned(), Some(Ok(())));
    {
        let l = log.lock().unwrap();
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].ends_with(&format!(" {}", store.cache_bytes())),
            "the whole slab: {l:?}"
        );
        assert!(store.cache_bytes() >= 3 * m.max_stride());
    }
    let got = store.fetch(0, &[2]).unwrap();
    assert_eq!(got[0].gate.data.as_slice()[0], 2);
    drop(got);
    drop(store);
    let l = log.lock().unwrap();
    assert_eq!(l.len(), 2, "{l:?}");
    assert_eq!(l[1].replace("unpin", "pin"), l[0], "the same region let go");
}

#[test]
fn a_refused_pin_is_reported_and_the_store_still_works() {
    let (dir, _) = tiny_store(4);
    let store = open_pinned(
        dir.path(),
        2,
        FakePinner {
            log: Arc::new(Mutex::new(Vec::new())),
            refuse: true,
        },
    );
    let why = store.pinned().unwrap().unwrap_err();
    assert!(why.contains("no locked memory left"), "{why}");
    let got = store.fetch(0, &[1, 3]).unwrap();
    assert_eq!(got[1].down.data.as_slice()[0], 3);
    assert_eq!(open(dir.path(), 2, Policy::Lru).pinned(), None);
}

#[test]
fn a_layer_served_elsewhere_lets_its_prefetch_go() {
    let (dir, _) = tiny_store(8);
    let store = open(dir.path(), 2, Policy::Frequency);
    store.prefetch(0, &[1, 2]);
    // Both slots are held for layer 0's next fetch; that layer was served without one (a GPU
    // held its experts), so the holds go and the next token's other experts find room.
    store.release_prefetch(0);
    let got = store.fetch(0, &[5, 6]).unwrap();
    assert_eq!(got[1].gate.data.as_slice()[0], 6);
    let s = store.stats();
    assert_eq!((s.prefetch_issued, s.prefetch_wasted), (2, 2));
}

#[test]
fn the_expert_map_records_each_experts_last_event() {
    const IN: u8 = ExpertMap::IN_CACHE;
    const NEW: u8 = ExpertMap::FRESH;
    let code = |event: ExpertEvent| (event as u8) << 1;
    let (dir, _) = tiny_store(8);
    let store = open(dir.path(), 2, Policy::Lru);
    let map = store.expert_map();
    assert_eq!(map.layers().collect::<Vec<_>>(), vec![(0, 8)]);
    assert_eq!(map.snapshot(true), vec![vec![0; 8]]);
    drop(store.fetch(0, &[1, 2]).unwrap());
    let read = IN | code(ExpertEvent::DemandRead);
    let m = &map.snapshot(true)[0];
    assert_eq!((m[1], m[2], m[3]), (read | NEW, read | NEW, 0));
    assert_eq!(ExpertMap::event(m[1]), Some(ExpertEvent::DemandRead));
    // Cleared: the last event stays, no longer new.
    drop(store.fetch(0, &[2]).unwrap());
    let m = &map.snapshot(false)[0];
    assert_eq!((m[1], m[2]), (read, IN | code(ExpertEvent::Hit) | NEW));
    // Expert 1 is the least recently used: reading 5 ahead takes its slot.
    store.prefetch(0, &[5]);
    let m = &map.snapshot(true)[0];
    assert_eq!(m[1], code(ExpertEvent::Evicted) | NEW, "left the cache");
    assert_eq!(m[5], IN | code(ExpertEvent::ReadAhead) | NEW);
    assert_eq!(map.snapshot(true)[0][1], code(ExpertEvent::Evicted));
}

/// Reads experts 1, 2, 3, then 1 again (evicted by then: 2 slots), and returns the blocks read
/// and the blocks checked.
fn read_one_twice(store: &ExpertStore) -> (u64, u64) {
    for e in [1, 2, 3, 1] {
        drop(store.fetch(0, &[e]).unwrap());
    }
    let s = store.stats();
    (s.blocks_read, s.blocks_verified)
}

/// Flips a byte of expert `e`'s block on disk and gives the file a new modification time (a
/// rewrite within one tick of the kernel's coarse clock would keep the old one).
fn corrupt(dir: &Path, m: &Manifest, e: usize, mtime: u64) {
    let path = dir.join(EXPERTS_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[m.layers[0].block_offset(e) as usize + 100] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime);
    let file = std::fs::File::options().write(true).open(&path).unwrap();
    file.set_modified(when).unwrap();
}

#[test]
fn verify_once_checks_a_block_on_its_first_read_only() {
    let (dir, _) = tiny_store(8);
    let runs: Vec<_> = [Verify::Once, Verify::Always, Verify::Off]
        .into_iter()
        .map(|v| read_one_twice(&open_verifying(dir.path(), 2, Policy::Lru, None, v)))
        .collect();
    assert_eq!(runs, vec![(4, 3), (4, 4), (4, 0)]);
}

#[test]
fn verify_once_checks_again_after_the_file_changes() {
    let (dir, m) = tiny_store(8);
    let store = open(dir.path(), 2, Policy::Lru);
    assert_eq!(read_one_twice(&store), (4, 3));
    // Expert 1 (checked, now cached) is damaged on disk: evicted and read again, it is checked
    // again and refused.
    corrupt(dir.path(), &m, 1, 1_000_000);
    for e in [2, 3] {
        drop(store.fetch(0, &[e]).unwrap());
    }
    let err = store.fetch(0, &[1]).err().expect("corrupt").to_string();
    assert!(err.contains("checksum mismatch"), "{err}");
    // Those reads after the change were all checked again: 2 and 3 pass, 1 does not.
    let s = store.stats();
    assert_eq!((s.blocks_read, s.blocks_verified, s.errors), (7, 6, 1));
    // The file mended (another time): the good block reads, once checked.
    corrupt(dir.path(), &m, 1, 2_000_000);
    drop(store.fetch(0, &[1]).unwrap());
    assert_eq!(store.stats().blocks_verified, 7);
}
