//! GLM-4.5 MoE (`model_type: glm4_moe`): GLM-4.5, GLM-4.5-Air, GLM-4.6.
//!
//! Pre-norm decoder. Each layer: grouped-query attention with biases on q, k and v, optional
//! per-head RMSNorm on q and k (`use_qk_norm`), and rotary embeddings on the first
//! `partial_rotary_factor` of each head; then, after `first_k_dense_replace` dense SwiGLU layers,
//! a sparse MoE block: DeepSeek-V3's sigmoid router (experts chosen by `sigmoid + bias` within the
//! best `topk_group` of `n_group` groups, weighted by their sigmoid, renormalised when
//! `norm_topk_prob`, times `routed_scaling_factor`) and ungated shared experts. Experts are read
//! from the mlx-community stacked layout (`mlp.switch_mlp.*`) or the official per-expert layout
//! (`mlp.experts.{e}.*`). The multi-token-prediction layer after the last is not run.

use std::sync::Arc;

use serde::Deserialize;
use sluice_backend::{AttentionSpec, Backend, ExpertSource, Rope, SigmoidRouting};
use sluice_format::ModelDir;

use crate::decoder::{
    attention_caches, attention_values, moe_values, pass_values, Architecture, Decoder, Dims, Ends,
    StateDims,
};
use crate::loader::Loader;
use crate::moe::{check_sigmoid_router, Mlp, MoeDims, Routing, SharedDims};
use crate::{config_error, default_rope_theta, ModelError, Segment, State};

/// The fields of config.json this architecture reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Glm4MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Of the leading dense layers.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// transformers >= 5 keeps `rope_theta` and `partial_rotary_factor` here.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    #[serde(default = "one")]
    pub n_group: usize,
    #[serde(default = "one")]
    pub topk_group: usize,
    #[serde(default = "one_f64")]
    pub routed_scaling_factor: f64,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default)]
    pub use_qk_norm: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "sigmoid")]
    pub scoring_func: String,
    #[serde(default = "noaux_tc")]
    pub topk_method: String,
}

fn default_max_positions() -> usize {
    131072
}

fn one() -> usize {
    1
}

fn one_f64() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn sigmoid() -> String {
    "sigmoid".into()
}

fn noaux_tc() -> String {
    "noaux_tc".into()
}

impl Glm4MoeConfig {
    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Rotary theta and the rotated part of each head (`int(head_dim * factor)`, as mlx-lm and
    /// transformers take it).
    fn rope(&self, dir: &ModelDir) -> Result<(f64, usize), ModelError> {
        let theta = default_rope_theta(
            dir,
            self.rope_theta,
            [&self.rope_scaling, &self.rope_parameters],
        )?;
        let factor = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(|f| f.as_f64())
            .or(self.partial_rotary_factor)
            .unwrap_or(0.5);
        let dims = (self.head_dim() as f64 * factor) as usize;
        if dims == 0 || dims > self.head_dim() || !dims.is_multiple_of(2) {
            return Err(config_error(
                dir,
                format!(
                    "partial_rotary_factor {factor} of head_dim {} gives {dims} rotated values; \
                     it must be even and between 2 and head_dim",
                    self.head_dim()
                ),
            ));
        }
        Ok((theta, dims))
    }

    fn is_sparse(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }

    fn routing(&self) -> SigmoidRouting {
        SigmoidRouting {
            groups: self.n_group,
            top_groups: self.topk_group,
            normalize: self.norm_topk_prob,
            scale: self.routed_scaling_factor as f32,
        }
    }

    pub(crate) fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
        let err = |m: String| Err(config_error(dir, m));
        let (heads, kv_heads) = (self.num_attention_heads, self.num_key_value_heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return err(format!(
                "num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})"
            ));
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return err(format!(
                "head_dim {} must be even and positive",
                self.head_dim()
            ));
        }
        check_sigmoid_router(
            (self.n_routed_experts, self.num_experts_per_tok),
            (self.n_group, self.topk_group),
            (&self.scoring_func, &self.topk_method),
        )
        .or_else(err)?;
        if self.first_k_dense_replace > 0 && self.intermediate_size == 0 {
            return err("dense layers need `intermediate_size`".into());
        }
        Ok(())
    }
}

