//! Weights in device memory, in their stored format, described to the kernels by [`Mat`].

use cudarc::driver::DeviceRepr;
use sluice_backend::{BackendError, Dtype, HostMatrix, WeightFormat, MXFP4_GROUP};

/// A weight matrix as the kernels see it (`struct Mat` in `kernels/sluice.cu`): device pointers
/// to the codes (or values), scales and biases, and the format.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Mat {
    pub data: u64,
    pub scales: u64,
    pub biases: u64,
    pub rows: i32,
    pub cols: i32,
    pub fmt: i32,
    pub bits: i32,
    pub group: i32,
    pub sdt: i32,
    /// log2(group): groups are powers of two (the kernels shift instead of dividing).
    pub gshift: i32,
    pub pad: i32,
}

// SAFETY: plain old data with the C layout the kernels declare (three pointers, eight ints).
unsafe impl DeviceRepr for Mat {}

/// Matrices that one launch applies to the same input (`struct MatSet`): matrix `i` owns the
/// blocks `first[i]..first[i + 1]` and writes `out[i]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct MatSet {
    pub m: [Mat; MAT_SET_MAX],
    pub out: [u64; MAT_SET_MAX],
    pub first: [i32; MAT_SET_MAX + 1],
    pub n: i32,
}

/// `MULTI_MAX` in the kernels.
pub(crate) const MAT_SET_MAX: usize = 4;

/// The three projections of one expert (`struct ExpertMats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExpertMats {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

// SAFETY: three `Mat`s, as the kernels declare.
unsafe impl DeviceRepr for ExpertMats {}

/// A shared expert computed in the routed experts' launches (`struct SharedExpert`): its three
/// projections, its one-row gate `scale`, and where the gate/up kernel leaves each token's
/// `sigmoid(scale . x)` for the down kernel.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SharedExpert {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
    pub scale: Mat,
    pub weight: u64,
}

impl Mat {
    /// Appends the kernels' view of this description (`struct Mat`: three pointers, eight
    /// ints, little-endian) as 32-bit words.
    fn push_words(&self, out: &mut Vec<u32>) {
        for p in [self.data, self.scales, self.biases] {
            out.extend([p as u32, (p >> 32) as u32]);
        }
        let ints = [
            self.rows,
            self.cols,
            self.fmt,
            self.bits,
            self.group,
            self.sdt,
            self.gshift,
            self.pad,
        ];
        out.extend(ints.map(|v| v as u32));
    }
}

impl ExpertMats {
    /// 32-bit words of one `struct ExpertMats` (168 bytes: no padding).
    pub(crate) const WORDS: usize = size_of::<ExpertMats>() / 4;

    /// Appends this table entry as [`ExpertMats::WORDS`] words (see [`Mat::push_words`]).
    pub(crate) fn push_words(&self, out: &mut Vec<u32>) {
        for m in [&self.gate, &self.up, &self.down] {
            m.push_words(out);
        }
    }
}

/// `FMT_AFFINE` and `FMT_MXFP4` in the kernels (the dense formats are their [`dtype_code`]).
const FMT_AFFINE: i32 = 3;
const FMT_MXFP4: i32 = 4;

/// How routed experts compute beyond SwiGLU without biases, as the MoE kernels take it
/// (`struct Ffn`; [`sluice_backend::ExpertFfn`]): the device addresses of the per-expert biases
/// (0: none) of experts `0..experts`, and the activation (`clamped`: gpt-oss's clamped SwiGLU
/// with `alpha` and `limit`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ffn {
    pub gate_bias: u64,
    pub up_bias: u64,
    pub down_bias: u64,
    pub alpha: f32,
    pub limit: f32,
    pub clamped: i32,
    pub experts: i32,
    /// Entries of the launch's expert table, which the decode kernels ask L2 for before they
    /// wait (0: none).
    pub table: i32,
    pub pad: i32,
}

// SAFETY: plain old data with the C layout the kernels declare (three pointers, two floats, four
// ints: 48 bytes, no padding).
unsafe impl DeviceRepr for Ffn {}

