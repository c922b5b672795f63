//! Reads a GGUF file (versions 2 and 3), the format of llama.cpp, Ollama and LM Studio: the
//! metadata key/value pairs and the tensor table, memory-mapped, every length, count, type and
//! tensor extent checked against the file before anything is handed out. A defect is a one-line
//! [`GgufError`] naming the file (and the key or tensor); nothing here panics on bad input.
//!
//! A split set (`NAME-00001-of-00003.gguf` ..., as `llama-gguf-split` writes the large models)
//! opens from any of its parts as one file: the first part's metadata, every part's tensors.
//!
//! ```no_run
//! # fn main() -> Result<(), sluice_format::gguf::GgufError> {
//! let file = sluice_format::gguf::GgufFile::open("Qwen3-30B-A3B-Q4_K_M.gguf")?;
//! println!("{:?}", file.metadata("general.architecture"));
//! for t in file.tensors() {
//!     println!("{} {:?} {} {} bytes", t.name, t.dims, t.ggml_type.name(), t.bytes);
//! }
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use sluice_backend::HostBytes;

/// What can be wrong with a GGUF file; the message names the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct GgufError {
    pub path: PathBuf,
    pub message: String,
}

/// A ggml tensor type: its id in the file, name, and block geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(u32);

/// (id, name, elements per block, bytes per block), as ggml defines them.
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().any(|t| t.0 == id).then_some(GgmlType(id))
    }

    fn entry(self) -> &'static (u32, &'static str, u64, u64) {
        GGML_TYPES
            .iter()
            .find(|t| t.0 == self.0)
            .expect("constructed from the table")
    }

    pub fn id(self) -> u32 {
        self.0
    }

    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_elements(self) -> u64 {
        self.entry().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.entry().3
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// Any integer type that fits, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The value's type id in a GGUF file (llama.cpp's `gguf_type`).
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    /// Appends the value as a GGUF file stores it after its type id (an array: its item type,
    /// length and items; an empty one is typed as strings).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.extend(x.to_le_bytes()),
            GgufValue::U16(x) => out.extend(x.to_le_bytes()),
            GgufValue::I16(x) => out.extend(x.to_le_bytes()),
            GgufValue::U32(x) => out.extend(x.to_le_bytes()),
            GgufValue::I32(x) => out.extend(x.to_le_bytes()),
            GgufValue::F32(x) => out.extend(x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => {
                out.extend((s.len() as u64).to_le_bytes());
                out.extend(s.as_bytes());
            }
            GgufValue::Array(items) => {
                out.extend(items.first().map_or(8, GgufValue::type_id).to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    item.encode(out);
                }
            }
            GgufValue::U64(x) => out.extend(x.to_le_bytes()),
            GgufValue::I64(x) => out.extend(x.to_le_bytes()),
            GgufValue::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
}

/// A version-3 GGUF file holding the metadata `kv` and no tensors (for tests and tools that
/// describe a model's tokenizer or config without weights).
pub fn metadata_only_gguf(kv: &[(String, GgufValue)]) -> Vec<u8> {
    gguf_bytes(kv, &[])
}

/// A version-3 GGUF file of the metadata `kv` and the tensors `(name, dims, type, data)` laid
/// out as llama.cpp's writer does: each tensor's data at a multiple of the alignment
/// (`general.alignment`, else 32) from the aligned start of the data section.
pub fn gguf_bytes(
    kv: &[(String, GgufValue)],
    tensors: &[(&str, &[u64], GgmlType, &[u8])],
) -> Vec<u8> {
    let alignment = kv
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .and_then(|(_, v)| v.as_u64())
        .unwrap_or(32) as usize;
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        GgufValue::String(k.clone()).encode(&mut b);
        b.extend(v.type_id().to_le_bytes());
        v.encode(&mut b);
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        GgufValue::String(name.to_string()).encode(&mut b);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.id().to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += data.len().div_ceil(alignment) as u64 * alignment as u64;
    }
    if !tensors.is_empty() {
        b.resize(b.len().div_ceil(alignment) * alignment, 0);
    }
    for (_, _, _, data) in tensors {
        b.extend(*data);
        b.resize(b.len().div_ceil(alignment) * alignment, 0);
    }
    b
}

