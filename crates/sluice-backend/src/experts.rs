//! The seam between model code and wherever routed experts live when they are not all resident:
//! an [`ExpertSource`] hands out a layer's experts as host matrices on demand (the expert store
//! behind it reads them from SSD into a budgeted cache). Model code asks for the experts a layer
//! was routed to and gives them to its backend ([`crate::Backend::stage_expert`]); it never sees
//! files, caches or I/O.

use std::fmt;

use crate::{FfnWeights, HostMatrix, WeightFormat};

/// The gate, up and down projections of one expert, in host memory (borrowed from the source's
/// cache: the memory stays valid, and the cache slot pinned, while any clone lives).
pub type HostExpert = FfnWeights<HostMatrix>;

/// One routed expert of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    pub layer: usize,
    pub expert: u32,
}

/// Shape and storage format of one projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixShape {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
}

impl MatrixShape {
    pub fn of(m: &HostMatrix) -> MatrixShape {
        MatrixShape {
            rows: m.rows,
            cols: m.cols,
            format: m.format,
        }
    }
}

/// What a source holds for one decoder layer: how many experts and their projections' shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayer {
    pub experts: usize,
    pub gate: MatrixShape,
    pub up: MatrixShape,
    pub down: MatrixShape,
    /// Bytes one expert occupies in the source (what a token that uses it reads).
    pub bytes_per_expert: u64,
}

/// Why an expert could not be fetched. The source's own error (which names the file, offset and
/// what to do) is kept as the [`std::error::Error::source`] and its message.
#[derive(Debug)]
pub struct ExpertError {
    pub kind: ExpertErrorKind,
    source: Box<dyn std::error::Error + Send + Sync>,
}

/// The kind of an [`ExpertError`], for callers that react differently (a server answers a
/// damaged file with a 5xx, a bad request with a 4xx).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertErrorKind {
    /// Reading failed (an I/O error, a short read, a file that went away).
    Io,
    /// The bytes read are not what was stored (checksum mismatch).
    Corrupt,
    /// The request does not fit the source (more experts at once than its cache holds).
    Capacity,
    /// A layer or expert that the source does not have.
    NotFound,
}

impl ExpertError {
    pub fn new(
        kind: ExpertErrorKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        ExpertError {
            kind,
            source: source.into(),
        }
    }

    /// The source's own error, e.g. to downcast to the store's error type.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.source.as_ref()
    }
}

impl fmt::Display for ExpertError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl std::error::Error for ExpertError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.source.as_ref())
    }
}

/// Routed experts fetched on demand (the streaming expert store implements it).
///
/// Called from one decode thread: [`ExpertSource::fetch`] for the experts a layer was routed to
/// (waits until they are in memory) and [`ExpertSource::prefetch`] for the ones it will probably
/// need next (starts reading, does not wait).
pub trait ExpertSource: Send + Sync {
    /// Where the experts come from, for messages (e.g. `DIR/experts.json`).
    fn name(&self) -> String;
    /// The experts held for decoder layer `layer`; `None` when it has none here.
    fn layer(&self, layer: usize) -> Option<ExpertLayer>;
    /// Most experts one [`ExpertSource::fetch`] can return at once.
    fn max_fetch(&self) -> usize;
    /// Whether every expert of every layer fits the source's memory at once, so that all of
    /// them may stay fetched (see [`crate::Backend::experts_in_host`]).
    fn can_hold_all(&self) -> bool {
        false
    }
    /// The experts `experts` (ascending, distinct, at most [`ExpertSource::max_fetch`]) of
    /// `layer`, in that order.
    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<HostExpert>, ExpertError>;
    /// Starts reading experts `experts` of `layer` so that a later fetch finds them; a hint that
    /// may be ignored.
    fn prefetch(&self, layer: usize, experts: &[u32]);
    /// `layer` was served without a fetch (its backend held every expert it needed): what a
    /// prefetch holds for it is let go, as a fetch would.
    fn release_prefetch(&self, layer: usize) {
        let _ = layer;
    }
}
