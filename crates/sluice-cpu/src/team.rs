//! A team of worker threads that stay awake between the many small parallel steps of a decode
//! step (a layer has six to ten), so that handing out work costs no system call: rayon parks its
//! idle workers, and then every parallel step pays a wake-up on each side. The calling thread
//! works too; workers spin for a while after each step, then sleep until the next one.
//!
//! The team has `rayon::current_num_threads()` threads counting the caller (`-t`, or the pool a
//! benchmark installs; or what [`set_thread_count`] set for the calling thread), rebuilt when that
//! changes. A call made while the team is busy (a nested
//! call, or another thread's) runs on the calling thread alone.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;

/// Spins of an idle worker before it sleeps, the last of them giving the CPU up (see
/// [`SPINS_BEFORE_YIELD`]): ~1 ms on the 2-core CI VM (a pause ~25 ns, a yield ~0.5 us), well
/// above the gaps between the steps of a layer and below those between tokens.
const SPINS: u32 = 4_000;

/// One parallel step: `f(i)` for every `i < n`, handed out one index at a time.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
}

/// An atomic on cache lines of its own (two: the adjacent-line prefetcher fetches pairs), so
/// that threads hammering one (`next`, during a step) do not slow those watching another
/// (`generation`, while idle).
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

struct Shared {
    /// Bumped for each job (workers watch it).
    generation: Padded<AtomicUsize>,
    /// The current job while one runs, else null.
    job: Padded<AtomicPtr<Job<'static>>>,
    next: Padded<AtomicUsize>,
    /// Workers inside a job: counted before they read the job's pointer, uncounted once they
    /// are done with it. The caller waits only for these, not for every worker: a worker that
    /// the host has not run since the job was published (a busy or shared machine: at 15-16
    /// threads on the lent 16-core VM, steps waited 38-220 us on average for one) takes no part
    /// in it, and the step ends without it.
    active: Padded<AtomicUsize>,
    panicked: AtomicBool,
    stop: AtomicBool,
    /// With profiling on: when the job was published, and the latest start of a worker on it
    /// (nanoseconds since [`crate::profile::now`]'s origin).
    published: AtomicU64,
    latest_start: AtomicU64,
    /// Workers asleep, and what wakes them.
    asleep: Mutex<usize>,
    wake: Condvar,
}

