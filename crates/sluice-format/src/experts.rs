//! Where the routed experts of a checkpoint are. This is the one scanner of the expert tensor
//! layouts: `sluice pack`, the unpacked streaming store and the model loader all read routed
//! experts through it, so they accept the same checkpoints.
//!
//! Three layouts are read, per MoE block at `prefix` (`*.layers.N.mlp`, or
//! `*.layers.N.block_sparse_moe` in Mixtral):
//! - mlx-community's stacks: `{prefix}.switch_mlp.{gate,up,down}_proj`, `[E, out, in]` each;
//! - transformers 5's fused parameters: `{prefix}.experts.gate_up_proj` (with or without
//!   `.weight`), `[E, 2 * inter, hidden]` with the gate rows first, and
//!   `{prefix}.experts.down_proj`;
//! - official per-expert modules: `{prefix}.experts.{e}.{gate,up,down}_proj`, or Mixtral's
//!   `{prefix}.experts.{e}.{w1,w3,w2}` (gate, up, down).
//!
//! Each may be dense or MLX affine-quantised (`.scales`/`.biases` beside the weight). Besides
//! the zero-copy [`HostMatrix`] views, the scan says where each byte slice of each expert lies
//! on disk ([`FileSlice`]), computed from the tensors' file offsets, so the experts can also be
//! read with plain file I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use sluice_backend::HostMatrix;

use crate::{FormatError, QuantConfig, Tensors};

/// The projections of an expert, in the order of [`Expert::matrices`].
pub const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// Mixtral's names for [`PROJECTIONS`] in per-expert modules (`w1` gate, `w3` up, `w2` down).
const MIXTRAL_PROJECTIONS: [&str; 3] = ["w1", "w3", "w2"];

/// The module names of an MoE block under `*.layers.N.`.
const MOE_MODULES: [&str; 2] = ["mlp", "block_sparse_moe"];

/// A byte range of one of the checkpoint's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileSlice {
    /// Index into [`Tensors::files`].
    pub file: usize,
    /// Absolute offset in the file.
    pub offset: u64,
    pub len: u64,
}

/// Where the parts of one matrix lie on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixSlices {
    pub data: FileSlice,
    /// Quantised matrices only.
    pub scales: Option<FileSlice>,
    pub biases: Option<FileSlice>,
}

/// One routed expert.
#[derive(Debug, Clone)]
pub struct Expert {
    /// Gate, up and down, zero-copy views of the memory maps.
    pub matrices: [HostMatrix; 3],
    /// Where each of `matrices` lies on disk; `None` when they are not in a file as such (a
    /// GGUF's blocks converted in memory).
    pub slices: Option<[MatrixSlices; 3]>,
}

/// The routed experts of one MoE block.
#[derive(Debug, Clone)]
pub struct MoeLayer {
    /// The decoder layer index `N` of `*.layers.N.mlp`.
    pub layer: usize,
    /// The block's module prefix, e.g. `model.layers.3.mlp`.
    pub prefix: String,
    /// Every expert has the shapes and formats of expert 0.
    pub experts: Vec<Expert>,
}

/// What [`scan`] found.
#[derive(Debug, Clone, Default)]
pub struct ExpertScan {
    /// In decoder-layer order; empty when the checkpoint has no routed experts.
    pub layers: Vec<MoeLayer>,
    /// The names of the tensors that hold routed experts (every other tensor is resident).
    pub tensors: BTreeSet<String>,
}

