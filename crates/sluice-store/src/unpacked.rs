//! Streaming the routed experts of an unpacked checkpoint (no `sluice pack`): an in-memory
//! [`Manifest`] laying out each expert's block exactly as a packed block, and for each
//! (layer, expert) the plain buffered reads that gather its slices from the safetensors shards
//! into a cache slot.
//!
//! The experts and where their slices lie on disk come from the same scan as `sluice pack`'s
//! ([`sluice_format::experts`]), so whatever packs also streams unpacked. Packing remains the
//! faster layout: one aligned O_DIRECT read per expert instead of up to nine buffered ones, and
//! checksums.
//!
//! A GGUF whose routed experts were left in the file ([`ModelDir::streamed_experts`]) streams the
//! same way, with one step more: each projection's ggml blocks are read as stored (the file's
//! bytes, fewer than the converted form's) to the start of the projection's parts in the slot,
//! and converted there, exactly, once the reads are in ([`Conversion`]).

use std::collections::BTreeSet;
use std::path::PathBuf;

use sluice_format::experts::{self, FileSlice, PROJECTIONS};
use sluice_format::{ModelDir, QuantConfig, StreamedExperts, Tensors};

use crate::error::StoreError;
use crate::manifest::{plan_layers, LayerExperts, Manifest, Part};

/// One read of an expert's block: `len` bytes at `offset` of source file `file` (an index into
/// the source's files) into the slot at byte `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartRead {
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) at: u64,
}

/// Where the experts of an unpacked checkpoint live.
#[derive(Debug, Clone)]
pub struct UnpackedLayout {
    /// The slot layout (as a packed manifest, without checksums or blocks file: never written
    /// to disk and not valid for [`Manifest::validate`]).
    pub manifest: Manifest,
    /// The shards that hold routed experts, in the checkpoint's order.
    pub(crate) files: Vec<PathBuf>,
    /// Per manifest layer index, per expert: the reads that fill its slot (up to 9: gate, up and
    /// down x weight, scales, biases).
    pub(crate) reads: Vec<Vec<Vec<PartRead>>>,
    /// Per manifest layer index: the projections whose bytes are converted once read (a
    /// GGUF's quantised experts); empty for a safetensors checkpoint.
    pub(crate) conversions: Vec<Vec<Conversion>>,
}

/// A projection read as ggml blocks and converted in its slot: the raw bytes land at the start
/// of the projection's parts (`at`, `len`: never more than the parts span) and are replaced by
/// the converted weight, scales and biases.
#[derive(Debug, Clone)]
pub(crate) struct Conversion {
    pub(crate) experts: StreamedExperts,
    pub(crate) at: u64,
    pub(crate) len: u64,
    pub(crate) parts: [Part; 3],
}

impl Conversion {
    /// Converts the raw bytes of one expert's projection in `block` (its slot) into its parts.
    pub(crate) fn apply(&self, block: &mut [u8]) -> Result<(), String> {
        let raw = &block[self.at as usize..(self.at + self.len) as usize];
        let parts = self.experts.convert(raw)?;
        for (part, bytes) in self
            .parts
            .iter()
            .zip([parts.data, parts.scales, parts.biases])
        {
            if bytes.len() as u64 != part.bytes {
                return Err(format!(
                    "{} bytes converted where the layout has {} (internal error)",
                    bytes.len(),
                    part.bytes
                ));
            }
            block[part.offset as usize..][..bytes.len()].copy_from_slice(&bytes);
        }
        Ok(())
    }
}

