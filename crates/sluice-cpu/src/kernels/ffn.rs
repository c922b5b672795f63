//! Several experts' feed-forward blocks (gate and up products, an activation, the down product)
//! as ONE parallel step. A thread that runs out of gate/up work moves on to the down product of
//! an expert whose gate and up rows are all done; the thread that finishes an expert's last
//! gate/up task runs its activation. Decoding, this removes a barrier per MoE layer (with its
//! late start and its tail, ~11 us on 16 threads) and the activation that ran on one thread
//! while the others waited.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::{
    check_matrix, level, plan, prep_kind, prepare, record_products, run_prepared, supported, Ctx,
    Inputs, Kernels, Level, MatRef, Prep, SERIAL_COST,
};

/// One expert's feed-forward over `tokens` rows of `x` (`[tokens, gate.cols]`):
/// `h = x gate^T`, `u = x up^T`, then the activation turns `h` into `act(h, u)` in place, and
/// `out = h down^T` (`[tokens, down.rows]`).
pub struct FfnJob<'a> {
    pub gate: MatRef<'a>,
    pub up: MatRef<'a>,
    pub down: MatRef<'a>,
    pub x: &'a [f32],
    pub tokens: usize,
    /// `[tokens, gate.rows]`: the gate products, then down's input.
    pub h: &'a mut [f32],
    /// `[tokens, up.rows]`: the up products.
    pub u: &'a mut [f32],
    pub out: &'a mut [f32],
}

/// `activate(j, h, u)` of [`ffn_batch`].
pub type Activate<'a> = dyn Fn(usize, &mut [f32], &[f32]) + Sync + 'a;

/// The experts' feed-forwards of `jobs` in one parallel step; `activate(j, h, u)` turns job `j`'s
/// gate products `h` into down's input, reading its up products `u`. Every row is computed as
/// [`super::matmul_batch`] computes it, so the results are the bits of two such calls with the
/// activations between them. Inputs are prepared by the first task that needs them: meant for
/// decoding (a prompt's large inputs are better prepared up front, as `matmul_batch` does).
pub fn ffn_batch(kernels: Kernels, jobs: &mut [FfnJob<'_>], activate: &Activate<'_>) {
    ffn_batch_at(level(), kernels, jobs, activate);
}

/// A raw slice shared by the step's threads; who may touch it when is said where it is used.
#[derive(Clone, Copy)]
struct Raw(*mut f32, usize);
// SAFETY: a `Raw` is only dereferenced under the ordering rules stated at each use (an
// expert's gate/up tasks write disjoint rows; the activation runs once, after them; the down
// tasks read only after it), while `ffn_batch_at` holds the slice borrowed mutably.
unsafe impl Sync for Raw {}
// SAFETY: as above.
unsafe impl Send for Raw {}

/// Marks the step failed if dropped while its thread unwinds, so that down tasks waiting for an
/// expert that will never be ready stop instead of spinning forever.
struct FailOnUnwind<'a>(&'a AtomicBool);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