/// Finds the routed experts of every MoE layer. Only the decoder stack with the most MoE layers
/// is scanned (e.g. the experts of a multi-token-prediction head are left out). Touches no
/// tensor data.
///
/// Errors ([`FormatError::ExpertLayout`], or the tensor's own [`FormatError`]) name the tensor:
/// a tensor under a layer's experts that is not a gate/up/down projection's weight, scales or
/// biases; experts of different shapes or formats within a layer; a gap in per-expert modules;
/// stacks of different expert counts; an odd fused `gate_up_proj`.
pub fn scan(t: &Tensors, quant: Option<&QuantConfig>) -> Result<ExpertScan, FormatError> {
    // stack -> prefix -> layer.
    let mut stacks: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for name in t.names() {
        if let Some((prefix, stack, layer)) = expert_prefix(name) {
            stacks.entry(stack).or_default().insert(prefix, layer);
        }
    }
    let Some((_, prefixes)) = stacks.into_iter().max_by_key(|(_, p)| p.len()) else {
        return Ok(ExpertScan::default());
    };
    let mut sc = Scanner::new(t, quant);
    let mut layers = Vec::new();
    for (prefix, layer) in prefixes {
        let experts = sc.layer(&prefix)?;
        layers.push(MoeLayer {
            layer,
            prefix,
            experts,
        });
    }
    layers.sort_by_key(|l| l.layer);
    if let Some(w) = layers.windows(2).find(|w| w[0].layer == w[1].layer) {
        return Err(layout(
            format!("{}.*", w[1].prefix),
            format!(
                "layer {} has experts under two prefixes ({} and {})",
                w[1].layer, w[0].prefix, w[1].prefix
            ),
        ));
    }
    Ok(ExpertScan {
        layers,
        tensors: sc.used,
    })
}

/// The gate, up and down matrices of every routed expert of the MoE block at `prefix` (e.g.
/// `model.layers.0.mlp`), for a model loader that keeps experts resident. Accepts exactly what
/// [`scan`] (and so `sluice pack`) accepts for one layer, with the same errors; a prefix with
/// no experts is an error too ("holds no experts", naming `{prefix}.experts`). Shapes are not
/// checked against a config: compare `rows`/`cols` of expert 0 (all experts are alike).
pub fn layer_experts(
    t: &Tensors,
    quant: Option<&QuantConfig>,
    prefix: &str,
) -> Result<Vec<[HostMatrix; 3]>, FormatError> {
    let experts = Scanner::new(t, quant).layer(prefix)?;
    Ok(experts.into_iter().map(|e| e.matrices).collect())
}

fn layout(tensor: String, msg: impl Into<String>) -> FormatError {
    FormatError::ExpertLayout {
        tensor,
        msg: msg.into(),
    }
}

/// `Some((prefix, stack, layer))` when `name` is under `*.layers.N.mlp.{switch_mlp,experts}.`
/// (or `block_sparse_moe` for `mlp`), where `prefix` is `*.layers.N.mlp` and `stack` the part
/// before `.layers.`.
fn expert_prefix(name: &str) -> Option<(String, String, usize)> {
    let segs: Vec<&str> = name.split('.').collect();
    (0..segs.len().saturating_sub(4)).find_map(|i| {
        if segs[i] != "layers"
            || !MOE_MODULES.contains(&segs[i + 2])
            || !matches!(segs[i + 3], "switch_mlp" | "experts")
            || !segs[i + 1].bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let layer = segs[i + 1].parse().ok()?;
        Some((segs[..i + 3].join("."), segs[..i].join("."), layer))
    })
}

/// A matrix and where it lies on disk.
type Located = (HostMatrix, Option<MatrixSlices>);

/// Reads expert matrices with their file slices, remembering which tensors it used.
struct Scanner<'a> {
    t: &'a Tensors,
    quant: Option<&'a QuantConfig>,
    used: BTreeSet<String>,
}

impl<'a> Scanner<'a> {
    fn new(t: &'a Tensors, quant: Option<&'a QuantConfig>) -> Self {
        Scanner {
            t,
            quant,
            used: BTreeSet::new(),
        }
    }

    /// The experts of the MoE block at `prefix`, checked: all alike, and every tensor under
    /// the expert modules placed.
    fn layer(&mut self, prefix: &str) -> Result<Vec<Expert>, FormatError> {
        let experts = self.layout(prefix)?;
        check_uniform(prefix, &experts)?;
        for under in [
            format!("{prefix}.switch_mlp."),
            format!("{prefix}.experts."),
        ] {
            if let Some(extra) = self
                .t
                .names()
                .find(|n| n.starts_with(&under) && !self.used.contains(*n) && !is_expert_bias(n))
            {
                return Err(layout(
                    extra.to_string(),
                    "is under the routed experts but is not a gate/up/down projection's weight, scales or biases; sluice pack cannot place it (is this architecture supported?)",
                ));
            }
        }
        Ok(experts)
    }

