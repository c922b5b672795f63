//! Experts computed on the host: when a decode step's routed experts are kept in host memory
//! and no VRAM slot holds them, the device reads them over the link (PCIe), which is slower than
//! the host's own memory. The host can instead compute some of them itself, with the CPU
//! backend on the same bytes, while the device reads the others: both memories then work at
//! once. llama.cpp (`--n-cpu-moe`) and ktransformers split by whole layers; here the split is
//! per expert, within each layer's call.
//!
//! Nothing goes through the stream, so the decode step stays one replayed graph: after the
//! routing, a kernel (`host_split_plan`) picks on the device which misses the host takes and
//! writes the layer's input rows and routing into a mailbox of page-locked host memory mapped
//! into the device, then rings its doorbell; a worker thread here, watching the doorbell,
//! computes those experts with the CPU backend and writes their sum back; the MoE kernels skip
//! the host's pairs, and `host_split_join` waits for the host's answer (with a timeout that
//! fails the run, never a hang) and adds it.
//!
//! The share of a layer's misses the host takes is found by measurement ([`HostSplit`]): the
//! time of each decode step is what it optimises, climbing the share a step at a time towards
//! whichever side makes steps faster (perturb and observe). A faster link or a slower CPU so
//! gives the host fewer experts, a slower link more. (Balancing which side waited for the other
//! was tried first: with one or two misses per layer it cannot tell a host that makes the device
//! wait a few microseconds from one that saves it tens, and it drove the share to nothing.)

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use sluice_backend::{
    Activation, Backend, BackendError, ExpertFfn, FfnWeights, HostExpert, HostRouting,
};
use sluice_cpu::{CpuAct, CpuBackend};

use crate::device::{DevBuf, Device};
use crate::in_place::InPlaceLayer;

/// Whether and how the host computes experts the device would read over the link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostCompute {
    /// Never: every expert in host memory is read in place by the device.
    Off,
    /// A share of each layer's misses balanced from measurement (the default).
    Auto,
    /// This fixed share (0 to 1) of each layer's misses (for measuring).
    Share(f64),
}

impl FromStr for HostCompute {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(HostCompute::Off),
            "auto" => Ok(HostCompute::Auto),
            _ => match s.parse::<f64>() {
                Ok(v) if (0.0..=1.0).contains(&v) => Ok(HostCompute::Share(v)),
                _ => Err(format!(
                    "`{s}`: expected auto, off, or a share of the misses from 0 to 1"
                )),
            },
        }
    }
}

/// Share the climbing starts from.
const START_SHARE: f64 = 0.5;
/// Step of the share between two measurements.
const STEP: f64 = 0.1;
/// Decode steps per measurement (the mean of their middle half: a step's time varies with how
/// many of its experts miss, whatever the share).
const WINDOW: usize = 16;
/// A step taking more than this many times the last measurement is something else (a prompt
/// between two decodes, a pause): not measured.
const OUTLIER: f64 = 4.0;

/// The share of misses the host takes, and how it is found.
#[derive(Debug)]
pub(crate) struct HostSplit {
    share: f64,
    adaptive: bool,
    /// +1 or -1: where the next step goes.
    direction: f64,
    last_step: Option<Instant>,
    window: Vec<f64>,
    /// The step time measured at the share before this one.
    before: Option<f64>,
}

impl HostSplit {
    pub fn new(mode: HostCompute) -> Option<HostSplit> {
        let (share, adaptive) = match mode {
            HostCompute::Off => return None,
            HostCompute::Auto => (START_SHARE, true),
            HostCompute::Share(s) => (s, false),
        };
        Some(HostSplit {
            share,
            adaptive,
            direction: 1.0,
            last_step: None,
            window: Vec::with_capacity(WINDOW),
            before: None,
        })
    }

    pub fn share(&self) -> f64 {
        self.share
    }

    /// A decode step starts at `now` (the previous one ended): after every [`WINDOW`] steps,
    /// the share moves by [`STEP`], on in the same direction if these steps were faster than
    /// the window before, else back. The new share, when it changed.
    pub fn step_starts(&mut self, now: Instant) -> Option<f64> {
        let last = self.last_step.replace(now)?;
        self.observe(now.duration_since(last).as_secs_f64())
    }