impl Ffn {
    /// SwiGLU without biases: what every family but gpt-oss computes.
    pub fn is_plain(&self) -> bool {
        self.clamped == 0 && (self.gate_bias, self.up_bias, self.down_bias) == (0, 0, 0)
    }
}

impl PartialEq for Ffn {
    /// Bitwise (a graph node's parameters need updating exactly when their bytes differ).
    fn eq(&self, o: &Ffn) -> bool {
        (
            self.gate_bias,
            self.up_bias,
            self.down_bias,
            self.clamped,
            self.experts,
            self.table,
        ) == (
            o.gate_bias,
            o.up_bias,
            o.down_bias,
            o.clamped,
            o.experts,
            o.table,
        ) && (self.alpha.to_bits(), self.limit.to_bits()) == (o.alpha.to_bits(), o.limit.to_bits())
    }
}

fn dtype_code(d: Dtype) -> i32 {
    match d {
        Dtype::F32 => 0,
        Dtype::F16 => 1,
        Dtype::Bf16 => 2,
    }
}

/// The kernel's description of `m`'s format, or why the kernels cannot run it.
pub(crate) fn describe(m: &HostMatrix) -> Result<Mat, BackendError> {
    let unsupported = |why: &str| {
        Err(BackendError::Unsupported(format!(
            "the CUDA backend cannot run a [{}, {}] {} matrix: {why}",
            m.rows, m.cols, m.format
        )))
    };
    if !m.cols.is_multiple_of(8) || m.rows > i32::MAX as usize || m.cols > i32::MAX as usize {
        return unsupported("columns must be a multiple of 8");
    }
    let (fmt, bits, group, sdt) = match m.format {
        WeightFormat::Dense(d) => (dtype_code(d), 0, 0, 0),
        WeightFormat::Affine {
            bits,
            group_size,
            scale_dtype,
        } => {
            if !group_size.is_power_of_two() || group_size < 8 {
                return unsupported("the group size must be a power of two, 8 or more");
            }
            (
                FMT_AFFINE,
                bits as i32,
                group_size as i32,
                dtype_code(scale_dtype),
            )
        }
        // Codes of 4 bits, one E8M0 byte per 32 columns (no scale dtype, no biases).
        WeightFormat::Mxfp4 => (FMT_MXFP4, 4, MXFP4_GROUP as i32, 0),
    };
    Ok(Mat {
        data: 0,
        scales: 0,
        biases: 0,
        rows: m.rows as i32,
        cols: m.cols as i32,
        fmt,
        bits,
        group,
        sdt,
        gshift: if group > 0 {
            group.trailing_zeros() as i32
        } else {
            0
        },
        pad: 0,
    })
}

/// `SPREAD_ROWS` in the kernels: rows per thread of the one-token `*_s` kernels.
pub(crate) const SPREAD_ROWS: usize = 4;
/// `SPREAD_CODES`: the columns a thread of the `*_s` kernels takes of each row.
const SPREAD_CODES: usize = 16;
/// The most threads a block of the dense `*_s` kernels has.
const SPREAD_BLOCK: usize = 256;

/// A block's layout in the dense one-token `*_s` kernels: `groups` row groups of `SPREAD_ROWS`
/// rows, each group `threads_per_row` threads wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spread {
    pub threads_per_row: usize,
    pub groups: usize,
}

impl Spread {
    pub fn rows_per_block(&self) -> usize {
        self.groups * SPREAD_ROWS
    }

    pub fn block_threads(&self) -> u32 {
        (self.groups * self.threads_per_row) as u32
    }
}

impl Mat {
    /// How many threads of the one-token `*_s` kernels share a row (16 columns each), if this
    /// matrix fits them: 4-bit affine, groups of 16 or more, a multiple of 128 columns (whole
    /// eights of threads per row), at most 4096.
    pub fn spread_threads(&self) -> Option<usize> {
        let cols = self.cols as usize;
        (self.kind() == 1
            && self.group >= SPREAD_CODES as i32
            && cols.is_multiple_of(128)
            && cols / SPREAD_CODES <= SPREAD_BLOCK)
            .then_some(cols / SPREAD_CODES)
    }