pub(crate) fn ffn_batch_at(
    level: Level,
    kernels: Kernels,
    jobs: &mut [FfnJob<'_>],
    activate: &Activate<'_>,
) {
    assert!(
        supported(level),
        "SIMD level {} not supported",
        level.name()
    );
    for job in jobs.iter() {
        for w in [&job.gate, &job.up, &job.down] {
            check_matrix(w);
        }
        let (t, inter) = (job.tokens, job.gate.rows);
        assert_eq!(
            (job.up.rows, job.up.cols),
            (inter, job.gate.cols),
            "ffn: gate and up differ in shape"
        );
        assert_eq!(
            job.down.cols, inter,
            "ffn: down's columns are not gate's rows"
        );
        assert_eq!(job.x.len(), t * job.gate.cols, "ffn: x has wrong length");
        assert_eq!(job.h.len(), t * inter, "ffn: h has wrong length");
        assert_eq!(job.u.len(), t * inter, "ffn: u has wrong length");
        assert_eq!(
            job.out.len(),
            t * job.down.rows,
            "ffn: out has wrong length"
        );
    }
    let n = jobs.len();
    let raw = |s: &mut [f32]| Raw(s.as_mut_ptr(), s.len());
    let hs: Vec<Raw> = jobs.iter_mut().map(|j| raw(j.h)).collect();
    let us: Vec<Raw> = jobs.iter_mut().map(|j| raw(j.u)).collect();
    let outs: Vec<Raw> = jobs.iter_mut().map(|j| raw(j.out)).collect();
    // Products in the order tasks are cut and handed out: gate and up of every job (2j, 2j + 1),
    // then the downs (2n + j), whose inputs exist only once their job is activated.
    let mut ctxs: Vec<Ctx> = Vec::with_capacity(3 * n);
    for (j, job) in jobs.iter().enumerate() {
        let (x, t) = (job.x, job.tokens);
        ctxs.push(Ctx::new(level, kernels, job.gate, x, t, (hs[j].0, hs[j].1)));
        ctxs.push(Ctx::new(level, kernels, job.up, x, t, (us[j].0, us[j].1)));
    }
    for (j, job) in jobs.iter().enumerate() {
        let out = (outs[j].0, outs[j].1);
        ctxs.push(Ctx::new(level, kernels, job.down, &[], job.tokens, out));
    }
    // Gate/up inputs are prepared once each: a decoded token's experts all read the same `x`.
    let inputs = Inputs::of(level, kernels, &ctxs[..2 * n]);
    let preps: Vec<OnceLock<Prep>> = inputs.kinds.iter().map(|_| OnceLock::new()).collect();
    let down_preps: Vec<OnceLock<Prep>> = (0..n).map(|_| OnceLock::new()).collect();

    let threads = crate::team::thread_count();
    let (tasks, total) = plan(&ctxs, threads);
    // Gate/up tasks still to finish per job; a job with none is activated before the step.
    let pending: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
    for t in tasks.iter().filter(|t| t.job < 2 * n) {
        pending[t.job / 2].fetch_add(1, Ordering::Relaxed);
    }
    let ready: Vec<AtomicBool> = (0..n).map(|_| AtomicBool::new(false)).collect();
    let activate_job = |j: usize| {
        // SAFETY: called once per job, after every gate/up task of job `j` has finished (its
        // pending count reached zero through AcqRel decrements, so their writes are visible) and
        // before `ready[j]` is set, so nothing else reads or writes `h` or `u` meanwhile.
        let (h, u) = unsafe {
            (
                std::slice::from_raw_parts_mut(hs[j].0, hs[j].1),
                std::slice::from_raw_parts(us[j].0 as *const f32, us[j].1),
            )
        };
        activate(j, h, u);
        ready[j].store(true, Ordering::Release);
    };
    for (j, count) in pending.iter().enumerate() {
        if count.load(Ordering::Relaxed) == 0 {
            activate_job(j);
        }
    }
    let failed = AtomicBool::new(false);
    let profiling = crate::profile::enabled().then(std::time::Instant::now);
    let task_nanos = AtomicU64::new(0);
    let run = |i: usize| {
        let t = &tasks[i];
        let start = profiling.map(|_| std::time::Instant::now());
        let _fail = FailOnUnwind(&failed);
        if t.job < 2 * n {
            let k = inputs.of[t.job];
            let p = preps[k].get_or_init(|| inputs.prepare(k, &ctxs));
            run_prepared(level, &ctxs[t.job], p, t.r0, t.r1);
            let j = t.job / 2;
            if pending[j].fetch_sub(1, Ordering::AcqRel) == 1 {
                activate_job(j);
            }
        } else {
            let j = t.job - 2 * n;
            // Every gate/up task was handed out before this one (tasks go in order), so the
            // threads running them finish without waiting for anything: this wait ends.
            while !ready[j].load(Ordering::Acquire) {
                assert!(
                    !failed.load(Ordering::Acquire),
                    "ffn: a gate/up task or activation of this step panicked"
                );
                std::hint::spin_loop();
            }
            // SAFETY: `ready[j]` (Acquire) says job `j`'s activation is done and its writes are
            // visible; from here on `h` is only read.
            let h = unsafe { std::slice::from_raw_parts(hs[j].0 as *const f32, hs[j].1) };
            let c = Ctx {
                x: h,
                ..ctxs[t.job]
            };
            let pk = prep_kind(level, kernels, c.kind, c.tokens);
            let p = down_preps[j].get_or_init(|| prepare(pk, h, c.tokens, c.w.cols));
            run_prepared(level, &c, p, t.r0, t.r1);
        }
        if let Some(start) = start {
            task_nanos.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    };
    let serial = threads <= 1 || tasks.len() <= 1 || total < SERIAL_COST;
    if serial {
        (0..tasks.len()).for_each(run);
    } else {
        crate::team::for_each(tasks.len(), &run);
    }
    if let Some(start) = profiling {
        record_products(&ctxs, serial, start, &task_nanos);
    }
}