    /// The experts at `prefix`, from whichever of the three layouts it uses.
    fn layout(&mut self, prefix: &str) -> Result<Vec<Expert>, FormatError> {
        let switch = format!("{prefix}.switch_mlp");
        if self.t.contains(&format!("{switch}.gate_proj.weight")) {
            let gate = self.stack(&format!("{switch}.gate_proj"))?;
            let up = self.stack(&format!("{switch}.up_proj"))?;
            let down = self.stack(&format!("{switch}.down_proj"))?;
            return zip3(&switch, gate, up, down);
        }
        // mlx's gpt-oss: the stacks under `experts.` (its SwitchGLU's name).
        let stacked = format!("{prefix}.experts");
        if self.t.contains(&format!("{stacked}.gate_proj.weight")) {
            let gate = self.stack(&format!("{stacked}.gate_proj"))?;
            let up = self.stack(&format!("{stacked}.up_proj"))?;
            let down = self.stack(&format!("{stacked}.down_proj"))?;
            return zip3(&stacked, gate, up, down);
        }
        let fused = format!("{prefix}.experts.gate_up_proj");
        // gpt-oss's released experts: mxfp4 blocks, the gate and up rows interleaved (gate
        // even, up odd), de-interleaved here into copies.
        if self.t.contains(&format!("{fused}_blocks")) {
            let gate_up = self.stack(&fused)?;
            let down = self.stack(&format!("{prefix}.experts.down_proj"))?;
            let rows = gate_up.first().map_or(0, |(m, _)| m.rows);
            if !rows.is_multiple_of(2) {
                return Err(layout(
                    format!("{fused}_blocks"),
                    format!("has {rows} rows per expert, expected an even number (gate and up interleaved)"),
                ));
            }
            let every_other = |first: usize| -> Vec<Range<usize>> {
                (first..rows).step_by(2).map(|r| r..r + 1).collect()
            };
            let (gate, up) = gate_up
                .iter()
                .map(|(m, _)| {
                    (
                        (m.gather_rows(&every_other(0)), None),
                        (m.gather_rows(&every_other(1)), None),
                    )
                })
                .unzip();
            return zip3(&fused, gate, up, down);
        }
        // gpt-oss as transformers keeps it dense: `[E, hidden, 2 * inter]` (input-major, gate
        // and up columns interleaved) and `down_proj` `[E, inter, hidden]`, with `_bias`
        // tensors; transposed and de-interleaved here into copies.
        let fused_bias = format!("{fused}_bias");
        if self.t.contains(&fused) && self.t.contains(&fused_bias) {
            let two_inter = self.t.get(&fused_bias)?.shape.last().copied().unwrap_or(0);
            let gate_up = self.stack(&fused)?;
            let down = self.stack(&format!("{prefix}.experts.down_proj"))?;
            let first = &gate_up[0].0;
            let input_major = match (first.rows == two_inter, first.cols == two_inter) {
                (false, true) => true,
                (true, false) => false,
                _ => {
                    return Err(layout(
                        fused,
                        format!(
                            "is [{}, {}] per expert: neither side is the {two_inter} of `{fused_bias}` (or both are)",
                            first.rows, first.cols
                        ),
                    ))
                }
            };
            let out_major = |m: &HostMatrix, name: &str| -> Result<HostMatrix, FormatError> {
                if !input_major {
                    return Ok(m.clone());
                }
                m.transposed().ok_or_else(|| {
                    layout(
                        name.to_string(),
                        "is quantised in the input-major layout, which cannot be transposed",
                    )
                })
            };
            let down_name = format!("{prefix}.experts.down_proj");
            let mut gate = Vec::new();
            let mut up = Vec::new();
            let mut downs = Vec::new();
            for ((gu, _), (d, _)) in gate_up.iter().zip(&down) {
                let gu = out_major(gu, &fused)?;
                let rows = |first: usize| -> Vec<Range<usize>> {
                    (first..gu.rows).step_by(2).map(|r| r..r + 1).collect()
                };
                gate.push((gu.gather_rows(&rows(0)), None));
                up.push((gu.gather_rows(&rows(1)), None));
                downs.push((out_major(d, &down_name)?, None));
            }
            return zip3(&fused, gate, up, downs);
        }
        if self.t.contains(&fused) || self.t.contains(&format!("{fused}.weight")) {
            let gate_up = self.stack(&fused)?;
            let down = self.stack(&format!("{prefix}.experts.down_proj"))?;
            let rows = gate_up.first().map_or(0, |(m, _)| m.rows);
            if !rows.is_multiple_of(2) {
                return Err(layout(
                    fused,
                    format!("has {rows} rows per expert, expected an even number (gate then up)"),
                ));
            }
            let i = rows / 2;
            let (gate, up) = gate_up
                .iter()
                .map(|gu| (split_rows(gu, 0..i), split_rows(gu, i..rows)))
                .unzip();
            return zip3(&fused, gate, up, down);
        }
        // Official per-expert modules: `{prefix}.experts.{e}.{gate,up,down}_proj`, or Mixtral's
        // `w1`, `w3`, `w2`.
        let under = format!("{prefix}.experts.");
        let names = match self.t.contains(&format!("{under}0.w1.weight")) {
            true => MIXTRAL_PROJECTIONS,
            false => PROJECTIONS,
        };
        let mut ids = BTreeSet::new();
        for n in self.t.names().filter(|n| n.starts_with(&under)) {
            let id = n[under.len()..].split('.').next().unwrap_or("");
            match id.parse::<usize>() {
                Ok(e) => {
                    ids.insert(e);
                }
                Err(_) => return Err(layout(
                    n.to_string(),
                    "is not in a known expert layout (`experts.N.*_proj`, `experts.N.w1`/`w3`/`w2`, `experts.gate_up_proj` + `experts.down_proj`, or `switch_mlp.*_proj`)",
                )),
            }
        }
        let n = ids.len();
        if let Some(missing) = (0..n).find(|e| !ids.contains(e)) {
            return Err(layout(
                format!("{under}{missing}.{}.weight", names[0]),
                format!(
                    "is missing although experts up to {} exist (incomplete checkpoint?)",
                    ids.last().copied().unwrap_or(0)
                ),
            ));
        }
        (0..n)
            .map(|e| {
                let [g, u, d] = names.map(|p| format!("{under}{e}.{p}"));
                let [(gm, gs), (um, us), (dm, ds)] =
                    [self.matrix(&g)?, self.matrix(&u)?, self.matrix(&d)?];
                Ok(Expert {
                    matrices: [gm, um, dm],
                    slices: all3(gs, us, ds),
                })
            })
            .collect()
    }

