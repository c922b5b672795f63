//! Writes full-size random checkpoints with the exact shapes of real MoE models.
//!
//! No real checkpoint can be downloaded where sluice is benchmarked, yet speed has to be measured
//! on real shapes. [`synthesize`] writes a model directory in the layout mlx-lm writes for an
//! mlx-community affine-quantised model (sharded safetensors + index, config.json with the
//! published dimensions, a byte-level BPE tokenizer of the real vocabulary size and the real chat
//! template), so sluice, mlx-lm and converters all load it as they would the real one.
//!
//! ```no_run
//! use sluice_synth::{synthesize, Preset, SynthOptions};
//! let preset = Preset::find("qwen3.5-35b-a3b").unwrap();
//! let opts = SynthOptions::new(preset, "/models/q35-synth".into());
//! let summary = synthesize(&opts, &|done, total| eprintln!("{done}/{total}")).unwrap();
//! println!("{} bytes in {} files", summary.bytes, summary.files);
//! ```
//!
//! Generation is parallel (rayon) and deterministic: the same preset, bits and seed give the same
//! bytes whatever the thread count.

#![forbid(unsafe_code)]

mod fill;
pub mod plan;
pub mod presets;
mod tokenizer;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use rayon::prelude::*;
use serde_json::{json, Value};
use sluice_format::{safetensors_header_for, StDtype};

pub use plan::{Quant, TensorPlan, ZeroPoint};
pub use presets::{Family, Preset, PRESETS};

/// Largest shard, as mlx-lm's `save_model` (5 GB).
pub const SHARD_BYTES: u64 = 5 << 30;
/// Bytes generated per parallel work item.
const CHUNK_BYTES: usize = 16 << 20;

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub preset: &'static Preset,
    pub out: PathBuf,
    pub quant: Quant,
    pub seed: u64,
    /// Overrides the preset's layer count (for mid-size experiments).
    pub layers: Option<usize>,
    /// Where the biases put each group's zero.
    pub zero_point: ZeroPoint,
}