    /// How the dense `*_s` kernels lay this matrix out (row groups per block: the most that make
    /// whole warps of at most 256 threads), if it fits them.
    pub fn spread(&self) -> Option<Spread> {
        let threads_per_row = self.spread_threads()?;
        let groups = (1..=SPREAD_BLOCK / threads_per_row)
            .rev()
            .find(|n| (n * threads_per_row).is_multiple_of(32))?;
        Some(Spread {
            threads_per_row,
            groups,
        })
    }

    /// Which compiled variant of the matrix kernels runs this format (index into
    /// [`crate::kernels::KINDS`]).
    pub fn kind(&self) -> usize {
        match (self.fmt, self.bits) {
            (FMT_AFFINE, 4) => 1,
            (FMT_AFFINE, 8) => 2,
            (2, _) => 3,
            (FMT_MXFP4, _) => 4,
            _ => 0,
        }
    }

    /// The index into [`crate::kernels::EXACT_KINDS`] of the tensor-core kernels that take this
    /// format's weights exactly (4/8-bit affine codes with groups of at least their 32-column
    /// tile, bf16, mxfp4; rows of whole tiles), if any.
    pub fn exact_kind(&self) -> Option<usize> {
        if self.cols % 32 != 0 {
            return None;
        }
        match self.kind() {
            1 | 2 if self.group >= 32 => Some(self.kind() - 1),
            3 => Some(2),
            4 => Some(3),
            _ => None,
        }
    }
}

impl ExpertMats {
    /// The kernel kinds of the gate/up launch and of the down launch.
    pub fn kinds(&self) -> (usize, usize) {
        let gate_up = match (self.gate.kind(), self.up.kind()) {
            (g, u) if g == u => g,
            _ => 0,
        };
        (gate_up, self.down.kind())
    }