impl UnpackedLayout {
    /// Finds the routed experts of `t` and where each slice of each expert lies on disk. An
    /// empty layout (no layers) when the checkpoint has no routed experts. Touches no tensor
    /// data.
    pub fn plan(t: &Tensors, quant: Option<&QuantConfig>) -> Result<UnpackedLayout, StoreError> {
        let scan = experts::scan(t, quant)?;
        let plans = plan_layers(&scan.layers);
        // Experts made in memory (a GGUF's converted blocks, gpt-oss's interleaved gate and up
        // split apart) have no file bytes to stream.
        let in_memory = |x: &experts::Expert| x.slices.is_none();
        if let Some(l) = scan.layers.iter().find(|l| l.experts.iter().any(in_memory)) {
            return Err(StoreError::Layout(format!(
                "{}: the experts of `{}` are rearranged in memory at load (a GGUF's blocks \
                 converted, or gpt-oss's interleaved gate and up rows split), so they cannot \
                 stream from the file as it is; pack the model first (`sluice pack MODEL -o \
                 DIR`) and stream DIR, or run it without --expert-cache/--memory-budget",
                t.dir().display(),
                l.prefix
            )));
        }

        // Readers are opened only for the shards that hold experts; a read's `file` indexes
        // those.
        let shards: BTreeSet<usize> = scan
            .layers
            .iter()
            .flat_map(|l| &l.experts)
            .flat_map(|x| x.slices.iter().flatten())
            .flat_map(|s| [Some(s.data), s.scales, s.biases])
            .flatten()
            .map(|f| f.file)
            .collect();
        let files = shards.iter().map(|&i| t.files()[i].clone()).collect();
        let reader_of = |f: FileSlice| shards.range(..f.file).count();

        let mut reads = Vec::with_capacity(scan.layers.len());
        for (l, plan) in scan.layers.iter().zip(&plans) {
            let mut per_expert = Vec::with_capacity(l.experts.len());
            for (e, x) in l.experts.iter().enumerate() {
                let mut parts = Vec::with_capacity(9);
                for (p, s) in plan.projections.iter().zip(x.slices.iter().flatten()) {
                    let pairs: [(Option<Part>, Option<FileSlice>); 3] = [
                        (Some(p.weight), Some(s.data)),
                        (p.scales, s.scales),
                        (p.biases, s.biases),
                    ];
                    for pair in pairs {
                        let (part, f) = match pair {
                            (None, None) => continue,
                            (Some(part), Some(f)) if part.bytes == f.len => (part, f),
                            (part, f) => {
                                return Err(StoreError::Layout(format!(
                                    "{} expert {e} {}: {} bytes on disk, the layout planned {} (internal error)",
                                    l.prefix,
                                    p.name,
                                    f.map_or(0, |f| f.len),
                                    part.map_or(0, |p| p.bytes)
                                )))
                            }
                        };
                        if part.bytes == 0 {
                            continue;
                        }
                        parts.push(PartRead {
                            file: reader_of(f),
                            offset: f.offset,
                            len: part.bytes,
                            at: part.offset,
                        });
                    }
                }
                per_expert.push(parts);
            }
            reads.push(per_expert);
        }
        let mut manifest = Manifest::new(plans);
        // No blocks file: the slots are filled from `files`.
        manifest.file = None;
        Ok(UnpackedLayout {
            manifest,
            files,
            reads,
            conversions: Vec::new(),
        })
    }

    /// The layout of `dir`'s routed experts: [`UnpackedLayout::plan`] for a checkpoint, or for
    /// a GGUF whose experts were left in the file, their blocks with the conversion of each.
    pub fn for_model(dir: &ModelDir) -> Result<UnpackedLayout, StoreError> {
        if dir.streamed_experts.is_empty() {
            return Self::plan(&dir.tensors, dir.quantization.as_ref());
        }
        Self::plan_streamed(&dir.streamed_experts, dir.tensors.files())
    }

