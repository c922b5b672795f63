//! The `.npy` format for 2-D little-endian f32 arrays: how `sluice logits` writes its results and
//! how tests read reference logits.

use std::io::{self, Read, Write};
use std::path::Path;

/// Writes `data` as a C-order `<f4` array of `shape`.
pub fn write_f32(path: &Path, data: &[f32], shape: &[usize]) -> io::Result<()> {
    assert_eq!(data.len(), shape.iter().product::<usize>());
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' must be a multiple of 64.
    let pad = (64 - (10 + header.len() + 1) % 64) % 64;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    let mut out = io::BufWriter::new(std::fs::File::create(path)?);
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    for v in data {
        out.write_all(&v.to_le_bytes())?;
    }
    out.flush()
}

/// Reads a C-order `<f4` array; returns its data and shape.
pub fn read_f32(path: &Path) -> io::Result<(Vec<f32>, Vec<usize>)> {
    let bad = |m: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {m}", path.display()),
        )
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize,
            12,
        ),
        _ => return Err(bad("unsupported .npy version")),
    };
    let header = std::str::from_utf8(
        bytes
            .get(start..start + hlen)
            .ok_or_else(|| bad("truncated header"))?,
    )
    .map_err(|_| bad("header is not UTF-8"))?;
    if !header.contains("'descr': '<f4'") || header.contains("'fortran_order': True") {
        return Err(bad("expected a C-order little-endian float32 array"));
    }
    let shape_txt = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape in header"))?;
    let shape: Vec<usize> = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_, _>>()?;
    let body = &bytes[start + hlen..];
    let n: usize = shape.iter().product();
    if body.len() != n * 4 {
        return Err(bad("data length does not match the shape"));
    }
    let data = body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Ok((data, shape))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("sluice-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        super::write_f32(&p, &data, &[3, 4]).unwrap();
        let (back, shape) = super::read_f32(&p).unwrap();
        assert_eq!(shape, vec![3, 4]);
        assert_eq!(back, data);
        let raw = std::fs::read(&p).unwrap();
        assert_eq!((raw.len() - 48) % 64, 0, "header is padded to 64 bytes");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
