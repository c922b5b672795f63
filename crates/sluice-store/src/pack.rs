//! `sluice pack`: rewrites a checkpoint into the streaming layout.
//!
//! The output directory holds `model.safetensors` (every tensor except the routed experts,
//! unchanged), `experts.bin` (one [`BLOCK_ALIGN`]-aligned block per layer x expert, laid out by
//! [`LayerExperts::plan`]), `experts.json` ([`Manifest`]) and copies of the source's other files
//! (config.json, tokenizer files, ...), so it is still a normal model directory. A GGUF file packs
//! the same way: its converted tensors, and the config and tokenizer files its metadata gives.
//! The routed experts are those [`sluice_format::experts::scan`] finds (scan errors pass through
//! as [`PackError::Format`]).
//!
//! The directory is written as `OUT.partial`, synced, and renamed into place when complete: an
//! interrupted pack never leaves a directory that loads.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use sluice_backend::HostMatrix;
use sluice_format::experts::{self, ExpertScan};
use sluice_format::{
    safetensors_header_for, FormatError, GgufExperts, ModelDir, INDEX_FILE, SINGLE_FILE,
};

use crate::manifest::{checksum, plan_layers, LayerExperts, Manifest, EXPERTS_FILE, MANIFEST_FILE};
use crate::unpacked::UnpackedLayout;

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
    /// Multi-token-prediction tensors added from `--mtp-from` (0 without it).
    pub mtp_tensors: usize,
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
    #[error("{0} has no routed experts (no `*.layers.N.mlp.switch_mlp.*`, `*.layers.N.mlp.experts.*` or `*.layers.N.block_sparse_moe.*` tensors): nothing to pack, load it directly")]
    NoExperts(PathBuf),
    #[error("not enough free space in {}: packing needs {:.2} GB, {:.2} GB free{} (free some space or choose another output directory)", dir.display(), *need as f64 / 1e9, *free as f64 / 1e9, if *replacing { "; the existing output is removed only after the new one is complete" } else { "" })]
    NoSpace {
        dir: PathBuf,
        need: u64,
        free: u64,
        replacing: bool,
    },
    /// `--mtp-from` refused: the file or directory at fault, and why (with what to do).
    #[error("{}: {msg}", path.display())]
    Mtp { path: PathBuf, msg: String },
    /// The planned layout is inconsistent (an internal error).
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
    pack_with_mtp(model_dir, out, opts, None, progress)
}