    /// The layout of a GGUF's experts left in its files (`files`, which `stacks` index).
    fn plan_streamed(
        stacks: &[StreamedExperts],
        files: &[PathBuf],
    ) -> Result<UnpackedLayout, StoreError> {
        let bad = |s: &StreamedExperts, msg: String| {
            StoreError::Layout(format!(
                "{}: {}.switch_mlp.{}: {msg}",
                files
                    .get(s.file)
                    .map_or(String::new(), |f| f.display().to_string()),
                s.prefix,
                PROJECTIONS[s.projection]
            ))
        };
        // layer -> [gate, up, down].
        let mut layers: std::collections::BTreeMap<usize, [Option<&StreamedExperts>; 3]> =
            Default::default();
        for s in stacks {
            let slot = &mut layers.entry(s.layer).or_default()[s.projection];
            if slot.is_some() {
                return Err(bad(s, "appears twice".into()));
            }
            *slot = Some(s);
        }
        let used: BTreeSet<usize> = stacks.iter().map(|s| s.file).collect();
        if let Some(&f) = used.iter().find(|&&f| f >= files.len()) {
            return Err(StoreError::Layout(format!(
                "expert blocks in file {f} of a set of {} (internal error)",
                files.len()
            )));
        }
        let reader_of = |f: usize| used.range(..f).count();
        let (mut plans, mut reads, mut conversions) = (Vec::new(), Vec::new(), Vec::new());
        let mut offset = 0u64;
        for (&layer, projections) in &layers {
            let Some(first) = projections.iter().flatten().next() else {
                continue;
            };
            if let Some(i) = projections.iter().position(Option::is_none) {
                return Err(bad(first, format!("has no {} experts", PROJECTIONS[i])));
            }
            let projections = projections.map(|p| p.expect("checked above"));
            let experts = first.offsets.len();
            if let Some(p) = projections.iter().find(|p| p.offsets.len() != experts) {
                return Err(bad(
                    p,
                    format!("{} experts, the gate has {experts}", p.offsets.len()),
                ));
            }
            let shapes: Vec<(String, usize, usize, sluice_backend::WeightFormat)> = projections
                .iter()
                .map(|p| {
                    (
                        PROJECTIONS[p.projection].to_string(),
                        p.rows,
                        p.cols,
                        p.format(),
                    )
                })
                .collect();
            let plan = LayerExperts::plan(layer, first.prefix.clone(), experts, offset, &shapes);
            offset = plan.offset + plan.stride * experts as u64;
            let mut convert = Vec::new();
            for (p, proj) in projections.iter().zip(&plan.projections) {
                let end = [Some(proj.weight), proj.scales, proj.biases]
                    .into_iter()
                    .flatten()
                    .map(|x| x.offset + x.bytes)
                    .max()
                    .unwrap_or(0);
                let span = end - proj.weight.offset;
                if p.bytes_per_expert > span {
                    return Err(bad(
                        p,
                        format!(
                            "{} bytes per expert as stored, more than the {span} they convert \
                             to (internal error)",
                            p.bytes_per_expert
                        ),
                    ));
                }
                if p.converts() {
                    let (Some(scales), Some(biases)) = (proj.scales, proj.biases) else {
                        return Err(bad(p, "converts to a format without biases".into()));
                    };
                    convert.push(Conversion {
                        experts: (*p).clone(),
                        at: proj.weight.offset,
                        len: p.bytes_per_expert,
                        parts: [proj.weight, scales, biases],
                    });
                }
            }
            let per_expert: Vec<Vec<PartRead>> = (0..experts)
                .map(|e| {
                    projections
                        .iter()
                        .zip(&plan.projections)
                        .map(|(p, proj)| PartRead {
                            file: reader_of(p.file),
                            offset: p.offsets[e],
                            len: p.bytes_per_expert,
                            at: proj.weight.offset,
                        })
                        .collect()
                })
                .collect();
            plans.push(plan);
            reads.push(per_expert);
            conversions.push(convert);
        }
        let mut manifest = Manifest::new(plans);
        manifest.file = None;
        Ok(UnpackedLayout {
            manifest,
            files: used.iter().map(|&f| files[f].clone()).collect(),
            reads,
            conversions,
        })
    }

    /// Bytes of expert data in the checkpoint (what resident experts would occupy).
    pub fn expert_bytes(&self) -> u64 {
        self.reads.iter().flatten().flatten().map(|r| r.len).sum()
    }

    /// Whether the checkpoint has routed experts at all.
    pub fn is_empty(&self) -> bool {
        self.manifest.layers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ExpertStore, IoKind, Policy, ReaderOptions, StoreOptions};
    use sluice_format::{write_safetensors, StDtype};

    const E: usize = 4;
    const H: usize = 64;
    const I: usize = 8;