    /// One decode step took `secs`.
    fn observe(&mut self, secs: f64) -> Option<f64> {
        if !self.adaptive {
            return None;
        }
        if self.before.is_some_and(|b| secs > OUTLIER * b) {
            return None;
        }
        self.window.push(secs);
        if self.window.len() < WINDOW {
            return None;
        }
        self.window.sort_by(f64::total_cmp);
        let middle = &self.window[WINDOW / 4..WINDOW - WINDOW / 4];
        let time = middle.iter().sum::<f64>() / middle.len() as f64;
        self.window.clear();
        if self.before.is_some_and(|b| time > b) {
            self.direction = -self.direction;
        }
        self.before = Some(time);
        let next = (self.share + self.direction * STEP).clamp(0.0, 1.0);
        if next == self.share {
            // At an end: come back next time.
            self.direction = -self.direction;
        }
        self.share = next;
        Some(next)
    }
}

// The mailbox, in words (`MB_*` in kernels/sluice.cu): written by `host_split_plan` on the
// device, answered by the worker thread here.
const MB_DOORBELL: usize = 0;
const MB_DONE: usize = 1;
const MB_FAILED: usize = 3;
const MB_SHARE: usize = 4;
const MB_LAYER: usize = 5;
const MB_ROWS: usize = 6;
const MB_K: usize = 7;
const MB_COLS: usize = 8;
const MB_HOST_IDS: usize = 16;
/// Routed pairs a call may have (`rows x K`).
pub(crate) const MAX_PAIRS: usize = 128;
const MB_PAIR_IDS: usize = MB_HOST_IDS + MAX_PAIRS;
const MB_PAIR_WEIGHTS: usize = MB_PAIR_IDS + MAX_PAIRS;
const MB_X: usize = MB_PAIR_WEIGHTS + MAX_PAIRS;
/// The doorbell's call number is 24 bits (the low 8 say how many experts the host takes).
const SEQ_MASK: u32 = 0xff_ffff;
/// How long the device waits for the host's answer before it gives up (a failure).
pub(crate) const JOIN_TIMEOUT_NS: u64 = 5_000_000_000;
/// How long the worker spins after a call before it sleeps between looks (the gap between two
/// layers is ~0.1-0.2 ms; between two tokens of a decode, ~1 ms).
const SPIN: Duration = Duration::from_millis(5);
const NAP: Duration = Duration::from_micros(20);

/// Page-locked host memory mapped into the device: the device and the worker exchange a call
/// through it.
struct Mailbox {
    host: *mut AtomicU32,
    words: usize,
    device: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned by the mailbox until it drops, and every access goes through
// atomics.
unsafe impl Send for Mailbox {}
// SAFETY: as above.
unsafe impl Sync for Mailbox {}

impl Mailbox {
    fn new(ctx: &Arc<CudaContext>, words: usize) -> Result<Mailbox, BackendError> {
        use cudarc::driver::{result, sys};
        let err = |what: &str, e: cudarc::driver::DriverError| {
            BackendError::Device(format!("CUDA {what} (experts computed by the CPU): {e}"))
        };
        ctx.bind_to_thread()
            .map_err(|e| err("binding the context", e))?;
        let bytes = words * 4;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: allocates `bytes` of page-locked host memory, freed in `drop`.
        let host = unsafe { result::malloc_host(bytes, flags) }
            .map_err(|e| err("allocating page-locked memory", e))?;
        // SAFETY: `host` holds `bytes` bytes, zeroed before the device or the worker sees them.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP just above; the driver writes `device`.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result();
        let mailbox = Mailbox {
            host: host as *mut AtomicU32,
            words,
            device,
            ctx: ctx.clone(),
        };
        mapped.map_err(|e| err("mapping page-locked memory", e))?;
        Ok(mailbox)
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        assert!(i < self.words);
        // SAFETY: `i` is within the allocation, which lives as long as `self`; AtomicU32 has the
        // size and alignment of the u32 the device reads and writes there.
        unsafe { &*self.host.add(i) }
    }

    fn load(&self, i: usize) -> u32 {
        self.word(i).load(Ordering::Relaxed)
    }

