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
}

impl WeightFormat {
    /// Bytes of `data` per row of `cols` columns.
    pub fn row_bytes(&self, cols: usize) -> usize {
        match *self {
            WeightFormat::Dense(dt) => cols * dt.size(),
            WeightFormat::Affine { bits, .. } => cols * bits as usize / 8,
        }
    }

    /// Bytes of `scales` (and of `biases`) per row.
    pub fn scale_row_bytes(&self, cols: usize) -> usize {
        match *self {
            WeightFormat::Dense(_) => 0,
            WeightFormat::Affine {
                group_size,
                scale_dtype,
                ..
            } => cols / group_size * scale_dtype.size(),
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
        let (scales, biases) = if sb == 0 {
            (self.scales.clone(), self.biases.clone())
        } else {
            (
                self.scales.slice(range.start * sb..range.end * sb),
                self.biases.slice(range.start * sb..range.end * sb),
            )
        };
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
            biases: copy(&self.biases, sb),
        }
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
    /// Affine only: `rows * cols / group_size` elements each (empty for dense formats).
    pub scales: &'a [u8],
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
        if self.scales.len() != want_s || self.biases.len() != want_s {
            return bad(format!(
                "{}/{} scale/bias bytes for [{}, {}] in {}, expected {want_s}",
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
        MatRef {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            data: &self.data[range.start * rb..range.end * rb],
            scales: if sb == 0 {
                self.scales
            } else {
                &self.scales[range.start * sb..range.end * sb]
            },
            biases: if sb == 0 {
                self.biases
            } else {
                &self.biases[range.start * sb..range.end * sb]
            },
        }
    }
}