struct Team {
    threads: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Team {
    fn new(threads: usize) -> Team {
        let shared = Arc::new(Shared {
            generation: Padded(AtomicUsize::new(0)),
            job: Padded(AtomicPtr::new(std::ptr::null_mut())),
            next: Padded(AtomicUsize::new(0)),
            active: Padded(AtomicUsize::new(0)),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            published: AtomicU64::new(0),
            latest_start: AtomicU64::new(0),
            asleep: Mutex::new(0),
            wake: Condvar::new(),
        });
        let workers = (1..threads)
            .filter_map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("sluice-cpu-{i}"))
                    .spawn(move || work(&shared, 0))
                    .ok()
            })
            .collect();
        Team {
            threads,
            shared,
            workers,
        }
    }

    /// Runs `job` over the team; whether a task panicked.
    fn run(&self, job: &Job<'_>) -> bool {
        let s = &self.shared;
        s.next.store(0, Ordering::Relaxed);
        // SAFETY: the pointer is erased to 'static only while this call runs: a worker uses it
        // only between counting itself active and uncounting, and this function clears the
        // pointer, then waits until no worker is counted, before it returns (see `work`).
        let ptr = job as *const Job<'_> as *mut Job<'static>;
        let profiling = crate::profile::enabled();
        if profiling {
            let now = crate::profile::now();
            s.published.store(now, Ordering::Relaxed);
            s.latest_start.store(now, Ordering::Relaxed);
        }
        s.job.store(ptr, Ordering::Release);
        s.generation.fetch_add(1, Ordering::AcqRel);
        if *s.asleep.lock().unwrap_or_else(|p| p.into_inner()) > 0 {
            s.wake.notify_all();
        }
        if panic::catch_unwind(AssertUnwindSafe(|| take_indices(s, job))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        let waiting = profiling.then(std::time::Instant::now);
        // Every index is taken: no worker may join from here on (one that reads the pointer
        // after this store finds it null). Those already counted may still be running tasks.
        s.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        let mut spins = 0u32;
        while s.active.load(Ordering::SeqCst) > 0 {
            spin_or_yield(&mut spins);
        }
        if let Some(start) = waiting {
            let nanos = start.elapsed().as_nanos() as u64;
            crate::profile::record("team: caller waiting for the last worker", nanos, 0);
            let late = s.latest_start.load(Ordering::Relaxed) - s.published.load(Ordering::Relaxed);
            crate::profile::record("team: last worker's start after the job's", late, 0);
        }
        s.panicked.swap(false, Ordering::Relaxed)
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
        {
            let _asleep = self.shared.asleep.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Spins (~50 us) before a waiting thread starts giving its CPU up on each further spin: a thread
/// that holds a task but is not running (more threads than free cores) then runs sooner.
const SPINS_BEFORE_YIELD: u32 = 2_000;

fn spin_or_yield(spins: &mut u32) {
    *spins += 1;
    if *spins > SPINS_BEFORE_YIELD {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

fn take_indices(s: &Shared, job: &Job<'_>) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n {
            return;
        }
        (job.f)(i);
    }
}

/// A worker's loop; `seen` is the generation when the team was made (a job may start before this
/// thread does).
fn work(s: &Shared, mut seen: usize) {
    // Tests start workers late, so that a new team's first job always begins before they do.
    #[cfg(test)]
    std::thread::sleep(std::time::Duration::from_millis(2));
    loop {
        let mut spins = 0;
        let generation = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                break g;
            }
            if spins < SPINS {
                spin_or_yield(&mut spins);
                continue;
            }
            let mut asleep = s.asleep.lock().unwrap_or_else(|p| p.into_inner());
            *asleep += 1;
            // Checked under the lock the caller takes before it wakes sleepers: no wake-up lost.
            while s.generation.load(Ordering::Acquire) == seen {
                asleep = s.wake.wait(asleep).unwrap_or_else(|p| p.into_inner());
            }
            *asleep -= 1;
            spins = 0;
        };
        seen = generation;
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        // Tests stand for a worker the host does not run for a while.
        #[cfg(test)]
        std::thread::sleep(std::time::Duration::from_millis(
            STALLED_WORKER_MS.load(Ordering::Relaxed),
        ));
        // Counted before reading the pointer, both sequentially consistent (the caller stores
        // null, then reads the count): either the caller sees this count and waits for it, or
        // this thread reads null (or a later job's pointer, whose caller waits likewise).
        s.active.fetch_add(1, Ordering::SeqCst);
        let ptr = s.job.load(Ordering::SeqCst);
        // SAFETY: a non-null pointer is a caller's job, alive until that caller has seen no
        // worker counted active after clearing it; this thread is counted until below.
        if let Some(job) = unsafe { ptr.as_ref() } {
            if crate::profile::enabled() {
                s.latest_start
                    .fetch_max(crate::profile::now(), Ordering::Relaxed);
            }
            if panic::catch_unwind(AssertUnwindSafe(|| take_indices(s, job))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.active.fetch_sub(1, Ordering::SeqCst);
    }
}

static TEAM: OnceLock<Mutex<Option<Team>>> = OnceLock::new();

/// How long a worker stalls after it sees a new job, before it joins (tests only).
#[cfg(test)]
static STALLED_WORKER_MS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREADS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Threads (counting the caller) that the calling thread's parallel steps use:
/// `rayon::current_num_threads()`, unless [`set_thread_count`] said otherwise on this thread.
pub fn thread_count() -> usize {
    THREADS
        .with(|t| t.get())
        .unwrap_or_else(rayon::current_num_threads)
}

/// Makes the calling thread's parallel steps use `n` threads counting it (`None`: rayon's
/// count). For a thread outside rayon's pools that must leave cores to others: the CUDA
/// backend's thread computing experts beside the GPU, while another thread waits on the GPU.
pub fn set_thread_count(n: Option<usize>) {
    THREADS.with(|t| t.set(n.map(|n| n.max(1))));
}

/// `f(i)` for every `i < n`, spread over the team (the calling thread works too); returns once
/// all are done. A panic in `f` is raised again here.
pub(crate) fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let threads = thread_count();
    if n <= 1 || threads <= 1 {
        (0..n).for_each(f);
        return;
    }
    let team = TEAM.get_or_init(|| Mutex::new(None));
    let mut guard = match team.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => {
            // Busy: a nested call, or another thread's step.
            (0..n).for_each(f);
            return;
        }
    };
    if guard.as_ref().is_none_or(|t| t.threads != threads) {
        *guard = None;
        *guard = Some(Team::new(threads));
    }
    let panicked = guard.as_ref().is_some_and(|t| t.run(&Job { f, n }));
    drop(guard);
    if panicked {
        panic!("a task of a parallel step panicked");
    }
}

/// A pointer that may be shared between the team's threads (each task derives a disjoint part).
struct SharedPtr<T>(*mut T);
// SAFETY: only used by `chunks_mut`, whose tasks each touch their own chunk.
unsafe impl<T: Send> Sync for SharedPtr<T> {}
// SAFETY: as above: the pointee is `Send`, and each task touches its own chunk.
unsafe impl<T: Send> Send for SharedPtr<T> {}

/// Below this much work (roughly, values a step reads and writes), a step runs on the calling
/// thread: handing it to the team and waiting for the last worker costs more than it saves
/// (a decode step's norms and rotations).
pub(crate) const MIN_PARALLEL_WORK: usize = 1 << 15;

/// [`chunks_mut`], or the same calls on the calling thread when `work` (roughly the values the
/// whole step reads and writes) is below [`MIN_PARALLEL_WORK`].
pub(crate) fn chunks_mut_sized<T: Send>(
    data: &mut [T],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if work >= MIN_PARALLEL_WORK {
        return chunks_mut(data, chunk, f);
    }
    assert!(chunk > 0, "chunks of zero length");
    for (i, part) in data.chunks_mut(chunk).enumerate() {
        f(i, part);
    }
}

/// `f(i, chunk)` for each `chunk`-long piece of `data` (the last may be shorter), over the team.
pub(crate) fn chunks_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk > 0, "chunks of zero length");
    let (len, base) = (data.len(), SharedPtr(data.as_mut_ptr()));
    let base = &base;
    for_each(len.div_ceil(chunk), &|i| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: index i gets the elements [start, end) of `data`, which no other index
        // overlaps, and `data` stays borrowed mutably until for_each returns.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        f(i, part);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn in_pool(threads: usize, f: impl FnOnce() + Send) {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
            .install(f);
    }

    #[test]
    fn every_index_runs_once() {
        for threads in [1, 2, 3, 8] {
            in_pool(threads, || {
                for n in [0, 1, 2, 7, 1000] {
                    let counts: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                    for_each(n, &|i| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert!(
                        counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                        "{threads} threads, {n} tasks"
                    );
                }
            });
        }
    }

    /// A team's first job may start before its workers do: they must still take it.
    #[test]
    fn a_new_team_takes_its_first_job() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for round in 0..200 {
                in_pool(2 + round % 2, || {
                    let total = AtomicU32::new(0);
                    for_each(3, &|_| {
                        total.fetch_add(1, Ordering::Relaxed);
                    });
                    assert_eq!(total.load(Ordering::Relaxed), 3);
                });
            }
            let _ = done.send(());
        });
        assert!(
            finished
                .recv_timeout(std::time::Duration::from_secs(60))
                .is_ok(),
            "200 new teams did not finish their first jobs within a minute"
        );
    }

    /// A worker that the host does not run (stalled here for 300 ms after it sees each job) holds
    /// up no step: the others, the caller among them, take its share, and the step ends without
    /// it. Before, the caller waited for every worker to check in.
    #[test]
    fn a_stalled_worker_holds_up_no_step() {
        in_pool(4, || {
            let total = AtomicU32::new(0);
            // A team exists and its workers are idle before they stall.
            for_each(8, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
            std::thread::sleep(std::time::Duration::from_millis(20));
            STALLED_WORKER_MS.store(300, Ordering::Relaxed);
            let start = std::time::Instant::now();
            for _ in 0..5 {
                for_each(16, &|_| {
                    total.fetch_add(1, Ordering::Relaxed);
                });
            }
            let took = start.elapsed();
            STALLED_WORKER_MS.store(0, Ordering::Relaxed);
            assert_eq!(total.load(Ordering::Relaxed), 8 + 5 * 16);
            assert!(
                took < std::time::Duration::from_millis(250),
                "five steps took {took:?} with every worker stalled for 300 ms"
            );
        });
    }

    #[test]
    fn chunks_cover_the_slice() {
        in_pool(4, || {
            let mut v = vec![0usize; 103];
            chunks_mut(&mut v, 10, |i, c| c.iter_mut().for_each(|x| *x += i + 1));
            for (j, x) in v.iter().enumerate() {
                assert_eq!(*x, j / 10 + 1);
            }
        });
    }

    #[test]
    fn nested_and_concurrent_calls_finish() {
        in_pool(3, || {
            let total = AtomicU32::new(0);
            for_each(4, &|_| {
                for_each(5, &|_| {
                    total.fetch_add(1, Ordering::Relaxed);
                });
            });
            assert_eq!(total.load(Ordering::Relaxed), 20);
        });
        let total = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    in_pool(2, || {
                        for _ in 0..50 {
                            for_each(9, &|_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        }
                    })
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 9);
    }

    #[test]
    fn a_panic_reaches_the_caller_and_the_team_goes_on() {
        in_pool(2, || {
            let r = panic::catch_unwind(|| {
                for_each(64, &|i| {
                    if i == 33 {
                        panic!("task 33");
                    }
                })
            });
            assert!(r.is_err());
            let total = AtomicU32::new(0);
            for_each(10, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(total.load(Ordering::Relaxed), 10);
        });
    }
}