/// [`pack`], adding the multi-token-prediction layer (`mtp.*`) of the official checkpoint
/// `mtp_from` to the resident weights, converted to `model_dir`'s layout and quantisation
/// (`sluice pack --mtp-from`; see `mtp.rs`), with its per-module quantisation entries added to
/// config.json.
pub fn pack_with_mtp(
    model_dir: &Path,
    out: &Path,
    opts: &PackOptions,
    mtp_from: Option<&Path>,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PackSummary, PackError> {
    if model_dir.join(MANIFEST_FILE).exists() {
        return Err(PackError::AlreadyPacked(model_dir.to_path_buf()));
    }
    let dir = ModelDir::open_with(model_dir, GgufExperts::Stream)?;
    // Converted before anything is written: a refusal leaves no output.
    let graft = match mtp_from {
        Some(official) => Some(crate::mtp::graft(&dir, official)?),
        None => None,
    };

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
    // A GGUF's experts are converted one block at a time as they are written (its layout is
    // the one its experts stream in unpacked), so packing takes memory for the resident
    // weights only; a checkpoint's are copied from their tensors.
    let (layers, used, streamed) = if dir.streamed_experts.is_empty() {
        let ExpertScan { layers, tensors } = experts::scan(t, quant)?;
        (layers, tensors, None)
    } else {
        let layout = UnpackedLayout::for_model(&dir).map_err(|e| PackError::Layout {
            tensor: "experts".into(),
            msg: e.to_string(),
        })?;
        (Vec::new(), Default::default(), Some(layout))
    };
    let mut plans = match &streamed {
        Some(layout) => layout.manifest.layers.clone(),
        None => plan_layers(&layers),
    };
    if plans.is_empty() {
        return Err(PackError::NoExperts(model_dir.to_path_buf()));
    }
    let (layer_count, experts_per_layer) = (plans.len(), plans[0].experts);
    let blocks = plans.iter().map(|p| p.experts).sum();

    // Plan experts.bin.
    let expert_bytes = plans
        .last()
        .map_or(0, |p| p.offset + p.stride * p.experts as u64);

    // Plan model.safetensors.
    let resident: Vec<_> = t.iter().filter(|x| !used.contains(&x.name)).collect();
    let mut entries: Vec<_> = resident
        .iter()
        .map(|x| (x.name.clone(), x.dtype, x.shape.clone()))
        .collect();
    let grafted = graft.as_ref().map_or(&[][..], |g| &g.tensors[..]);
    entries.extend(
        grafted
            .iter()
            .map(|(n, d, s, _)| (n.clone(), *d, s.clone())),
    );
    // A GGUF has no safetensors metadata to carry over; its config and tokenizer files are
    // made from its metadata (the source files of a directory are copied).
    let gguf = dir.is_gguf();
    let metadata = if gguf {
        None
    } else {
        source_metadata(t.files())?
    };
    let resident_path = Path::new(SINGLE_FILE);
    let header =
        safetensors_header_for(&entries, metadata.as_ref()).map_err(|e| PackError::Io {
            path: out.join(resident_path),
            source: e,
        })?;
    let resident_bytes = header.len() as u64
        + resident.iter().map(|x| x.bytes.len() as u64).sum::<u64>()
        + grafted.iter().map(|t| t.3.len() as u64).sum::<u64>();
    let (others, generated) = if gguf {
        (Vec::new(), dir.generated_files())
    } else {
        (other_files(model_dir)?, Vec::new())
    };
    let other_bytes: u64 = others.iter().map(|(_, n)| n).sum::<u64>()
        + generated
            .iter()
            .map(|(_, text)| text.len() as u64)
            .sum::<u64>();
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
    // A failed write (the disk filling up, say) removes the partial output: it must not keep
    // the space that the user needs back.
    let written = (|| -> Result<(), PackError> {
        // model.safetensors: the header, then the tensors' bytes.
        let mut done = 0u64;
        progress(0, total);
        let path = partial.join(resident_path);
        let mut f = File::create(&path).map_err(io_at(&path))?;
        f.write_all(&header).map_err(io_at(&path))?;
        done += header.len() as u64;
        let mut pending = 0u64;
        let bytes = resident
            .iter()
            .map(|x| x.bytes.as_slice())
            .chain(grafted.iter().map(|t| &t.3[..]));
        for b in bytes {
            f.write_all(b).map_err(io_at(&path))?;
            done += b.len() as u64;
            pending += b.len() as u64;
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
        let layouts = plans.clone();
        let from_tensors = |li: usize, e: usize, block: &mut [u8]| {
            fill_block(&layouts[li], &layers[li].experts[e].matrices, block);
            Ok(())
        };
        let sources = match &streamed {
            Some(layout) => layout
                .files
                .iter()
                .map(|p| File::open(p).map(|f| (p, f)).map_err(io_at(p)))
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        let from_gguf = |li: usize, e: usize, block: &mut [u8]| {
            let layout = streamed.as_ref().expect("a streamed layout");
            for r in &layout.reads[li][e] {
                let (p, f) = &sources[r.file];
                let dst = &mut block[r.at as usize..(r.at + r.len) as usize];
                read_exact_at(f, dst, r.offset).map_err(io_at(p))?;
            }
            for (i, c) in layout.conversions.get(li).into_iter().flatten().enumerate() {
                c.apply(block, layout.raw_at[li][e][i])
                    .map_err(|msg| PackError::Layout {
                        tensor: format!("{} expert {e}", layouts[li].prefix),
                        msg,
                    })?;
            }
            Ok(())
        };
        let fill: &FillBlock<'_> = if streamed.is_some() {
            &from_gguf
        } else {
            &from_tensors
        };
        write_blocks(&path, f, &mut plans, fill, &mut |n| {
            done += n;
            progress(done, total);
        })?;

        // experts.json.
        let first = plans[0].prefix.clone();
        let manifest = Manifest::new(plans);
        manifest.validate().map_err(|msg| PackError::Layout {
            tensor: format!("{first}.*"),
            msg: format!("internal error, the planned manifest is invalid: {msg}"),
        })?;
        let path = partial.join(MANIFEST_FILE);
        let text = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
        write_synced(&path, text.as_bytes())?;

        // The other files.
        for (from, _) in &others {
            let name = from.file_name().expect("read_dir entries have names");
            let to = partial.join(name);
            let mut bytes = fs::read(from).map_err(io_at(from))?;
            if let Some(g) = graft.as_ref().filter(|g| !g.overrides.is_empty()) {
                if name == "config.json" {
                    bytes = crate::mtp::config_with_overrides(from, &bytes, &g.overrides)?;
                }
            }
            write_synced(&to, &bytes)?;
        }
        for (name, text) in &generated {
            write_synced(&partial.join(name), text.as_bytes())?;
        }
        sync_dir(&partial)?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&partial);
        return Err(e);
    }

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
        layers: layer_count,
        experts_per_layer,
        blocks,
        mtp_tensors: grafted.len(),
    })
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

/// Reads `buf.len()` bytes of `f` at `offset` (end of file is an error).
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match crate::io::read_at(f, &mut buf[done..], offset + done as u64) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills expert `e`'s block of manifest layer `li`.
type FillBlock<'a> = dyn Fn(usize, usize, &mut [u8]) -> Result<(), PackError> + Sync + 'a;

/// Writes every layer's blocks in order to `f`, filling in the plans' checksums. Batches of
/// whole blocks are built (`fill`, in parallel over the batch's blocks) while another thread
/// writes the previous batch.
fn write_blocks(
    path: &Path,
    mut f: File,
    plans: &mut [LayerExperts],
    fill: &FillBlock<'_>,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<(), PackError> {
    let (full_tx, full_rx) = mpsc::sync_channel::<Vec<u8>>(1);
    let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
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
        let mut failed = None;
        let mut spare = 3usize; // buffers that may still be allocated
        'layers: for (li, plan) in plans.iter_mut().enumerate() {
            let stride = plan.stride as usize;
            let per_batch = (BATCH_BYTES / plan.stride).max(1) as usize;
            let mut sums = Vec::with_capacity(plan.experts);
            for first in (0..plan.experts).step_by(per_batch) {
                let n = per_batch.min(plan.experts - first);
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
                buf.resize(n * stride, 0);
                let mut blocks: Vec<(usize, &mut [u8])> =
                    (first..).zip(buf.chunks_exact_mut(stride)).collect();
                let per_thread = n.div_ceil(threads);
                let filled = std::thread::scope(|t| {
                    let workers: Vec<_> = blocks
                        .chunks_mut(per_thread)
                        .map(|chunk| {
                            t.spawn(move || {
                                chunk
                                    .iter_mut()
                                    .try_for_each(|(e, block)| fill(li, *e, block))
                            })
                        })
                        .collect();
                    workers
                        .into_iter()
                        .map(|w| w.join().expect("filling a block does not panic"))
                        .collect::<Result<Vec<()>, PackError>>()
                });
                if let Err(e) = filled {
                    failed = Some(e);
                    break 'layers;
                }
                sums.extend(buf.chunks_exact(stride).map(checksum));
                if full_tx.send(buf).is_err() {
                    break 'layers;
                }
            }
            plan.checksums = sums;
        }
        drop(full_tx);
        let written = writer.join().expect("the writer thread does not panic");
        match failed {
            Some(e) => Err(e),
            None => written,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_handles_missing_paths() {
        let tmp = std::env::temp_dir().canonicalize().unwrap();
        let p = tmp.join("sluice-pack-missing/a/b");
        assert_eq!(resolve(&p).unwrap(), p);
    }
}
