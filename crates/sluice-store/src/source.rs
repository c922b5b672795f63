//! Where blocks come from: the layout of every block (the manifest) and the files it is read
//! from, either a packed directory's `experts.bin` (one aligned read per block) or an unpacked
//! checkpoint's shards (one buffered read per slice of the expert, [`crate::unpacked`]).
//!
//! Both answer the same two questions, [`Source::reads_for`] (which reads fill a block's slot)
//! and [`Source::locate`] (which file and offset to name when one of them fails).

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use crate::error::StoreError;
use crate::io::{IoKind, Reader, ReaderOptions};
use crate::manifest::Manifest;
use crate::unpacked::{Conversion, PartRead, UnpackedLayout};

const PACKED_HINT: &str = "the file is damaged: re-run `sluice pack`";
const UNPACKED_HINT: &str =
    "the checkpoint file is damaged, or was truncated or replaced while sluice ran";

pub(crate) struct Source {
    /// The block (and so slot) layout.
    manifest: Manifest,
    /// The files blocks are read from, one reader each (same order).
    files: Vec<PathBuf>,
    readers: Vec<Reader>,
    /// Unpacked checkpoints: per manifest layer index, per expert, the reads that gather its
    /// block from `files`. `None` for a packed directory: one read of the whole block from
    /// `files[0]`.
    gather: Option<Vec<Vec<Vec<PartRead>>>>,
    /// Per manifest layer index, the projections converted once read (a GGUF's blocks); empty
    /// when nothing converts.
    conversions: Vec<Vec<Conversion>>,
    /// Per layer, expert and conversion: where the raw bytes land in the slot.
    raw_at: Vec<Vec<Vec<u64>>>,
}

fn open(path: &Path, io: &ReaderOptions) -> Result<Reader, StoreError> {
    Reader::open(path, io).map_err(|source| StoreError::Open {
        path: path.to_path_buf(),
        source,
    })
}

impl Source {
    /// The blocks file of the packed directory `dir`, described by `manifest`.
    pub(crate) fn packed(
        dir: &Path,
        manifest: Manifest,
        io: &ReaderOptions,
    ) -> Result<Source, StoreError> {
        manifest.check_file_len(dir)?;
        let path = manifest.blocks_path(dir)?;
        let reader = open(&path, io)?;
        Ok(Source {
            manifest,
            files: vec![path],
            readers: vec![reader],
            gather: None,
            conversions: Vec::new(),
            raw_at: Vec::new(),
        })
    }

    /// The shards of an unpacked checkpoint: buffered reads, except where the layout aligned
    /// them for O_DIRECT (a GGUF's converted experts) and `io` asks for it.
    pub(crate) fn unpacked(
        layout: UnpackedLayout,
        io: &ReaderOptions,
    ) -> Result<Source, StoreError> {
        let readers = layout
            .files
            .iter()
            .zip(&layout.direct)
            .map(|(path, &direct)| {
                let io = ReaderOptions {
                    direct: direct && io.direct,
                    ..io.clone()
                };
                open(path, &io)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Source {
            manifest: layout.manifest,
            files: layout.files,
            readers,
            gather: Some(layout.reads),
            conversions: layout.conversions,
            raw_at: layout.raw_at,
        })
    }

    pub(crate) fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub(crate) fn readers(&self) -> &[Reader] {
        &self.readers
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.readers.iter().map(Reader::in_flight).sum()
    }

    pub(crate) fn is_unpacked(&self) -> bool {
        self.gather.is_some()
    }

    /// The reads that fill the slot of `key` (manifest layer index, expert); their `file` is a
    /// reader index.
    pub(crate) fn reads_for(&self, (li, e): (usize, u32)) -> Cow<'_, [PartRead]> {
        match &self.gather {
            Some(reads) => Cow::Borrowed(&reads[li][e as usize]),
            None => {
                let l = &self.manifest.layers[li];
                Cow::Owned(vec![PartRead {
                    file: 0,
                    offset: l.block_offset(e as usize),
                    len: l.stride,
                    at: 0,
                }])
            }
        }
    }

    /// Whether any block is converted once read.
    pub(crate) fn converts_any(&self) -> bool {
        self.conversions.iter().any(|c| !c.is_empty())
    }

    /// Whether the blocks of manifest layer `li` are converted once read.
    pub(crate) fn converts(&self, li: usize) -> bool {
        self.conversions.get(li).is_some_and(|c| !c.is_empty())
    }

    /// Converts, in place, what the reads of `key`'s block left in `block` (its slot); nothing
    /// to do for a layer that does not convert.
    pub(crate) fn convert(&self, (li, e): (usize, u32), block: &mut [u8]) -> Result<(), String> {
        for (i, c) in self.conversions.get(li).into_iter().flatten().enumerate() {
            c.apply(block, self.raw_at[li][e as usize][i])?;
        }
        Ok(())
    }

