//! `experts.json`: where each (layer, expert) block lives in `experts.bin` and how to read it.
//!
//! Block layout: the projections in order `gate_proj`, `up_proj`, `down_proj`; of each, the packed
//! weight, then (quantised formats) the scales and the biases. Every part starts at a multiple of
//! [`PART_ALIGN`] inside the block, and every block at a multiple of [`BLOCK_ALIGN`] in the file,
//! so one aligned read (O_DIRECT) fetches an expert whole.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sluice_backend::{Dtype, HostBytes, HostMatrix, WeightFormat};
use sluice_format::experts::MoeLayer;

/// File name of the manifest inside a packed model directory.
pub const MANIFEST_FILE: &str = "experts.json";
/// Default name of the expert blocks file.
pub const EXPERTS_FILE: &str = "experts.bin";
/// Alignment of blocks in the file (and of their lengths): the O_DIRECT unit.
pub const BLOCK_ALIGN: u64 = 4096;
/// Alignment of parts inside a block (SIMD loads).
pub(crate) const PART_ALIGN: u64 = 64;
/// The projections of an expert, in block order (the scanner's order).
pub(crate) const PROJECTIONS: [&str; 3] = sluice_format::experts::PROJECTIONS;
pub(crate) const FORMAT_NAME: &str = "sluice-experts";
pub(crate) const FORMAT_VERSION: u32 = 1;

/// Errors reading or using a manifest, each naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a valid expert manifest: {msg}")]
    Invalid { path: String, msg: String },
}

/// A byte range inside a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    pub offset: u64,
    pub bytes: u64,
}

/// How a projection's weights are stored (mirrors [`WeightFormat`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum FormatSpec {
    Dense {
        dtype: String,
    },
    Affine {
        bits: u32,
        group_size: usize,
        scale_dtype: String,
    },
    /// Microscaling FP4 (gpt-oss): codes and one E8M0 exponent per 32 columns, no biases.
    Mxfp4,
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "f32",
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    }
}

fn dtype_parse(s: &str) -> Option<Dtype> {
    Some(match s {
        "f32" => Dtype::F32,
        "f16" => Dtype::F16,
        "bf16" => Dtype::Bf16,
        _ => return None,
    })
}

impl FormatSpec {
    pub fn from_format(f: WeightFormat) -> Self {
        match f {
            WeightFormat::Dense(d) => FormatSpec::Dense {
                dtype: dtype_name(d).into(),
            },
            WeightFormat::Affine {
                bits,
                group_size,
                scale_dtype,
            } => FormatSpec::Affine {
                bits,
                group_size,
                scale_dtype: dtype_name(scale_dtype).into(),
            },
            WeightFormat::Mxfp4 => FormatSpec::Mxfp4,
        }
    }

    pub fn to_format(&self) -> Option<WeightFormat> {
        Some(match self {
            FormatSpec::Dense { dtype } => WeightFormat::Dense(dtype_parse(dtype)?),
            FormatSpec::Affine {
                bits,
                group_size,
                scale_dtype,
            } => WeightFormat::Affine {
                bits: *bits,
                group_size: *group_size,
                scale_dtype: dtype_parse(scale_dtype)?,
            },
            FormatSpec::Mxfp4 => WeightFormat::Mxfp4,
        })
    }
}

/// One projection of every expert of a layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Projection {
    /// `gate_proj`, `up_proj` or `down_proj`.
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub format: FormatSpec,
    pub weight: Part,
    pub scales: Option<Part>,
    pub biases: Option<Part>,
}

/// The experts of one MoE layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerExperts {
    /// Decoder layer index.
    pub layer: usize,
    /// Module path of the MoE block in the source checkpoint (`model.layers.0.mlp`).
    pub prefix: String,
    pub experts: usize,
    /// File offset of expert 0's block.
    pub offset: u64,
    /// Bytes from one expert's block to the next (a multiple of [`BLOCK_ALIGN`]).
    pub stride: u64,
    /// Bytes of a block that hold data (`<= stride`).
    pub block_bytes: u64,
    pub projections: Vec<Projection>,
    /// xxh3-64 of each expert's `stride` bytes, as 16 hex digits.
    pub checksums: Vec<String>,
}