    fn store(&self, i: usize, v: u32) {
        self.word(i).store(v, Ordering::Relaxed)
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_host` in `new`; the worker has stopped and the device
            // has finished every launch that could touch it (the owner synchronises first).
            let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut _) };
        }
    }
}

/// What the host computed, for the VRAM tier's counters (drained at each read of the counts).
#[derive(Debug, Default)]
pub(crate) struct HostTally {
    /// Routed pairs per (registry layer, expert).
    pub uses: HashMap<(usize, u32), u64>,
    pub pairs: u64,
    pub bytes: u64,
    pub secs: f64,
}

/// How one layer's experts compute on the host ([`ExpertFfn`] with host copies of the biases),
/// as the device computes them.
pub(crate) struct HostFfn {
    pub activation: Activation,
    pub biases: Option<FfnWeights<Vec<f32>>>,
    /// The device addresses of the biases copied (gate, up, down; 0 without): what tells a
    /// layer's current biases from others.
    pub from: (u64, u64, u64),
}

/// State the backend and the worker thread share.
struct Shared {
    mailbox: Mailbox,
    /// Rows x columns of input the mailbox has room for.
    capacity: usize,
    /// The layers read in place, by registry index.
    layers: Mutex<HashMap<usize, Weak<InPlaceLayer>>>,
    /// How each of them computes, by registry index (set before its first call).
    ffns: Mutex<HashMap<usize, Arc<HostFfn>>>,
    cpu: CpuBackend,
    tally: Arc<Mutex<HostTally>>,
    /// Why the worker failed, once it has.
    failure: Mutex<Option<String>>,
    stop: AtomicBool,
}

/// The host side of the split: the mailbox and the thread that answers it.
pub(crate) struct HostExperts {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    /// Device words of `host_split_plan`: call number, carry, experts taken.
    pub state: DevBuf,
}

impl HostExperts {
    /// A mailbox for calls of up to `capacity` input values (rows x columns), and its worker.
    pub fn start(
        d: &Device,
        share: f64,
        cpu: CpuBackend,
        capacity: usize,
        tally: Arc<Mutex<HostTally>>,
    ) -> Result<HostExperts, BackendError> {
        let mailbox = Mailbox::new(d.context(), MB_X + 2 * capacity)?;
        mailbox.store(MB_SHARE, (share as f32).to_bits());
        let state = d.alloc(16, "the host split's state")?;
        d.zero(&state);
        let shared = Arc::new(Shared {
            mailbox,
            capacity,
            layers: Mutex::new(HashMap::new()),
            ffns: Mutex::new(HashMap::new()),
            cpu,
            tally,
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        // The thread waiting on the GPU spins on a core of its own: the worker's team leaves it
        // one (a team step waits for its slowest thread, and one descheduled by the spinning
        // waiter stalls every step: measured 3-5 GB/s over the experts on 16 cores, not ~45).
        let threads = sluice_cpu::thread_count().saturating_sub(1).max(1);
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("sluice-cpu-experts".into())
                .spawn(move || {
                    sluice_cpu::set_thread_count(Some(threads));
                    answer_calls(&shared)
                })
                .map_err(|e| {
                    BackendError::Device(format!("starting the CPU experts' thread: {e}"))
                })?
        };
        Ok(HostExperts {
            shared,
            worker: Some(worker),
            state,
        })
    }

    /// Rows x columns of input a call may have.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// The mailbox's device address, and where the host's sums are in it.
    pub fn device_addresses(&self) -> (u64, u64) {
        let mb = self.shared.mailbox.device;
        (mb, mb + ((MB_X + self.shared.capacity) * 4) as u64)
    }

    /// The share of misses the device hands over from the next call on.
    pub fn set_share(&self, share: f64) {
        self.shared
            .mailbox
            .store(MB_SHARE, (share as f32).to_bits());
    }

    /// Lets the worker find `layer`'s experts.
    pub fn register(&self, layer: &Arc<InPlaceLayer>) {
        let mut layers = self.shared.layers.lock().unwrap_or_else(|p| p.into_inner());
        layers
            .entry(layer.id())
            .or_insert_with(|| Arc::downgrade(layer));
    }

    /// Whether the worker computes `layer`'s experts with `activation` and the biases at the
    /// device addresses `from` (see [`HostFfn`]) already.
    pub fn has_ffn(&self, layer: usize, activation: Activation, from: (u64, u64, u64)) -> bool {
        let ffns = self.shared.ffns.lock().unwrap_or_else(|p| p.into_inner());
        ffns.get(&layer)
            .is_some_and(|f| f.activation == activation && f.from == from)
    }

    /// How the worker computes `layer`'s experts from its next call on.
    pub fn set_ffn(&self, layer: usize, ffn: HostFfn) {
        let mut ffns = self.shared.ffns.lock().unwrap_or_else(|p| p.into_inner());
        ffns.insert(layer, Arc::new(ffn));
    }

    /// Why the split failed (the worker's error, or the device's wait timed out), once it has.
    pub fn failure(&self) -> Option<String> {
        if let Some(f) = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Some(f);
        }
        (self.shared.mailbox.load(MB_FAILED) != 0).then(|| {
            format!(
                "the GPU waited over {} s for the CPU's experts",
                JOIN_TIMEOUT_NS / 1_000_000_000
            )
        })
    }
}

impl Drop for HostExperts {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The worker: waits for each doorbell, computes the call's host experts, writes their sum and
/// answers.
fn answer_calls(shared: &Shared) {
    let mb = &shared.mailbox;
    let mut last = 0;
    let mut since = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        let bell = mb.word(MB_DOORBELL).load(Ordering::Acquire);
        let seq = bell >> 8;
        if seq == last || bell & 0xff == 0 {
            if since.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(NAP);
            }
            continue;
        }
        last = seq;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            compute_call(shared, (bell & 0xff) as usize)
        }));
        let failed = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some("the CPU's expert computation panicked".to_string()),
        };
        if let Some(f) = failed {
            let mut failure = shared.failure.lock().unwrap_or_else(|p| p.into_inner());
            failure.get_or_insert(f);
            // The device still gets its answer (adding zeros) and stops at the next call.
            let rows = mb.load(MB_ROWS) as usize;
            let cols = mb.load(MB_COLS) as usize;
            let y = MB_X + shared.capacity;
            for i in 0..(rows * cols).min(shared.capacity) {
                mb.store(y + i, 0);
            }
        }
        mb.word(MB_DONE).store(seq & SEQ_MASK, Ordering::Release);
        since = Instant::now();
    }
}

/// One call: `take` experts of the layer named in the mailbox, on its input rows.
fn compute_call(shared: &Shared, take: usize) -> Result<(), String> {
    let mb = &shared.mailbox;
    let start = Instant::now();
    let layer_id = mb.load(MB_LAYER) as usize;
    let (rows, k, cols) = (
        mb.load(MB_ROWS) as usize,
        mb.load(MB_K) as usize,
        mb.load(MB_COLS) as usize,
    );
    if rows * k > MAX_PAIRS || rows * cols > shared.capacity || take > MAX_PAIRS {
        return Err(format!(
            "a call of {rows} rows of {cols} with {k} experts each, {take} on the CPU: over the \
             mailbox's room"
        ));
    }
    let layer = shared
        .layers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&layer_id)
        .and_then(Weak::upgrade)
        .ok_or_else(|| format!("layer {layer_id} is not registered"))?;
    let host = layer.host();
    let ffn = shared
        .ffns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&layer_id)
        .cloned()
        .ok_or_else(|| format!("layer {layer_id}'s activation is not registered"))?;
    let ids: Vec<u32> = (0..take).map(|i| mb.load(MB_HOST_IDS + i)).collect();
    if ids.iter().any(|&e| e as usize >= host.len()) || !ids.windows(2).all(|w| w[0] < w[1]) {
        return Err(format!("bad expert ids {ids:?} of {}", host.len()));
    }
    let routing = HostRouting {
        k,
        experts: (0..rows * k).map(|p| mb.load(MB_PAIR_IDS + p)).collect(),
        weights: (0..rows * k)
            .map(|p| f32::from_bits(mb.load(MB_PAIR_WEIGHTS + p)))
            .collect(),
    };
    let x = CpuAct {
        data: (0..rows * cols)
            .map(|i| f32::from_bits(mb.load(MB_X + i)))
            .collect(),
        rows,
        cols,
    };
    let experts: Vec<(u32, &HostExpert)> = ids.iter().map(|&e| (e, &host[e as usize])).collect();
    let mut sum = CpuAct::zeros(rows, cols);
    let how = ExpertFfn {
        activation: ffn.activation,
        biases: ffn.biases.as_ref(),
    };
    shared
        .cpu
        .moe_accumulate(&x, &routing, &experts, how, &mut sum);
    let y = MB_X + shared.capacity;
    for (i, v) in sum.data.iter().enumerate() {
        mb.store(y + i, v.to_bits());
    }
    // Counted before the answer: once the device has it, the host may read the counters.
    let mut tally = shared.tally.lock().unwrap_or_else(|p| p.into_inner());
    for &e in &ids {
        let uses = routing.experts.iter().filter(|&&p| p == e).count() as u64;
        *tally.uses.entry((layer_id, e)).or_default() += uses;
        tally.pairs += uses;
        tally.bytes += layer.expert_bytes(e as usize);
    }
    tally.secs += start.elapsed().as_secs_f64();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_modes() {
        assert_eq!("off".parse::<HostCompute>(), Ok(HostCompute::Off));
        assert_eq!("auto".parse::<HostCompute>(), Ok(HostCompute::Auto));
        assert_eq!("0.25".parse::<HostCompute>(), Ok(HostCompute::Share(0.25)));
        assert!("1.5".parse::<HostCompute>().is_err());
        assert!("-0.1".parse::<HostCompute>().is_err());
        assert!("sometimes".parse::<HostCompute>().is_err());
    }

    #[test]
    fn off_makes_no_split() {
        assert!(HostSplit::new(HostCompute::Off).is_none());
    }

    #[test]
    fn a_fixed_share_does_not_move() {
        let mut s = HostSplit::new(HostCompute::Share(0.3)).unwrap();
        for _ in 0..100 {
            assert_eq!(s.observe(1e-3), None);
        }
        assert_eq!(s.share, 0.3);
    }

    /// Decode steps whose time is `f(share)` plus noise: the share climbs to the fastest and
    /// stays about it.
    fn settle(f: impl Fn(f64) -> f64) -> f64 {
        let mut s = HostSplit::new(HostCompute::Auto).unwrap();
        let mut seed = 1u64;
        let mut noise = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 0.04
        };
        let mut shares = Vec::new();
        for _ in 0..4000 {
            let t = f(s.share) * (1.0 + noise());
            s.observe(t);
            shares.push(s.share);
        }
        let tail = &shares[shares.len() - 1000..];
        tail.iter().sum::<f64>() / tail.len() as f64
    }

    #[test]
    fn climbs_to_the_fastest_share() {
        // A step: 5 ms of everything else, then the slower of the device reading its misses
        // over the link and the host computing its own (with some overhead), 200 MB of misses.
        let step = |link: f64, host: f64| {
            move |share: f64| {
                let misses = 200e6;
                let device = (1.0 - share) * misses / link;
                let cpu = share * misses / host + 2e-3 * share;
                5e-3 + device.max(cpu)
            }
        };
        // Link and host alike: about half (the host's overheads move it lower).
        let even = settle(step(55e9, 45e9));
        assert!((0.2..0.6).contains(&even), "{even}");
        // A slow link (PCIe 4 x8): the host takes most.
        let slow_link = settle(step(12e9, 45e9));
        assert!(slow_link > 0.6, "{slow_link}");
        // A slow host: it takes little.
        let slow_host = settle(step(55e9, 5e9));
        assert!(slow_host < 0.25, "{slow_host}");
    }

    #[test]
    fn a_step_far_slower_than_the_rest_is_not_measured() {
        let mut s = HostSplit::new(HostCompute::Auto).unwrap();
        for _ in 0..WINDOW {
            s.observe(1e-3);
        }
        let share = s.share;
        // A prompt between two decode steps.
        assert_eq!(s.observe(1.0), None);
        assert_eq!(s.window.len(), 0);
        assert_eq!(s.share, share);
    }
}