/// The files of a split set holding the metadata `kv` and `tensors`, `per_part` tensors to a
/// file (at least 1), byte for byte as `llama-gguf-split --split-max-tensors` writes them: every
/// key in the first file, then in each file `split.no` (u16, from 0), `split.tensors.count`
/// (i32) and `split.count` (u16), in that order. Name file `i` `PREFIX-{i+1:05}-of-{n:05}.gguf`.
pub fn split_gguf_bytes(
    kv: &[(String, GgufValue)],
    tensors: &[(&str, &[u64], GgmlType, &[u8])],
    per_part: usize,
) -> Vec<Vec<u8>> {
    let chunks: Vec<_> = tensors.chunks(per_part.max(1)).collect();
    let n = chunks.len().max(1);
    (0..n)
        .map(|i| {
            let mut part_kv = if i == 0 { kv.to_vec() } else { Vec::new() };
            part_kv.push(("split.no".into(), GgufValue::U16(i as u16)));
            part_kv.push((
                "split.tensors.count".into(),
                GgufValue::I32(tensors.len() as i32),
            ));
            part_kv.push(("split.count".into(), GgufValue::U16(n as u16)));
            gguf_bytes(&part_kv, chunks.get(i).copied().unwrap_or(&[]))
        })
        .collect()
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::String(s) if s.len() > 60 => {
                let cut = (0..=60).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                write!(f, "{:?}… ({} bytes)", &s[..cut], s.len())
            }
            GgufValue::String(s) => write!(f, "{s:?}"),
            GgufValue::Array(a) if a.len() > 8 => write!(f, "[{} values]", a.len()),
            GgufValue::Array(a) => {
                write!(f, "[")?;
                for (i, v) in a.iter().enumerate() {
                    write!(f, "{}{v}", if i > 0 { ", " } else { "" })?;
                }
                write!(f, "]")
            }
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
        }
    }
}

/// One entry of the tensor table, checked against the file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (contiguous), as llama.cpp prints shapes.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// The file of a split set that holds the data (0 for a single file): see
    /// [`GgufFile::paths`].
    pub part: usize,
    /// Offset of the data from the start of that file.
    pub offset: u64,
    pub bytes: u64,
}

impl GgufTensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A memory-mapped GGUF file (or split set) with its metadata and tensor table parsed and checked.
pub struct GgufFile {
    /// One file, or every part of a split set in order.
    parts: Vec<(PathBuf, Arc<Mmap>)>,
    pub version: u32,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("paths", &self.paths())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The most dimensions a ggml tensor has.
const MAX_DIMS: u32 = 4;
/// Nesting limit for arrays of arrays (llama.cpp writes none deeper than 1).
const MAX_DEPTH: u32 = 4;

impl GgufFile {
    /// Opens a GGUF file; a part of a split set opens the whole set (its siblings by name, in
    /// the same folder).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let (mmap, parsed) = map_and_parse(path)?;
        let count = split_field(&parsed, "split.count").map_err(|m| gguf_err(path, m))?;
        match count {
            None | Some(0) | Some(1) => Ok(Self::from_parts(
                vec![(path.to_path_buf(), Arc::new(mmap))],
                vec![parsed],
            )),
            Some(n) => Self::open_split(path, n, mmap, parsed),
        }
    }

    /// The set of `count` parts that `path` belongs to, checked part by part: each says its own
    /// place in the set and the set's size, no tensor is in two parts, and the first part's
    /// `split.tensors.count` matches what the parts hold.
    fn open_split(path: &Path, count: u64, mmap: Mmap, parsed: Parsed) -> Result<Self, GgufError> {
        let err = |m: String| gguf_err(path, m);
        let names = split_names(path, count).ok_or_else(|| {
            err(format!(
                "part of a split GGUF set of {count} files, but its name does not end in -NNNNN-of-{count:05}.gguf as llama-gguf-split names the parts: give them back their names, or merge them into one file with `llama-gguf-split --merge FIRST-PART.gguf OUT.gguf`"
            ))
        })?;
        let mut given = Some((mmap, parsed));
        let mut parts = Vec::with_capacity(names.len());
        let mut parsed_parts = Vec::with_capacity(names.len());
        for (i, part) in names.iter().enumerate() {
            let (mmap, parsed) = if part.file_name() == path.file_name() {
                given.take().expect("a set names each part once")
            } else {
                if !part.exists() {
                    return Err(err(format!(
                        "part {} of this split set, {}, is missing: keep every part of the set in one folder",
                        i + 1,
                        part.display()
                    )));
                }
                map_and_parse(part)?
            };
            let perr = |m: String| gguf_err(part, m);
            let no = split_field(&parsed, "split.no").map_err(perr)?;
            let n = split_field(&parsed, "split.count").map_err(perr)?;
            if no != Some(i as u64) || n != Some(count) {
                return Err(perr(format!(
                    "expected part {} of a set of {count} (split.no {i}), found split.no {} of split.count {}: the parts come from different sets",
                    i + 1,
                    no.map_or("missing".into(), |v| v.to_string()),
                    n.map_or("missing".into(), |v| v.to_string()),
                )));
            }
            parts.push((part.clone(), Arc::new(mmap)));
            parsed_parts.push(parsed);
        }
        let want = split_field(&parsed_parts[0], "split.tensors.count")
            .map_err(|m| gguf_err(&parts[0].0, m))?;
        let file = Self::from_parts(parts, parsed_parts);
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for t in &file.tensors {
            if let Some(other) = seen.insert(&t.name, t.part) {
                return Err(err(format!(
                    "tensor {} is in two parts of the set ({} and {})",
                    t.name,
                    file.parts[other].0.display(),
                    file.parts[t.part].0.display()
                )));
            }
        }
        if let Some(want) = want.filter(|&w| w != file.tensors.len() as u64) {
            return Err(err(format!(
                "the {count} parts hold {} tensors, but the first says the set has {want} \
                 (split.tensors.count): a part is damaged or from another set",
                file.tensors.len()
            )));
        }
        Ok(file)
    }