    /// Every matrix of the stacked `[E, out, in]` tensor(s) at `prefix`.
    fn stack(&mut self, prefix: &str) -> Result<Vec<Located>, FormatError> {
        let ms = self.t.matrix_stack(prefix, self.quant, None)?;
        self.mark(prefix);
        ms.into_iter()
            .enumerate()
            .map(|(e, m)| {
                let s = self.slices(prefix, e, &m)?;
                Ok((m, s))
            })
            .collect()
    }

    /// The 2-D matrix at `prefix`.
    fn matrix(&mut self, prefix: &str) -> Result<Located, FormatError> {
        let m = self.t.matrix(prefix, self.quant, None)?;
        self.mark(prefix);
        let s = self.slices(prefix, 0, &m)?;
        Ok((m, s))
    }

    /// Where `m`, matrix `index` of the tensors at `prefix` (all matrices of a stack have the
    /// same size), lies on disk; `None` when it was made in memory.
    fn slices(
        &self,
        prefix: &str,
        index: usize,
        m: &HostMatrix,
    ) -> Result<Option<MatrixSlices>, FormatError> {
        // The weight is `{prefix}.weight`, or `prefix` itself (fused parameters), as in
        // `Tensors::matrix`.
        if self.t.contains(&format!("{prefix}_blocks")) {
            // gpt-oss's gate and up come out as copies; its down projection is read alike.
            return Ok(None);
        }
        let weight = format!("{prefix}.weight");
        let weight = if self.t.contains(&weight) {
            weight
        } else {
            prefix.to_string()
        };
        if !self.t.get(&weight)?.in_file() {
            return Ok(None);
        }
        let data = self.slice(&weight, index, m.data.len())?;
        if m.scales.is_empty() {
            return Ok(Some(MatrixSlices {
                data,
                scales: None,
                biases: None,
            }));
        }
        Ok(Some(MatrixSlices {
            data,
            scales: Some(self.slice(&format!("{prefix}.scales"), index, m.scales.len())?),
            // mxfp4 has no biases.
            biases: match m.biases.is_empty() {
                true => None,
                false => Some(self.slice(&format!("{prefix}.biases"), index, m.biases.len())?),
            },
        }))
    }

