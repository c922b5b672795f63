//! Streaming the routed experts of an unpacked checkpoint (no `sluice pack`): an in-memory
//! [`Manifest`] laying out each expert's block exactly as a packed block, and for each
//! (layer, expert) the plain buffered reads that gather its slices from the safetensors shards
//! into a cache slot.
//!
//! The experts are found by the same scan as `sluice pack` (mlx `switch_mlp` stacks,
//! per-expert modules, fused `gate_up_proj`), so whatever packs also streams unpacked. Packing
//! remains the faster layout: one aligned O_DIRECT read per expert instead of up to nine
//! buffered ones, and checksums.

use std::collections::HashMap;
use std::path::PathBuf;

use sluice_backend::HostBytes;
use sluice_format::{QuantConfig, Tensors};

use crate::manifest::Manifest;
use crate::pack::{find_experts, plan_layers};
use crate::store::StoreError;

/// One read of an expert's block: `len` bytes at `offset` of source file `file` (an index into
/// [`UnpackedLayout::files`]) into the slot at byte `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartRead {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    pub at: u64,
}

/// Where the experts of an unpacked checkpoint live.
#[derive(Debug, Clone)]
pub struct UnpackedLayout {
    /// The shards that hold routed experts.
    pub files: Vec<PathBuf>,
    /// The slot layout (as a packed manifest, without checksums: never written to disk and not
    /// valid for [`Manifest::validate`]).
    pub manifest: Manifest,
    /// Per manifest layer index, per expert: the reads that fill its slot (up to 9: gate, up and
    /// down x weight, scales, biases).
    pub reads: Vec<Vec<Vec<PartRead>>>,
}

/// Name of the (non-existent) blocks file of an unpacked layout's manifest.
pub const UNPACKED_FILE: &str = "(unpacked safetensors)";

impl UnpackedLayout {
    /// Finds the routed experts of `t` and where each slice of each expert lies on disk. An
    /// empty layout (no layers) when the checkpoint has no routed experts. Touches no tensor
    /// data (only the addresses of the memory maps).
    pub fn plan(t: &Tensors, quant: Option<&QuantConfig>) -> Result<UnpackedLayout, StoreError> {
        let layout_err = |e: crate::pack::PackError| StoreError::Layout(e.to_string());
        let (layers, used) = find_experts(t, quant).map_err(layout_err)?;
        let plans = plan_layers(&layers);

        // The address range of every expert tensor in its memory map, with its file position:
        // each slice of an expert is found in the tensor that contains it.
        let mut files: Vec<PathBuf> = Vec::new();
        let mut file_index: HashMap<PathBuf, usize> = HashMap::new();
        // (start address, end address, file index, file offset of start)
        let mut spans: Vec<(usize, usize, usize, u64)> = Vec::with_capacity(used.len());
        for name in &used {
            let info = t.get(name).map_err(|e| StoreError::Layout(e.to_string()))?;
            if info.bytes.is_empty() {
                continue;
            }
            let (path, offset, len) = t
                .location(name)
                .map_err(|e| StoreError::Layout(e.to_string()))?;
            let fi = *file_index.entry(path.to_path_buf()).or_insert_with(|| {
                files.push(path.to_path_buf());
                files.len() - 1
            });
            let start = info.bytes.as_slice().as_ptr() as usize;
            spans.push((start, start + len as usize, fi, offset));
        }
        spans.sort_unstable();
        let locate = |b: &HostBytes, what: &str| -> Result<(usize, u64), StoreError> {
            let p = b.as_slice().as_ptr() as usize;
            let i = spans.partition_point(|s| s.0 <= p);
            match i.checked_sub(1).map(|i| spans[i]) {
                Some((start, end, fi, offset)) if p + b.len() <= end => {
                    Ok((fi, offset + (p - start) as u64))
                }
                _ => Err(StoreError::Layout(format!(
                    "{what}: an expert slice lies outside the checkpoint's expert tensors (internal error)"
                ))),
            }
        };

        let mut reads = Vec::with_capacity(layers.len());
        for (l, plan) in layers.iter().zip(&plans) {
            let mut per_expert = Vec::with_capacity(l.experts.len());
            for (e, ms) in l.experts.iter().enumerate() {
                let what = format!("{} expert {e}", l.prefix);
                let mut parts = Vec::with_capacity(9);
                for (p, m) in plan.projections.iter().zip(ms) {
                    for (part, bytes) in [
                        (Some(p.weight), &m.data),
                        (p.scales, &m.scales),
                        (p.biases, &m.biases),
                    ] {
                        let Some(part) = part else { continue };
                        if part.bytes != bytes.len() as u64 {
                            return Err(StoreError::Layout(format!(
                                "{what} {}: {} bytes, the layout planned {} (internal error)",
                                p.name,
                                bytes.len(),
                                part.bytes
                            )));
                        }
                        if part.bytes == 0 {
                            continue;
                        }
                        let (file, offset) = locate(bytes, &what)?;
                        parts.push(PartRead {
                            file,
                            offset,
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
        manifest.file = UNPACKED_FILE.into();
        Ok(UnpackedLayout {
            files,
            manifest,
            reads,
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
    use crate::io::{IoKind, ReaderOptions};
    use crate::{ExpertStore, Policy, StoreOptions};
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
            },
            verify: true, // ignored: no checksums
            min_slots: 1,
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
