//! The store as the models see it: an [`ExpertSource`].

use sluice_backend::{
    ExpertError, ExpertErrorKind, ExpertLayer, ExpertSource, FfnWeights, HostExpert, MatrixShape,
};

use crate::manifest::{Projection, MANIFEST_FILE};
use crate::{ExpertStore, StoreError};

fn shape(p: &Projection) -> MatrixShape {
    MatrixShape {
        rows: p.rows,
        cols: p.cols,
        format: p.format.to_format().expect("validated on load"),
    }
}

/// What kind of failure a store error is, for callers that react differently.
fn kind(e: &StoreError) -> ExpertErrorKind {
    match e {
        StoreError::Block { msg, .. } if msg.contains("checksum") => ExpertErrorKind::Corrupt,
        StoreError::Memory(_) => ExpertErrorKind::Capacity,
        StoreError::NoLayer(..) | StoreError::Expert { .. } => ExpertErrorKind::NotFound,
        _ => ExpertErrorKind::Io,
    }
}

impl ExpertSource for ExpertStore {
    fn name(&self) -> String {
        if self.is_unpacked() {
            format!("{} (unpacked checkpoint)", self.dir().display())
        } else {
            self.dir().join(MANIFEST_FILE).display().to_string()
        }
    }

    fn layer(&self, layer: usize) -> Option<ExpertLayer> {
        let l = self.manifest().layer(layer)?;
        let [gate, up, down] = [0, 1, 2].map(|i| &l.projections[i]);
        // The bytes computing reads: the parts, without the alignment padding between them.
        let bytes_per_expert = l
            .projections
            .iter()
            .flat_map(|p| [Some(p.weight), p.scales, p.biases])
            .flatten()
            .map(|part| part.bytes)
            .sum();
        Some(ExpertLayer {
            experts: l.experts,
            gate: shape(gate),
            up: shape(up),
            down: shape(down),
            bytes_per_expert,
        })
    }

    fn max_fetch(&self) -> usize {
        ExpertStore::max_fetch(self)
    }

    fn can_hold_all(&self) -> bool {
        let all: usize = self.manifest().layers.iter().map(|l| l.experts).sum();
        self.slots() >= all
    }

    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<HostExpert>, ExpertError> {
        let fetched =
            ExpertStore::fetch(self, layer, experts).map_err(|e| ExpertError::new(kind(&e), e))?;
        Ok(fetched
            .into_iter()
            .map(|f| FfnWeights {
                gate: f.gate,
                up: f.up,
                down: f.down,
            })
            .collect())
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        ExpertStore::prefetch(self, layer, experts)
    }

    fn release_prefetch(&self, layer: usize) {
        ExpertStore::release_prefetch(self, layer);
    }
}
