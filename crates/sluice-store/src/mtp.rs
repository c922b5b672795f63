//! `sluice pack --mtp-from OFFICIAL_DIR`: the multi-token-prediction layer of an official
//! Qwen3.5 / Qwen3-Next checkpoint (`mtp.*` at its root), which mlx-community conversions drop,
//! converted to the source's layout and quantisation and added to the packed resident weights.
//!
//! The conversion is mlx-lm's (`convert` after `sanitize`), applied to the `mtp.*` tensors:
//! - norms (1-D `*norm*.weight`, `pre_fc_norm_embedding` / `_hidden` included): the official
//!   layout stores zero-centred RMSNorm weights (applied as `1 + w`), the mlx layout `1 + w`;
//!   shifted when the source is mlx layout and the official directory is not (see
//!   [`is_mlx_layout`]), in the dtype of the source's own final norm;
//! - 2-D matrices: MLX affine quantisation ([`affine_quantize`], mlx's CPU `quantize`) with the
//!   source's bits and group size, or the override the source gives the same module of its own
//!   layers (`mlp.gate` / `mlp.shared_expert_gate` at 8 bits in mlx-lm's qwen3_5 conversions),
//!   recorded in config.json; a matrix whose input width is not a multiple of the group size
//!   stays dense (as mlx-lm leaves it), in the dtype of the source's scales;
//! - routed experts (per expert, or fused `gate_up_proj` / `down_proj`): stacked as mlx's
//!   `mlp.switch_mlp.{gate,up,down}_proj` `[E, out, in]`, quantised per row as above.

use std::collections::BTreeMap;
use std::path::Path;

use sluice_format::{ModelDir, QuantConfig, StDtype, Tensors};

use crate::pack::PackError;

