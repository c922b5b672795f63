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
use crate::manifest::{align_up, plan_layers, LayerExperts, Manifest, Part, BLOCK_ALIGN};

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
    /// Per manifest layer index, per expert, per conversion: where in the slot that expert's
    /// raw bytes landed (aligned reads put each expert's at its own offset).
    pub(crate) raw_at: Vec<Vec<Vec<u64>>>,
    /// Per file: whether its reads are aligned for O_DIRECT (a file may be listed twice, once
    /// for aligned reads and once for the reads that end the file).
    pub(crate) direct: Vec<bool>,
}

/// A projection read as ggml blocks and converted in its slot: the raw bytes (`len` of them)
/// land in the projection's own span of the slot, at an offset per expert (`raw_at`), and are
/// replaced by the converted weight, scales and biases.
#[derive(Debug, Clone)]
pub(crate) struct Conversion {
    pub(crate) experts: StreamedExperts,
    pub(crate) len: u64,
    pub(crate) parts: [Part; 3],
}

impl Conversion {
    /// Converts the raw bytes of one expert's projection, at `raw_at` of `block` (its slot),
    /// into its parts.
    pub(crate) fn apply(&self, block: &mut [u8], raw_at: u64) -> Result<(), String> {
        let raw = &block[raw_at as usize..(raw_at + self.len) as usize];
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
        let files: Vec<PathBuf> = shards.iter().map(|&i| t.files()[i].clone()).collect();
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
        let direct = vec![false; files.len()];
        Ok(UnpackedLayout {
            manifest,
            files,
            reads,
            conversions: Vec::new(),
            raw_at: Vec::new(),
            direct,
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
        // Each file is read through two readers: aligned reads (O_DIRECT) and the exact reads
        // of blocks whose aligned range would run past the end of the file.
        let file_len = |f: usize| std::fs::metadata(&files[f]).map(|m| m.len()).unwrap_or(0);
        let lens: std::collections::BTreeMap<usize, u64> =
            used.iter().map(|&f| (f, file_len(f))).collect();
        let reader_of =
            |f: usize, aligned: bool| 2 * used.range(..f).count() + usize::from(!aligned);
        let (mut plans, mut reads, mut conversions, mut raw_at) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
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
            // Each projection's span of the slot: from its weight to the next projection's.
            let spans: Vec<(u64, u64)> = plan
                .projections
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let end = plan
                        .projections
                        .get(i + 1)
                        .map_or(plan.stride, |n| n.weight.offset);
                    (p.weight.offset, end)
                })
                .collect();
            let mut convert = Vec::new();
            for (p, proj) in projections.iter().zip(&plan.projections) {
                if !p.converts() {
                    continue;
                }
                let (Some(scales), Some(biases)) = (proj.scales, proj.biases) else {
                    return Err(bad(p, "converts to a format without biases".into()));
                };
                convert.push(Conversion {
                    experts: (*p).clone(),
                    len: p.bytes_per_expert,
                    parts: [proj.weight, scales, biases],
                });
            }
            // Aligned reads when every projection converts (its raw bytes may then land
            // anywhere in its span) and an aligned range fits each span.
            let aligned = convert.len() == projections.len()
                && projections.iter().zip(&spans).all(|(p, &(start, end))| {
                    align_up(start, BLOCK_ALIGN) + p.bytes_per_expert + 2 * BLOCK_ALIGN <= end
                });
            let mut per_expert = Vec::with_capacity(experts);
            let mut per_expert_raw = Vec::with_capacity(experts);
            for e in 0..experts {
                let (mut parts, mut raws) = (Vec::with_capacity(3), Vec::with_capacity(3));
                for (p, &(start, end)) in projections.iter().zip(&spans) {
                    let (off, len) = (p.offsets[e], p.bytes_per_expert);
                    if len > end - start {
                        return Err(bad(
                            p,
                            format!(
                                "{len} bytes per expert as stored, more than the {} they \
                                 convert to (internal error)",
                                end - start
                            ),
                        ));
                    }
                    let a_off = off / BLOCK_ALIGN * BLOCK_ALIGN;
                    let a_end = align_up(off + len, BLOCK_ALIGN);
                    let at = align_up(start, BLOCK_ALIGN);
                    let read = if aligned && a_end <= lens[&p.file] {
                        PartRead {
                            file: reader_of(p.file, true),
                            offset: a_off,
                            len: a_end - a_off,
                            at,
                        }
                    } else if aligned {
                        // The end of the file: the exact range, where the aligned read would
                        // have put it.
                        PartRead {
                            file: reader_of(p.file, false),
                            offset: off,
                            len,
                            at: at + (off - a_off),
                        }
                    } else {
                        PartRead {
                            file: reader_of(p.file, false),
                            offset: off,
                            len,
                            at: start,
                        }
                    };
                    if p.converts() {
                        raws.push(read.at + (off - read.offset));
                    }
                    parts.push(read);
                }
                per_expert.push(parts);
                per_expert_raw.push(raws);
            }
            plans.push(plan);
            reads.push(per_expert);
            conversions.push(convert);
            raw_at.push(per_expert_raw);
        }
        let mut manifest = Manifest::new(plans);
        manifest.file = None;
        Ok(UnpackedLayout {
            manifest,
            files: used
                .iter()
                .flat_map(|&f| [files[f].clone(), files[f].clone()])
                .collect(),
            reads,
            conversions,
            raw_at,
            direct: used.iter().flat_map(|_| [true, false]).collect(),
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
    use crate::{ExpertStore, IoKind, Policy, ReaderOptions, StoreOptions, Verify};
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
            verify: Verify::Off, // ignored: no checksums
            min_slots: 1,
            pinner: None,
        }
    }

