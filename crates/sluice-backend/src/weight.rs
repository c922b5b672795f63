//! Weight formats and zero-copy views of weight bytes in host memory.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Element type of dense weights and of affine scales/biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        })
    }
}

/// How a weight matrix `[rows, cols]` is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Plain row-major elements.
    Dense(Dtype),
    /// MLX affine quantisation: each row is split into groups of `group_size` columns; element
    /// `c` of a group is `scale * q_c + bias`. `q` are `bits`-bit unsigned integers packed
    /// little-endian into u32 words, element `i` of a word in bits `[i * bits, (i + 1) * bits)`.
    /// `scales` and `biases` are `[rows, cols / group_size]` of `scale_dtype`.
    Affine {
        bits: u32,
        group_size: usize,
        scale_dtype: Dtype,
    },
    /// OCP microscaling FP4 (`mxfp4`: gpt-oss's released experts, MLX's `mode="mxfp4"`): each
    /// row is split into groups of [`MXFP4_GROUP`] columns; element `c` of a group is
    /// `FP4_E2M1[q_c] * 2^(e - 127)`. `q` are 4-bit codes packed two per byte, the lower nibble
    /// first (MLX's u32 words, little-endian, are the same bytes); `scales` are the groups'
    /// exponents `e` (E8M0, one byte each), `[rows, cols / 32]`; there are no biases.
    Mxfp4,
}

/// Columns per scale of [`WeightFormat::Mxfp4`].
pub const MXFP4_GROUP: usize = 32;

/// The values of the sixteen FP4 (E2M1) codes: sign bit 3, exponent bits 2-1, mantissa bit 0.
pub const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The scale an E8M0 byte stands for: `2^(e - 127)`, as MLX computes it (0 is the subnormal
/// 2^-127; 255, NaN in the OCP standard, is infinity there; gpt-oss writes neither).
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

impl WeightFormat {
    /// Bytes of `data` per row of `cols` columns.
    pub fn row_bytes(&self, cols: usize) -> usize {
        match *self {
            WeightFormat::Dense(dt) => cols * dt.size(),
            WeightFormat::Affine { bits, .. } => cols * bits as usize / 8,
            WeightFormat::Mxfp4 => cols / 2,
        }
    }

    /// Bytes of `scales` per row.
    pub fn scale_row_bytes(&self, cols: usize) -> usize {
        match *self {
            WeightFormat::Dense(_) => 0,
            WeightFormat::Affine {
                group_size,
                scale_dtype,
                ..
            } => cols / group_size * scale_dtype.size(),
            WeightFormat::Mxfp4 => cols / MXFP4_GROUP,
        }
    }

    /// Bytes of `biases` per row (affine formats only).
    pub fn bias_row_bytes(&self, cols: usize) -> usize {
        match *self {
            WeightFormat::Affine { .. } => self.scale_row_bytes(cols),
            WeightFormat::Dense(_) | WeightFormat::Mxfp4 => 0,
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightFormat::Dense(dt) => write!(f, "{dt}"),
            WeightFormat::Affine {
                bits,
                group_size,
                scale_dtype,
            } => write!(f, "q{bits}/g{group_size} ({scale_dtype} scales)"),
            WeightFormat::Mxfp4 => f.write_str("mxfp4"),
        }
    }
}

/// Host bytes that do not describe the matrix they claim to.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WeightError {
    #[error("{0}")]
    Invalid(String),
}

/// A shared, immutable byte range in host memory (usually part of a memory-mapped file).
#[derive(Clone)]
pub struct HostBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl HostBytes {
    /// Bytes `range` of `owner`. Panics if the range is out of bounds (callers validate first).
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= (*owner).as_ref().len());
        HostBytes { owner, range }
    }

    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        HostBytes {
            owner: Arc::new(v),
            range: 0..len,
        }
    }

    pub fn empty() -> Self {
        Self::from_vec(Vec::new())
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// Whether `self` and `other` are ranges of the same buffer (say one expert's parts in one
    /// block of an expert cache).
    pub fn same_buffer(&self, other: &HostBytes) -> bool {
        Arc::ptr_eq(&self.owner, &other.owner)
    }

    /// The range of the buffer this is a part of.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Bytes `range` of the buffer this is a part of (see [`HostBytes::range`]).
    pub fn buffer_slice(&self, range: Range<usize>) -> &[u8] {
        &(*self.owner).as_ref()[range]
    }

    /// A sub-range, relative to this one.
    pub fn slice(&self, range: Range<usize>) -> HostBytes {
        assert!(range.start <= range.end && range.end <= self.len());
        HostBytes {
            owner: self.owner.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len())
    }
}

/// A weight matrix `[rows, cols]` whose bytes live in host memory.
#[derive(Debug, Clone)]
pub struct HostMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: HostBytes,
    /// Affine only (empty otherwise).
    pub scales: HostBytes,
    pub biases: HostBytes,
}

