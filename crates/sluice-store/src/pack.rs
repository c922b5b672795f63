//! `sluice pack`: rewrites a checkpoint into the streaming layout.
//!
//! The output directory holds `model.safetensors` (every tensor except the routed experts,
//! unchanged), `experts.bin` (one [`BLOCK_ALIGN`]-aligned block per layer x expert, laid out by
//! [`LayerExperts::plan`]), `experts.json` ([`Manifest`]) and copies of the source's other files
//! (config.json, tokenizer files, ...), so it is still a normal model directory.
//!
//! The directory is written as `OUT.partial`, synced, and renamed into place when complete: an
//! interrupted pack never leaves a directory that loads.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use sluice_backend::{HostMatrix, WeightFormat};
use sluice_format::{
    safetensors_header_for, FormatError, ModelDir, QuantConfig, Tensors, INDEX_FILE, SINGLE_FILE,
};

use crate::manifest::{checksum, LayerExperts, Manifest, EXPERTS_FILE, MANIFEST_FILE, PROJECTIONS};

/// Bytes of whole blocks handed to the writer at once (large sequential writes).
const BATCH_BYTES: u64 = 32 << 20;

/// Options of [`pack`].
#[derive(Debug, Clone, Default)]
pub struct PackOptions {
    /// Replace the output directory if it exists (never the source itself).
    pub force: bool,
}

/// What [`pack`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackSummary {
    /// Size of the resident `model.safetensors`.
    pub resident_bytes: u64,
    /// Size of `experts.bin`.
    pub expert_bytes: u64,
    /// MoE layers packed.
    pub layers: usize,
    /// Routed experts of each MoE layer (the first layer's count).
    pub experts_per_layer: usize,
    /// Blocks written (layers x experts).
    pub blocks: usize,
}

/// Errors of [`pack`]: one line each, naming the file or tensor and what to do.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{0} already exists (pass --force to replace it, or choose another output directory)")]
    Exists(PathBuf),
    #[error("refusing to write {out}: it is, or contains, the source model {src} (choose an output directory outside it)")]
    SourceOverlap { out: PathBuf, src: PathBuf },
    #[error("{0} is already packed (it has experts.json); pack the original checkpoint instead")]
    AlreadyPacked(PathBuf),
    #[error("{0} has no routed experts (no `*.layers.N.mlp.switch_mlp.*` or `*.layers.N.mlp.experts.*` tensors): nothing to pack, load it directly")]
    NoExperts(PathBuf),
    #[error("not enough free space in {}: packing needs {:.2} GB, {:.2} GB free{} (free some space or choose another output directory)", dir.display(), *need as f64 / 1e9, *free as f64 / 1e9, if *replacing { "; the existing output is removed only after the new one is complete" } else { "" })]
    NoSpace {
        dir: PathBuf,
        need: u64,
        free: u64,
        replacing: bool,
    },
    #[error("tensor `{tensor}`: {msg}")]
    Layout { tensor: String, msg: String },
}

fn io_at(path: &Path) -> impl Fn(io::Error) -> PackError + '_ {
    move |source| PackError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `path` with `suffix` appended to its last component.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The absolute, symlink-resolved form of `p`, which need not exist (its nearest existing
/// ancestor is resolved).
fn resolve(p: &Path) -> io::Result<PathBuf> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    let mut rest = Vec::new();
    let mut cur = abs.as_path();
    loop {
        match cur.canonicalize() {
            Ok(mut c) => {
                for part in rest.iter().rev() {
                    c.push(part);
                }
                return Ok(c);
            }
            Err(e) => {
                let (Some(parent), Some(name)) = (cur.parent(), cur.file_name()) else {
                    return Err(e);
                };
                rest.push(name.to_owned());
                cur = parent;
            }
        }
    }
}

/// The experts of one MoE layer, as found in the source.
pub(crate) struct SourceLayer {
    pub(crate) layer: usize,
    pub(crate) prefix: String,
    /// Per expert: gate, up, down.
    pub(crate) experts: Vec<[HostMatrix; 3]>,
}

