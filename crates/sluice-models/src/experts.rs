//! The routed experts of one MoE layer: resident in memory, or streamed from a packed expert
//! store through its cache.

use sluice_backend::{Backend, FfnWeights, Routing};
use sluice_store::ExpertStore;

use crate::ModelError;

/// Where a layer's experts live.
pub enum Experts<B: Backend> {
    /// All experts loaded (memory-mapped on the CPU).
    Resident(Vec<FfnWeights<B::Weight>>),
    /// Fetched per call from the store of a packed directory.
    Streamed { store: ExpertStore, layer: usize },
}

/// Routed experts of a batch, distinct and ascending.
pub fn distinct(routing: &Routing) -> Vec<u32> {
    let mut used = routing.experts.clone();
    used.sort_unstable();
    used.dedup();
    used
}

impl<B: Backend> Experts<B> {
    /// `sum_j weight_j * expert_j(x)` per row. Streamed experts are fetched in ascending runs
    /// that fit the cache; rows accumulate in ascending expert id either way, so both paths give
    /// bit-identical results.
    ///
    /// `then` runs once this layer's experts are in memory and before computing with them: the
    /// place to start reading the next layer's experts, so those reads overlap this compute.
    pub fn run(
        &self,
        b: &B,
        x: &B::Act,
        routing: &Routing,
        then: &mut dyn FnMut(),
    ) -> Result<B::Act, ModelError> {
        match self {
            Experts::Resident(experts) => {
                then();
                Ok(b.moe(x, routing, experts))
            }
            Experts::Streamed { store, layer } => {
                let used = distinct(routing);
                let (rows, cols) = b.shape(x);
                let mut out = b.act_from_host(&vec![0.0; rows * cols], rows, cols);
                let mut then = Some(then);
                for run in used.chunks(store.max_fetch().max(1)) {
                    let fetched = store
                        .fetch(*layer, run)
                        .map_err(|e| ModelError::Input(e.to_string()))?;
                    let weights = fetched
                        .into_iter()
                        .map(|f| {
                            let up = |m| {
                                b.weight(m).map_err(|source| ModelError::Weight {
                                    tensor: format!("layer {layer} expert {}", f.expert),
                                    source,
                                })
                            };
                            Ok(FfnWeights {
                                gate: up(f.gate)?,
                                up: up(f.up)?,
                                down: up(f.down)?,
                            })
                        })
                        .collect::<Result<Vec<_>, ModelError>>()?;
                    if let Some(f) = then.take() {
                        f();
                    }
                    let pairs: Vec<(u32, &FfnWeights<B::Weight>)> =
                        run.iter().copied().zip(weights.iter()).collect();
                    b.moe_accumulate(x, routing, &pairs, &mut out);
                    // `weights` drops here, unpinning the run's cache slots.
                }
                Ok(out)
            }
        }
    }

    /// Starts reading the experts the router `gate` picks for `x` (a guess at this layer's
    /// routing made one layer early); a no-op for resident experts and for large batches.
    pub fn prefetch(&self, b: &B, gate: &B::Weight, x: &B::Act, k: usize, normalize: bool) {
        if let Experts::Streamed { store, layer } = self {
            if b.shape(x).0 > PREFETCH_MAX_ROWS {
                return;
            }
            let routing = b.route(&b.matmul(x, gate), k, normalize);
            store.prefetch(*layer, &distinct(&routing));
        }
    }

    pub fn is_streamed(&self) -> bool {
        matches!(self, Experts::Streamed { .. })
    }
}

/// Batches with more rows than this route to most experts anyway: no prefetch.
const PREFETCH_MAX_ROWS: usize = 4;
