//! All tensors of a checkpoint, and typed views of them (weight matrices, vectors).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_backend::{HostBytes, HostMatrix, WeightFormat, MXFP4_GROUP};

use crate::error::FormatError;
use crate::quant::QuantConfig;
use crate::read_json;
use crate::safetensors::{read_all, StDtype, TensorInfo};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// Every tensor of a checkpoint (one file or several shards), memory-mapped.
#[derive(Clone)]
pub struct Tensors {
    dir: PathBuf,
    files: Vec<PathBuf>,
    map: BTreeMap<String, TensorInfo>,
}

impl fmt::Debug for Tensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensors")
            .field("dir", &self.dir)
            .field("files", &self.files)
            .field("tensors", &self.map.len())
            .finish()
    }
}

/// What `load` found: `experts` matrices of `[rows, cols]` laid out one after another.
struct Stack<'a> {
    weight: &'a TensorInfo,
    experts: usize,
    rows: usize,
    cols: usize,
    format: WeightFormat,
    /// Describes the stored form for error messages, e.g. `U32 [8, 64] at 4 bits, group 64`.
    stored: String,
    data: HostBytes,
    scales: HostBytes,
    biases: HostBytes,
}

impl Tensors {
    /// The weights of a model directory: the shards listed in `model.safetensors.index.json` if
    /// it exists, else every `*.safetensors` file of the directory.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Tensors, FormatError> {
        let dir = dir.as_ref();
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(dir, &index);
        }
        let entries = std::fs::read_dir(dir).map_err(|source| FormatError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut files = Vec::new();
        for e in entries {
            let e = e.map_err(|source| FormatError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let name = e.file_name();
            let name = name.to_string_lossy();
            // Dot files are e.g. macOS `._x` resource forks or partial downloads.
            if name.ends_with(".safetensors") && !name.starts_with('.') && e.path().is_file() {
                files.push(e.path());
            }
        }
        if files.is_empty() {
            return Err(FormatError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        files.sort();
        Self::open_files(dir, files)
    }

    /// The tensors of `files` (names must not repeat across them); `dir` is used in messages.
    pub fn open_files(dir: impl AsRef<Path>, files: Vec<PathBuf>) -> Result<Tensors, FormatError> {
        let map = read_all(&files)?;
        Ok(Tensors {
            dir: dir.as_ref().to_path_buf(),
            files,
            map,
        })
    }

    /// Tensors made elsewhere (a GGUF's, under Hugging Face names); `dir` is used in messages.
    pub(crate) fn from_map(
        dir: impl AsRef<Path>,
        files: Vec<PathBuf>,
        map: BTreeMap<String, TensorInfo>,
    ) -> Tensors {
        Tensors {
            dir: dir.as_ref().to_path_buf(),
            files,
            map,
        }
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Tensors, FormatError> {
        let err = |msg: String| FormatError::Config {
            path: index.to_path_buf(),
            msg,
        };
        let v = read_json(index)?;
        let Some(Value::Object(wm)) = v.get("weight_map") else {
            return Err(err(
                "no `weight_map` object (name -> shard file); re-download the index".to_string(),
            ));
        };
        let mut listed: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in wm {
            let Some(file) = file.as_str() else {
                return Err(err(format!(
                    "`weight_map` entry `{name}` must be a file name, found {file}"
                )));
            };
            if Path::new(file).is_absolute() || file.contains("..") {
                return Err(err(format!(
                    "shard `{file}` of tensor `{name}` must be a file name inside the model directory"
                )));
            }
            listed.entry(file).or_default().push(name);
        }
        if listed.is_empty() {
            return Err(err("`weight_map` is empty".to_string()));
        }
        let mut files = Vec::new();
        for (file, names) in &listed {
            let p = dir.join(file);
            if !p.is_file() {
                return Err(err(format!(
                    "shard {file} (holding {} tensors, e.g. `{}`) is missing from {} (incomplete download? fetch it again)",
                    names.len(),
                    names[0],
                    dir.display()
                )));
            }
            files.push(p);
        }
        let t = Self::open_files(dir, files)?;
        for (file, names) in &listed {
            if let Some(missing) = names.iter().find(|n| !t.map.contains_key(**n)) {
                return Err(err(format!(
                    "lists tensor `{missing}` in {file}, but no shard holds it (index and shards do not match: re-download them)"
                )));
            }
        }
        Ok(t)
    }

    /// The directory the tensors were read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The safetensors files, in the order they were read.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// All tensors, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = &TensorInfo> {
        self.map.values()
    }

    pub fn get(&self, name: &str) -> Result<&TensorInfo, FormatError> {
        self.map.get(name).ok_or_else(|| self.not_found(name))
    }

    /// Where tensor `name`'s data lives on disk: the file, the absolute offset of its first byte
    /// in that file, and its length in bytes (to read it with plain file I/O instead of the map).
    pub fn location(&self, name: &str) -> Result<(&Path, u64, u64), FormatError> {
        let t = self.get(name)?;
        if !t.in_file() {
            return Err(t.err(
                "was converted in memory (a GGUF's quantised blocks), so it cannot be read from \
                 the file; pack the model first (`sluice pack MODEL.gguf -o DIR`)"
                    .to_string(),
            ));
        }
        Ok((&t.file, t.offset, t.bytes.len() as u64))
    }

    fn not_found(&self, name: &str) -> FormatError {
        let similar = similar_names(name, self.map.keys().map(String::as_str), 3);
        FormatError::TensorNotFound {
            name: name.to_string(),
            dir: self.dir.clone(),
            count: self.map.len(),
            similar: if similar.is_empty() {
                String::new()
            } else {
                format!("; similar: {}", similar.join(", "))
            },
        }
    }

    /// `{prefix}.weight`, or `prefix` itself when that is a tensor (transformers' fused expert
    /// parameters such as `mlp.experts.gate_up_proj` have no `.weight` suffix).
    fn weight_of(&self, prefix: &str) -> Result<&TensorInfo, FormatError> {
        let w = format!("{prefix}.weight");
        if let Some(t) = self.map.get(&w) {
            return Ok(t);
        }
        if let Some(t) = self.map.get(prefix) {
            return Ok(t);
        }
        Err(self.not_found(&w))
    }

    /// A 2-D weight matrix `[out, in]` of the module at `prefix` (e.g.
    /// `model.layers.0.self_attn.q_proj`), zero-copy.
    ///
    /// If `{prefix}.scales` exists the weight is MLX-affine quantised: `{prefix}.weight` is U32
    /// `[out, in * bits / 32]`, `{prefix}.scales` and `{prefix}.biases` are `[out, in / group]`
    /// of F32/F16/BF16, and `(bits, group)` come from `quant.for_module(prefix)`, checked
    /// against the shapes. Otherwise `{prefix}.weight` (or `prefix` itself) is a dense
    /// `[out, in]` F32/F16/BF16 tensor. `expect` checks the logical shape `(out, in)`.
    pub fn matrix(
        &self,
        prefix: &str,
        quant: Option<&QuantConfig>,
        expect: Option<(usize, usize)>,
    ) -> Result<HostMatrix, FormatError> {
        let s = self.load(prefix, quant, 2, expect.map(|e| e.1))?;
        if let Some((out, inp)) = expect {
            if (s.rows, s.cols) != (out, inp) {
                return Err(s.weight.err(format!(
                    "holds a [{}, {}] matrix ({}), expected [{out}, {inp}]",
                    s.rows, s.cols, s.stored
                )));
            }
        }
        Self::build(&s, s.data.clone(), s.scales.clone(), s.biases.clone())
    }

    /// Like [`Tensors::matrix`] for a stacked 3-D tensor `[experts, out, in]` (mlx
    /// `switch_mlp` projections, transformers' fused experts): one zero-copy matrix per expert.
    /// `expect` checks `(experts, out, in)`.
    pub fn matrix_stack(
        &self,
        prefix: &str,
        quant: Option<&QuantConfig>,
        expect: Option<(usize, usize, usize)>,
    ) -> Result<Vec<HostMatrix>, FormatError> {
        let s = self.load(prefix, quant, 3, expect.map(|e| e.2))?;
        if let Some((e, out, inp)) = expect {
            if (s.experts, s.rows, s.cols) != (e, out, inp) {
                return Err(s.weight.err(format!(
                    "holds {} experts of [{}, {}] ({}), expected {e} experts of [{out}, {inp}]",
                    s.experts, s.rows, s.cols, s.stored
                )));
            }
        }
        let db = s.rows * s.format.row_bytes(s.cols);
        let sb = s.rows * s.format.scale_row_bytes(s.cols);
        let bb = s.rows * s.format.bias_row_bytes(s.cols);
        (0..s.experts)
            .map(|e| {
                let part = |bytes: &HostBytes, n: usize| match n {
                    0 => HostBytes::empty(),
                    n => bytes.slice(e * n..(e + 1) * n),
                };
                let (scales, biases) = (part(&s.scales, sb), part(&s.biases, bb));
                Self::build(&s, s.data.slice(e * db..(e + 1) * db), scales, biases)
            })
            .collect()
    }

    fn build(
        s: &Stack<'_>,
        data: HostBytes,
        scales: HostBytes,
        biases: HostBytes,
    ) -> Result<HostMatrix, FormatError> {
        HostMatrix::new(s.format, s.rows, s.cols, data, scales, biases)
            .map_err(|e| s.weight.err(format!("{e} ({})", s.stored)))
    }

    /// Finds and checks the tensors of a (stack of) matrices; `ndim` is 2 or 3. `expect_cols`
    /// only improves messages about quantisation settings that do not fit.
    fn load(
        &self,
        prefix: &str,
        quant: Option<&QuantConfig>,
        ndim: usize,
        expect_cols: Option<usize>,
    ) -> Result<Stack<'_>, FormatError> {
        let what = if ndim == 2 {
            "a 2-D [out, in] matrix"
        } else {
            "a 3-D [experts, out, in] stack"
        };
        // gpt-oss's released experts: `{prefix}_blocks` U8 `[.., out, in / 32, 16]` (two FP4
        // codes a byte) and `{prefix}_scales` U8 `[.., out, in / 32]` (E8M0 exponents).
        let blocks_name = format!("{prefix}_blocks");
        if let Some(blocks) = self.map.get(&blocks_name) {
            return self.mxfp4_blocks(prefix, blocks, ndim);
        }
        let scales_name = format!("{prefix}.scales");
        let Some(scales) = self.map.get(&scales_name) else {
            // Dense.
            let w = self.weight_of(prefix)?;
            let Some(dt) = w.dtype.to_dtype() else {
                let hint = match w.dtype {
                    StDtype::U32 => format!(
                        " (U32 looks like a quantised weight, but there is no `{scales_name}`)"
                    ),
                    // DeepSeek-V3's and Kimi K2's official checkpoints (128 x 128 block scales).
                    StDtype::F8_E4M3 | StDtype::F8_E5M2 => " (FP8 checkpoints are not read: \
                        convert to bf16 or quantise with mlx_lm.convert first)"
                        .to_string(),
                    _ => String::new(),
                };
                return Err(w.err(format!(
                    "dtype {}, expected F32, F16 or BF16 for a dense weight{hint}",
                    w.dtype
                )));
            };
            if w.shape.len() != ndim {
                return Err(w.err(format!(
                    "has shape {:?} ({}), expected {what}",
                    w.shape, w.dtype
                )));
            }
            let (experts, rows, cols) = dims(&w.shape);
            return Ok(Stack {
                weight: w,
                experts,
                rows,
                cols,
                format: WeightFormat::Dense(dt),
                stored: format!("{} {:?}", w.dtype, w.shape),
                data: w.bytes.clone(),
                scales: HostBytes::empty(),
                biases: HostBytes::empty(),
            });
        };

        let w = self.weight_of(prefix)?;
        if quant.map(|q| q.mode_for(prefix)) == Some("mxfp4") {
            return self.mxfp4_mlx(prefix, w, scales, ndim);
        }
        // MLX affine.
        let biases_name = format!("{prefix}.biases");
        let Some(biases) = self.map.get(&biases_name) else {
            return Err(scales.err(format!(
                "exists but `{biases_name}` does not: sluice reads MLX affine quantisation, which needs both"
            )));
        };
        if w.dtype != StDtype::U32 {
            return Err(w.err(format!(
                "dtype {}, expected U32 (packed quantised weights, since `{scales_name}` exists)",
                w.dtype
            )));
        }
        if w.shape.len() != ndim {
            return Err(w.err(format!(
                "has shape {:?} (U32), expected {what} (packed)",
                w.shape
            )));
        }
        let Some(sdt) = scales.dtype.to_dtype() else {
            return Err(scales.err(format!(
                "dtype {}, expected F32, F16 or BF16 quantisation scales",
                scales.dtype
            )));
        };
        if biases.dtype != scales.dtype || biases.shape != scales.shape {
            return Err(biases.err(format!(
                "is {} {:?} but `{scales_name}` is {} {:?}: they must match",
                biases.dtype, biases.shape, scales.dtype, scales.shape
            )));
        }
        if scales.shape.len() != ndim || scales.shape[..ndim - 1] != w.shape[..ndim - 1] {
            return Err(scales.err(format!(
                "has shape {:?}, which does not fit the packed weight `{}` {:?}",
                scales.shape, w.name, w.shape
            )));
        }
        let Some(q) = quant else {
            return Err(w.err(format!(
                "is MLX-quantised (`{scales_name}` exists) but config.json has no `quantization` settings (add \"quantization\": {{\"bits\": ..., \"group_size\": ...}} or re-convert with mlx_lm.convert)"
            )));
        };
        if q.mode_for(prefix) != "affine" {
            return Err(w.err(format!(
                "quantisation mode `{}` in config.json is not supported (sluice reads modes `affine` and `mxfp4`)",
                q.mode_for(prefix)
            )));
        }
        let Some((bits, group)) = q.for_module(prefix) else {
            return Err(w.err(format!(
                "config.json marks `{prefix}` as not quantised (`false` in `quantization`), but `{scales_name}` exists"
            )));
        };
        let (experts, rows, packed) = dims(&w.shape);
        let ngroups = scales.shape[ndim - 1];
        let stored = format!("stored as U32 {:?} at {bits} bits, group {group}", w.shape);
        let row_bits = packed * 32;
        let bits_us = bits as usize;
        let cols = row_bits / bits_us;
        if row_bits % bits_us != 0 || ngroups.checked_mul(group) != Some(cols) {
            let hint = shape_hint(row_bits, ngroups, expect_cols);
            return Err(w.err(format!(
                "config.json says `{prefix}` has {bits} bits, group size {group}, but the tensors do not fit that: {packed} u32 words per row and {ngroups} groups per row in `{scales_name}`{hint}; fix `quantization` in config.json"
            )));
        }
        if let Some(ec) = expect_cols {
            if ec != cols && ec > 0 && row_bits % ec == 0 && ec % ngroups.max(1) == 0 {
                return Err(w.err(format!(
                    "holds rows of {cols} columns at {bits} bits ({stored}), expected {ec} columns: the shapes fit {} bits, group size {}; does `quantization` in config.json match the tensors?",
                    row_bits / ec,
                    ec / ngroups.max(1)
                )));
            }
        }
        Ok(Stack {
            weight: w,
            experts,
            rows,
            cols,
            format: WeightFormat::Affine {
                bits,
                group_size: group,
                scale_dtype: sdt,
            },
            stored,
            data: w.bytes.clone(),
            scales: scales.bytes.clone(),
            biases: biases.bytes.clone(),
        })
    }

    /// An MLX `mode="mxfp4"` weight: U32 `[.., out, in / 8]` codes and U8 `[.., out, in / 32]`
    /// exponents, no biases.
    fn mxfp4_mlx<'t>(
        &'t self,
        prefix: &str,
        w: &'t TensorInfo,
        scales: &'t TensorInfo,
        ndim: usize,
    ) -> Result<Stack<'t>, FormatError> {
        if w.dtype != StDtype::U32 || w.shape.len() != ndim {
            return Err(w.err(format!(
                "is {} {:?}, expected U32 packed mxfp4 codes of {ndim} dimensions",
                w.dtype, w.shape
            )));
        }
        let (experts, rows, packed) = dims(&w.shape);
        let cols = packed * 8;
        let groups_ok = scales.shape.len() == ndim
            && scales.shape[..ndim - 1] == w.shape[..ndim - 1]
            && scales.shape[ndim - 1] * MXFP4_GROUP == cols;
        if scales.dtype != StDtype::U8 || !groups_ok {
            return Err(scales.err(format!(
                "is {} {:?}, expected U8 mxfp4 exponents, one per 32 of the {cols} columns of `{}` {:?} (config.json says mode mxfp4 for `{prefix}`)",
                scales.dtype, scales.shape, w.name, w.shape
            )));
        }
        Ok(Stack {
            weight: w,
            experts,
            rows,
            cols,
            format: WeightFormat::Mxfp4,
            stored: format!("stored as U32 {:?} in mxfp4", w.shape),
            data: w.bytes.clone(),
            scales: scales.bytes.clone(),
            biases: HostBytes::empty(),
        })
    }

    /// gpt-oss's released mxfp4 tensors: `{prefix}_blocks` U8 `[.., out, in / 32, 16]` and
    /// `{prefix}_scales` U8 `[.., out, in / 32]`.
    fn mxfp4_blocks<'t>(
        &'t self,
        prefix: &str,
        blocks: &'t TensorInfo,
        ndim: usize,
    ) -> Result<Stack<'t>, FormatError> {
        let scales_name = format!("{prefix}_scales");
        let Some(scales) = self.map.get(&scales_name) else {
            return Err(blocks.err(format!(
                "exists but `{scales_name}` does not: mxfp4 blocks need their scales"
            )));
        };
        let n = blocks.shape.len();
        if blocks.dtype != StDtype::U8 || n != ndim + 1 || blocks.shape[n - 1] != 16 {
            return Err(blocks.err(format!(
                "is {} {:?}, expected U8 mxfp4 blocks [.., out, in / 32, 16] ({} dimensions)",
                blocks.dtype,
                blocks.shape,
                ndim + 1
            )));
        }
        if scales.dtype != StDtype::U8 || scales.shape[..] != blocks.shape[..n - 1] {
            return Err(scales.err(format!(
                "is {} {:?}, expected U8 {:?} (one exponent per block of `{}`)",
                scales.dtype,
                scales.shape,
                &blocks.shape[..n - 1],
                blocks.name
            )));
        }
        let (experts, rows, groups) = dims(&blocks.shape[..n - 1]);
        Ok(Stack {
            weight: blocks,
            experts,
            rows,
            cols: groups * MXFP4_GROUP,
            format: WeightFormat::Mxfp4,
            stored: format!("stored as U8 mxfp4 blocks {:?}", blocks.shape),
            data: blocks.bytes.clone(),
            scales: scales.bytes.clone(),
            biases: HostBytes::empty(),
        })
    }

    /// A 1-D float tensor converted to f32; `expect_len` checks its length.
    pub fn vector_f32(
        &self,
        name: &str,
        expect_len: Option<usize>,
    ) -> Result<Vec<f32>, FormatError> {
        let t = self.get(name)?;
        if t.shape.len() != 1 {
            return Err(t.err(format!(
                "has shape {:?}, expected a 1-D vector{}",
                t.shape,
                expect_len.map(|n| format!(" of {n}")).unwrap_or_default()
            )));
        }
        if let Some(n) = expect_len {
            if t.shape[0] != n {
                return Err(t.err(format!("has length {}, expected {n}", t.shape[0])));
            }
        }
        t.to_f32()
    }

    /// Any float tensor converted to f32, with its shape (for small tensors such as conv
    /// weights).
    pub fn to_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), FormatError> {
        let t = self.get(name)?;
        Ok((t.to_f32()?, t.shape.clone()))
    }
}

