//! Memory figures from `/proc` (Linux).

/// A field of a `/proc` file in the `Name:   value kB` style (`/proc/meminfo`,
/// `/proc/self/status`), in bytes; `None` if the file or field is missing or malformed.
fn proc_kb_field(file: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    parse_kb_field(&text, field)
}

/// [`proc_kb_field`] of the file's text. A value without a unit is taken as bytes.
fn parse_kb_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let mut parts = rest.split_whitespace();
        let n: u64 = parts.next()?.parse().ok()?;
        match parts.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// Memory the kernel estimates is available for new allocations without swapping
/// (`MemAvailable` in `/proc/meminfo`); page cache it can drop counts as available.
pub fn mem_available_bytes() -> Option<u64> {
    proc_kb_field("/proc/meminfo", "MemAvailable")
}

/// The process's peak resident set size since it started or since [`reset_peak_rss`]
/// (`VmHWM` in `/proc/self/status`). `None` where that is not available.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kb_field("/proc/self/status", "VmHWM")
}

/// The process's resident set size now (`VmRSS` in `/proc/self/status`).
pub fn current_rss_bytes() -> Option<u64> {
    proc_kb_field("/proc/self/status", "VmRSS")
}

/// Resets the peak resident set size to the current one (writes `5` to
/// `/proc/self/clear_refs`). Returns false where that is not permitted or not available.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_kb_fields() {
        let text = "Name:\tx\nVmHWM:\t    2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(parse_kb_field(text, "VmHWM"), Some(2048 * 1024));
        assert_eq!(parse_kb_field(text, "VmRSS"), Some(1024 * 1024));
        assert_eq!(parse_kb_field(text, "VmSwap"), None);
    }

    #[test]
    fn parse_meminfo_fields() {
        let text = "MemTotal:       32768000 kB\nMemFree:         1000 kB\n\
                    MemAvailable:   16384000 kB\nHugePages_Total:       0\n";
        assert_eq!(
            parse_kb_field(text, "MemAvailable"),
            Some(16_384_000 * 1024)
        );
        // A prefix of another field's name is not that field.
        assert_eq!(parse_kb_field(text, "Mem"), None);
        assert_eq!(parse_kb_field(text, "HugePages_Total"), Some(0));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn peak_rss_covers_current_after_allocating() {
        let before = current_rss_bytes().expect("VmRSS");
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        let current = current_rss_bytes().expect("VmRSS");
        let peak = peak_rss_bytes().expect("VmHWM");
        assert!(current >= before + (32 << 20), "{before} -> {current}");
        assert!(peak >= current, "peak {peak} < current {current}");
        drop(buf);
        // Resetting may not be permitted; when it is, the peak falls back to about the current.
        if reset_peak_rss() {
            let peak = peak_rss_bytes().expect("VmHWM");
            assert!(peak >= current_rss_bytes().expect("VmRSS") / 2);
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn available_memory_exists() {
        assert!(mem_available_bytes().unwrap() > 0);
    }
}