    /// Element `index`, of `len` bytes, of tensor `name`, on disk.
    fn slice(&self, name: &str, index: usize, len: usize) -> Result<FileSlice, FormatError> {
        let (path, offset, total) = self.t.location(name)?;
        let (at, len) = ((index * len) as u64, len as u64);
        match self.t.files().iter().position(|f| f == path) {
            Some(file) if at + len <= total => Ok(FileSlice {
                file,
                offset: offset + at,
                len,
            }),
            _ => Err(layout(
                name.to_string(),
                format!(
                    "bytes {at}..{} of it are not in a checkpoint file (internal error)",
                    at + len
                ),
            )),
        }
    }

    /// Marks `{prefix}.weight` (or `prefix`), `.scales`, `.biases` as used.
    fn mark(&mut self, prefix: &str) {
        for n in [
            prefix.to_string(),
            format!("{prefix}.weight"),
            format!("{prefix}.scales"),
            format!("{prefix}.biases"),
            format!("{prefix}_blocks"),
            format!("{prefix}_scales"),
        ] {
            if self.t.contains(&n) {
                self.used.insert(n);
            }
        }
    }
}

/// gpt-oss's per-expert biases (`experts.gate_up_proj_bias`, `experts.down_proj_bias`, mlx's
/// `experts.{gate,up,down}_proj.bias`): small, kept resident by the model, not packed.
fn is_expert_bias(name: &str) -> bool {
    name.ends_with("_proj_bias") || name.ends_with("_proj.bias")
}

/// Rows `range` of a located matrix: the view and its slices narrowed alike.
fn split_rows((m, s): &Located, range: Range<usize>) -> Located {
    let rb = m.format.row_bytes(m.cols) as u64;
    let sb = m.format.scale_row_bytes(m.cols) as u64;
    let (start, n) = (range.start as u64, range.len() as u64);
    let narrow = |x: FileSlice, row: u64| FileSlice {
        file: x.file,
        offset: x.offset + start * row,
        len: n * row,
    };
    let slices = s.map(|s| MatrixSlices {
        data: narrow(s.data, rb),
        scales: s.scales.map(|x| narrow(x, sb)),
        biases: s.biases.map(|x| narrow(x, sb)),
    });
    (m.rows(range), slices)
}

/// The three matrices' slices when all three lie in files.
fn all3(
    g: Option<MatrixSlices>,
    u: Option<MatrixSlices>,
    d: Option<MatrixSlices>,
) -> Option<[MatrixSlices; 3]> {
    Some([g?, u?, d?])
}

fn zip3(
    what: &str,
    gate: Vec<Located>,
    up: Vec<Located>,
    down: Vec<Located>,
) -> Result<Vec<Expert>, FormatError> {
    if gate.len() != up.len() || gate.len() != down.len() {
        return Err(layout(
            what.to_string(),
            format!(
                "gate, up and down hold {}, {} and {} experts; they must match",
                gate.len(),
                up.len(),
                down.len()
            ),
        ));
    }
    Ok(gate
        .into_iter()
        .zip(up)
        .zip(down)
        .map(|(((gm, gs), (um, us)), (dm, ds))| Expert {
            matrices: [gm, um, dm],
            slices: all3(gs, us, ds),
        })
        .collect())
}

/// Every expert of a layer must have the shapes and formats of expert 0.
fn check_uniform(prefix: &str, experts: &[Expert]) -> Result<(), FormatError> {
    let Some(first) = experts.first() else {
        return Err(layout(format!("{prefix}.experts"), "holds no experts"));
    };
    for (e, x) in experts.iter().enumerate() {
        for (j, (m, f)) in x.matrices.iter().zip(&first.matrices).enumerate() {
            if (m.rows, m.cols, m.format) != (f.rows, f.cols, f.format) {
                return Err(layout(
                    format!("{prefix} expert {e} {}", PROJECTIONS[j]),
                    format!(
                        "is [{}, {}] {}, but expert 0's is [{}, {}] {}: every expert of a layer must have the same shape and format",
                        m.rows, m.cols, m.format, f.rows, f.cols, f.format
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
