//! What the operating system says about this process and machine: resident memory, available
//! memory, free disk space; and byte counts as people write them ("6GiB", "17.2 GB").
//!
//! The memory figures come from `/proc` and exist on Linux only; elsewhere they are `None`.

/// A `kB` field (`VmHWM`, `MemAvailable`, ...) of a `/proc` status-style file, in bytes.
fn proc_kb_field(file: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    parse_kb_field(&text, field)
}

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

/// Memory the kernel estimates is available for new allocations without swapping
/// (`MemAvailable` in `/proc/meminfo`); page cache it can drop counts as available.
pub use sluice_engine::streaming::mem_available as mem_available_bytes;

pub use sluice_format::free_disk_bytes;

/// Parses a byte count: a number, optionally fractional, then optionally a unit, with or without
/// a space between: `1024`, `512MiB`, `6 GiB`, `1.5GB`, `4k`. Units (case-insensitive): `B`;
/// decimal `kB` `MB` `GB` `TB`; binary `KiB` `MiB` `GiB` `TiB`; and the single letters `k` `m`
/// `g` `t`, which are binary as in `dd` and `fio`. Fractional results round to the nearest byte.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty byte count: expected a number such as 1024, 512MiB or 1.5GB".into());
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    if num.is_empty() {
        return Err(format!(
            "invalid byte count {text:?}: expected a non-negative number first, such as 512MiB"
        ));
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "invalid byte count {text:?}: unknown unit {unit:?} (use B, kB, MB, GB, TB, \
                 KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let too_large = || format!("byte count {text:?} is too large");
    if !num.contains('.') {
        let n: u64 = num.parse().map_err(|_| too_large())?;
        return n.checked_mul(multiplier).ok_or_else(too_large);
    }
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid byte count {text:?}: {num:?} is not a number"))?;
    let bytes = (n * multiplier as f64).round();
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

/// Formats a byte count with decimal units and one decimal: `512 B`, `2.1 MB`, `17.2 GB`.
pub fn format_bytes(bytes: u64) -> String {
    format_with(bytes, 1000.0, &["B", "kB", "MB", "GB", "TB", "PB"])
}

/// Formats a byte count with binary units and one decimal: `512 B`, `2.0 MiB`, `16.0 GiB`.
pub fn format_bytes_binary(bytes: u64) -> String {
    format_with(bytes, 1024.0, &["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
}

fn format_with(bytes: u64, step: f64, units: &[&str]) -> String {
    if (bytes as f64) < step {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64;
    let mut i = 0;
    // Move up while the value would print as >= one step of the next unit ("1000.0 MB").
    while i + 1 < units.len() && (v * 10.0).round() / 10.0 >= step {
        v /= step;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn parse_bytes_accepts_common_forms() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("6GiB"), Ok(6 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes(" 2 gb "), Ok(2_000_000_000));
        assert_eq!(parse_bytes("4k"), Ok(4096));
        assert_eq!(parse_bytes("4kB"), Ok(4000));
        assert_eq!(parse_bytes("10B"), Ok(10));
        assert_eq!(parse_bytes("0.5KiB"), Ok(512));
        assert_eq!(parse_bytes("1TiB"), Ok(1 << 40));
    }

    #[test]
    fn parse_bytes_rejects_bad_input_clearly() {
        let e = parse_bytes("").unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = parse_bytes("GiB").unwrap_err();
        assert!(e.contains("expected a non-negative number"), "{e}");
        let e = parse_bytes("-5MiB").unwrap_err();
        assert!(e.contains("expected a non-negative number"), "{e}");
        let e = parse_bytes("5 furlongs").unwrap_err();
        assert!(e.contains("unknown unit \"furlongs\""), "{e}");
        let e = parse_bytes("1.2.3GB").unwrap_err();
        assert!(e.contains("is not a number"), "{e}");
        let e = parse_bytes("99999999999999999999").unwrap_err();
        assert!(e.contains("too large"), "{e}");
        let e = parse_bytes("20000000TiB").unwrap_err();
        assert!(e.contains("too large"), "{e}");
    }

    #[test]
    fn format_bytes_picks_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(17_200_000_000), "17.2 GB");
        assert_eq!(format_bytes(2_100_000), "2.1 MB");
        assert_eq!(format_bytes(999_990), "1.0 MB");
        assert_eq!(format_bytes_binary(16 << 30), "16.0 GiB");
        assert_eq!(format_bytes_binary(2 << 20), "2.0 MiB");
        assert_eq!(format_bytes_binary(1023), "1023 B");
    }

    #[test]
    fn parse_kb_fields() {
        let text = "Name:\tx\nVmHWM:\t    2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(parse_kb_field(text, "VmHWM"), Some(2048 * 1024));
        assert_eq!(parse_kb_field(text, "VmRSS"), Some(1024 * 1024));
        assert_eq!(parse_kb_field(text, "VmSwap"), None);
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
    fn memory_and_disk_figures_exist() {
        assert!(mem_available_bytes().unwrap() > 0);
        let dir = tempfile::tempdir().unwrap();
        assert!(free_disk_bytes(dir.path()).unwrap() > 0);
        // A path that does not exist yet is measured at its nearest existing ancestor.
        let missing = dir.path().join("not/yet/here");
        assert!(free_disk_bytes(&missing).unwrap() > 0);
        assert!(free_disk_bytes(Path::new("relative-missing-file")).unwrap() > 0);
    }
}
