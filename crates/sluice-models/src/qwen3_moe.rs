//! Qwen3-MoE (`model_type: qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B and their kin.
//!
//! Pre-norm decoder. Each layer: grouped-query attention with per-head RMSNorm on q and k and
//! rotary embeddings, then a sparse MoE block (softmax router, top-k experts, optional
//! renormalisation of the chosen weights) or, for layers in `mlp_only_layers`, a dense SwiGLU.
//! Tensor names follow the Hugging Face checkpoints; experts are read from the mlx-community
//! stacked layout (`mlp.switch_mlp.*`), the official per-expert layout (`mlp.experts.{e}.*`), or
//! the fused layout transformers 5 uses in memory (`mlp.experts.gate_up_proj`, `down_proj`).

use std::sync::Arc;

use serde::Deserialize;
use sluice_backend::{Backend, FfnWeights};
use sluice_format::ModelDir;
use sluice_store::ExpertStore;

use crate::{config_error, CausalLm, Experts, LayerState, Loader, ModelError, ModelInfo, State};

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
    /// transformers >= 5 writes `num_local_experts`.
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
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
        for scaling in [&self.rope_scaling, &self.rope_parameters]
            .into_iter()
            .flatten()
        {
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            if kind != "default" {
                return Err(config_error(
                    dir,
                    format!("rope scaling `{kind}` is not supported yet (only the default rotary embedding)"),
                ));
            }
        }
        let from_params = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(|t| t.as_f64());
        self.rope_theta
            .or(from_params)
            .ok_or_else(|| config_error(dir, "missing `rope_theta`"))
    }

    fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
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
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
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