struct Attention<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    /// `q_proj`, `k_proj`, `v_proj` biases when `attention_bias`.
    biases: Option<[B::Vector; 3]>,
    o_proj: B::Weight,
    /// `q_norm`, `k_norm` when `use_qk_norm`.
    norms: Option<(B::Vector, B::Vector)>,
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct Glm4Moe<B: Backend> {
    cfg: Glm4MoeConfig,
    rope_theta: f32,
    rotary_dim: usize,
    decoder: Decoder<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Glm4Moe<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        experts: Option<Arc<dyn ExpertSource>>,
    ) -> Result<Self, ModelError> {
        let cfg: Glm4MoeConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let (rope_theta, rotary_dim) = cfg.rope(dir)?;
        let hidden = cfg.hidden_size;
        let mut ld = Loader::new(dir, backend.as_ref(), experts);
        let embed_tokens = ld.embeddings("model.embed_tokens", cfg.vocab_size, hidden)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(&mut ld, &cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let ends = Ends {
            embed_tokens,
            norm: ld.vector("model.norm.weight", hidden)?,
            lm_head: match cfg.tie_word_embeddings {
                true => None,
                false => Some(ld.matrix("lm_head", cfg.vocab_size, hidden)?),
            },
        };
        let dims = Dims {
            model_type: "glm4_moe".into(),
            vocab_size: cfg.vocab_size,
            hidden_size: hidden,
            layers: cfg.num_hidden_layers,
            max_context: cfg.max_position_embeddings,
            experts: cfg.n_routed_experts,
            experts_per_token: cfg.num_experts_per_tok,
            rms_norm_eps: cfg.rms_norm_eps as f32,
            state: state_dims(&cfg),
        };
        let decoder = Decoder::new(&ld, backend.clone(), dims, ends);
        Ok(Glm4Moe {
            cfg,
            rope_theta: rope_theta as f32,
            rotary_dim,
            decoder,
            layers,
        })
    }
}

impl<B: Backend> Layer<B> {
    fn load(ld: &mut Loader<B>, cfg: &Glm4MoeConfig, i: usize) -> Result<Self, ModelError> {
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let biases = match cfg.attention_bias {
            true => Some([
                ld.vector(&format!("{a}.q_proj.bias"), heads * hd)?,
                ld.vector(&format!("{a}.k_proj.bias"), kv_heads * hd)?,
                ld.vector(&format!("{a}.v_proj.bias"), kv_heads * hd)?,
            ]),
            false => None,
        };
        let norms = match cfg.use_qk_norm {
            true => Some((
                ld.vector(&format!("{a}.q_norm.weight"), hd)?,
                ld.vector(&format!("{a}.k_norm.weight"), hd)?,
            )),
            false => None,
        };
        let mlp = format!("{p}.mlp");
        Ok(Layer {
            input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), hidden)?,
            self_attn: Attention {
                q_proj: ld.matrix(&format!("{a}.q_proj"), heads * hd, hidden)?,
                k_proj: ld.matrix(&format!("{a}.k_proj"), kv_heads * hd, hidden)?,
                v_proj: ld.matrix(&format!("{a}.v_proj"), kv_heads * hd, hidden)?,
                biases,
                o_proj: ld.matrix(&format!("{a}.o_proj"), hidden, heads * hd)?,
                norms,
            },
            post_attention_layernorm: ld
                .vector(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
            mlp: if cfg.is_sparse(i) {
                let dims = MoeDims {
                    experts: cfg.n_routed_experts,
                    hidden,
                    inter: cfg.moe_intermediate_size,
                    shared: cfg.n_shared_experts.filter(|&n| n > 0).map(|n| SharedDims {
                        name: "shared_experts",
                        inter: n * cfg.moe_intermediate_size,
                        gated: false,
                    }),
                    routing: Routing::Sigmoid(cfg.routing()),
                };
                Mlp::sparse(ld, i, &mlp, &dims)?
            } else {
                Mlp::dense(ld, &mlp, hidden, cfg.intermediate_size)?
            },
        })
    }
}