    /// A checkpoint of one mlx-style layer of `E` bf16 experts (plus a resident tensor first),
    /// every byte distinct per position.
    fn checkpoint() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let bytes = |n: usize, seed: usize| -> Vec<u8> {
            (0..n).map(|i| (i * 7 + seed * 31) as u8).collect()
        };
        let norm = bytes(H * 2, 1);
        let gate = bytes(E * I * H * 2, 2);
        let up = bytes(E * I * H * 2, 3);
        let down = bytes(E * H * I * 2, 4);
        let p = "model.layers.0.mlp.switch_mlp";
        let tensors: Vec<(String, StDtype, Vec<usize>, &[u8])> = vec![
            ("model.norm.weight".into(), StDtype::BF16, vec![H], &norm),
            (
                format!("{p}.down_proj.weight"),
                StDtype::BF16,
                vec![E, H, I],
                &down,
            ),
            (
                format!("{p}.gate_proj.weight"),
                StDtype::BF16,
                vec![E, I, H],
                &gate,
            ),
            (
                format!("{p}.up_proj.weight"),
                StDtype::BF16,
                vec![E, I, H],
                &up,
            ),
        ];
        write_safetensors(&dir.path().join("model.safetensors"), &tensors, None).unwrap();
        dir
    }

    fn opts(slots: u64, stride: u64) -> StoreOptions {
        StoreOptions {
            cache_bytes: slots * stride,
            policy: Policy::Lru,
            io: ReaderOptions {
                kind: IoKind::Auto,
                direct: true, // ignored: unpacked reads are buffered
                queue_depth: 4,
                faults: None,
            },
            verify: true, // ignored: no checksums
            min_slots: 1,
            pinner: None,
        }
    }

    #[test]
    fn unpacked_experts_read_the_same_bytes_as_the_map() {
        let dir = checkpoint();
        let t = Tensors::open_dir(dir.path()).unwrap();
        let layout = UnpackedLayout::plan(&t, None).unwrap();
        assert_eq!(layout.files.len(), 1);
        assert_eq!(layout.reads[0].len(), E);
        assert!(layout.reads[0].iter().all(|r| r.len() == 3));
        assert_eq!(layout.expert_bytes(), (3 * E * I * H * 2) as u64);
        let stride = layout.manifest.max_stride();
        let store = ExpertStore::from_unpacked(dir.path(), layout, &opts(2, stride)).unwrap();
        assert!(store.is_unpacked());
        assert!(store.io_description().contains("buffered"));
        let p = "model.layers.0.mlp.switch_mlp";
        let gate = t
            .matrix_stack(&format!("{p}.gate_proj"), None, None)
            .unwrap();
        let up = t.matrix_stack(&format!("{p}.up_proj"), None, None).unwrap();
        let down = t
            .matrix_stack(&format!("{p}.down_proj"), None, None)
            .unwrap();
        for e in [3u32, 0, 2, 1, 3] {
            let got = store.fetch(0, &[e]).unwrap();
            let e = e as usize;
            assert_eq!(got[0].gate.data.as_slice(), gate[e].data.as_slice());
            assert_eq!(got[0].up.data.as_slice(), up[e].data.as_slice());
            assert_eq!(got[0].down.data.as_slice(), down[e].data.as_slice());
            assert_eq!((got[0].down.rows, got[0].down.cols), (H, I));
        }
        let s = store.stats();
        assert_eq!((s.requests, s.misses, s.blocks_read), (5, 5, 5));
        assert_eq!(s.bytes_read, 5 * 3 * (I * H * 2) as u64);
    }

    #[test]
    fn the_store_can_hold_all_only_with_a_slot_for_every_expert() {
        use sluice_backend::ExpertSource;
        let dir = checkpoint();
        let t = Tensors::open_dir(dir.path()).unwrap();
        for (slots, all) in [(E as u64, true), (E as u64 - 1, false), (1, false)] {
            let layout = UnpackedLayout::plan(&t, None).unwrap();
            let stride = layout.manifest.max_stride();
            let store =
                ExpertStore::from_unpacked(dir.path(), layout, &opts(slots, stride)).unwrap();
            assert_eq!(store.slots() as u64, slots);
            assert_eq!(store.can_hold_all(), all, "{slots} slots for {E} experts");
        }
    }

    #[test]
    fn a_shard_truncated_after_load_fails_the_request_naming_it() {
        let dir = checkpoint();
        let file = dir.path().join("model.safetensors");
        let t = Tensors::open_dir(dir.path()).unwrap();
        let layout = UnpackedLayout::plan(&t, None).unwrap();
        // The last expert's last slice ends the file.
        let last = layout.reads[0][E - 1]
            .iter()
            .map(|r| r.offset + r.len)
            .max()
            .unwrap();
        assert_eq!(last, std::fs::metadata(&file).unwrap().len());
        let cut = layout.reads[0][E - 1]
            .iter()
            .map(|r| r.offset)
            .max()
            .unwrap();
        drop(t); // the store keeps no map of the file
        let stride = layout.manifest.max_stride();
        let store = ExpertStore::from_unpacked(dir.path(), layout, &opts(2, stride)).unwrap();
        assert!(store.fetch(0, &[0]).is_ok());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(cut + 10)
            .unwrap();
        let err = store.fetch(0, &[E as u32 - 1]).err().expect("truncated");
        let msg = err.to_string();
        assert!(
            msg.contains("model.safetensors")
                && msg.contains(&format!("expert {}", E - 1))
                && msg.contains("end of file")
                && msg.contains("truncated"),
            "{msg}"
        );
        assert_eq!(store.stats().errors, 1);
        // The store keeps working: an expert before the cut still reads, the damaged one fails
        // again rather than being served half-read.
        assert!(store.fetch(0, &[1]).is_ok());
        assert!(store.fetch(0, &[E as u32 - 1]).is_err());
    }
}