/// The whole `experts.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Name of the blocks file, relative to the manifest. Always set in `experts.json`; `None`
    /// only for the in-memory layout of an unpacked checkpoint, whose blocks are gathered from
    /// its shards.
    pub file: Option<String>,
    pub block_align: u64,
    /// `xxh3-64`.
    pub checksum: String,
    pub layers: Vec<LayerExperts>,
}

/// The xxh3-64 checksum of a block, as stored in the manifest.
pub fn checksum(block: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(block))
}

/// The block layout of every MoE layer found in a checkpoint, one after another from offset 0
/// (checksums left empty): what `sluice pack` writes, and the slots of an unpacked store.
pub(crate) fn plan_layers(layers: &[MoeLayer]) -> Vec<LayerExperts> {
    let mut plans = Vec::with_capacity(layers.len());
    let mut offset = 0u64;
    for l in layers {
        let projs: Vec<(String, usize, usize, WeightFormat)> = l.experts[0]
            .matrices
            .iter()
            .zip(PROJECTIONS)
            .map(|(m, name)| (name.to_string(), m.rows, m.cols, m.format))
            .collect();
        let plan = LayerExperts::plan(l.layer, l.prefix.clone(), l.experts.len(), offset, &projs);
        offset = plan.offset + plan.stride * plan.experts as u64;
        plans.push(plan);
    }
    plans
}

/// Rounds `x` up to a multiple of `a`.
pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl LayerExperts {
    /// Lays out the block for projections given as (name, rows, cols, format); the parts'
    /// offsets are filled in, checksums left empty.
    pub fn plan(
        layer: usize,
        prefix: String,
        experts: usize,
        offset: u64,
        projections: &[(String, usize, usize, WeightFormat)],
    ) -> LayerExperts {
        let mut at = 0u64;
        let mut part = |bytes: u64| {
            let p = Part {
                offset: align_up(at, PART_ALIGN),
                bytes,
            };
            at = p.offset + bytes;
            p
        };
        let projections = projections
            .iter()
            .map(|(name, rows, cols, format)| {
                let weight = part((rows * format.row_bytes(*cols)) as u64);
                let (scales, biases) = match format {
                    WeightFormat::Dense(_) => (None, None),
                    WeightFormat::Affine { .. } => {
                        let n = (rows * format.scale_row_bytes(*cols)) as u64;
                        (Some(part(n)), Some(part(n)))
                    }
                    WeightFormat::Mxfp4 => (
                        Some(part((rows * format.scale_row_bytes(*cols)) as u64)),
                        None,
                    ),
                };
                Projection {
                    name: name.clone(),
                    rows: *rows,
                    cols: *cols,
                    format: FormatSpec::from_format(*format),
                    weight,
                    scales,
                    biases,
                }
            })
            .collect();
        LayerExperts {
            layer,
            prefix,
            experts,
            offset,
            stride: align_up(at, BLOCK_ALIGN),
            block_bytes: at,
            projections,
            checksums: Vec::new(),
        }
    }

    /// File offset of `expert`'s block.
    pub fn block_offset(&self, expert: usize) -> u64 {
        self.offset + expert as u64 * self.stride
    }

    /// The three matrices of an expert whose block (`stride` bytes) is `block`.
    pub fn matrices(&self, block: &HostBytes) -> [HostMatrix; 3] {
        let get = |p: &Projection| {
            let slice = |part: Option<Part>| match part {
                Some(x) => block.slice(x.offset as usize..(x.offset + x.bytes) as usize),
                None => HostBytes::empty(),
            };
            HostMatrix {
                format: p.format.to_format().expect("validated on load"),
                rows: p.rows,
                cols: p.cols,
                data: slice(Some(p.weight)),
                scales: slice(p.scales),
                biases: slice(p.biases),
            }
        };
        [
            get(&self.projections[0]),
            get(&self.projections[1]),
            get(&self.projections[2]),
        ]
    }
}

impl Manifest {
    pub fn new(layers: Vec<LayerExperts>) -> Manifest {
        Manifest {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            file: Some(EXPERTS_FILE.into()),
            block_align: BLOCK_ALIGN,
            checksum: "xxh3-64".into(),
            layers,
        }
    }

