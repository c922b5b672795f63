//! Byte counts as people write them: parsed from `6GiB` or `1.5 GB`, printed as `17.2 GB`.

use std::fmt;
use std::str::FromStr;

/// A number of bytes, written the way people write sizes (see [`parse_bytes`] for the forms).
///
/// `FromStr` makes it a clap value: `#[arg(long)] expert_cache: Option<ByteSize>` rejects a bad
/// size while parsing the command line, naming the flag. `Display` writes the exact count in
/// the largest unit that divides it (`6GiB`, `1500MB`, `1000B`), so it parses back to the same
/// value; [`format_bytes`] is the rounded form for people.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl From<u64> for ByteSize {
    fn from(bytes: u64) -> Self {
        ByteSize(bytes)
    }
}

impl From<ByteSize> for u64 {
    fn from(size: ByteSize) -> u64 {
        size.0
    }
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_bytes(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 8] = [
            (1 << 40, "TiB"),
            (1_000_000_000_000, "TB"),
            (1 << 30, "GiB"),
            (1_000_000_000, "GB"),
            (1 << 20, "MiB"),
            (1_000_000, "MB"),
            (1 << 10, "KiB"),
            (1_000, "kB"),
        ];
        let b = self.0;
        let unit = UNITS
            .iter()
            .find(|&&(unit, _)| b != 0 && b.is_multiple_of(unit));
        match unit {
            Some(&(unit, name)) => write!(f, "{}{name}", b / unit),
            None => write!(f, "{b}B"),
        }
    }
}

/// Why a byte count could not be read. The messages of malformed ones list the units, since they
/// reach people through command-line errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    #[error("empty byte count: expected a number such as 1024, 512MiB or 1.5GB ({UNITS})")]
    Empty,
    #[error(
        "invalid byte count {0:?}: expected a non-negative number first, such as 512MiB ({UNITS})"
    )]
    NoNumber(String),
    #[error("invalid byte count {text:?}: unknown unit {unit:?} ({UNITS})")]
    UnknownUnit { text: String, unit: String },
    #[error("invalid byte count {text:?}: {number:?} is not a number ({UNITS})")]
    NotANumber { text: String, number: String },
    #[error("byte count {0:?} is too large")]
    TooLarge(String),
}

/// What [`parse_bytes`] accepts after the number, for error messages.
const UNITS: &str = "units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB; k, m, g, t are binary";

/// Parses a byte count: a number, optionally fractional, then optionally a unit, with or without
/// a space between: `1024`, `512MiB`, `6 GiB`, `1.5GB`, `4k`. Units (case-insensitive): `B`;
/// decimal `kB` `MB` `GB` `TB`; binary `KiB` `MiB` `GiB` `TiB`; and the single letters `k` `m`
/// `g` `t`, which are binary as in `dd` and `fio`. Fractional results round to the nearest byte.
pub fn parse_bytes(text: &str) -> Result<u64, ByteSizeError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(ByteSizeError::Empty);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    if num.is_empty() {
        return Err(ByteSizeError::NoNumber(text.into()));
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
            return Err(ByteSizeError::UnknownUnit {
                text: text.into(),
                unit: unit.into(),
            })
        }
    };
    let too_large = || ByteSizeError::TooLarge(text.into());
    if !num.contains('.') {
        let n: u64 = num.parse().map_err(|_| too_large())?;
        return n.checked_mul(multiplier).ok_or_else(too_large);
    }
    let n: f64 = num.parse().map_err(|_| ByteSizeError::NotANumber {
        text: text.into(),
        number: num.into(),
    })?;
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
        let e = parse_bytes("").unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        let e = parse_bytes("GiB").unwrap_err().to_string();
        assert!(e.contains("expected a non-negative number"), "{e}");
        let e = parse_bytes("-5MiB").unwrap_err().to_string();
        assert!(e.contains("expected a non-negative number"), "{e}");
        let e = parse_bytes("5 furlongs").unwrap_err().to_string();
        assert!(e.contains("unknown unit \"furlongs\""), "{e}");
        let e = parse_bytes("1.2.3GB").unwrap_err().to_string();
        assert!(e.contains("is not a number"), "{e}");
        let e = parse_bytes("99999999999999999999").unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
        let e = parse_bytes("20000000TiB").unwrap_err().to_string();
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
    fn byte_size_parses_and_prints_exactly() {
        let s: ByteSize = "6GiB".parse().unwrap();
        assert_eq!(s, ByteSize(6 << 30));
        assert_eq!(u64::from(s), 6 << 30);
        assert_eq!(s.to_string(), "6GiB");
        assert_eq!(ByteSize(1_500_000_000).to_string(), "1500MB");
        assert_eq!(ByteSize(2 << 40).to_string(), "2TiB");
        assert_eq!(ByteSize(4000).to_string(), "4kB");
        assert_eq!(ByteSize(1000).to_string(), "1kB");
        assert_eq!(ByteSize(1023).to_string(), "1023B");
        assert_eq!(ByteSize(0).to_string(), "0B");
        for b in [
            0,
            1,
            999,
            1024,
            1536,
            4_000_000,
            6 << 30,
            1_500_000_000,
            u64::MAX,
        ] {
            let back: ByteSize = ByteSize(b).to_string().parse().unwrap();
            assert_eq!(back, ByteSize(b), "{b}");
        }
        let e = "5 furlongs".parse::<ByteSize>().unwrap_err();
        assert!(matches!(e, ByteSizeError::UnknownUnit { .. }), "{e}");
    }
}