    /// The file and offset of read `part` of `key`'s block, for error messages (a packed
    /// block is one read; `part` 0 also stands for the block as a whole).
    pub(crate) fn locate(&self, key: (usize, u32), part: usize) -> (PathBuf, u64) {
        match self.reads_for(key).get(part) {
            Some(r) => (self.files[r.file].clone(), r.offset),
            None => (self.files[0].clone(), 0),
        }
    }

    /// What to do about a block that failed.
    pub(crate) fn hint(&self) -> &'static str {
        if self.is_unpacked() {
            UNPACKED_HINT
        } else {
            PACKED_HINT
        }
    }

    /// The I/O path, e.g. `Uring, O_DIRECT` or `Threads, buffered, unpacked: 3 files`.
    pub(crate) fn describe(&self) -> String {
        let kind = self.readers.first().map_or(IoKind::Threads, Reader::kind);
        if self.is_unpacked() {
            let n = self.readers.len();
            if self.converts_any() {
                // Each file has an aligned reader and an exact one (the file's end).
                let direct = self.readers.iter().any(Reader::direct);
                return format!(
                    "{kind:?}, {}, unpacked: {} file{}, ggml blocks converted as read",
                    if direct { "O_DIRECT" } else { "buffered" },
                    n / 2,
                    if n == 2 { "" } else { "s" }
                );
            }
            return format!(
                "{kind:?}, buffered, unpacked: {n} file{}",
                if n == 1 { "" } else { "s" }
            );
        }
        let direct = self.readers.first().is_some_and(Reader::direct);
        format!(
            "{kind:?}{}",
            if direct { ", O_DIRECT" } else { ", buffered" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{LayerExperts, EXPERTS_FILE};
    use sluice_backend::{Dtype, WeightFormat};

    fn layer(layer: usize, offset: u64) -> LayerExperts {
        let f = WeightFormat::Dense(Dtype::Bf16);
        let projs = vec![
            ("gate_proj".to_string(), 4, 64, f),
            ("up_proj".to_string(), 4, 64, f),
            ("down_proj".to_string(), 64, 4, f),
        ];
        let mut l = LayerExperts::plan(
            layer,
            format!("model.layers.{layer}.mlp"),
            4,
            offset,
            &projs,
        );
        l.checksums = vec!["0".repeat(16); 4];
        l
    }

    #[test]
    fn packed_blocks_are_one_read_located_in_the_blocks_file() {
        let dir = tempfile::tempdir().unwrap();
        let l0 = layer(0, 0);
        let l1 = layer(3, l0.stride * 4);
        let m = Manifest::new(vec![l0, l1]);
        std::fs::write(
            dir.path().join(EXPERTS_FILE),
            vec![0u8; m.file_len() as usize],
        )
        .unwrap();
        let s = Source::packed(dir.path(), m.clone(), &ReaderOptions::default()).unwrap();
        assert!(!s.is_unpacked());
        let stride = m.layers[1].stride;
        assert_eq!(
            s.reads_for((1, 2)).as_ref(),
            [PartRead {
                file: 0,
                offset: 6 * stride,
                len: stride,
                at: 0
            }]
        );
        let path = dir.path().join(EXPERTS_FILE);
        assert_eq!(s.locate((1, 2), 0), (path.clone(), 6 * stride));
        assert_eq!(s.locate((0, 1), 0), (path, stride));
        assert!(s.hint().contains("sluice pack"));

        // A blocks file shorter than the manifest says is refused.
        std::fs::write(dir.path().join(EXPERTS_FILE), [0u8; 10]).unwrap();
        let e = Source::packed(dir.path(), m, &ReaderOptions::default()).err();
        assert!(e.expect("truncated").to_string().contains("truncated"));
    }

    #[test]
    fn unpacked_blocks_are_located_by_part() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<PathBuf> = ["a", "b"].iter().map(|f| dir.path().join(f)).collect();
        for f in &files {
            std::fs::write(f, [0u8; 64]).unwrap();
        }
        let r = |file, offset| PartRead {
            file,
            offset,
            len: 8,
            at: 0,
        };
        let layout = UnpackedLayout {
            manifest: Manifest::new(vec![layer(0, 0)]),
            files: files.clone(),
            reads: vec![vec![vec![r(0, 8), r(1, 40)], vec![r(1, 16)]]],
            conversions: Vec::new(),
            raw_at: Vec::new(),
            direct: vec![false; 2],
        };
        let s = Source::unpacked(layout, &ReaderOptions::default()).unwrap();
        assert!(s.is_unpacked());
        assert_eq!(s.reads_for((0, 0)).len(), 2);
        assert_eq!(s.locate((0, 0), 1), (files[1].clone(), 40));
        assert_eq!(s.locate((0, 1), 0), (files[1].clone(), 16));
        assert!(s.hint().contains("truncated or replaced"));
        assert!(
            s.describe().ends_with("buffered, unpacked: 2 files"),
            "{}",
            s.describe()
        );
    }
}