impl SynthOptions {
    /// 4-bit, group 64, seed 0: what mlx-community publishes most.
    pub fn new(preset: &'static Preset, out: PathBuf) -> Self {
        Self {
            preset,
            out,
            quant: Quant {
                bits: 4,
                group_size: 64,
            },
            seed: 0,
            layers: None,
            zero_point: ZeroPoint::Centred,
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Summary {
    pub bytes: u64,
    pub files: usize,
    pub tensors: usize,
}

/// Errors, each naming the path or setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("{0} already exists; choose another output directory or remove it first")]
    Exists(PathBuf),
    #[error("not enough free space in {dir}: the checkpoint needs {need} bytes ({need_gb:.1} GB), {free} bytes ({free_gb:.1} GB) are free", need_gb = *need as f64 / 1e9, free_gb = *free as f64 / 1e9)]
    NoSpace { dir: PathBuf, need: u64, free: u64 },
    #[error("--bits {0} is not supported; use 4 or 8")]
    Bits(u32),
    #[error("--layers {0} is not valid for {1}: {2}")]
    Layers(usize, &'static str, String),
    #[error("writing {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The preset with the options' layer override applied.
pub fn effective_preset(opts: &SynthOptions) -> Result<Preset, SynthError> {
    let mut p = opts.preset.clone();
    if let Some(l) = opts.layers {
        if l == 0 || l > p.layers {
            return Err(SynthError::Layers(
                l,
                p.name,
                format!("must be between 1 and {}", p.layers),
            ));
        }
        p.layers = l;
    }
    Ok(p)
}

/// The tensors, split into shards of at most [`SHARD_BYTES`] (a tensor never straddles two).
pub fn shard_plan(preset: &Preset, opts: &SynthOptions) -> Vec<Vec<TensorPlan>> {
    let mut shards: Vec<Vec<TensorPlan>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in plan::tensors(preset, opts.quant, opts.zero_point, opts.seed) {
        let n = t.nbytes();
        if size > 0 && size + n > SHARD_BYTES {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        shards.last_mut().expect("one shard").push(t);
    }
    shards
}

/// Bytes the checkpoint will take (weights; the JSON files are small).
pub fn planned_bytes(shards: &[Vec<TensorPlan>]) -> u64 {
    shards.iter().flatten().map(|t| t.nbytes()).sum()
}

/// Writes the checkpoint into `opts.out` (through `OUT.partial`, renamed at the end so that an
/// interrupted run never leaves a directory that loads). `progress(done, total)` is called with
/// weight bytes written.
pub fn synthesize(
    opts: &SynthOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Summary, SynthError> {
    if !matches!(opts.quant.bits, 4 | 8) {
        return Err(SynthError::Bits(opts.quant.bits));
    }
    let preset = effective_preset(opts)?;
    if opts.out.exists() {
        return Err(SynthError::Exists(opts.out.clone()));
    }
    let shards = shard_plan(&preset, opts);
    let total = planned_bytes(&shards);
    let parent = match opts.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if let Some(free) = sluice_sys::free_disk_bytes(&parent) {
        // Keep a margin so the rest of the machine keeps working.
        let need = total + (total / 50).max(64 << 20);
        if need > free {
            return Err(SynthError::NoSpace {
                dir: parent,
                need,
                free,
            });
        }
    }
    let tmp = partial_path(&opts.out);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io_at(&tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io_at(&tmp))?;

    let n = shards.len();
    let names: Vec<String> = (0..n)
        .map(|i| {
            if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            }
        })
        .collect();
    let mut done = 0u64;
    let mut weight_map = serde_json::Map::new();
    for (shard, name) in shards.iter().zip(&names) {
        let path = tmp.join(name);
        write_shard(&path, shard, &mut |b| {
            done += b;
            progress(done, total);
        })?;
        for t in shard {
            weight_map.insert(t.name.clone(), json!(name));
        }
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let json_files: [(&str, Value); 5] = [
        (
            "config.json",
            preset.config_json(opts.quant.bits, opts.quant.group_size),
        ),
        ("model.safetensors.index.json", index),
        (
            "tokenizer.json",
            tokenizer::tokenizer_json(&preset, opts.seed),
        ),
        (
            "tokenizer_config.json",
            tokenizer::tokenizer_config_json(&preset),
        ),
        (
            "generation_config.json",
            tokenizer::generation_config_json(&preset),
        ),
    ];
    for (name, value) in json_files {
        let path = tmp.join(name);
        let text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        fs::write(&path, text).map_err(io_at(&path))?;
    }
    fs::rename(&tmp, &opts.out).map_err(io_at(&opts.out))?;
    Ok(Summary {
        bytes: total,
        files: n,
        tensors: shards.iter().map(Vec::len).sum(),
    })
}

fn partial_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// Streams one shard: the header, then every tensor generated in parallel chunks while the
/// previous chunks are written (a bounded channel keeps memory at a few chunks per thread).
fn write_shard(
    path: &Path,
    tensors: &[TensorPlan],
    progress: &mut dyn FnMut(u64),
) -> Result<(), SynthError> {
    let entries: Vec<(String, StDtype, Vec<usize>)> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    let header = safetensors_header_for(&entries, Some(&meta)).map_err(io_at(path))?;
    let mut file = File::create(path).map_err(io_at(path))?;
    file.write_all(&header).map_err(io_at(path))?;

    // Work items: (tensor, byte range), in file order.
    let items: Vec<(&TensorPlan, usize, usize)> = tensors
        .iter()
        .flat_map(|t| {
            let len = t.nbytes() as usize;
            (0..len.div_ceil(CHUNK_BYTES).max(1)).map(move |c| {
                let start = c * CHUNK_BYTES;
                (t, start, (start + CHUNK_BYTES).min(len))
            })
        })
        .collect();
    let batch = rayon::current_num_threads().max(1) * 2;
    let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(batch);
    let writer_path = path.to_path_buf();
    std::thread::scope(|s| {
        let writer = s.spawn(move || -> Result<(), SynthError> {
            for buf in rx {
                file.write_all(&buf).map_err(io_at(&writer_path))?;
            }
            file.sync_all().map_err(io_at(&writer_path))
        });
        for group in items.chunks(batch) {
            let bufs: Vec<Vec<u8>> = group
                .par_iter()
                .map(|&(t, start, end)| fill::fill(t, start, end))
                .collect();
            for buf in bufs {
                let n = buf.len() as u64;
                if tx.send(buf).is_err() {
                    break; // The writer failed; its error is reported below.
                }
                progress(n);
            }
        }
        drop(tx);
        writer.join().expect("writer thread does not panic")
    })
}