    /// One file from its parts: the first part's version and metadata, every part's tensors.
    fn from_parts(parts: Vec<(PathBuf, Arc<Mmap>)>, parsed: Vec<Parsed>) -> Self {
        let mut parsed = parsed.into_iter();
        let first = parsed.next().expect("at least one part");
        let mut tensors = first.tensors;
        for (i, p) in parsed.enumerate() {
            tensors.extend(
                p.tensors
                    .into_iter()
                    .map(|t| GgufTensorInfo { part: i + 1, ..t }),
            );
        }
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        GgufFile {
            parts,
            version: first.version,
            metadata: first.metadata,
            tensors,
            by_name,
        }
    }

    /// The file opened (the first part of a split set).
    pub fn path(&self) -> &Path {
        &self.parts[0].0
    }

    /// Every file: one, or each part of a split set in order.
    pub fn paths(&self) -> Vec<&Path> {
        self.parts.iter().map(|(p, _)| p.as_path()).collect()
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// All key/value pairs, in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// `general.architecture`, when present.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata("general.architecture")
            .and_then(GgufValue::as_str)
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (bounds were checked at open).
    pub fn tensor_bytes(&self, t: &GgufTensorInfo) -> &[u8] {
        &self.parts[t.part].1[t.offset as usize..(t.offset + t.bytes) as usize]
    }

    /// The bytes of a tensor as a zero-copy view that keeps the map alive.
    pub fn tensor_host_bytes(&self, t: &GgufTensorInfo) -> HostBytes {
        HostBytes::new(
            self.parts[t.part].1.clone(),
            t.offset as usize..(t.offset + t.bytes) as usize,
        )
    }

    /// Bytes of every file of the set together.
    pub fn file_bytes(&self) -> u64 {
        self.parts.iter().map(|(_, m)| m.len() as u64).sum()
    }
}

fn gguf_err(path: &Path, message: String) -> GgufError {
    GgufError {
        path: path.to_path_buf(),
        message,
    }
}

fn map_and_parse(path: &Path) -> Result<(Mmap, Parsed), GgufError> {
    let file = File::open(path).map_err(|e| gguf_err(path, format!("cannot open: {e}")))?;
    // SAFETY: the map is read-only and private to this process; a file truncated or rewritten
    // underneath it is the same hazard every memory-mapped weight loader accepts, and all
    // offsets are checked against the length seen at open.
    let mmap =
        unsafe { Mmap::map(&file) }.map_err(|e| gguf_err(path, format!("cannot map: {e}")))?;
    let parsed = parse(&mmap).map_err(|m| gguf_err(path, m))?;
    Ok((mmap, parsed))
}

/// A `split.*` key of a part as a count (llama.cpp writes u16 and i32): absent is `None`.
fn split_field(parsed: &Parsed, key: &str) -> Result<Option<u64>, String> {
    match parsed.metadata.iter().find(|(k, _)| k == key) {
        None => Ok(None),
        Some((_, v)) => match v.as_u64() {
            Some(n) => Ok(Some(n)),
            None => Err(format!("{key} is {v}, not a count")),
        },
    }
}

/// The paths of the `count` parts of the set `path` belongs to, when its name ends in
/// llama.cpp's `-NNNNN-of-NNNNN.gguf` (`llama_split_path`: `%s-%05d-of-%05d.gguf`, from 1).
fn split_names(path: &Path, count: u64) -> Option<Vec<PathBuf>> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (head, of) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(of) || of.parse::<u64>().ok()? != count {
        return None;
    }
    let no: u64 = no.parse().ok()?;
    if no == 0 || no > count || count > 99_999 {
        return None;
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    Some(
        (1..=count)
            .map(|i| dir.join(format!("{prefix}-{i:05}-of-{count:05}.gguf")))
            .collect(),
    )
}

struct Parsed {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        let left = (self.data.len() - self.pos) as u64;
        if n > left {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {}, {left} left",
                self.pos
            ));
        }
        let s = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<GgufValue, String> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("{what}: boolean byte {b}")),
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("{what}: arrays nested deeper than {MAX_DEPTH}"));
                }
                let item_ty = self.u32(what)?;
                let n = self.u64(what)?;
                // Every item takes at least one byte: a count beyond the file is a lie, not an
                // allocation to attempt.
                if n > (self.data.len() - self.pos) as u64 {
                    return Err(format!(
                        "{what}: array of {n} items is longer than the file"
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item_ty, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(format!("{what}: unknown value type {t}")),
        })
    }
}