/// `Some((prefix, stack, layer))` when `name` is under `*.layers.N.mlp.{switch_mlp,experts}.`,
/// where `prefix` is `*.layers.N.mlp` and `stack` the part before `.layers.`.
fn expert_prefix(name: &str) -> Option<(String, String, usize)> {
    let segs: Vec<&str> = name.split('.').collect();
    (0..segs.len().saturating_sub(4)).find_map(|i| {
        if segs[i] != "layers"
            || segs[i + 2] != "mlp"
            || !matches!(segs[i + 3], "switch_mlp" | "experts")
            || !segs[i + 1].bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let layer = segs[i + 1].parse().ok()?;
        Some((segs[..i + 3].join("."), segs[..i].join("."), layer))
    })
}

/// Finds the routed experts of every MoE layer, in layer order, and the names of the tensors
/// they use. Only the decoder stack with the most MoE layers is packed (e.g. the experts of a
/// multi-token-prediction head stay resident). Shared with [`crate::unpacked`], which streams
/// the same experts straight from the checkpoint.
pub(crate) fn find_experts(
    t: &Tensors,
    quant: Option<&QuantConfig>,
) -> Result<(Vec<SourceLayer>, BTreeSet<String>), PackError> {
    // stack -> prefix -> layer.
    let mut stacks: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for name in t.names() {
        if let Some((prefix, stack, layer)) = expert_prefix(name) {
            stacks.entry(stack).or_default().insert(prefix, layer);
        }
    }
    let Some((_, prefixes)) = stacks.into_iter().max_by_key(|(_, p)| p.len()) else {
        return Ok((Vec::new(), BTreeSet::new()));
    };
    let mut used = BTreeSet::new();
    let mut layers = Vec::new();
    for (prefix, layer) in prefixes {
        let experts = layer_experts(t, quant, &prefix, &mut used)?;
        check_uniform(&prefix, &experts)?;
        // Every tensor under the expert modules must have been placed in a block.
        for under in [
            format!("{prefix}.switch_mlp."),
            format!("{prefix}.experts."),
        ] {
            if let Some(extra) = t
                .names()
                .find(|n| n.starts_with(&under) && !used.contains(*n))
            {
                return Err(PackError::Layout {
                    tensor: extra.to_string(),
                    msg: "is under the routed experts but is not a gate/up/down projection's weight, scales or biases; sluice pack cannot place it (is this architecture supported?)".into(),
                });
            }
        }
        layers.push(SourceLayer {
            layer,
            prefix,
            experts,
        });
    }
    layers.sort_by_key(|l| l.layer);
    if let Some(w) = layers.windows(2).find(|w| w[0].layer == w[1].layer) {
        return Err(PackError::Layout {
            tensor: format!("{}.*", w[1].prefix),
            msg: format!(
                "layer {} has experts under two prefixes ({} and {})",
                w[1].layer, w[0].prefix, w[1].prefix
            ),
        });
    }
    Ok((layers, used))
}

/// Marks `{prefix}.weight` (or `prefix`), `.scales`, `.biases` as used.
fn mark(t: &Tensors, prefix: &str, used: &mut BTreeSet<String>) {
    for n in [
        prefix.to_string(),
        format!("{prefix}.weight"),
        format!("{prefix}.scales"),
        format!("{prefix}.biases"),
    ] {
        if t.contains(&n) {
            used.insert(n);
        }
    }
}

