//! The feed-forward half of a decoder layer, shared by every architecture here: a sparse MoE
//! block (a softmax router as Qwen's and Mixtral's, or DeepSeek-V3's sigmoid router with its
//! selection bias as GLM-4.5's; top-k routed experts; optionally a shared expert, scaled by a
//! sigmoid gate or added as is) or, for the layers a config marks dense, a plain SwiGLU block.

use sluice_backend::{Activation, Backend, ExpertFfn, FfnWeights, SigmoidRouting};

use crate::loader::Loader;
use crate::{Experts, ModelError};

/// How a block's router turns its logits into experts and weights.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Routing {
    /// Softmax over all experts, top k, renormalised to sum to one when `normalize`.
    Softmax { normalize: bool },
    /// DeepSeek-V3's `noaux_tc`: the router has a selection bias `gate.e_score_correction_bias`.
    Sigmoid(SigmoidRouting),
}

/// A shared expert: always run, beside the routed ones.
pub(crate) struct SharedDims {
    /// Module name under the block: `shared_expert` (Qwen) or `shared_experts` (GLM).
    pub name: &'static str,
    pub inter: usize,
    /// Scaled by `sigmoid(x shared_expert_gate^T)` (Qwen) or added as is (GLM).
    pub gated: bool,
}

/// The shapes of one MoE block.
pub(crate) struct MoeDims {
    pub experts: usize,
    pub hidden: usize,
    /// Of each routed expert.
    pub inter: usize,
    pub shared: Option<SharedDims>,
    pub routing: Routing,
}

pub(crate) struct SharedExpert<B: Backend> {
    ffn: FfnWeights<B::Weight>,
    /// `[1, hidden]`: the shared expert's output is scaled by `sigmoid(gate(x))`.
    gate: Option<B::Weight>,
}

/// The router: `gate` is `[experts, hidden]`.
pub(crate) enum Router<B: Backend> {
    Softmax {
        gate: B::Weight,
        /// Added to the logits (gpt-oss's router).
        bias: Option<B::Vector>,
        normalize: bool,
    },
    Sigmoid {
        gate: B::Weight,
        bias: B::Vector,
        how: SigmoidRouting,
    },
}

impl<B: Backend> Router<B> {
    fn route(&self, b: &B, x: &B::Act, k: usize) -> B::Routing {
        match self {
            Router::Softmax {
                gate,
                bias: None,
                normalize,
            } => b.route_matmul(x, gate, k, *normalize),
            Router::Softmax {
                gate,
                bias: Some(bias),
                normalize,
            } => {
                let mut logits = b.matmul(x, gate);
                b.add_bias(&mut logits, bias);
                b.route(&logits, k, *normalize)
            }
            Router::Sigmoid { gate, bias, how } => {
                b.route_sigmoid(&b.matmul(x, gate), bias, k, *how)
            }
        }
    }
}

pub(crate) struct SparseMoe<B: Backend> {
    router: Router<B>,
    experts: Experts<B>,
    /// The routed experts' activation (SwiGLU but for gpt-oss's clamped one).
    activation: Activation,
    /// Per-expert biases (gpt-oss), `[experts * width]` each.
    expert_biases: Option<FfnWeights<B::Vector>>,
    shared_expert: Option<SharedExpert<B>>,
}

impl<B: Backend> SparseMoe<B> {
    fn ffn(&self) -> ExpertFfn<'_, B::Vector> {
        ExpertFfn {
            activation: self.activation,
            biases: self.expert_biases.as_ref(),
        }
    }
}

pub(crate) enum Mlp<B: Backend> {
    Sparse(SparseMoe<B>),
    Dense(FfnWeights<B::Weight>),
}

impl<B: Backend> Mlp<B> {
    /// The sparse block of decoder layer `layer` under `prefix` (`gate`, the experts, the shared
    /// expert and its gate).
    pub fn sparse(
        ld: &mut Loader<B>,
        layer: usize,
        prefix: &str,
        d: &MoeDims,
    ) -> Result<Self, ModelError> {
        let gate = ld.matrix(&format!("{prefix}.gate"), d.experts, d.hidden)?;
        let router = match d.routing {
            Routing::Softmax { normalize } => Router::Softmax {
                gate,
                bias: None,
                normalize,
            },
            Routing::Sigmoid(how) => Router::Sigmoid {
                gate,
                bias: ld.vector(&format!("{prefix}.gate.e_score_correction_bias"), d.experts)?,
                how,
            },
        };
        let experts = ld.experts(layer, prefix, d.experts, d.hidden, d.inter)?;
        let shared_expert = match &d.shared {
            Some(s) => Some(SharedExpert {
                ffn: ld.ffn(&format!("{prefix}.{}", s.name), d.hidden, s.inter)?,
                gate: match s.gated {
                    true => Some(ld.matrix(&format!("{prefix}.{}_gate", s.name), 1, d.hidden)?),
                    false => None,
                },
            }),
            None => None,
        };
        Ok(Mlp::Sparse(SparseMoe {
            router,
            experts,
            activation: Activation::Silu,
            expert_biases: None,
            shared_expert,
        }))
    }

