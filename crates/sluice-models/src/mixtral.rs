//! Mixtral (`model_type: mixtral`): Mixtral-8x7B, Mixtral-8x22B and their fine-tunes.
//!
//! Pre-norm decoder. Each layer: grouped-query attention with rotary embeddings (no q/k norm, no
//! biases), then a sparse MoE block (`block_sparse_moe`): a softmax over the router's top-k
//! logits weighs the chosen experts (the softmax of all logits renormalised over the top k, the
//! same numbers), no shared expert. Experts are read from the mlx-community stacked layout
//! (`block_sparse_moe.switch_mlp.*`) or the official per-expert layout
//! (`block_sparse_moe.experts.{e}.w1/w3/w2`: gate, up, down).

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
pub struct MixtralConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The width of each routed expert.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
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
    /// transformers' name; `num_experts` is accepted too.
    #[serde(alias = "num_experts")]
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "silu")]
    pub hidden_act: String,
}

fn default_eps() -> f64 {
    1e-5
}

fn default_max_positions() -> usize {
    32768
}

fn silu() -> String {
    "silu".into()
}

impl MixtralConfig {
    fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// As transformers: `head_dim` when the config sets it, else `hidden_size / heads`.
    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The longest context: a sliding window no shorter than the context changes nothing, and a
    /// shorter one caps the context at the window, where full attention still equals it.
    fn max_context(&self) -> usize {
        match self.sliding_window {
            Some(w) if w > 0 => self.max_position_embeddings.min(w),
            _ => self.max_position_embeddings,
        }
    }

    pub(crate) fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
        let err = |m: String| Err(config_error(dir, m));
        let (heads, kv_heads) = (self.num_attention_heads, self.kv_heads());
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
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_local_experts {
            return err(format!(
                "num_experts_per_tok ({}) must be between 1 and num_local_experts ({})",
                self.num_experts_per_tok, self.num_local_experts
            ));
        }
        if self.hidden_act != "silu" {
            return err(format!(
                "hidden_act `{}` is not supported (only `silu`)",
                self.hidden_act
            ));
        }
        Ok(())
    }
}

struct Attention<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    block_sparse_moe: Mlp<B>,
}

pub struct Mixtral<B: Backend> {
    cfg: MixtralConfig,
    rope_theta: f32,
    decoder: Decoder<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Mixtral<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        experts: Option<Arc<dyn ExpertSource>>,
    ) -> Result<Self, ModelError> {
        let cfg: MixtralConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let rope_theta = default_rope_theta(
            dir,
            cfg.rope_theta,
            [&cfg.rope_scaling, &cfg.rope_parameters],
        )? as f32;
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
            model_type: "mixtral".into(),
            vocab_size: cfg.vocab_size,
            hidden_size: hidden,
            layers: cfg.num_hidden_layers,
            max_context: cfg.max_context(),
            experts: cfg.num_local_experts,
            experts_per_token: cfg.num_experts_per_tok,
            rms_norm_eps: cfg.rms_norm_eps as f32,
            state: state_dims(&cfg),
        };
        let decoder = Decoder::new(&ld, backend.clone(), dims, ends);
        Ok(Mixtral {
            cfg,
            rope_theta,
            decoder,
            layers,
        })
    }
}

impl<B: Backend> Layer<B> {
    fn load(ld: &mut Loader<B>, cfg: &MixtralConfig, i: usize) -> Result<Self, ModelError> {
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.kv_heads());
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        // Checkpoints keep the block as `block_sparse_moe`; transformers 5 names it `mlp` in
        // memory, and a checkpoint written without converting back keeps that name.
        let moe = match ld.has(&format!("{p}.mlp.gate.weight")) {
            true => "mlp",
            false => "block_sparse_moe",
        };
        let dims = MoeDims {
            experts: cfg.num_local_experts,
            hidden,
            inter: cfg.intermediate_size,
            shared: None,
            routing: Routing::Softmax { normalize: true },
        };
        Ok(Layer {
            input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), hidden)?,
            self_attn: Attention {
                q_proj: ld.matrix(&format!("{a}.q_proj"), heads * hd, hidden)?,
                k_proj: ld.matrix(&format!("{a}.k_proj"), kv_heads * hd, hidden)?,
                v_proj: ld.matrix(&format!("{a}.v_proj"), kv_heads * hd, hidden)?,
                o_proj: ld.matrix(&format!("{a}.o_proj"), hidden, heads * hd)?,
            },
            post_attention_layernorm: ld
                .vector(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
            block_sparse_moe: Mlp::sparse(ld, i, &format!("{p}.{moe}"), &dims)?,
        })
    }
}

impl<B: Backend> Mixtral<B> {
    /// Grouped-query attention with full rotary embeddings and no q/k norms; each segment's rows
    /// attend through its own cache of layer `i`.
    fn attention(
        &self,
        l: &Attention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let hd = self.cfg.head_dim();
        let [q, k, v] = b.matmuls(x, [&l.q_proj, &l.k_proj, &l.v_proj]);
        let scale = 1.0 / (hd as f32).sqrt();
        let (mut caches, rows) = attention_caches(segments, i)?;
        let o = b.attention_rope_segments(
            &q,
            &k,
            &v,
            None,
            self.decoder.eps(),
            Rope::new(hd, hd, self.rope_theta),
            &mut caches,
            &rows,
            AttentionSpec::new(self.cfg.num_attention_heads, scale),
        );
        Ok(b.matmul(&o, &l.o_proj))
    }
}

impl<B: Backend> Architecture<B> for Mixtral<B> {
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
        // The previous layer's MoE output, added to `h` by the next norm (one fused step).
        let mut moe_out: Option<B::Act> = None;
        for (i, l) in self.layers.iter().enumerate() {
            let x = match moe_out.take() {
                Some(moe) => b.add_rms_norm(&mut h, &moe, &l.input_layernorm, eps),
                None => b.rms_norm(&h, &l.input_layernorm, eps),
            };
            let attn = self.attention(&l.self_attn, &x, i, segments)?;
            let x = b.add_rms_norm(&mut h, &attn, &l.post_attention_layernorm, eps);
            let next = self.layers.get(i + 1).map(|n| &n.block_sparse_moe);
            moe_out = Some(l.block_sparse_moe.forward(b, &x, k, next)?);
        }
        Ok(self.decoder.end_layers(h, moe_out, segments))
    }

    fn new_state(&self) -> Result<State<B>, ModelError> {
        let hd = self.cfg.head_dim();
        self.decoder
            .attention_only_state(self.layers.len(), self.cfg.kv_heads(), hd)
    }
}

/// What one request's state holds, from the config.
pub(crate) fn state_dims(cfg: &MixtralConfig) -> StateDims {
    StateDims {
        // Keys and values of every layer.
        kv_values_per_token: cfg.num_hidden_layers * 2 * cfg.kv_heads() * cfg.head_dim(),
        kv_head_dim: cfg.head_dim(),
        fixed_bytes: 0,
        pass_values_per_token: pass_values(
            cfg.hidden_size,
            attention_values(
                cfg.num_attention_heads,
                cfg.kv_heads(),
                cfg.head_dim(),
                false,
            ),
            moe_values(
                cfg.num_experts_per_tok,
                cfg.intermediate_size,
                cfg.hidden_size,
                0,
            ),
        ),
    }
}