/// MLX affine quantisation of a row-major `[rows, cols]` matrix, per group of `group` columns.
#[derive(Debug, Clone, PartialEq)]
pub struct AffineQuantized {
    /// The `bits`-bit codes, a little-endian bit stream per row (`u32` words for 2, 4 and 8
    /// bits): `rows * cols * bits / 8` bytes.
    pub weight: Vec<u8>,
    /// Per group, `[rows, cols / group]`: element = `scale * q + bias`. As mlx computes them in
    /// f32, before they are stored in the model's dtype.
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

/// Quantises `w` (`[rows, cols]`, `cols` a multiple of `group`, `cols * bits` of 32) the way
/// mlx's `mx.quantize(w, group, bits)` does on the CPU (`mlx/backend/cpu/quantized.cpp`):
/// per group, `scale = max((max - min) / (2^bits - 1), 1e-7)` signed so that the extreme of
/// larger magnitude (the "edge") is the reference; when the edge is not code 0 the scale is
/// adjusted so that the edge is exactly representable (`scale = edge / rint(edge / scale)`,
/// `bias = edge`), else `bias = 0`; `q = clamp(rint((w - bias) / scale), 0, 2^bits - 1)`
/// (`rint` rounds half to even).
pub fn affine_quantize(w: &[f32], cols: usize, bits: u32, group: usize) -> AffineQuantized {
    assert!(
        (1..=8).contains(&bits) && group > 0 && cols.is_multiple_of(group),
        "affine_quantize: {bits} bits, group {group}, {cols} columns"
    );
    assert!(
        (cols * bits as usize).is_multiple_of(32) && w.len().is_multiple_of(cols),
        "affine_quantize: {} values of {cols} columns at {bits} bits",
        w.len()
    );
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    let groups = w.len() / group;
    let mut scales = Vec::with_capacity(groups);
    let mut biases = Vec::with_capacity(groups);
    let mut weight = vec![0u8; w.len() * bits as usize / 8];
    let mut bit = 0usize;
    for g in w.chunks_exact(group) {
        let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
        for &x in g {
            w_max = w_max.max(x);
            w_min = w_min.min(x);
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(eps);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for &x in g {
            let q = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32;
            // Little-endian bit stream: element i at bits i*bits.. (a u32 word holds 32/bits
            // elements, the first in its low bits; 3/5/6 bits pack 8/8/4 per 3/5/3 bytes).
            for b in 0..bits as usize {
                if q >> b & 1 == 1 {
                    weight[(bit + b) / 8] |= 1 << ((bit + b) % 8);
                }
            }
            bit += bits as usize;
        }
        scales.push(scale);
        biases.push(bias);
    }
    AffineQuantized {
        weight,
        scales,
        biases,
    }
}

/// The inverse of [`affine_quantize`] (for tests and checks): `[rows, cols]` values.
pub fn affine_dequantize(q: &AffineQuantized, cols: usize, bits: u32, group: usize) -> Vec<f32> {
    let n = q.scales.len() * group;
    debug_assert!(n.is_multiple_of(cols));
    (0..n)
        .map(|i| {
            let mut v = 0u32;
            for b in 0..bits as usize {
                let at = i * bits as usize + b;
                v |= ((q.weight[at / 8] >> (at % 8)) as u32 & 1) << b;
            }
            q.scales[i / group] * v as f32 + q.biases[i / group]
        })
        .collect()
}

/// Tensors to add to the packed resident file, and the per-module quantisation entries to add
/// to config.json (`None`: the module is not quantised, `false`).
pub(crate) struct Graft {
    pub tensors: Vec<(String, StDtype, Vec<usize>, Vec<u8>)>,
    pub overrides: Vec<(String, Option<(u32, usize)>)>,
}

fn refuse(path: &Path, msg: impl Into<String>) -> PackError {
    PackError::Mtp {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// Where the text model's tensors live (as the Qwen3.5 loader looks for them).
const TEXT_PREFIXES: [&str; 3] = ["language_model.model", "model.language_model", "model"];

/// Whether `t` is in the mlx layout, as the Qwen3.5 loader decides (`Layout::find`): the
/// linear-attention conv weights are `[C, K, 1]` in mlx's layout, `[C, 1, K]` in the official
/// one. `None` when there is no 3-D conv weight to tell (not a Qwen3.5 / Qwen3-Next model).
fn is_mlx_layout(t: &Tensors) -> Option<bool> {
    t.iter()
        .find(|x| x.name.ends_with("linear_attn.conv1d.weight") && x.shape.len() == 3)
        .map(|x| x.shape.last() == Some(&1))
}

/// Whether 1-D tensor `name` is an RMSNorm weight (its module's name contains `norm`).
fn is_norm(name: &str) -> bool {
    name.strip_suffix(".weight")
        .and_then(|m| m.rsplit('.').next())
        .is_some_and(|m| m.contains("norm"))
}

fn hidden_size(config: &serde_json::Value) -> Option<u64> {
    config
        .get("text_config")
        .and_then(|t| t.get("hidden_size"))
        .or_else(|| config.get("hidden_size"))
        .and_then(|v| v.as_u64())
}

/// Little-endian `dtype` bytes of `v` (F32, F16 or BF16; anything else is written as F32).
fn encode(dtype: StDtype, v: &[f32]) -> (StDtype, Vec<u8>) {
    match dtype {
        StDtype::BF16 => (
            dtype,
            v.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
        ),
        StDtype::F16 => (
            dtype,
            v.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
        ),
        _ => (
            StDtype::F32,
            v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        ),
    }
}

fn float_dtype(d: StDtype) -> Option<StDtype> {
    matches!(d, StDtype::F32 | StDtype::F16 | StDtype::BF16).then_some(d)
}

/// The `(bits, group)` for MTP module `module` (e.g. `mtp.layers.0.mlp.gate`): the override
/// the source gives the same module of its own layers (its deepest such layer), else the
/// source's global setting. The second value says whether an entry is to be recorded.
fn module_quant(q: &QuantConfig, module: &str) -> (Option<(u32, usize)>, bool) {
    let Some(rest) = module.strip_prefix("mtp.layers.") else {
        return (Some((q.bits, q.group_size)), false);
    };
    let Some((_, suffix)) = rest.split_once('.') else {
        return (Some((q.bits, q.group_size)), false);
    };
    let best = q
        .overrides
        .iter()
        .filter_map(|(k, v)| {
            let (head, tail) = k.rsplit_once(&format!(".{suffix}"))?;
            if !tail.is_empty() {
                return None;
            }
            let (_, layer) = head.rsplit_once(".layers.")?;
            Some((layer.parse::<usize>().ok()?, *v))
        })
        .max_by_key(|(layer, _)| *layer);
    match best {
        Some((_, v)) => (v, true),
        None => (Some((q.bits, q.group_size)), false),
    }
}

struct Converter<'a> {
    quant: Option<&'a QuantConfig>,
    /// The dtype of quantisation scales/biases and of dense matrices.
    model_dtype: StDtype,
    out: Graft,
}

impl Converter<'_> {
    /// Adds matrix `module`: `[rows, cols]` when `experts` is 0, else a stack
    /// `[experts, rows, cols]` whose expert `e` is `part(e)` (converted one at a time, so that
    /// a large layer never is in f32 all at once; quantisation is per row, so this is the
    /// stack's quantisation).
    fn matrix(
        &mut self,
        module: &str,
        experts: usize,
        rows: usize,
        cols: usize,
        part: &mut dyn FnMut(usize) -> Result<Vec<f32>, PackError>,
    ) -> Result<(), PackError> {
        let lead: Vec<usize> = if experts == 0 { vec![] } else { vec![experts] };
        let shape = |last: usize| [lead.clone(), vec![rows, last]].concat();
        let q = match self.quant {
            Some(q) => {
                let (bq, record) = module_quant(q, module);
                if record {
                    self.out.overrides.push((module.to_string(), bq));
                }
                bq.filter(|&(bits, g)| {
                    cols.is_multiple_of(g) && (cols * bits as usize).is_multiple_of(32)
                })
            }
            None => None,
        };
        let (mut weight, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
        let mut dtype = self.model_dtype;
        for e in 0..experts.max(1) {
            let w = part(e)?;
            if w.len() != rows * cols {
                return Err(PackError::Layout {
                    tensor: module.to_string(),
                    msg: format!("{} values, expected [{rows}, {cols}]", w.len()),
                });
            }
            match q {
                Some((bits, group)) => {
                    let a = affine_quantize(&w, cols, bits, group);
                    weight.extend_from_slice(&a.weight);
                    scales.extend(encode(self.model_dtype, &a.scales).1);
                    biases.extend(encode(self.model_dtype, &a.biases).1);
                }
                None => {
                    let (d, bytes) = encode(self.model_dtype, &w);
                    dtype = d;
                    weight.extend(bytes);
                }
            }
        }
        match q {
            Some((bits, group)) => {
                let (d, _) = encode(self.model_dtype, &[]);
                let words = cols * bits as usize / 32;
                let t = &mut self.out.tensors;
                t.push((
                    format!("{module}.weight"),
                    StDtype::U32,
                    shape(words),
                    weight,
                ));
                t.push((format!("{module}.scales"), d, shape(cols / group), scales));
                t.push((format!("{module}.biases"), d, shape(cols / group), biases));
            }
            None => {
                self.out
                    .tensors
                    .push((format!("{module}.weight"), dtype, shape(cols), weight));
            }
        }
        Ok(())
    }
}

/// Where one routed expert's projection is in the official tensors: `len` elements from
/// element `start` of tensor `name`, a `[rows, cols]` matrix.
#[derive(Clone)]
struct Piece {
    name: String,
    start: usize,
    rows: usize,
    cols: usize,
}

/// One routed expert's projections (gate, up, down).
#[derive(Default)]
struct ExpertParts([Option<Piece>; 3]);

/// The `mtp.*` tensors of `official`, converted for `src` (see the module docs).
pub(crate) fn graft(src: &ModelDir, official: &Path) -> Result<Graft, PackError> {
    if src.is_gguf() {
        return Err(refuse(
            &src.path,
            "--mtp-from needs a safetensors model directory (an mlx conversion), not a GGUF file: pack the GGUF without --mtp-from",
        ));
    }
    if let Some(t) = src
        .tensors
        .names()
        .find(|n| n.starts_with("mtp.") || n.contains(".mtp."))
    {
        return Err(refuse(
            &src.path,
            format!(
                "already has a multi-token-prediction layer (`{t}`): pack it without --mtp-from"
            ),
        ));
    }
    let tensors = Tensors::open_dir(official)?;
    if !tensors.contains("mtp.fc.weight") {
        return Err(refuse(
            official,
            "has no `mtp.fc.weight`: --mtp-from needs the official checkpoint (e.g. Qwen/Qwen3.5-35B-A3B, bf16 safetensors), whose weights keep the `mtp.*` tensors that mlx conversions drop",
        ));
    }
    let official_config = official.join("config.json");
    let cfg: serde_json::Value = match std::fs::read(&official_config) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| refuse(&official_config, e.to_string()))?,
        Err(e) => {
            return Err(refuse(
                &official_config,
                format!("{e} (--mtp-from needs the official checkpoint's config.json)"),
            ))
        }
    };
    let (want, got) = (hidden_size(&src.config), hidden_size(&cfg));
    if want.is_none() || want != got {
        return Err(refuse(
            &official_config,
            format!(
                "hidden_size {} but the model being packed ({}) has {}: --mtp-from must be the official checkpoint of the same model",
                got.map_or("missing".into(), |v| v.to_string()),
                src.path.display(),
                want.map_or("missing".into(), |v| v.to_string()),
            ),
        ));
    }
    let quant = src.quantization.as_ref();
    if let Some(q) = quant {
        if q.mode != "affine" {
            return Err(refuse(
                &src.config_path(),
                format!("--mtp-from converts to MLX affine quantisation only, this model's mode is `{}`", q.mode),
            ));
        }
    }
    // Norms: shifted from the official zero-centred form when the source stores `1 + w` (mlx
    // layout; a source without conv weights to tell is taken as mlx when quantised, as only
    // mlx conversions are), unless the official directory is in mlx layout itself.
    let src_mlx = is_mlx_layout(&src.tensors).unwrap_or(quant.is_some());
    let official_mlx = is_mlx_layout(&tensors).unwrap_or(false);
    let shift = if src_mlx && !official_mlx { 1.0 } else { 0.0 };
    let norm_dtype = TEXT_PREFIXES
        .iter()
        .find_map(|p| src.tensors.get(&format!("{p}.norm.weight")).ok())
        .and_then(|t| float_dtype(t.dtype))
        .unwrap_or(StDtype::F32);
    let model_dtype = src
        .tensors
        .iter()
        .find(|t| t.name.ends_with(".scales"))
        .or_else(|| {
            TEXT_PREFIXES
                .iter()
                .find_map(|p| src.tensors.get(&format!("{p}.embed_tokens.weight")).ok())
        })
        .and_then(|t| float_dtype(t.dtype))
        .unwrap_or(StDtype::BF16);

    let mut c = Converter {
        quant,
        model_dtype,
        out: Graft {
            tensors: Vec::new(),
            overrides: Vec::new(),
        },
    };
    let bad = |name: &str, msg: String| refuse(official, format!("tensor `{name}`: {msg}"));
    // Routed experts by their `...mlp` prefix, in expert order.
    let mut experts: BTreeMap<String, BTreeMap<usize, ExpertParts>> = BTreeMap::new();
    let mut names: Vec<&str> = tensors.names().filter(|n| n.starts_with("mtp.")).collect();
    names.sort();
    for name in names {
        let shape = tensors.get(name)?.shape.clone();
        // Per-expert `P.experts.N.{gate,up,down}_proj.weight`.
        if let Some((mlp, rest)) = name.split_once(".experts.") {
            let mlp = mlp.to_string();
            if let Some((n, proj)) = rest.split_once('.') {
                if let Ok(e) = n.parse::<usize>() {
                    let [rows, cols] = shape[..] else {
                        return Err(bad(name, format!("shape {shape:?}, expected a matrix")));
                    };
                    let parts = experts.entry(mlp).or_default().entry(e).or_default();
                    let k = match proj {
                        "gate_proj.weight" => 0,
                        "up_proj.weight" => 1,
                        "down_proj.weight" => 2,
                        _ => return Err(bad(name, "unknown expert tensor".into())),
                    };
                    parts.0[k] = Some(Piece {
                        name: name.to_string(),
                        start: 0,
                        rows,
                        cols,
                    });
                    continue;
                }
            }
            // Fused `P.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
            // `P.experts.down_proj` [E, H, I].
            let [e, rows, cols] = shape[..] else {
                return Err(bad(
                    name,
                    format!("shape {shape:?}, expected [experts, out, in]"),
                ));
            };
            let per = rows * cols;
            let layer = experts.entry(mlp).or_default();
            let piece = |start, rows| Piece {
                name: name.to_string(),
                start,
                rows,
                cols,
            };
            match rest.trim_end_matches(".weight") {
                "gate_up_proj" => {
                    if rows % 2 != 0 {
                        return Err(bad(name, format!("odd fused width {rows}")));
                    }
                    for k in 0..e {
                        let p = &mut layer.entry(k).or_default().0;
                        p[0] = Some(piece(k * per, rows / 2));
                        p[1] = Some(piece(k * per + per / 2, rows / 2));
                    }
                }
                "down_proj" => {
                    for k in 0..e {
                        layer.entry(k).or_default().0[2] = Some(piece(k * per, rows));
                    }
                }
                _ => return Err(bad(name, "unknown expert tensor".into())),
            }
            continue;
        }
        match shape[..] {
            // Every RMSNorm: `*norm.weight`, and `pre_fc_norm_{embedding,hidden}.weight`.
            [n] if is_norm(name) => {
                let (v, _) = tensors.to_f32(name)?;
                let w: Vec<f32> = v.iter().map(|x| x + shift).collect();
                let (d, bytes) = encode(norm_dtype, &w);
                c.out.tensors.push((name.to_string(), d, vec![n], bytes));
            }
            [rows, cols] if name.ends_with(".weight") => {
                let module = name.trim_end_matches(".weight");
                c.matrix(module, 0, rows, cols, &mut |_| Ok(tensors.to_f32(name)?.0))?;
            }
            _ => {
                // Anything else (none in the known checkpoints) is kept as it is.
                let t = tensors.get(name)?;
                c.out.tensors.push((
                    name.to_string(),
                    t.dtype,
                    t.shape.clone(),
                    t.bytes.as_slice().to_vec(),
                ));
            }
        }
    }
    for (mlp, layer) in experts {
        let n = layer.len();
        if layer.keys().copied().ne(0..n) {
            return Err(bad(
                &format!("{mlp}.experts"),
                "expert indices are not 0..N".into(),
            ));
        }
        for (k, proj) in ["gate_proj", "up_proj", "down_proj"]
            .into_iter()
            .enumerate()
        {
            let mut pieces = Vec::with_capacity(n);
            for (e, parts) in &layer {
                let Some(p) = parts.0[k].clone() else {
                    return Err(bad(&format!("{mlp}.experts.{e}.{proj}"), "missing".into()));
                };
                if pieces
                    .first()
                    .is_some_and(|f: &Piece| (f.rows, f.cols) != (p.rows, p.cols))
                {
                    return Err(bad(
                        &format!("{mlp}.experts.{e}.{proj}"),
                        "experts of different shapes".into(),
                    ));
                }
                pieces.push(p);
            }
            let (rows, cols) = (pieces[0].rows, pieces[0].cols);
            let mut part = |e: usize| -> Result<Vec<f32>, PackError> {
                let p = &pieces[e];
                let t = tensors.get(&p.name)?;
                let size = t.dtype.size();
                let bytes = &t.bytes.as_slice()[p.start * size..(p.start + p.rows * p.cols) * size];
                sluice_format::convert_to_f32(t.dtype, bytes)
                    .ok_or_else(|| bad(&p.name, format!("dtype {} is not a float", t.dtype.name())))
            };
            c.matrix(
                &format!("{mlp}.switch_mlp.{proj}"),
                n,
                rows,
                cols,
                &mut part,
            )?;
        }
    }
    Ok(c.out)
}

/// config.json with the graft's per-module entries added to `quantization` and
/// `quantization_config` (where present).
pub(crate) fn config_with_overrides(
    path: &Path,
    text: &[u8],
    overrides: &[(String, Option<(u32, usize)>)],
) -> Result<Vec<u8>, PackError> {
    let mut v: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| refuse(path, e.to_string()))?;
    for key in ["quantization", "quantization_config"] {
        if let Some(serde_json::Value::Object(q)) = v.get_mut(key) {
            for (module, bq) in overrides {
                let entry = match bq {
                    Some((bits, group)) => serde_json::json!({"group_size": group, "bits": bits}),
                    None => serde_json::Value::Bool(false),
                };
                q.insert(module.clone(), entry);
            }
        }
    }
    let mut out = serde_json::to_vec_pretty(&v).expect("config serialises");
    out.push(b'\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-checked 4-bit group: values on the grid `-1 + k * 0.125` (k = 0..15) come back
    /// exactly; the codes are the k's, packed little-endian.
    #[test]
    fn on_grid_values_are_exact() {
        let w: Vec<f32> = (0..32).map(|i| -1.0 + (i % 16) as f32 * 0.125).collect();
        let q = affine_quantize(&w, 32, 4, 32);
        // min -1, max 0.875: |min| > |max|, so the edge is -1 with scale 1.875 / 15 = 0.125,
        // q0 = rint(-1 / 0.125) = -8, scale = -1 / -8 = 0.125, bias = -1.
        assert_eq!(q.scales, vec![0.125]);
        assert_eq!(q.biases, vec![-1.0]);
        // Codes 0..15 twice: the words 0x76543210, 0xfedcba98 (element 0 in the low bits).
        let words: Vec<u32> = q
            .weight
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(
            words,
            vec![0x7654_3210, 0xfedc_ba98, 0x7654_3210, 0xfedc_ba98]
        );
        assert_eq!(affine_dequantize(&q, 32, 4, 32), w);
    }

    /// Off-grid values come back within half a step; the edge of larger magnitude exactly.
    #[test]
    fn values_round_to_the_nearest_step() {
        let w: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * if i < 64 { 0.3 } else { 2.0 })
            .collect();
        for bits in [2, 3, 4, 6, 8] {
            let q = affine_quantize(&w, 64, bits, 32);
            let d = affine_dequantize(&q, 64, bits, 32);
            for (gi, g) in w.chunks_exact(32).enumerate() {
                let step = q.scales[gi].abs();
                let (min, max) = g
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                let edge = if min.abs() > max.abs() { min } else { max };
                assert_eq!(q.biases[gi], edge, "{bits} bits: the edge is the bias");
                // Within half a step, but for values past the last code: mlx moves the scale
                // so that the edge is on the grid, which can leave the far extreme up to one
                // step out, clamped.
                let n_bins = ((1u32 << bits) - 1) as f32;
                for (j, &x) in g.iter().enumerate() {
                    let y = d[gi * 32 + j];
                    let code = (x - q.biases[gi]) / q.scales[gi];
                    let tol = if code <= n_bins + 0.5 {
                        step / 2.0
                    } else {
                        step
                    };
                    assert!(
                        (x - y).abs() <= tol * 1.0001,
                        "{bits} bits, group {gi}: {x} -> {y}, step {step}"
                    );
                }
            }
        }
    }

    /// A constant group (range 0): the scale is the 1e-7 floor and the value the bias.
    #[test]
    fn constant_groups_are_exact() {
        let w = vec![0.5f32; 64];
        let q = affine_quantize(&w, 64, 4, 64);
        assert_eq!(affine_dequantize(&q, 64, 4, 64), w);
        let z = vec![0.0f32; 64];
        let q = affine_quantize(&z, 64, 4, 64);
        assert_eq!(q.biases, vec![0.0]);
        assert_eq!(affine_dequantize(&q, 64, 4, 64), z);
    }
}
