//! A small, validating reader of the safetensors format.
//!
//! A file is an 8-byte little-endian header length `n`, `n` bytes of JSON header (an object from
//! tensor name to `{dtype, shape, data_offsets}`, plus an optional `__metadata__` entry that is
//! ignored here) and then the data section; `data_offsets` are relative to the data section.
//! Files are memory-mapped; tensors are zero-copy [`HostBytes`] views of the mapping.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::Value;
use sluice_backend::{Dtype, HostBytes};

use crate::error::FormatError;

/// Element type of a safetensors tensor (the `dtype` strings of the format).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StDtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    BOOL,
    F8_E4M3,
    F8_E5M2,
}

impl StDtype {
    pub const ALL: [StDtype; 15] = [
        StDtype::F64,
        StDtype::F32,
        StDtype::F16,
        StDtype::BF16,
        StDtype::I64,
        StDtype::I32,
        StDtype::I16,
        StDtype::I8,
        StDtype::U64,
        StDtype::U32,
        StDtype::U16,
        StDtype::U8,
        StDtype::BOOL,
        StDtype::F8_E4M3,
        StDtype::F8_E5M2,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StDtype::F64 | StDtype::I64 | StDtype::U64 => 8,
            StDtype::F32 | StDtype::I32 | StDtype::U32 => 4,
            StDtype::F16 | StDtype::BF16 | StDtype::I16 | StDtype::U16 => 2,
            StDtype::I8 | StDtype::U8 | StDtype::BOOL | StDtype::F8_E4M3 | StDtype::F8_E5M2 => 1,
        }
    }

    /// The name used in safetensors headers, e.g. `BF16`.
    pub fn name(self) -> &'static str {
        match self {
            StDtype::F64 => "F64",
            StDtype::F32 => "F32",
            StDtype::F16 => "F16",
            StDtype::BF16 => "BF16",
            StDtype::I64 => "I64",
            StDtype::I32 => "I32",
            StDtype::I16 => "I16",
            StDtype::I8 => "I8",
            StDtype::U64 => "U64",
            StDtype::U32 => "U32",
            StDtype::U16 => "U16",
            StDtype::U8 => "U8",
            StDtype::BOOL => "BOOL",
            StDtype::F8_E4M3 => "F8_E4M3",
            StDtype::F8_E5M2 => "F8_E5M2",
        }
    }

    /// Parses a header `dtype` string; `None` for dtypes this crate does not know.
    pub fn from_name(s: &str) -> Option<StDtype> {
        StDtype::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Whether [`convert_to_f32`] accepts it.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            StDtype::F64
                | StDtype::F32
                | StDtype::F16
                | StDtype::BF16
                | StDtype::F8_E4M3
                | StDtype::F8_E5M2
        )
    }

    /// The backend dtype, for the three float types weights and scales may be stored in.
    pub fn to_dtype(self) -> Option<Dtype> {
        match self {
            StDtype::F32 => Some(Dtype::F32),
            StDtype::F16 => Some(Dtype::F16),
            StDtype::BF16 => Some(Dtype::Bf16),
            _ => None,
        }
    }
}

impl From<Dtype> for StDtype {
    fn from(d: Dtype) -> StDtype {
        match d {
            Dtype::F32 => StDtype::F32,
            Dtype::F16 => StDtype::F16,
            Dtype::Bf16 => StDtype::BF16,
        }
    }
}

impl fmt::Display for StDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a safetensors file: its header entry and a zero-copy view of its bytes.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    /// The file it lives in.
    pub file: PathBuf,
    /// Exactly `numel() * dtype.size()` bytes, little-endian, not necessarily aligned.
    pub bytes: HostBytes,
    /// Absolute offset of the data in `file` (header included), for reading it without the map;
    /// [`TensorInfo::IN_MEMORY`] for bytes made in memory (a GGUF's converted blocks).
    pub offset: u64,
}

impl TensorInfo {
    /// The `offset` of a tensor whose bytes are in no file as such.
    pub const IN_MEMORY: u64 = u64::MAX;

    /// Whether the bytes can be read from `file` at `offset`.
    pub fn in_file(&self) -> bool {
        self.offset != Self::IN_MEMORY
    }

    /// Number of elements (1 for a scalar of shape `[]`).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements converted to f32 (float dtypes only).
    pub fn to_f32(&self) -> Result<Vec<f32>, FormatError> {
        convert_to_f32(self.dtype, self.bytes.as_slice()).ok_or_else(|| {
            self.err(format!(
                "dtype {}, expected a float dtype (F32, F16, BF16, F64, F8_E4M3 or F8_E5M2)",
                self.dtype
            ))
        })
    }

    pub(crate) fn err(&self, msg: String) -> FormatError {
        FormatError::Tensor {
            name: self.name.clone(),
            file: self.file.clone(),
            msg,
        }
    }
}