    /// A GGUF-like file: `pad` bytes, then a Q8_0 stack per projection of `experts` experts of
    /// `rows x cols`, ending the file unaligned; and the stacks as a GGUF open describes them.
    fn q8_stacks(
        dir: &std::path::Path,
        pad: u64,
        experts: usize,
        rows: usize,
        cols: usize,
    ) -> (PathBuf, Vec<StreamedExperts>, Vec<u8>) {
        let ty = sluice_format::gguf::GgmlType::from_id(8).unwrap();
        assert_eq!(ty.name(), "Q8_0");
        let per = (rows * cols / 32 * 34) as u64;
        let mut bytes: Vec<u8> = (0..pad).map(|i| i as u8).collect();
        let mut stacks = Vec::new();
        for projection in 0..3 {
            let (r, c) = if projection == 2 {
                (cols, rows)
            } else {
                (rows, cols)
            };
            let base = bytes.len() as u64;
            for e in 0..experts {
                for b in 0..r * c / 32 {
                    // d: a finite f16 per block; 32 codes.
                    // f16 bits of 2^-7 times 1..1.75.
                    let d = 0x2000u16 + ((b + e + projection) % 7) as u16 * 0x80;
                    bytes.extend_from_slice(&d.to_le_bytes());
                    bytes.extend((0..32).map(|i| (i * 37 + b * 11 + e * 5 + projection) as u8));
                }
            }
            stacks.push(StreamedExperts {
                layer: 0,
                prefix: "model.layers.0.mlp".into(),
                projection,
                ggml_type: ty,
                rows: r,
                cols: c,
                file: 0,
                offsets: (0..experts as u64).map(|e| base + e * per).collect(),
                bytes_per_expert: per,
            });
        }
        let path = dir.join("model.gguf");
        std::fs::write(&path, &bytes).unwrap();
        (path, stacks, bytes)
    }

    #[test]
    fn streamed_gguf_experts_read_whole_pages_and_convert_exactly() {
        let tmp = tempfile::tempdir().unwrap();
        let (experts, rows, cols) = (3, 512, 256);
        let (path, stacks, bytes) = q8_stacks(tmp.path(), 100, experts, rows, cols);
        let layout = UnpackedLayout::plan_streamed(&stacks, std::slice::from_ref(&path)).unwrap();
        assert_eq!(layout.files.len(), 2, "an aligned and an exact reader");
        assert_eq!(layout.direct, [true, false]);
        let stride = layout.manifest.layers[0].stride;
        for (e, parts) in layout.reads[0].iter().enumerate() {
            for (p, r) in parts.iter().enumerate() {
                let s = &stacks[p];
                // The read covers the expert's blocks, and lands where the conversion looks.
                assert!(
                    r.offset <= s.offsets[e]
                        && s.offsets[e] + s.bytes_per_expert <= r.offset + r.len
                );
                assert_eq!(layout.raw_at[0][e][p], r.at + (s.offsets[e] - r.offset));
                assert!(r.at + r.len <= stride);
                if r.file == 0 {
                    assert_eq!(
                        (r.offset % 4096, r.len % 4096, r.at % 4096),
                        (0, 0, 0),
                        "{r:?}"
                    );
                } else {
                    // Only the expert that ends the file is read exactly.
                    assert_eq!((e, p), (experts - 1, 2));
                    assert_eq!(r.offset + r.len, bytes.len() as u64);
                }
            }
        }
        let store = ExpertStore::from_unpacked(tmp.path(), layout, &opts(2, stride)).unwrap();
        for e in [2u32, 0, 1, 2] {
            let got = store.fetch(0, &[e]).unwrap();
            let got = [&got[0].gate, &got[0].up, &got[0].down];
            for (m, s) in got.into_iter().zip(&stacks) {
                let at = s.offsets[e as usize] as usize;
                let want = s
                    .convert(&bytes[at..at + s.bytes_per_expert as usize])
                    .unwrap();
                assert_eq!(m.format, s.format());
                assert_eq!(m.data.as_slice(), &want.data[..]);
                assert_eq!(m.scales.as_slice(), &want.scales[..]);
                assert_eq!(m.biases.as_slice(), &want.biases[..]);
            }
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