fn parse(data: &[u8]) -> Result<Parsed, String> {
    let mut c = Cursor { data, pos: 0 };
    let magic = c.array::<4>("the magic")?;
    if &magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file (starts with {magic:02x?}, expected \"GGUF\")"
        ));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(format!(
            "GGUF version {version} is not supported (2 and 3 are; convert older files with \
             llama.cpp's tools)"
        ));
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.u64("the metadata count")?;
    // Each entry takes well over 8 bytes: counts beyond that are corrupt, not huge.
    for (n, what) in [(n_tensors, "tensors"), (n_kv, "metadata entries")] {
        if n > data.len() as u64 / 8 {
            return Err(format!(
                "header claims {n} {what}, more than the file can hold"
            ));
        }
    }
    let mut metadata = Vec::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&format!("the type of {key}"))?;
        let value = c.value(ty, &key, 0)?;
        if metadata.iter().any(|(k, _)| *k == key) {
            return Err(format!("metadata key {key} appears twice"));
        }
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => 32,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(format!("general.alignment {v} is not a power of two")),
        },
    };
    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor {i}"))?;
        let n_dims = c.u32(&format!("{name}: dimension count"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!(
                "{name}: {n_dims} dimensions (ggml has 1 to {MAX_DIMS})"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&format!("{name}: dimensions"))?);
        }
        let type_id = c.u32(&format!("{name}: type"))?;
        let ggml_type = GgmlType::from_id(type_id)
            .ok_or_else(|| format!("{name}: unknown ggml type {type_id}"))?;
        let offset = c.u64(&format!("{name}: offset"))?;
        if offset % alignment != 0 {
            return Err(format!(
                "{name}: data offset {offset} is not aligned to {alignment}"
            ));
        }
        let elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("{name}: dimensions {dims:?} overflow"))?;
        let block = ggml_type.block_elements();
        if dims[0] % block != 0 {
            return Err(format!(
                "{name}: rows of {} elements are not whole {} blocks of {block}",
                dims[0],
                ggml_type.name()
            ));
        }
        let bytes = (elements / block)
            .checked_mul(ggml_type.block_bytes())
            .ok_or_else(|| format!("{name}: size overflows"))?;
        if !names.insert(name.clone()) {
            return Err(format!("tensor {name} appears twice"));
        }
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            part: 0,
            offset,
            bytes,
        });
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = data.len() as u64;
    for t in &mut tensors {
        let start = data_start
            .checked_add(t.offset)
            .filter(|s| s.checked_add(t.bytes).is_some_and(|end| end <= file_len))
            .ok_or_else(|| {
                format!(
                    "{}: {} bytes at data offset {} run past the end of the file ({file_len} \
                     bytes; truncated download?)",
                    t.name, t.bytes, t.offset
                )
            })?;
        t.offset = start;
    }
    // Overlapping tensors mean a corrupt table.
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|t| (t.offset, t.offset + t.bytes, t.name.as_str()))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(format!("tensors {} and {} overlap", w[0].2, w[1].2));
        }
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
    })
}

#[cfg(test)]
#[path = "gguf_tests.rs"]
pub(crate) mod tests;