/// Little-endian elements of a float `dtype` converted to f32; `None` for non-float dtypes.
/// Trailing bytes that do not fill a whole element are ignored.
pub fn convert_to_f32(dtype: StDtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let v = match dtype {
        StDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        StDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        StDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        StDtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                f64::from_le_bytes(a) as f32
            })
            .collect(),
        StDtype::F8_E4M3 => bytes.iter().map(|&b| f8_e4m3_to_f32(b)).collect(),
        // E5M2 is the top byte of an IEEE half.
        StDtype::F8_E5M2 => bytes
            .iter()
            .map(|&b| half::f16::from_bits((b as u16) << 8).to_f32())
            .collect(),
        _ => return None,
    };
    Some(v)
}

/// `float8_e4m3fn`: bias 7, no infinities, `S.1111.111` is NaN.
fn f8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let mant = (b & 0x07) as f32;
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * mant / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    }
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Memory-maps `path` and returns its tensors, validated against the file's size.
pub fn read_safetensors(path: &Path) -> Result<Vec<TensorInfo>, FormatError> {
    let io_err = |source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    };
    let st_err = |msg: String| FormatError::Safetensors {
        path: path.to_path_buf(),
        msg,
    };
    let file = File::open(path).map_err(io_err)?;
    let len = file.metadata().map_err(io_err)?.len();
    if len < 8 {
        return Err(st_err(format!(
            "file is {len} bytes, too short for a safetensors header (re-download or re-convert the file)"
        )));
    }
    // SAFETY: the mapping is only sound while nobody modifies or truncates the file: another
    // process writing to it while it is mapped would change (or, for truncation, unmap) bytes
    // behind our immutable slices. Model files are treated as read-only while sluice runs; do not
    // overwrite a checkpoint in place while an engine has it open.
    let mmap = unsafe { Mmap::map(&file) }.map_err(io_err)?;
    let bytes: &[u8] = &mmap;
    if bytes.len() < 8 {
        return Err(st_err(format!(
            "file is {} bytes, too short for a safetensors header",
            bytes.len()
        )));
    }
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(&bytes[..8]);
    let header_len = u64::from_le_bytes(n8);
    let avail = (bytes.len() - 8) as u64;
    if header_len > avail {
        return Err(st_err(format!(
            "header length {header_len} is larger than the rest of the file ({avail} bytes): not a safetensors file, or truncated (re-download or re-convert the file)"
        )));
    }
    let header_end = 8 + header_len as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..header_end])
        .map_err(|e| st_err(format!("header is not a valid JSON object: {e}")))?;
    let data_start = header_end;
    let data_len = bytes.len() - data_start;

    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(mmap);
    let mut out = Vec::with_capacity(header.len());
    for (name, entry) in header {
        if name == "__metadata__" {
            continue;
        }
        let tensor_err = |msg: String| FormatError::Tensor {
            name: name.clone(),
            file: path.to_path_buf(),
            msg,
        };
        let raw: RawEntry = serde_json::from_value(entry).map_err(|e| {
            tensor_err(format!(
                "malformed header entry ({e}); expected {{\"dtype\", \"shape\", \"data_offsets\"}}"
            ))
        })?;
        let dtype = StDtype::from_name(&raw.dtype).ok_or_else(|| {
            tensor_err(format!(
                "unsupported dtype `{}` (sluice reads {})",
                raw.dtype,
                StDtype::ALL.map(|d| d.name()).join(", ")
            ))
        })?;
        let nbytes = raw
            .shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| tensor_err(format!("shape {:?} is too large", raw.shape)))?;
        let (begin, end) = raw.data_offsets;
        if begin > end {
            return Err(tensor_err(format!(
                "data_offsets [{begin}, {end}] are reversed"
            )));
        }
        if end > data_len {
            return Err(FormatError::Truncated {
                path: path.to_path_buf(),
                name,
                needed: end,
                have: data_len,
            });
        }
        if end - begin != nbytes {
            return Err(tensor_err(format!(
                "shape {:?} of {dtype} needs {nbytes} bytes but data_offsets [{begin}, {end}] span {} (corrupt header: re-convert the file)",
                raw.shape,
                end - begin
            )));
        }
        out.push(TensorInfo {
            name,
            dtype,
            shape: raw.shape,
            file: path.to_path_buf(),
            bytes: HostBytes::new(owner.clone(), data_start + begin..data_start + end),
            offset: (data_start + begin) as u64,
        });
    }
    Ok(out)
}

/// Reads every tensor of `files` into one map, refusing names that occur twice.
pub(crate) fn read_all(files: &[PathBuf]) -> Result<BTreeMap<String, TensorInfo>, FormatError> {
    let mut map: BTreeMap<String, TensorInfo> = BTreeMap::new();
    for f in files {
        for t in read_safetensors(f)? {
            if let Some(prev) = map.get(&t.name) {
                return Err(FormatError::DuplicateTensor {
                    name: t.name,
                    first: prev.file.clone(),
                    second: t.file,
                });
            }
            map.insert(t.name.clone(), t);
        }
    }
    Ok(map)
}