/// The gate, up and down matrices of every expert of the MoE block at `prefix`, from any of
/// the three layouts (mlx `switch_mlp` stacks, transformers' fused `gate_up_proj`, official
/// per-expert modules).
fn layer_experts(
    t: &Tensors,
    quant: Option<&QuantConfig>,
    prefix: &str,
    used: &mut BTreeSet<String>,
) -> Result<Vec<[HostMatrix; 3]>, PackError> {
    let mut stack = |name: String| -> Result<Vec<HostMatrix>, PackError> {
        let m = t.matrix_stack(&name, quant, None)?;
        mark(t, &name, used);
        Ok(m)
    };
    let switch = format!("{prefix}.switch_mlp");
    if t.contains(&format!("{switch}.gate_proj.weight")) {
        let gate = stack(format!("{switch}.gate_proj"))?;
        let up = stack(format!("{switch}.up_proj"))?;
        let down = stack(format!("{switch}.down_proj"))?;
        return zip3(&switch, gate, up, down);
    }
    let fused = format!("{prefix}.experts.gate_up_proj");
    if t.contains(&fused) || t.contains(&format!("{fused}.weight")) {
        let gate_up = stack(fused.clone())?;
        let down = stack(format!("{prefix}.experts.down_proj"))?;
        let rows = gate_up[0].rows;
        if !rows.is_multiple_of(2) {
            return Err(PackError::Layout {
                tensor: fused,
                msg: format!("has {rows} rows per expert, expected an even number (gate then up)"),
            });
        }
        let i = rows / 2;
        let (gate, up) = gate_up
            .iter()
            .map(|gu| (gu.rows(0..i), gu.rows(i..rows)))
            .unzip();
        return zip3(&fused, gate, up, down);
    }
    // Official per-expert modules: `{prefix}.experts.{e}.{gate,up,down}_proj`.
    let under = format!("{prefix}.experts.");
    let mut ids = BTreeSet::new();
    for n in t.names().filter(|n| n.starts_with(&under)) {
        let id = n[under.len()..].split('.').next().unwrap_or("");
        match id.parse::<usize>() {
            Ok(e) => {
                ids.insert(e);
            }
            Err(_) => {
                return Err(PackError::Layout {
                    tensor: n.to_string(),
                    msg: "is not in a known expert layout (`experts.N.*_proj`, `experts.gate_up_proj` + `experts.down_proj`, or `switch_mlp.*_proj`)".into(),
                })
            }
        }
    }
    let n = ids.len();
    if let Some(missing) = (0..n).find(|e| !ids.contains(e)) {
        return Err(PackError::Layout {
            tensor: format!("{under}{missing}.gate_proj.weight"),
            msg: format!(
                "is missing although experts up to {} exist (incomplete checkpoint?)",
                ids.last().copied().unwrap_or(0)
            ),
        });
    }
    (0..n)
        .map(|e| {
            let mut get = |p: &str| -> Result<HostMatrix, PackError> {
                let name = format!("{under}{e}.{p}");
                let m = t.matrix(&name, quant, None)?;
                mark(t, &name, used);
                Ok(m)
            };
            Ok([get("gate_proj")?, get("up_proj")?, get("down_proj")?])
        })
        .collect()
}

fn zip3(
    what: &str,
    gate: Vec<HostMatrix>,
    up: Vec<HostMatrix>,
    down: Vec<HostMatrix>,
) -> Result<Vec<[HostMatrix; 3]>, PackError> {
    if gate.len() != up.len() || gate.len() != down.len() {
        return Err(PackError::Layout {
            tensor: what.to_string(),
            msg: format!(
                "gate, up and down hold {}, {} and {} experts; they must match",
                gate.len(),
                up.len(),
                down.len()
            ),
        });
    }
    Ok(gate
        .into_iter()
        .zip(up)
        .zip(down)
        .map(|((g, u), d)| [g, u, d])
        .collect())
}

/// Every expert of a layer must have the shapes and formats of expert 0.
fn check_uniform(prefix: &str, experts: &[[HostMatrix; 3]]) -> Result<(), PackError> {
    let Some(first) = experts.first() else {
        return Err(PackError::Layout {
            tensor: format!("{prefix}.experts"),
            msg: "holds no experts".into(),
        });
    };
    for (e, ms) in experts.iter().enumerate() {
        for (j, (m, f)) in ms.iter().zip(first).enumerate() {
            if (m.rows, m.cols, m.format) != (f.rows, f.cols, f.format) {
                return Err(PackError::Layout {
                    tensor: format!("{prefix} expert {e} {}", PROJECTIONS[j]),
                    msg: format!(
                        "is [{}, {}] {}, but expert 0's is [{}, {}] {}: every expert of a layer must have the same shape and format",
                        m.rows, m.cols, m.format, f.rows, f.cols, f.format
                    ),
                });
            }
        }
    }
    Ok(())
}

