//! The routed experts of one MoE layer: resident on the backend, or fetched from an
//! [`ExpertSource`] as the layer is routed.

use std::sync::Arc;

use sluice_backend::{Backend, ExpertError, ExpertErrorKind, ExpertFfn, ExpertKey, ExpertSource};

use crate::ModelError;

/// Where a layer's experts live.
pub enum Experts<B: Backend> {
    /// All experts uploaded once (memory-mapped in place on the CPU).
    Resident(B::Experts),
    /// Fetched per call from a source (the expert store of a packed directory).
    Streamed {
        source: Arc<dyn ExpertSource>,
        layer: usize,
    },
}

impl<B: Backend> Experts<B> {
    /// `sum_j weight_j * expert_j(x)` per row, each expert computing as `ffn` says.
    ///
    /// Streamed experts the backend still holds are used as they are; the others are fetched in
    /// ascending runs that fit the source's cache and staged on the backend. Every row
    /// accumulates in ascending expert id however the experts are split, so streamed and
    /// resident experts give bit-identical results.
    ///
    /// `then` runs once this layer's (first run of) experts are in memory and before computing
    /// with them: the place to start reading the next layer's experts, so those reads overlap
    /// this compute without evicting what this layer needs.
    pub fn run(
        &self,
        b: &B,
        x: &B::Act,
        routing: &B::Routing,
        ffn: ExpertFfn<'_, B::Vector>,
        then: &mut dyn FnMut(),
    ) -> Result<B::Act, ModelError> {
        let (source, layer) = match self {
            Experts::Resident(experts) => {
                then();
                return Ok(b.moe(x, routing, experts, ffn));
            }
            Experts::Streamed { source, layer } => (source, *layer),
        };
        let used = b.read_routing(routing)?.distinct();
        let (rows, cols) = b.shape(x);
        let mut out = b.zeros(rows, cols);
        let mut then = Some(then);
        let max_fetch = source.max_fetch().max(1);
        let mut rest = used.as_slice();
        let mut first_run = true;
        let mut fetched_any = false;
        while !rest.is_empty() {
            // The next run: experts up to the `max_fetch`-th that needs fetching.
            let mut run: Vec<(u32, Option<B::StagedExpert>)> = Vec::new();
            let mut missing: Vec<u32> = Vec::new();
            for &expert in rest {
                let held = b.staged_expert(ExpertKey { layer, expert });
                if held.is_none() {
                    if missing.len() == max_fetch {
                        break;
                    }
                    missing.push(expert);
                }
                run.push((expert, held));
            }
            rest = &rest[run.len()..];
            if !first_run && !missing.is_empty() {
                // The backend may still hold the last run's host copies (a GPU's upload in
                // flight): let them go before the source reuses its slots.
                b.synchronize()?;
            }
            first_run = false;
            let mut fetched = if missing.is_empty() {
                Vec::new()
            } else {
                fetched_any = true;
                source.fetch(layer, &missing)?
            }
            .into_iter();
            let staged = run
                .into_iter()
                .map(|(expert, held)| {
                    let staged = match held {
                        Some(s) => s,
                        None => {
                            let host = fetched.next().ok_or_else(|| {
                                ExpertError::new(
                                    ExpertErrorKind::NotFound,
                                    format!(
                                        "{} returned fewer experts than asked for",
                                        source.name()
                                    ),
                                )
                            })?;
                            b.stage_expert(ExpertKey { layer, expert }, host)?
                        }
                    };
                    Ok((expert, staged))
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            if let Some(f) = then.take() {
                f();
            }
            let pairs: Vec<(u32, &B::StagedExpert)> = staged.iter().map(|(e, s)| (*e, s)).collect();
            b.moe_accumulate(x, routing, &pairs, ffn, &mut out);
            // `staged` drops here, releasing the run's hold on the source's cache.
        }
        if !fetched_any {
            // The backend held them all: what a prefetch holds for this layer would otherwise
            // stay held until the layer next fetches.
            source.release_prefetch(layer);
        }
        Ok(out)
    }

    /// Whether a guess at this layer's routing for `x` is worth computing: streamed experts, and
    /// a batch small enough not to route to most experts anyway.
    pub fn wants_prefetch(&self, b: &B, x: &B::Act) -> bool {
        self.is_streamed() && b.shape(x).0 <= PREFETCH_MAX_ROWS
    }

    /// Starts reading the experts of `guess` (this layer's routing guessed one layer early)
    /// that the backend does not hold; a no-op for resident experts.
    pub fn prefetch(&self, b: &B, guess: &B::Routing) {
        let Experts::Streamed { source, layer } = self else {
            return;
        };
        // A failed read of the guess is not this token's failure: the fetch will report it.
        if let Ok(routing) = b.read_routing(guess) {
            // Nothing to read for what the backend already holds.
            let wanted: Vec<u32> = routing
                .distinct()
                .into_iter()
                .filter(|&expert| {
                    !b.holds_expert(ExpertKey {
                        layer: *layer,
                        expert,
                    })
                })
                .collect();
            source.prefetch(*layer, &wanted);
        }
    }

    pub fn is_streamed(&self) -> bool {
        matches!(self, Experts::Streamed { .. })
    }
}

/// Batches with more rows than this route to most experts anyway: no prefetch.
const PREFETCH_MAX_ROWS: usize = 4;