    /// The exact-weight tensor-core kinds ([`Mat::exact_kind`]) of gate/up and of down.
    pub fn exact_kinds(&self) -> (Option<usize>, Option<usize>) {
        let gate_up = match (self.gate.exact_kind(), self.up.exact_kind()) {
            (Some(g), Some(u)) if g == u => Some(g),
            _ => None,
        };
        (gate_up, self.down.exact_kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affine(bits: i32, group: i32, cols: i32) -> Mat {
        Mat {
            rows: 64,
            cols,
            fmt: 3,
            bits,
            group,
            gshift: group.trailing_zeros() as i32,
            ..Mat::default()
        }
    }

    /// The column-spread kernels take only the shapes their arithmetic assumes: 4-bit, 16-column
    /// chunks inside one group, whole eights of threads per row, blocks of whole warps.
    #[test]
    fn expert_table_words_are_the_struct_bytes() {
        let m = |base: u64| Mat {
            data: base,
            scales: base + 0x1_0000_0004,
            biases: u64::MAX - base,
            rows: -3,
            cols: 2048,
            fmt: 3,
            bits: 4,
            group: 64,
            sdt: 2,
            gshift: 6,
            pad: 0,
        };
        let e = ExpertMats {
            gate: m(0x7f00_1234_5678),
            up: m(1),
            down: m(0xdead_beef_0000),
        };
        let mut words = Vec::new();
        e.push_words(&mut words);
        assert_eq!(words.len(), ExpertMats::WORDS);
        assert_eq!(ExpertMats::WORDS * 4, 168);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(size_of::<ExpertMats>(), 168);
        // SAFETY: `e` is a live `repr(C)` value of plain integers, 168 bytes with no padding
        // (three Mats of three u64 and eight i32, asserted above); read as bytes only.
        let memory =
            unsafe { std::slice::from_raw_parts(&e as *const ExpertMats as *const u8, 168) };
        assert_eq!(bytes, memory, "the words are the struct the kernels read");
    }

    #[test]
    fn spread_shapes() {
        // (bits, group, cols) -> (threads per row, row groups per block)
        for (bits, group, cols, want) in [
            (4, 64, 2048, Some((128, 2))),
            (4, 64, 4096, Some((256, 1))),
            (4, 64, 768, Some((48, 4))),
            (4, 32, 512, Some((32, 8))),
            (4, 128, 640, Some((40, 4))),
            (4, 16, 128, Some((8, 32))),
            // 72 threads per row: no block of whole warps up to 256 threads (the MoE's down
            // kernel, whose blocks hold K rows of threads, may still take it).
            (4, 64, 1152, None),
            // Not a multiple of 128 columns, too wide, groups under 16 columns, 8-bit.
            (4, 64, 1000, None),
            (4, 64, 8192, None),
            (4, 8, 2048, None),
            (8, 64, 2048, None),
        ] {
            let m = affine(bits, group, cols);
            let got = m.spread().map(|s| (s.threads_per_row, s.groups));
            assert_eq!(got, want, "{bits}-bit, group {group}, {cols} columns");
            if let Some(s) = m.spread() {
                let threads = s.block_threads() as usize;
                assert!(
                    threads <= 256
                        && threads.is_multiple_of(32)
                        && s.threads_per_row.is_multiple_of(8)
                );
                assert_eq!(s.rows_per_block(), s.groups * SPREAD_ROWS);
            }
        }
        let dense = Mat {
            cols: 2048,
            fmt: 2,
            ..Mat::default()
        };
        assert_eq!(dense.spread_threads(), None);
    }

    /// An mxfp4 matrix runs the kernels compiled for it (never the affine 4-bit ones, whose
    /// codes mean something else), exactly on tensor cores, and has no scale dtype or biases.
    #[test]
    fn mxfp4_takes_its_own_kernels() {
        use sluice_backend::HostBytes;
        let (rows, cols) = (3, 64);
        let m = HostMatrix::new(
            WeightFormat::Mxfp4,
            rows,
            cols,
            HostBytes::from_vec(vec![0; rows * cols / 2]),
            HostBytes::from_vec(vec![127; rows * cols / 32]),
            HostBytes::empty(),
        )
        .unwrap();
        let d = describe(&m).unwrap();
        assert_eq!((d.fmt, d.bits, d.group, d.gshift), (FMT_MXFP4, 4, 32, 5));
        assert_eq!(crate::kernels::KINDS[d.kind()], "mxfp4");
        assert_eq!(
            crate::kernels::EXACT_KINDS[d.exact_kind().unwrap()],
            "mxfp4"
        );
        assert!(d.exact_kind().unwrap() >= crate::kernels::INT8_KINDS.len());
        assert_eq!(d.spread(), None);
        for (m, name) in [
            (affine(4, 64, 2048), "q4"),
            (affine(8, 64, 2048), "q8"),
            (
                Mat {
                    fmt: 2,
                    cols: 64,
                    ..Mat::default()
                },
                "bf16",
            ),
        ] {
            assert_eq!(crate::kernels::KINDS[m.kind()], name);
            assert_eq!(crate::kernels::EXACT_KINDS[m.exact_kind().unwrap()], name);
        }
        // `struct Ffn`: three pointers, two floats, four ints.
        assert_eq!(size_of::<Ffn>(), 48);
        // `struct SharedExpert`: four Mats (56 bytes each) and a pointer.
        assert_eq!(size_of::<Mat>(), 56);
        assert_eq!(size_of::<SharedExpert>(), 4 * 56 + 8);
        // `struct MatSet`: four Mats, four pointers, five ints of `first` and the count.
        assert_eq!(size_of::<MatSet>(), 4 * 56 + 4 * 8 + 6 * 4);
    }
}

/// The caches of up to eight requests decoding together (`struct KvRows`): request `r`'s keys,
/// values, device-side length (0: none) and length argument.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct KvRows {
    pub keys: [u64; KV_ROWS_MAX],
    pub values: [u64; KV_ROWS_MAX],
    pub cached: [u64; KV_ROWS_MAX],
    pub total: [i32; KV_ROWS_MAX],
}

/// Requests one `attention_decode_rows` launch takes.
pub(crate) const KV_ROWS_MAX: usize = 8;