impl HostMatrix {
    /// Checks that the byte lengths match the shape and format.
    pub fn new(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: HostBytes,
        scales: HostBytes,
        biases: HostBytes,
    ) -> Result<Self, WeightError> {
        let m = HostMatrix {
            format,
            rows,
            cols,
            data,
            scales,
            biases,
        };
        m.as_ref().validate()?;
        Ok(m)
    }

    pub fn as_ref(&self) -> MatRef<'_> {
        MatRef {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: self.data.as_slice(),
            scales: self.scales.as_slice(),
            biases: self.biases.as_slice(),
        }
    }

    /// Rows `range` as a matrix of its own (zero-copy).
    pub fn rows(&self, range: Range<usize>) -> HostMatrix {
        assert!(range.start <= range.end && range.end <= self.rows);
        let rb = self.format.row_bytes(self.cols);
        let sb = self.format.scale_row_bytes(self.cols);
        let bb = self.format.bias_row_bytes(self.cols);
        let part = |bytes: &HostBytes, width: usize| match width {
            0 => bytes.clone(),
            w => bytes.slice(range.start * w..range.end * w),
        };
        let (scales, biases) = (part(&self.scales, sb), part(&self.biases, bb));
        HostMatrix {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            data: self.data.slice(range.start * rb..range.end * rb),
            scales,
            biases,
        }
    }

    /// The rows of `ranges`, in that order, copied into a matrix of their own (to de-interleave
    /// a fused projection once at load).
    pub fn gather_rows(&self, ranges: &[Range<usize>]) -> HostMatrix {
        let rb = self.format.row_bytes(self.cols);
        let sb = self.format.scale_row_bytes(self.cols);
        let bb = self.format.bias_row_bytes(self.cols);
        let copy = |bytes: &HostBytes, width: usize| -> HostBytes {
            if width == 0 {
                return HostBytes::empty();
            }
            let src = bytes.as_slice();
            HostBytes::from_vec(
                ranges
                    .iter()
                    .flat_map(|r| {
                        assert!(r.start <= r.end && r.end <= self.rows);
                        &src[r.start * width..r.end * width]
                    })
                    .copied()
                    .collect(),
            )
        };
        HostMatrix {
            format: self.format,
            rows: ranges.iter().map(|r| r.len()).sum(),
            cols: self.cols,
            data: copy(&self.data, rb),
            scales: copy(&self.scales, sb),
            biases: copy(&self.biases, bb),
        }
    }

    /// Columns `range` as a matrix of their own, copied: a projection over a concatenated input
    /// split into one per part (so no concatenation runs per token). `None` when the range does
    /// not start and end on a quantisation group.
    pub fn columns(&self, range: Range<usize>) -> Option<HostMatrix> {
        assert!(range.start <= range.end && range.end <= self.cols);
        let group = match self.format {
            WeightFormat::Dense(_) => 1,
            WeightFormat::Affine { group_size, .. } => group_size,
            WeightFormat::Mxfp4 => MXFP4_GROUP,
        };
        if !range.start.is_multiple_of(group) || !range.end.is_multiple_of(group) {
            return None;
        }
        let f = self.format;
        // Bytes of the first `cols` columns of a row in each part: every format stores a row's
        // groups in column order, so a group-aligned prefix is a byte prefix.
        let widths: [fn(&WeightFormat, usize) -> usize; 3] = [
            WeightFormat::row_bytes,
            WeightFormat::scale_row_bytes,
            WeightFormat::bias_row_bytes,
        ];
        let parts = [&self.data, &self.scales, &self.biases];
        let mut out = parts.iter().zip(widths).map(|(bytes, width)| {
            let (row, from, to) = (
                width(&f, self.cols),
                width(&f, range.start),
                width(&f, range.end),
            );
            if row == 0 {
                return HostBytes::empty();
            }
            let src = bytes.as_slice();
            HostBytes::from_vec(
                (0..self.rows)
                    .flat_map(|r| &src[r * row + from..r * row + to])
                    .copied()
                    .collect(),
            )
        });
        let (data, scales, biases) = (out.next()?, out.next()?, out.next()?);
        HostMatrix::new(f, self.rows, range.len(), data, scales, biases).ok()
    }

    /// The transpose `[cols, rows]`, copied; `None` for a quantised matrix (its groups run
    /// along rows).
    pub fn transposed(&self) -> Option<HostMatrix> {
        let WeightFormat::Dense(dt) = self.format else {
            return None;
        };
        let (n, src) = (dt.size(), self.data.as_slice());
        let mut out = vec![0u8; src.len()];
        for r in 0..self.rows {
            for c in 0..self.cols {
                let from = (r * self.cols + c) * n;
                let to = (c * self.rows + r) * n;
                out[to..to + n].copy_from_slice(&src[from..from + n]);
            }
        }
        Some(HostMatrix {
            format: self.format,
            rows: self.cols,
            cols: self.rows,
            data: HostBytes::from_vec(out),
            scales: HostBytes::empty(),
            biases: HostBytes::empty(),
        })
    }

    /// Total bytes (data + scales + biases).
    pub fn nbytes(&self) -> usize {
        self.data.len() + self.scales.len() + self.biases.len()
    }
}

