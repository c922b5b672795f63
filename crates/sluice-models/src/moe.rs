//! The feed-forward half of a decoder layer, shared by every architecture here: a sparse MoE
//! block (softmax router, top-k routed experts, optionally a shared expert scaled by its sigmoid
//! gate) or, for the layers a config marks dense, a plain SwiGLU block.

use sluice_backend::{Backend, FfnWeights};

use crate::loader::Loader;
use crate::{Experts, ModelError};

/// The shapes of one MoE block.
pub(crate) struct MoeDims {
    pub experts: usize,
    pub hidden: usize,
    /// Of each routed expert.
    pub inter: usize,
    /// Of the shared expert; `None` when there is none.
    pub shared_inter: Option<usize>,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
}

pub(crate) struct SharedExpert<B: Backend> {
    ffn: FfnWeights<B::Weight>,
    /// `[1, hidden]`: the shared expert's output is scaled by `sigmoid(gate(x))`.
    gate: B::Weight,
}

pub(crate) struct SparseMoe<B: Backend> {
    /// The router: `[experts, hidden]`.
    gate: B::Weight,
    experts: Experts<B>,
    shared_expert: Option<SharedExpert<B>>,
    norm_topk_prob: bool,
}

pub(crate) enum Mlp<B: Backend> {
    Sparse(SparseMoe<B>),
    Dense(FfnWeights<B::Weight>),
}

impl<B: Backend> Mlp<B> {
    /// The sparse block of decoder layer `layer` under `prefix` (`gate`, the experts,
    /// `shared_expert`, `shared_expert_gate`).
    pub fn sparse(
        ld: &mut Loader<B>,
        layer: usize,
        prefix: &str,
        d: &MoeDims,
    ) -> Result<Self, ModelError> {
        let gate = ld.matrix(&format!("{prefix}.gate"), d.experts, d.hidden)?;
        let experts = ld.experts(layer, prefix, d.experts, d.hidden, d.inter)?;
        let shared_expert = match d.shared_inter {
            Some(inter) => Some(SharedExpert {
                ffn: ld.ffn(&format!("{prefix}.shared_expert"), d.hidden, inter)?,
                gate: ld.matrix(&format!("{prefix}.shared_expert_gate"), 1, d.hidden)?,
            }),
            None => None,
        };
        Ok(Mlp::Sparse(SparseMoe {
            gate,
            experts,
            shared_expert,
            norm_topk_prob: d.norm_topk_prob,
        }))
    }

    /// A dense SwiGLU block under `prefix`.
    pub fn dense(
        ld: &mut Loader<B>,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<Self, ModelError> {
        Ok(Mlp::Dense(ld.ffn(prefix, hidden, inter)?))
    }

    /// The block's output for `x` with `k` experts per token. `next` is the following layer's
    /// block: its likely experts start streaming while this one computes.
    pub fn forward(
        &self,
        b: &B,
        x: &B::Act,
        k: usize,
        next: Option<&Mlp<B>>,
    ) -> Result<B::Act, ModelError> {
        let moe = match self {
            Mlp::Dense(ffn) => return Ok(b.ffn(x, ffn)),
            Mlp::Sparse(moe) => moe,
        };
        let routing = b.route_matmul(x, &moe.gate, k, moe.norm_topk_prob);
        // The next router applied to this layer's input: a guess at its experts one layer early,
        // computed with this layer's routing so that one read brings both back.
        let guess = match next {
            Some(Mlp::Sparse(next)) if next.experts.wants_prefetch(b, x) => {
                Some((next, b.route_matmul(x, &next.gate, k, next.norm_topk_prob)))
            }
            _ => None,
        };
        let mut y = moe.experts.run(b, x, &routing, &mut || {
            if let Some((next, guess)) = &guess {
                next.experts.prefetch(b, guess);
            }
        })?;
        if let Some(shared) = &moe.shared_expert {
            b.add_shared_expert(&mut y, x, &shared.ffn, &shared.gate);
        }
        Ok(y)
    }
}