enum Mlp<B: Backend> {
    Sparse {
        /// The router: `[num_experts, hidden]`.
        gate: B::Weight,
        experts: Experts<B>,
    },
    Dense(FfnWeights<B::Weight>),
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Vector,
    k_norm: B::Vector,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct Qwen3Moe<B: Backend> {
    backend: Arc<B>,
    cfg: Qwen3MoeConfig,
    info: ModelInfo,
    rope_theta: f32,
    embed_tokens: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Vector,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<B::Weight>,
}

impl<B: Backend> Qwen3Moe<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        store: Option<ExpertStore>,
    ) -> Result<Self, ModelError> {
        let cfg: Qwen3MoeConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let rope_theta = cfg.rope_theta(dir)? as f32;
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let mut ld = Loader::new(dir, backend.as_ref());
        ld.store = store;

        let embed_tokens = ld.matrix("model.embed_tokens", cfg.vocab_size, hidden)?;
        let embed_bytes = ld.bytes;
        let mut expert_bytes = 0;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = format!("{p}.self_attn");
            let input_layernorm = ld.vector(&format!("{p}.input_layernorm.weight"), hidden)?;
            let q_proj = ld.matrix(&format!("{attn}.q_proj"), heads * hd, hidden)?;
            let k_proj = ld.matrix(&format!("{attn}.k_proj"), kv_heads * hd, hidden)?;
            let v_proj = ld.matrix(&format!("{attn}.v_proj"), kv_heads * hd, hidden)?;
            let o_proj = ld.matrix(&format!("{attn}.o_proj"), hidden, heads * hd)?;
            let q_norm = ld.vector(&format!("{attn}.q_norm.weight"), hd)?;
            let k_norm = ld.vector(&format!("{attn}.k_norm.weight"), hd)?;
            let post_attention_layernorm =
                ld.vector(&format!("{p}.post_attention_layernorm.weight"), hidden)?;
            let mlp = if cfg.is_sparse(i) {
                let gate = ld.matrix(&format!("{p}.mlp.gate"), cfg.num_experts, hidden)?;
                let before = ld.bytes;
                let experts = ld.experts(
                    i,
                    &format!("{p}.mlp"),
                    cfg.num_experts,
                    hidden,
                    cfg.moe_intermediate_size,
                )?;
                expert_bytes += ld.bytes - before;
                Mlp::Sparse { gate, experts }
            } else {
                Mlp::Dense(ld.ffn(&format!("{p}.mlp"), hidden, cfg.intermediate_size)?)
            };
            layers.push(Layer {
                input_layernorm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm,
                k_norm,
                post_attention_layernorm,
                mlp,
            });
        }
        let norm = ld.vector("model.norm.weight", hidden)?;
        // Tied models use the embeddings even if a stray `lm_head` is stored, as mlx-lm and
        // transformers do.
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(ld.matrix("lm_head", cfg.vocab_size, hidden)?)
        };
        let info = ModelInfo {
            model_type: "qwen3_moe".into(),
            vocab_size: cfg.vocab_size,
            hidden_size: hidden,
            layers: cfg.num_hidden_layers,
            max_context: cfg.max_position_embeddings,
            experts: cfg.num_experts,
            experts_per_token: cfg.num_experts_per_tok,
            dense_bytes: ld.bytes - embed_bytes - expert_bytes,
            expert_bytes,
            weight_format: crate::describe_quant(dir),
        };
        Ok(Qwen3Moe {
            backend,
            cfg,
            info,
            rope_theta,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    fn attention(&self, l: &Layer<B>, x: &B::Act, cache: &mut B::KvCache) -> B::Act {
        let b = self.backend.as_ref();
        let (hd, eps) = (self.cfg.head_dim(), self.cfg.rms_norm_eps as f32);
        let position = b.kv_len(cache);
        let mut q = b.rms_norm(&b.matmul(x, &l.q_proj), &l.q_norm, eps);
        let mut k = b.rms_norm(&b.matmul(x, &l.k_proj), &l.k_norm, eps);
        let v = b.matmul(x, &l.v_proj);
        b.rope(&mut q, hd, hd, self.rope_theta, position);
        b.rope(&mut k, hd, hd, self.rope_theta, position);
        let scale = 1.0 / (hd as f32).sqrt();
        let o = b.attention(&q, &k, &v, cache, self.cfg.num_attention_heads, scale);
        b.matmul(&o, &l.o_proj)
    }

    fn mlp(&self, i: usize, x: &B::Act) -> Result<B::Act, ModelError> {
        let b = self.backend.as_ref();
        match &self.layers[i].mlp {
            Mlp::Sparse { gate, experts } => {
                let routing = b.route(
                    &b.matmul(x, gate),
                    self.info.experts_per_token,
                    self.cfg.norm_topk_prob,
                );
                experts.run(b, x, &routing, &mut || self.prefetch_after(i, x))
            }
            Mlp::Dense(ffn) => Ok(b.ffn(x, ffn)),
        }
    }

    /// Starts reading the next layer's likely experts: its router applied to this layer's input.
    fn prefetch_after(&self, i: usize, x: &B::Act) {
        if let Some(Mlp::Sparse { gate, experts }) = self.layers.get(i + 1).map(|l| &l.mlp) {
            let k = self.info.experts_per_token;
            experts.prefetch(self.backend.as_ref(), gate, x, k, self.cfg.norm_topk_prob);
        }
    }
}

impl<B: Backend> CausalLm<B> for Qwen3Moe<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> State<B> {
        let b = self.backend.as_ref();
        State {
            layers: (0..self.cfg.num_hidden_layers)
                .map(|_| {
                    LayerState::Attention(
                        b.kv_cache(self.cfg.num_key_value_heads, self.cfg.head_dim()),
                    )
                })
                .collect(),
            position: 0,
        }
    }

    fn forward(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<B::Act, ModelError> {
        let b = self.backend.as_ref();
        let eps = self.cfg.rms_norm_eps as f32;
        crate::check_tokens(tokens, state.position, &self.info)?;

        let mut h = b.embed(&self.embed_tokens, tokens);
        for (i, (l, layer_state)) in self.layers.iter().zip(&mut state.layers).enumerate() {
            let LayerState::Attention(cache) = layer_state else {
                return Err(ModelError::Input(
                    "state does not belong to this model".into(),
                ));
            };
            let x = b.rms_norm(&h, &l.input_layernorm, eps);
            let attn = self.attention(l, &x, cache);
            b.add_assign(&mut h, &attn);
            let x = b.rms_norm(&h, &l.post_attention_layernorm, eps);
            let mlp = self.mlp(i, &x)?;
            b.add_assign(&mut h, &mlp);
        }
        state.position += tokens.len();

        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(crate::output_logits(
            b, h, all_logits, &self.norm, eps, head,
        ))
    }

    fn set_experts_per_token(&mut self, k: usize) -> Result<(), ModelError> {
        crate::set_experts_per_token(&mut self.info, k)
    }

    fn backend(&self) -> &B {
        &self.backend
    }
}