/// `__metadata__` of the first source file that has one (e.g. `{"format": "mlx"}`).
fn source_metadata(files: &[PathBuf]) -> Result<Option<BTreeMap<String, String>>, PackError> {
    for path in files {
        let mut f = File::open(path).map_err(io_at(path))?;
        let mut n8 = [0u8; 8];
        f.read_exact(&mut n8).map_err(io_at(path))?;
        let n = u64::from_le_bytes(n8);
        if n > 100 << 20 {
            continue; // Already validated by the reader; do not allocate absurd headers.
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(io_at(path))?;
        let v: serde_json::Value = serde_json::from_slice(&header).map_err(|e| PackError::Io {
            path: path.clone(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        if let Some(serde_json::Value::Object(md)) = v.get("__metadata__") {
            return Ok(Some(
                md.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect(),
            ));
        }
    }
    Ok(None)
}

/// The source's files other than the weights, to copy: regular, non-hidden files that are not
/// safetensors shards or their index.
fn other_files(src: &Path) -> Result<Vec<(PathBuf, u64)>, PackError> {
    let mut out = Vec::new();
    for e in fs::read_dir(src).map_err(io_at(src))? {
        let e = e.map_err(io_at(src))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        let path = e.path();
        let meta = fs::metadata(&path).map_err(io_at(&path))?;
        if !meta.is_file()
            || name.starts_with('.')
            || name.ends_with(".safetensors")
            || name == INDEX_FILE
        {
            continue;
        }
        out.push((path, meta.len()));
    }
    out.sort();
    Ok(out)
}

fn sync_dir(dir: &Path) -> Result<(), PackError> {
    // Directories cannot be opened for syncing on every platform; it is best effort there.
    if let Ok(f) = File::open(dir) {
        #[cfg(unix)]
        f.sync_all().map_err(io_at(dir))?;
        #[cfg(not(unix))]
        drop(f);
    }
    Ok(())
}

/// Packs `model_dir` into `out` (see the module docs). `progress(done, total)` is called with
/// the bytes written so far.
pub fn pack(
    model_dir: &Path,
    out: &Path,
    opts: &PackOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PackSummary, PackError> {
    if model_dir.join(MANIFEST_FILE).exists() {
        return Err(PackError::AlreadyPacked(model_dir.to_path_buf()));
    }
    let dir = ModelDir::open(model_dir)?;

    // Where we write and what we may remove must never touch the source.
    let src = model_dir.canonicalize().map_err(io_at(model_dir))?;
    let partial = with_suffix(out, ".partial");
    let old = with_suffix(out, ".replaced");
    for p in [out, &partial, &old] {
        if src.starts_with(resolve(p).map_err(io_at(p))?) {
            return Err(PackError::SourceOverlap {
                out: p.to_path_buf(),
                src: src.clone(),
            });
        }
    }
    let replacing = out.symlink_metadata().is_ok();
    if replacing && !opts.force {
        return Err(PackError::Exists(out.to_path_buf()));
    }

    let quant = dir.quantization.as_ref();
    let t = &dir.tensors;
    let (layers, used) = find_experts(t, quant)?;
    if layers.is_empty() {
        return Err(PackError::NoExperts(model_dir.to_path_buf()));
    }

    // Plan experts.bin.
    let mut plans = plan_layers(&layers);
    let expert_bytes = plans
        .last()
        .map_or(0, |p| p.offset + p.stride * p.experts as u64);

    // Plan model.safetensors.
    let resident: Vec<_> = t.iter().filter(|x| !used.contains(&x.name)).collect();
    let entries: Vec<_> = resident
        .iter()
        .map(|x| (x.name.clone(), x.dtype, x.shape.clone()))
        .collect();
    let metadata = source_metadata(t.files())?;
    let resident_path = Path::new(SINGLE_FILE);
    let header =
        safetensors_header_for(&entries, metadata.as_ref()).map_err(|e| PackError::Io {
            path: out.join(resident_path),
            source: e,
        })?;
    let resident_bytes =
        header.len() as u64 + resident.iter().map(|x| x.bytes.len() as u64).sum::<u64>();
    let others = other_files(model_dir)?;
    let other_bytes: u64 = others.iter().map(|(_, n)| n).sum();
    let total = resident_bytes + expert_bytes;

    // Start from a clean partial directory and check the space.
    if partial.symlink_metadata().is_ok() {
        remove_any(&partial)?;
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let need = total + other_bytes + (total / 50).max(64 << 20);
    if let Some(free) = sluice_sys::free_disk_bytes(&parent) {
        if need > free {
            return Err(PackError::NoSpace {
                dir: parent,
                need,
                free,
                replacing,
            });
        }
    }
    fs::create_dir_all(&partial).map_err(io_at(&partial))?;

    // model.safetensors: the header, then the tensors' bytes.
    let mut done = 0u64;
    progress(0, total);
    let path = partial.join(resident_path);
    let mut f = File::create(&path).map_err(io_at(&path))?;
    f.write_all(&header).map_err(io_at(&path))?;
    done += header.len() as u64;
    let mut pending = 0u64;
    for x in &resident {
        f.write_all(x.bytes.as_slice()).map_err(io_at(&path))?;
        done += x.bytes.len() as u64;
        pending += x.bytes.len() as u64;
        if pending >= BATCH_BYTES {
            progress(done, total);
            pending = 0;
        }
    }
    f.sync_all().map_err(io_at(&path))?;
    drop(f);
    progress(done, total);

    // experts.bin: blocks are built into reused buffers while the previous batch is written.
    let path = partial.join(EXPERTS_FILE);
    let f = File::create(&path).map_err(io_at(&path))?;
    write_blocks(&path, f, &layers, &mut plans, &mut |n| {
        done += n;
        progress(done, total);
    })?;

    // experts.json.
    let manifest = Manifest::new(plans);
    manifest.validate().map_err(|msg| PackError::Layout {
        tensor: format!("{}.*", layers[0].prefix),
        msg: format!("internal error, the planned manifest is invalid: {msg}"),
    })?;
    let path = partial.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    write_synced(&path, text.as_bytes())?;

    // The other files.
    for (from, _) in &others {
        let to = partial.join(from.file_name().expect("read_dir entries have names"));
        let bytes = fs::read(from).map_err(io_at(from))?;
        write_synced(&to, &bytes)?;
    }
    sync_dir(&partial)?;

    // Into place: move an existing output aside first, so a failure leaves one of the two.
    if replacing {
        if old.symlink_metadata().is_ok() {
            remove_any(&old)?;
        }
        fs::rename(out, &old).map_err(io_at(out))?;
    }
    fs::rename(&partial, out).map_err(io_at(out))?;
    sync_dir(&parent)?;
    if replacing {
        remove_any(&old)?;
    }

    Ok(PackSummary {
        resident_bytes,
        expert_bytes,
        layers: layers.len(),
        experts_per_layer: layers[0].experts.len(),
        blocks: layers.iter().map(|l| l.experts.len()).sum(),
    })
}

/// The block layout of every layer, one after another from offset 0 (checksums left empty).
pub(crate) fn plan_layers(layers: &[SourceLayer]) -> Vec<LayerExperts> {
    let mut plans = Vec::with_capacity(layers.len());
    let mut offset = 0u64;
    for l in layers {
        let projs: Vec<(String, usize, usize, WeightFormat)> = l.experts[0]
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

fn remove_any(p: &Path) -> Result<(), PackError> {
    let meta = p.symlink_metadata().map_err(io_at(p))?;
    if meta.is_dir() {
        fs::remove_dir_all(p).map_err(io_at(p))
    } else {
        fs::remove_file(p).map_err(io_at(p))
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), PackError> {
    let mut f = File::create(path).map_err(io_at(path))?;
    f.write_all(bytes).map_err(io_at(path))?;
    f.sync_all().map_err(io_at(path))
}

/// Copies one expert's matrices into its block (`stride` bytes, zeroed) at the planned parts.
fn fill_block(plan: &LayerExperts, ms: &[HostMatrix; 3], block: &mut [u8]) {
    for (p, m) in plan.projections.iter().zip(ms) {
        let parts = [
            (Some(p.weight), &m.data),
            (p.scales, &m.scales),
            (p.biases, &m.biases),
        ];
        for (part, bytes) in parts {
            if let Some(part) = part {
                let at = part.offset as usize;
                block[at..at + part.bytes as usize].copy_from_slice(bytes.as_slice());
            }
        }
    }
}

/// Writes every layer's blocks in order to `f`, filling in the plans' checksums. One thread
/// builds batches of whole blocks (reading the source) while another writes the previous one.
fn write_blocks(
    path: &Path,
    mut f: File,
    layers: &[SourceLayer],
    plans: &mut [LayerExperts],
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<(), PackError> {
    let (full_tx, full_rx) = mpsc::sync_channel::<Vec<u8>>(1);
    let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
    std::thread::scope(|s| {
        let writer = s.spawn(move || -> Result<(), PackError> {
            for buf in full_rx {
                f.write_all(&buf).map_err(io_at(path))?;
                let n = buf.len() as u64;
                // The builder may have finished; a closed channel is fine.
                let _ = free_tx.send(buf);
                progress(n);
            }
            f.sync_all().map_err(io_at(path))
        });
        let mut spare = 3usize; // buffers that may still be allocated
        'layers: for (l, plan) in layers.iter().zip(plans.iter_mut()) {
            let stride = plan.stride as usize;
            let per_batch = (BATCH_BYTES / plan.stride).max(1) as usize;
            let mut sums = Vec::with_capacity(l.experts.len());
            for batch in l.experts.chunks(per_batch) {
                let mut buf = match free_rx.try_recv() {
                    Ok(b) => b,
                    Err(_) if spare > 0 => {
                        spare -= 1;
                        Vec::new()
                    }
                    Err(_) => match free_rx.recv() {
                        Ok(b) => b,
                        Err(_) => break 'layers, // The writer failed.
                    },
                };
                buf.clear();
                buf.resize(batch.len() * stride, 0);
                for (ms, block) in batch.iter().zip(buf.chunks_exact_mut(stride)) {
                    fill_block(plan, ms, block);
                    sums.push(checksum(block));
                }
                if full_tx.send(buf).is_err() {
                    break 'layers;
                }
            }
            plan.checksums = sums;
        }
        drop(full_tx);
        writer.join().expect("the writer thread does not panic")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_prefixes() {
        assert_eq!(
            expert_prefix("model.layers.12.mlp.switch_mlp.up_proj.scales"),
            Some(("model.layers.12.mlp".into(), "model".into(), 12))
        );
        assert_eq!(
            expert_prefix("language_model.model.layers.0.mlp.experts.3.down_proj.weight"),
            Some((
                "language_model.model.layers.0.mlp".into(),
                "language_model.model".into(),
                0
            ))
        );
        assert_eq!(
            expert_prefix("model.layers.0.mlp.experts.gate_up_proj"),
            Some(("model.layers.0.mlp".into(), "model".into(), 0))
        );
        assert_eq!(
            expert_prefix("model.layers.0.mlp.shared_expert.up_proj.weight"),
            None
        );
        assert_eq!(expert_prefix("model.layers.0.mlp.gate.weight"), None);
        assert_eq!(expert_prefix("model.layers.x.mlp.experts.0.w"), None);
    }

    #[test]
    fn resolve_handles_missing_paths() {
        let tmp = std::env::temp_dir().canonicalize().unwrap();
        let p = tmp.join("sluice-pack-missing/a/b");
        assert_eq!(resolve(&p).unwrap(), p);
    }
}
