//! Qwen3-MoE (`model_type: qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B and their kin; and the
//! dense Qwen3 (`model_type: qwen3`: Qwen3-0.6B to 32B, the draft models of the MoE ones), the
//! same layers with every MLP dense.
//!
//! Pre-norm decoder. Each layer: grouped-query attention with per-head RMSNorm on q and k and
//! rotary embeddings, then a sparse MoE block (softmax router, top-k experts, optional
//! renormalisation of the chosen weights) or, for layers in `mlp_only_layers`, a dense SwiGLU.
//! Tensor names follow the Hugging Face checkpoints; experts are read from the mlx-community
//! stacked layout (`mlp.switch_mlp.*`), the official per-expert layout (`mlp.experts.{e}.*`), or
//! the fused layout transformers 5 uses in memory (`mlp.experts.gate_up_proj`, `down_proj`).

use std::sync::Arc;

use serde::Deserialize;
use sluice_backend::{AttentionSpec, Backend, ExpertSource, Rope};
use sluice_format::ModelDir;

use crate::decoder::{
    attention_caches, attention_values, moe_values, pass_values, Architecture, Decoder, Dims, Ends,
    StateDims,
};
use crate::loader::Loader;
use crate::moe::{Mlp, MoeDims, Routing};
use crate::{config_error, default_rope_theta, ModelError, Segment, State};

/// The fields of config.json this architecture reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// transformers >= 5 keeps `rope_theta` here.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// transformers >= 5 writes `num_local_experts`. None (dense Qwen3): every MLP is dense.
    #[serde(alias = "num_local_experts", default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
}

fn default_max_positions() -> usize {
    40960
}

fn one() -> usize {
    1
}

impl Qwen3MoeConfig {
    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    fn rope_theta(&self, dir: &ModelDir) -> Result<f64, ModelError> {
        default_rope_theta(
            dir,
            self.rope_theta,
            [&self.rope_scaling, &self.rope_parameters],
        )
    }

    fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    pub(crate) fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
        let err = |m: String| Err(config_error(dir, m));
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return err(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return err(format!(
                "head_dim {} must be even and positive",
                self.head_dim()
            ));
        }
        if self.num_experts > 0
            && (self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts)
        {
            return err(format!(
                "num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.use_sliding_window {
            return err("use_sliding_window = true is not supported yet".into());
        }
        if self.attention_bias {
            return err("attention_bias = true is not supported yet".into());
        }
        if (0..self.num_hidden_layers).any(|l| !self.is_sparse(l)) && self.intermediate_size == 0 {
            return err("dense layers need `intermediate_size`".into());
        }
        Ok(())
    }
}

struct Attention<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Vector,
    k_norm: B::Vector,
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct Qwen3Moe<B: Backend> {
    cfg: Qwen3MoeConfig,
    rope_theta: f32,
    decoder: Decoder<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Qwen3Moe<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        experts: Option<Arc<dyn ExpertSource>>,
    ) -> Result<Self, ModelError> {
        let cfg: Qwen3MoeConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let rope_theta = cfg.rope_theta(dir)? as f32;
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
            model_type: dir.model_type()?.into(),
            vocab_size: cfg.vocab_size,
            hidden_size: hidden,
            layers: cfg.num_hidden_layers,
            max_context: cfg.max_position_embeddings,
            experts: cfg.num_experts,
            experts_per_token: cfg.num_experts_per_tok,
            rms_norm_eps: cfg.rms_norm_eps as f32,
            state: state_dims(&cfg),
        };
        let decoder = Decoder::new(&ld, backend.clone(), dims, ends);
        Ok(Qwen3Moe {
            cfg,
            rope_theta,
            decoder,
            layers,
        })
    }
}

impl<B: Backend> Layer<B> {
    fn load(ld: &mut Loader<B>, cfg: &Qwen3MoeConfig, i: usize) -> Result<Self, ModelError> {
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        Ok(Layer {
            input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), hidden)?,
            self_attn: Attention {
                q_proj: ld.matrix(&format!("{a}.q_proj"), heads * hd, hidden)?,
                k_proj: ld.matrix(&format!("{a}.k_proj"), kv_heads * hd, hidden)?,
                v_proj: ld.matrix(&format!("{a}.v_proj"), kv_heads * hd, hidden)?,
                o_proj: ld.matrix(&format!("{a}.o_proj"), hidden, heads * hd)?,
                q_norm: ld.vector(&format!("{a}.q_norm.weight"), hd)?,
                k_norm: ld.vector(&format!("{a}.k_norm.weight"), hd)?,
            },
            post_attention_layernorm: ld
                .vector(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
            mlp: if cfg.is_sparse(i) {
                let dims = MoeDims {
                    experts: cfg.num_experts,
                    hidden,
                    inter: cfg.moe_intermediate_size,
                    shared: None,
                    routing: Routing::Softmax {
                        normalize: cfg.norm_topk_prob,
                    },
                };
                Mlp::sparse(ld, i, &format!("{p}.mlp"), &dims)?
            } else {
                Mlp::dense(ld, &format!("{p}.mlp"), hidden, cfg.intermediate_size)?
            },
        })
    }
}

impl<B: Backend> Qwen3Moe<B> {
    /// Grouped-query attention with RMS-normed q and k and full rotary embeddings; each
    /// segment's rows attend through its own cache of layer `i`.
    fn attention(
        &self,
        l: &Attention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let (hd, eps) = (self.cfg.head_dim(), self.decoder.eps());
        let [q, k, v] = b.matmuls(x, [&l.q_proj, &l.k_proj, &l.v_proj]);
        let scale = 1.0 / (hd as f32).sqrt();
        let (mut caches, rows) = attention_caches(segments, i)?;
        // q_norm and k_norm per head, rotary on the whole head, at each cache's next positions.
        let o = b.attention_rope_segments(
            &q,
            &k,
            &v,
            Some((&l.q_norm, &l.k_norm)),
            eps,
            Rope::new(hd, hd, self.rope_theta),
            &mut caches,
            &rows,
            AttentionSpec::new(self.cfg.num_attention_heads, scale),
        );
        Ok(b.matmul(&o, &l.o_proj))
    }
}

impl<B: Backend> Architecture<B> for Qwen3Moe<B> {
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
            let mlp = l
                .mlp
                .forward(b, &x, k, self.layers.get(i + 1).map(|n| &n.mlp))?;
            mlp_out = Some(mlp);
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
pub(crate) fn state_dims(cfg: &Qwen3MoeConfig) -> StateDims {
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
                0,
            )
            .max(3 * cfg.intermediate_size),
        ),
    }
}
