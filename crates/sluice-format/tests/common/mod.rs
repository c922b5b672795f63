//! Helpers shared by the integration tests: build small model directories with the crate's own
//! safetensors writer.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_format::safetensors_writer::write_safetensors;
use sluice_format::{FormatError, StDtype};

/// One tensor to write: name, dtype, shape, bytes.
pub type T = (String, StDtype, Vec<usize>, Vec<u8>);

pub fn t(name: &str, dtype: StDtype, shape: &[usize], bytes: Vec<u8>) -> T {
    (name.to_string(), dtype, shape.to_vec(), bytes)
}

/// Deterministic, distinct bytes (so slices can be compared).
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 7) as u8)
        .collect()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect()
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect()
}

/// A dense tensor of `dtype` filled with a byte pattern.
pub fn dense(name: &str, dtype: StDtype, shape: &[usize], seed: u8) -> T {
    let n: usize = shape.iter().product::<usize>() * dtype.size();
    t(name, dtype, shape, pattern(n, seed))
}

/// The three tensors of an MLX affine weight `[lead.., rows, cols]` quantised with `bits`,
/// `group`: `.weight` U32 `[.., rows, cols*bits/32]`, `.scales`/`.biases` `[.., rows, cols/group]`.
pub fn affine(
    prefix: &str,
    lead: &[usize],
    rows: usize,
    cols: usize,
    bits: usize,
    group: usize,
    sdt: StDtype,
) -> Vec<T> {
    let mut ws: Vec<usize> = lead.to_vec();
    ws.extend([rows, cols * bits / 32]);
    let mut ss: Vec<usize> = lead.to_vec();
    ss.extend([rows, cols / group]);
    vec![
        dense(&format!("{prefix}.weight"), StDtype::U32, &ws, 1),
        dense(&format!("{prefix}.scales"), sdt, &ss, 2),
        dense(&format!("{prefix}.biases"), sdt, &ss, 3),
    ]
}

/// A model directory being built in a temporary folder.
pub struct Dir {
    pub tmp: tempfile::TempDir,
}

impl Dir {
    /// An empty directory.
    pub fn empty() -> Dir {
        Dir {
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    /// A directory with `config` as config.json and a (dummy) tokenizer.json.
    pub fn new(config: Value) -> Dir {
        let d = Dir::empty();
        d.json("config.json", &config);
        d.text("tokenizer.json", "{}");
        d
    }

    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn json(&self, name: &str, v: &Value) {
        std::fs::write(self.file(name), serde_json::to_string_pretty(v).unwrap()).unwrap();
    }

    pub fn text(&self, name: &str, s: &str) {
        std::fs::write(self.file(name), s).unwrap();
    }

    pub fn bytes(&self, name: &str, b: &[u8]) {
        std::fs::write(self.file(name), b).unwrap();
    }

    pub fn st(&self, name: &str, tensors: &[T]) {
        let refs: Vec<(String, StDtype, Vec<usize>, &[u8])> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), b.as_slice()))
            .collect();
        write_safetensors(&self.file(name), &refs, None).unwrap();
    }
}

/// A raw safetensors file: length prefix, `header` verbatim, then `data`.
pub fn raw_st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The error's message, checked to be a single line.
pub fn msg(e: FormatError) -> String {
    let m = e.to_string();
    assert!(!m.contains('\n'), "message is not one line: {m}");
    if std::env::var_os("SHOW_ERRORS").is_some() {
        eprintln!("ERROR: {m}");
    }
    m
}

/// Asserts that `m` contains every one of `parts`.
#[track_caller]
pub fn has(m: &str, parts: &[&str]) {
    for p in parts {
        assert!(m.contains(p), "message lacks `{p}`: {m}");
    }
}