    /// Reads and validates `dir/experts.json`; `Ok(None)` when the directory is not packed.
    pub fn open(dir: &Path) -> Result<Option<Manifest>, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let p = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|source| ManifestError::Io {
            path: p.clone(),
            source,
        })?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| ManifestError::Invalid {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        m.validate()
            .map_err(|msg| ManifestError::Invalid { path: p, msg })?;
        Ok(Some(m))
    }

    /// Checks internal consistency (not the blocks file: see [`Manifest::check_file_len`]).
    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT_NAME || self.version != FORMAT_VERSION {
            return Err(format!(
                "format {} version {} (this sluice reads {FORMAT_NAME} version {FORMAT_VERSION}; re-run `sluice pack`)",
                self.format, self.version
            ));
        }
        if self.block_align != BLOCK_ALIGN {
            return Err(format!(
                "block_align {} is not {BLOCK_ALIGN}",
                self.block_align
            ));
        }
        match &self.file {
            None => return Err("no blocks `file`".into()),
            Some(f) if f.contains('/') || f.contains("..") => {
                return Err(format!("file `{f}` must be a plain file name"))
            }
            Some(_) => {}
        }
        let mut end_prev = 0u64;
        for l in &self.layers {
            let at = format!("layer {}", l.layer);
            if l.projections.len() != 3
                || l.projections
                    .iter()
                    .zip(PROJECTIONS)
                    .any(|(p, n)| p.name != n)
            {
                return Err(format!("{at}: projections must be {PROJECTIONS:?}"));
            }
            if l.experts == 0 || l.checksums.len() != l.experts {
                return Err(format!(
                    "{at}: {} experts but {} checksums",
                    l.experts,
                    l.checksums.len()
                ));
            }
            if !l.offset.is_multiple_of(BLOCK_ALIGN)
                || !l.stride.is_multiple_of(BLOCK_ALIGN)
                || l.block_bytes > l.stride
                || l.offset < end_prev
            {
                return Err(format!("{at}: blocks are misaligned or overlap"));
            }
            for p in &l.projections {
                let format = p
                    .format
                    .to_format()
                    .ok_or_else(|| format!("{at} {}: unknown dtype", p.name))?;
                let weight = (p.rows * format.row_bytes(p.cols)) as u64;
                let scales = (p.rows * format.scale_row_bytes(p.cols)) as u64;
                let biases = (p.rows * format.bias_row_bytes(p.cols)) as u64;
                let fits = |x: &Part| x.offset + x.bytes <= l.block_bytes;
                // A part is present exactly when the format has it, of its size.
                let part_ok = |part: Option<Part>, want: u64| match part {
                    None => want == 0,
                    Some(x) => want > 0 && x.bytes == want && fits(&x),
                };
                let ok = p.weight.bytes == weight
                    && fits(&p.weight)
                    && part_ok(p.scales, scales)
                    && part_ok(p.biases, biases);
                if !ok {
                    return Err(format!(
                        "{at} {}: part sizes do not match [{}, {}] {format}",
                        p.name, p.rows, p.cols
                    ));
                }
            }
            end_prev = l
                .offset
                .checked_add(l.stride.checked_mul(l.experts as u64).ok_or("overflow")?)
                .ok_or("overflow")?;
        }
        Ok(())
    }

    /// Bytes the blocks file must have.
    pub fn file_len(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.offset + l.stride * l.experts as u64)
            .max()
            .unwrap_or(0)
    }

    /// The blocks file of the packed directory `dir`.
    pub fn blocks_path(&self, dir: &Path) -> Result<PathBuf, ManifestError> {
        match &self.file {
            Some(f) => Ok(dir.join(f)),
            None => Err(ManifestError::Invalid {
                path: dir.join(MANIFEST_FILE).display().to_string(),
                msg: "no blocks `file`".into(),
            }),
        }
    }

    /// Errors when the blocks file is shorter than the manifest says (a truncated copy).
    pub fn check_file_len(&self, dir: &Path) -> Result<(), ManifestError> {
        let path = self.blocks_path(dir)?;
        let p = path.display().to_string();
        let len = std::fs::metadata(&path)
            .map_err(|source| ManifestError::Io {
                path: p.clone(),
                source,
            })?
            .len();
        if len < self.file_len() {
            return Err(ManifestError::Invalid {
                path: p,
                msg: format!(
                    "{len} bytes, the manifest needs {} (truncated? re-run `sluice pack`)",
                    self.file_len()
                ),
            });
        }
        Ok(())
    }

    /// The layer entry of decoder layer `layer`, if it has routed experts.
    pub fn layer(&self, layer: usize) -> Option<&LayerExperts> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Largest block stride (the size of a cache slot).
    pub fn max_stride(&self) -> u64 {
        self.layers.iter().map(|l| l.stride).max().unwrap_or(0)
    }

    /// Total bytes of all expert blocks.
    pub fn total_block_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.stride * l.experts as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4() -> WeightFormat {
        WeightFormat::Affine {
            bits: 4,
            group_size: 64,
            scale_dtype: Dtype::Bf16,
        }
    }

    fn layer() -> LayerExperts {
        let projs = vec![
            ("gate_proj".to_string(), 768, 2048, q4()),
            ("up_proj".to_string(), 768, 2048, q4()),
            ("down_proj".to_string(), 2048, 768, q4()),
        ];
        let mut l = LayerExperts::plan(0, "model.layers.0.mlp".into(), 4, 0, &projs);
        l.checksums = vec!["0".repeat(16); 4];
        l
    }

    #[test]
    fn qwen3_30b_block_is_one_aligned_read() {
        let l = layer();
        // 3 x 768 x 2048 x 4.5 bits = 1769472 bytes, already 4 KiB-aligned parts.
        assert_eq!(l.block_bytes, 3 * 768 * 2048 * 9 / 16);
        assert_eq!(l.stride % BLOCK_ALIGN, 0);
        assert_eq!(l.block_offset(2), 2 * l.stride);
        for p in &l.projections {
            assert_eq!(p.weight.offset % PART_ALIGN, 0);
        }
        let m = Manifest::new(vec![l]);
        m.validate().unwrap();
        let text = serde_json::to_string(&m).unwrap();
        let back: Manifest = serde_json::from_str(&text).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn matrices_slice_the_block() {
        let l = layer();
        let block = HostBytes::from_vec(vec![0u8; l.stride as usize]);
        let [g, u, d] = l.matrices(&block);
        assert_eq!(
            (g.rows, g.cols, u.rows, d.rows, d.cols),
            (768, 2048, 768, 2048, 768)
        );
        assert_eq!(d.data.len(), 2048 * 768 / 2);
        assert_eq!(d.scales.len(), 2048 * 768 / 64 * 2);
    }

    #[test]
    fn validation_catches_inconsistencies() {
        let mut m = Manifest::new(vec![layer()]);
        m.layers[0].checksums.pop();
        assert!(m.validate().unwrap_err().contains("checksums"));
        let mut m = Manifest::new(vec![layer()]);
        m.layers[0].projections[1].weight.bytes += 1;
        assert!(m.validate().unwrap_err().contains("up_proj"));
        let mut m = Manifest::new(vec![layer()]);
        m.version = 9;
        assert!(m.validate().unwrap_err().contains("sluice pack"));
        let mut m = Manifest::new(vec![layer(), layer()]);
        m.layers[1].layer = 1;
        assert!(m.validate().unwrap_err().contains("overlap"));
    }

    #[test]
    fn only_a_packed_manifest_names_a_blocks_file() {
        let mut m = Manifest::new(vec![layer()]);
        let dir = Path::new("/models/packed");
        assert_eq!(m.blocks_path(dir).unwrap(), dir.join(EXPERTS_FILE));
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains(r#""file":"experts.bin""#), "{text}");
        // An unpacked layout's manifest has none: not valid on disk, and no file to open.
        m.file = None;
        assert!(m.validate().unwrap_err().contains("file"));
        assert!(m.blocks_path(dir).is_err());
        let text = text.replace(r#""file":"experts.bin","#, "");
        let back: Manifest = serde_json::from_str(&text).unwrap();
        assert!(back.validate().is_err());
    }
}