/// A borrowed view of a weight matrix, the form CPU kernels take. Nothing here is assumed to be
/// aligned.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// `rows * format.row_bytes(cols)` bytes.
    pub data: &'a [u8],
    /// Quantised formats: `rows * cols / group_size` elements (empty for dense formats).
    pub scales: &'a [u8],
    /// Affine only, as `scales`.
    pub biases: &'a [u8],
}

impl<'a> MatRef<'a> {
    pub fn validate(&self) -> Result<(), WeightError> {
        let bad = |m: String| Err(WeightError::Invalid(m));
        if let WeightFormat::Affine {
            bits, group_size, ..
        } = self.format
        {
            if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) {
                return bad(format!("unsupported quantisation: {bits} bits"));
            }
            if group_size == 0 || !self.cols.is_multiple_of(group_size) {
                return bad(format!(
                    "{} columns are not a multiple of the group size {group_size}",
                    self.cols
                ));
            }
            if !(self.cols * bits as usize).is_multiple_of(32) {
                return bad(format!(
                    "{} columns of {bits} bits do not fill whole u32 words",
                    self.cols
                ));
            }
        }
        if self.format == WeightFormat::Mxfp4 && !self.cols.is_multiple_of(MXFP4_GROUP) {
            return bad(format!(
                "{} columns are not a multiple of the mxfp4 group size {MXFP4_GROUP}",
                self.cols
            ));
        }
        let want = self.rows * self.format.row_bytes(self.cols);
        if self.data.len() != want {
            return bad(format!(
                "{} weight bytes for [{}, {}] in {}, expected {want}",
                self.data.len(),
                self.rows,
                self.cols,
                self.format
            ));
        }
        let want_s = self.rows * self.format.scale_row_bytes(self.cols);
        let want_b = self.rows * self.format.bias_row_bytes(self.cols);
        if self.scales.len() != want_s || self.biases.len() != want_b {
            return bad(format!(
                "{}/{} scale/bias bytes for [{}, {}] in {}, expected {want_s}/{want_b}",
                self.scales.len(),
                self.biases.len(),
                self.rows,
                self.cols,
                self.format
            ));
        }
        Ok(())
    }

    pub fn row_bytes(&self) -> usize {
        self.format.row_bytes(self.cols)
    }

    /// Rows `range` (zero-copy).
    pub fn rows(&self, range: Range<usize>) -> MatRef<'a> {
        let rb = self.format.row_bytes(self.cols);
        let sb = self.format.scale_row_bytes(self.cols);
        let bb = self.format.bias_row_bytes(self.cols);
        let part = |bytes: &'a [u8], width: usize| match width {
            0 => bytes,
            w => &bytes[range.start * w..range.end * w],
        };
        MatRef {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            data: &self.data[range.start * rb..range.end * rb],
            scales: part(self.scales, sb),
            biases: part(self.biases, bb),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::dequantize_row;

    fn bytes(n: usize, seed: u8) -> HostBytes {
        HostBytes::from_vec((0..n).map(|i| (i as u8).wrapping_mul(37) ^ seed).collect())
    }

    /// Every format's column split dequantises to the same columns of the whole matrix.
    #[test]
    fn columns_are_the_same_columns_of_the_whole() {
        let (rows, cols) = (3, 256);
        let formats = [
            WeightFormat::Dense(Dtype::Bf16),
            WeightFormat::Affine {
                bits: 4,
                group_size: 64,
                scale_dtype: Dtype::F16,
            },
            WeightFormat::Affine {
                bits: 8,
                group_size: 32,
                scale_dtype: Dtype::Bf16,
            },
            WeightFormat::Mxfp4,
        ];
        for f in formats {
            let m = HostMatrix::new(
                f,
                rows,
                cols,
                bytes(rows * f.row_bytes(cols), 1),
                bytes(rows * f.scale_row_bytes(cols), 2),
                bytes(rows * f.bias_row_bytes(cols), 3),
            )
            .unwrap();
            for range in [0..128, 128..256, 64..192] {
                let part = m.columns(range.clone()).unwrap();
                assert_eq!((part.rows, part.cols), (rows, range.len()));
                for r in 0..rows {
                    let whole = dequantize_row(&m.as_ref(), r);
                    let got = dequantize_row(&part.as_ref(), r);
                    let want = &whole[range.clone()];
                    // NaN patterns from the arbitrary bytes compare by their bits.
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{f}, columns {range:?}, row {r}");
                }
            }
            assert!(m.columns(0..100).is_none() || f == WeightFormat::Dense(Dtype::Bf16));
        }
    }
}