    /// gpt-oss's block under `prefix`: a router with a bias (`router`), top k of its logits
    /// weighted by their softmax, experts with per-expert biases and the clamped SwiGLU.
    pub fn gpt_oss(
        ld: &mut Loader<B>,
        layer: usize,
        prefix: &str,
        d: &MoeDims,
        activation: Activation,
    ) -> Result<Self, ModelError> {
        let router = Router::Softmax {
            gate: ld.matrix(&format!("{prefix}.router"), d.experts, d.hidden)?,
            bias: Some(ld.vector(&format!("{prefix}.router.bias"), d.experts)?),
            normalize: true,
        };
        Ok(Mlp::Sparse(SparseMoe {
            router,
            experts: ld.experts(layer, prefix, d.experts, d.hidden, d.inter)?,
            activation,
            expert_biases: Some(ld.expert_biases(prefix, d.experts, d.hidden, d.inter)?),
            shared_expert: None,
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
        let routing = moe.router.route(b, x, k);
        // The next router applied to this layer's input: a guess at its experts one layer early,
        // computed with this layer's routing so that one read brings both back.
        let guess = match next {
            Some(Mlp::Sparse(next)) if next.experts.wants_prefetch(b, x) => {
                Some((next, next.router.route(b, x, k)))
            }
            _ => None,
        };
        // Resident experts and a gated shared expert: one call, which a backend may fuse.
        if let (
            Experts::Resident(experts),
            Some(SharedExpert {
                ffn,
                gate: Some(gate),
            }),
        ) = (&moe.experts, &moe.shared_expert)
        {
            if let Some((next, guess)) = &guess {
                next.experts.prefetch(b, guess);
            }
            return Ok(b.moe_with_shared(x, &routing, experts, moe.ffn(), ffn, gate));
        }
        let mut y = moe.experts.run(b, x, &routing, moe.ffn(), &mut || {
            if let Some((next, guess)) = &guess {
                next.experts.prefetch(b, guess);
            }
        })?;
        match &moe.shared_expert {
            Some(SharedExpert {
                ffn,
                gate: Some(gate),
            }) => b.add_shared_expert(&mut y, x, ffn, gate),
            Some(SharedExpert { ffn, gate: None }) => b.add_assign(&mut y, &b.ffn(x, ffn)),
            None => {}
        }
        Ok(y)
    }
}

/// The `noaux_tc` sigmoid router's config as DeepSeek-V3 and GLM-4.5 write it, checked: `k` of
/// `experts` within the best `top_groups` of `groups` equal groups (of at least 2, for their
/// two-best scores), `scoring_func: sigmoid` with `topk_method: noaux_tc`. `Err` says what is
/// wrong, naming the config fields.
pub(crate) fn check_sigmoid_router(
    (experts, k): (usize, usize),
    (groups, top_groups): (usize, usize),
    (scoring_func, topk_method): (&str, &str),
) -> Result<(), String> {
    let (e, g, tg) = (experts, groups, top_groups);
    if k == 0 || k > e {
        return Err(format!(
            "num_experts_per_tok ({k}) must be between 1 and n_routed_experts ({e})"
        ));
    }
    if g == 0 || !e.is_multiple_of(g) || tg == 0 || tg > g || (g > 1 && e / g < 2) {
        return Err(format!(
            "n_group ({g}) must divide n_routed_experts ({e}) into groups of at least 2, \
             and topk_group ({tg}) be between 1 and n_group"
        ));
    }
    if g > 1 && tg * (e / g) < k {
        return Err(format!(
            "topk_group ({tg}) groups of {} experts hold fewer than num_experts_per_tok ({k})",
            e / g
        ));
    }
    if scoring_func != "sigmoid" || topk_method != "noaux_tc" {
        return Err(format!(
            "scoring_func `{scoring_func}` with topk_method `{topk_method}` is not supported \
             (only sigmoid with noaux_tc)"
        ));
    }
    Ok(())
}