/// `[e, r, c]` or `[r, c]` (as `e = 1`).
fn dims(shape: &[usize]) -> (usize, usize, usize) {
    match *shape {
        [r, c] => (1, r, c),
        [e, r, c] => (e, r, c),
        _ => (0, 0, 0),
    }
}

/// What quantisation the shapes suggest, for messages.
fn shape_hint(row_bits: usize, ngroups: usize, expect_cols: Option<usize>) -> String {
    let mut fits = Vec::new();
    if ngroups > 0 {
        for bits in [2usize, 3, 4, 5, 6, 8] {
            if !row_bits.is_multiple_of(bits) {
                continue;
            }
            let cols = row_bits / bits;
            if expect_cols.is_some_and(|c| c != cols) {
                continue;
            }
            if cols.is_multiple_of(ngroups) && [32, 64, 128].contains(&(cols / ngroups)) {
                fits.push(format!("{bits} bits with group size {}", cols / ngroups));
            }
        }
    }
    if fits.is_empty() {
        String::new()
    } else {
        format!(" (the shapes fit {})", fits.join(" or "))
    }
}

/// Up to `n` names most like `name` (longest shared prefix plus suffix).
fn similar_names<'a>(name: &str, names: impl Iterator<Item = &'a str>, n: usize) -> Vec<&'a str> {
    let score = |cand: &str| {
        let a = name.as_bytes();
        let b = cand.as_bytes();
        let pre = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let suf = a
            .iter()
            .rev()
            .zip(b.iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        (pre + suf).min(a.len().min(b.len()))
    };
    let mut best: BTreeSet<(std::cmp::Reverse<usize>, usize, &str)> = BTreeSet::new();
    let min = (name.len() / 3).max(3);
    for c in names {
        let s = score(c);
        if s < min {
            continue;
        }
        best.insert((std::cmp::Reverse(s), c.len().abs_diff(name.len()), c));
        if best.len() > n {
            best.pop_last();
        }
    }
    best.into_iter().map(|(_, _, c)| c).collect()
}