impl<B: Backend> Glm4Moe<B> {
    /// Grouped-query attention: biased q, k, v, optional q/k norms, partial rotary; each
    /// segment's rows attend through its own cache of layer `i`.
    fn attention(
        &self,
        l: &Attention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let hd = self.cfg.head_dim();
        let [mut q, mut k, mut v] = b.matmuls(x, [&l.q_proj, &l.k_proj, &l.v_proj]);
        if let Some([qb, kb, vb]) = &l.biases {
            b.add_bias(&mut q, qb);
            b.add_bias(&mut k, kb);
            b.add_bias(&mut v, vb);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let (mut caches, rows) = attention_caches(segments, i)?;
        let o = b.attention_rope_segments(
            &q,
            &k,
            &v,
            l.norms.as_ref().map(|(qn, kn)| (qn, kn)),
            self.decoder.eps(),
            Rope::new(hd, self.rotary_dim, self.rope_theta),
            &mut caches,
            &rows,
            AttentionSpec::new(self.cfg.num_attention_heads, scale),
        );
        Ok(b.matmul(&o, &l.o_proj))
    }
}

impl<B: Backend> Architecture<B> for Glm4Moe<B> {
    fn decoder(&self) -> &Decoder<B> {
        &self.decoder
    }

    fn decoder_mut(&mut self) -> &mut Decoder<B> {
        &mut self.decoder
    }

    /// The hidden states after the last layer, for the rows of every segment in order.
    fn layers(&self, segments: &mut [Segment<'_, B>]) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let (eps, k) = (self.decoder.eps(), self.decoder.experts_per_token());
        let mut h = self.decoder.embed(segments)?;
        // The previous layer's MLP output, added to `h` by the next norm (one fused step).
        let mut mlp_out: Option<B::Act> = None;
        for (i, l) in self.layers.iter().enumerate() {
            let x = match mlp_out.take() {
                Some(mlp) => b.add_rms_norm(&mut h, &mlp, &l.input_layernorm, eps),
                None => b.rms_norm(&h, &l.input_layernorm, eps),
            };
            let attn = self.attention(&l.self_attn, &x, i, segments)?;
            let x = b.add_rms_norm(&mut h, &attn, &l.post_attention_layernorm, eps);
            let next = self.layers.get(i + 1).map(|n| &n.mlp);
            mlp_out = Some(l.mlp.forward(b, &x, k, next)?);
        }
        Ok(self.decoder.end_layers(h, mlp_out, segments))
    }

    fn new_state(&self) -> Result<State<B>, ModelError> {
        let hd = self.cfg.head_dim();
        self.decoder
            .attention_only_state(self.layers.len(), self.cfg.num_key_value_heads, hd)
    }
}

/// What one request's state holds, from the config.
pub(crate) fn state_dims(cfg: &Glm4MoeConfig) -> StateDims {
    StateDims {
        // Keys and values of every layer.
        kv_values_per_token: cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim(),
        kv_head_dim: cfg.head_dim(),
        fixed_bytes: 0,
        pass_values_per_token: pass_values(
            cfg.hidden_size,
            attention_values(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim(),
                false,
            ),
            moe_values(
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.hidden_size,
                cfg.n_shared_experts.unwrap_or(0) * cfg.moe_intermediate_size,
            )
            .max(3 * cfg.intermediate_size),
        ),
    }
}
