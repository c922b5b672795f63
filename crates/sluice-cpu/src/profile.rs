//! `SLUICE_CPU_PROFILE=1`: where the CPU backend's time goes. Each backend operation's wall
//! time, the matrix products' weight bytes (so their GB/s), the threads' time inside product
//! tasks (so how busy the team was) and the time the calling thread waited for the last worker
//! of each parallel step, summed per name; [`report`] formats them. Off, a span costs one load.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

#[derive(Default, Clone, Copy)]
struct Entry {
    calls: u64,
    nanos: u64,
    bytes: u64,
    /// Time of calls made inside another operation (`rms_norm` inside `rms_norm_gated`): not
    /// added to the total a second time.
    nested_nanos: u64,
}

thread_local! {
    /// Operations open on this thread.
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Entries in first-seen order (a few dozen names: a linear search is cheap).
static TABLE: Mutex<Vec<(&'static str, Entry)>> = Mutex::new(Vec::new());

pub(crate) fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("SLUICE_CPU_PROFILE").is_some_and(|v| v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        s => s == 2,
    }
}

/// Nanoseconds since the first call (a clock that threads can compare).
pub(crate) fn now() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Adds one call of `nanos` (and `bytes` of weights) to `name`.
pub(crate) fn record(name: &'static str, nanos: u64, bytes: u64) {
    add(name, nanos, bytes, false);
}

fn add(name: &'static str, nanos: u64, bytes: u64, nested: bool) {
    let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let entry = match table.iter_mut().find(|(n, _)| *n == name) {
        Some((_, e)) => e,
        None => {
            table.push((name, Entry::default()));
            &mut table.last_mut().expect("just pushed").1
        }
    };
    entry.calls += 1;
    entry.nanos += nanos;
    entry.bytes += bytes;
    if nested {
        entry.nested_nanos += nanos;
    }
}

/// Times its scope under `name` when profiling is on.
pub(crate) struct Span {
    name: &'static str,
    start: Option<Instant>,
    nested: bool,
}

pub(crate) fn span(name: &'static str) -> Span {
    let start = enabled().then(Instant::now);
    let nested = start.is_some() && DEPTH.with(|d| d.replace(d.get() + 1)) > 0;
    Span {
        name,
        start,
        nested,
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
            add(self.name, start.elapsed().as_nanos() as u64, 0, self.nested);
        }
    }
}

/// The table so far, busiest backend operation first, or `None` when profiling is off or
/// nothing ran. Names with a colon (`moe: down`, `team: ...`) are parts of the operations (not
/// added to the total).
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if table.is_empty() {
        return None;
    }
    let is_part = |n: &str| n.contains(": ");
    let total: u64 = table
        .iter()
        .filter(|(n, _)| !is_part(n))
        .map(|(_, e)| e.nanos - e.nested_nanos)
        .sum();
    table.sort_by_key(|(n, e)| (is_part(n), std::cmp::Reverse(e.nanos)));
    let mut out = format!(
        "CPU profile (SLUICE_CPU_PROFILE): operations' wall time, {:.1} ms in all\n",
        total as f64 / 1e6
    );
    for (name, e) in table {
        let ms = e.nanos as f64 / 1e6;
        let share = if is_part(name) {
            String::from("     ")
        } else {
            format!("{:4.1}%", 100.0 * e.nanos as f64 / total.max(1) as f64)
        };
        let rate = if e.bytes > 0 {
            format!("  {:6.1} GB/s", e.bytes as f64 / e.nanos.max(1) as f64)
        } else {
            String::new()
        };
        out += &format!(
            "  {share} {ms:10.2} ms {calls:8} calls {us:9.2} us/call  {name}{rate}\n",
            calls = e.calls,
            us = 1e3 * ms / e.calls.max(1) as f64,
        );
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operation called inside another is marked nested, so that the total counts it once.
    #[test]
    fn nested_operations_are_not_counted_twice() {
        STATE.store(2, Ordering::Relaxed);
        {
            let _outer = span("test: outer");
            let _inner = span("test: inner");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let table = TABLE.lock().unwrap().clone();
        let entry = |name: &str| table.iter().find(|(n, _)| *n == name).unwrap().1;
        let (outer, inner) = (entry("test: outer"), entry("test: inner"));
        assert_eq!((outer.calls, inner.calls), (1, 1));
        assert!(inner.nanos >= 2_000_000 && outer.nanos >= inner.nanos);
        assert_eq!(outer.nested_nanos, 0);
        assert_eq!(inner.nested_nanos, inner.nanos);
        assert!(report().is_some_and(|r| r.contains("test: outer")));
    }
}
