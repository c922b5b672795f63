//! gpt-oss (`model_type: gpt_oss`): OpenAI's gpt-oss-20b and gpt-oss-120b.
//!
//! Pre-norm decoder. Each layer: grouped-query attention with biases on q, k, v and o, YaRN
//! rotary embeddings over the whole head, a learned sink logit per head that joins the softmax,
//! and a sliding window of 128 positions on the layers `layer_types` marks
//! `sliding_attention` (every other one); then a sparse MoE block: a router with a bias, the
//! top k of its logits weighted by their softmax, experts with per-expert biases and a clamped
//! SwiGLU (`(clamp(up, ±limit) + 1) * g * sigmoid(1.702 g)`, `g = min(gate, limit)`), no shared
//! expert. Experts are read from the released layout (mxfp4 `experts.gate_up_proj_blocks`, gate
//! and up rows interleaved, and `experts.down_proj_blocks`, with `_bias` tensors) or mlx's
//! (`experts.{gate,up,down}_proj`, stacked, affine or mxfp4, with `.bias`).

use std::sync::Arc;

use serde::Deserialize;
use sluice_backend::{Activation, AttentionSpec, Backend, ExpertSource, Rope};
use sluice_format::ModelDir;

use crate::decoder::{
    attention_caches, attention_values, moe_values, pass_values, Architecture, Decoder, Dims, Ends,
    StateDims,
};
use crate::loader::Loader;
use crate::moe::{Mlp, MoeDims, Routing};
use crate::{config_error, yarn_rope_theta, ModelError, Segment, State};

/// The clamped SwiGLU's `alpha` (fixed in both references).
const SWIGLU_ALPHA: f32 = 1.702;

/// The fields of config.json this architecture reads.
#[derive(Debug, Clone, Deserialize)]
pub struct GptOssConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The width of each routed expert.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers >= 5 keeps `rope_theta` and the scaling here.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(alias = "num_experts")]
    pub num_local_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    /// The released config's other name for `num_experts_per_tok` (it writes both).
    #[serde(default)]
    pub experts_per_token: Option<usize>,
    #[serde(default = "default_window")]
    pub sliding_window: usize,
    /// `sliding_attention` or `full_attention` per layer; absent: alternating, sliding first.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "default_limit")]
    pub swiglu_limit: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_eps() -> f64 {
    1e-5
}

fn default_max_positions() -> usize {
    131072
}

fn default_window() -> usize {
    128
}

fn default_limit() -> f64 {
    7.0
}

impl GptOssConfig {
    /// Routed experts per token.
    pub fn experts_per_tok(&self) -> usize {
        self.num_experts_per_tok
            .or(self.experts_per_token)
            .unwrap_or(0)
    }

    /// Whether each layer attends through a sliding window.
    fn sliding(&self) -> Vec<bool> {
        match &self.layer_types {
            Some(t) => t.iter().map(|t| t == "sliding_attention").collect(),
            None => (0..self.num_hidden_layers).map(|i| i % 2 == 0).collect(),
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
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return err(format!(
                "head_dim {} must be even and positive",
                self.head_dim
            ));
        }
        let k = self.experts_per_tok();
        if k == 0 || k > self.num_local_experts {
            return err(format!(
                "num_experts_per_tok ({k}) must be between 1 and num_local_experts ({})",
                self.num_local_experts
            ));
        }
        if let Some(t) = &self.layer_types {
            if t.len() != self.num_hidden_layers {
                return err(format!(
                    "layer_types has {} entries for {} layers",
                    t.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = t
                .iter()
                .find(|t| !matches!(t.as_str(), "sliding_attention" | "full_attention"))
            {
                return err(format!(
                    "layer_types entry `{bad}` is not supported (sliding_attention or full_attention)"
                ));
            }
        }
        if self.sliding_window == 0 {
            return err("sliding_window must be positive".into());
        }
        if self.swiglu_limit.is_nan() || self.swiglu_limit <= 0.0 {
            return err(format!(
                "swiglu_limit {} must be positive",
                self.swiglu_limit
            ));
        }
        Ok(())
    }

    /// The rotary embedding (YaRN where configured) and the softmax scale: `1/sqrt(head_dim)`
    /// times the square of YaRN's attention factor, which both references apply to q and k
    /// (the rope's cos and sin) and so to their product.
    fn rope(&self, dir: &ModelDir) -> Result<(Rope, f32), ModelError> {
        let (theta, yarn) = yarn_rope_theta(
            dir,
            self.rope_theta,
            [&self.rope_scaling, &self.rope_parameters],
        )?;
        let mut scale = 1.0 / (self.head_dim as f64).sqrt();
        if let Some(y) = yarn {
            let explicit = [&self.rope_scaling, &self.rope_parameters]
                .into_iter()
                .flatten()
                .find_map(|s| s.get("attention_factor").and_then(|f| f.as_f64()));
            let factor = explicit
                .unwrap_or_else(|| y.temperature(y.mscale) / y.temperature(y.mscale_all_dim));
            scale *= factor * factor;
        }
        let rope = Rope {
            yarn: yarn.map(|y| y.yarn),
            ..Rope::new(self.head_dim, self.head_dim, theta as f32)
        };
        Ok((rope, scale as f32))
    }
}

struct Attention<B: Backend> {
    q_proj: (B::Weight, B::Vector),
    k_proj: (B::Weight, B::Vector),
    v_proj: (B::Weight, B::Vector),
    o_proj: (B::Weight, B::Vector),
    /// One logit per head.
    sinks: B::Vector,
    /// The sliding window, on the layers that have one.
    window: Option<usize>,
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct GptOss<B: Backend> {
    cfg: GptOssConfig,
    rope: Rope,
    scale: f32,
    decoder: Decoder<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> GptOss<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        experts: Option<Arc<dyn ExpertSource>>,
    ) -> Result<Self, ModelError> {
        let cfg: GptOssConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let (rope, scale) = cfg.rope(dir)?;
        let hidden = cfg.hidden_size;
        let mut ld = Loader::new(dir, backend.as_ref(), experts);
        let embed_tokens = ld.embeddings("model.embed_tokens", cfg.vocab_size, hidden)?;
        let sliding = cfg.sliding();
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(&mut ld, &cfg, i, sliding[i]))
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
            model_type: "gpt_oss".into(),
            vocab_size: cfg.vocab_size,
            hidden_size: hidden,
            layers: cfg.num_hidden_layers,
            max_context: cfg.max_position_embeddings,
            experts: cfg.num_local_experts,
            experts_per_token: cfg.experts_per_tok(),
            rms_norm_eps: cfg.rms_norm_eps as f32,
            state: state_dims(&cfg),
        };
        let decoder = Decoder::new(&ld, backend.clone(), dims, ends);
        Ok(GptOss {
            cfg,
            rope,
            scale,
            decoder,
            layers,
        })
    }
}

impl<B: Backend> Layer<B> {
    fn load(
        ld: &mut Loader<B>,
        cfg: &GptOssConfig,
        i: usize,
        sliding: bool,
    ) -> Result<Self, ModelError> {
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim);
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let mut linear = |name: &str, out: usize, inp: usize| -> Result<_, ModelError> {
            let m = format!("{a}.{name}");
            Ok((
                ld.matrix(&m, out, inp)?,
                ld.vector(&format!("{m}.bias"), out)?,
            ))
        };
        let self_attn = Attention {
            q_proj: linear("q_proj", heads * hd, hidden)?,
            k_proj: linear("k_proj", kv_heads * hd, hidden)?,
            v_proj: linear("v_proj", kv_heads * hd, hidden)?,
            o_proj: linear("o_proj", hidden, heads * hd)?,
            sinks: ld.vector(&format!("{a}.sinks"), heads)?,
            window: sliding.then_some(cfg.sliding_window),
        };
        let dims = MoeDims {
            experts: cfg.num_local_experts,
            hidden,
            inter: cfg.intermediate_size,
            shared: None,
            routing: Routing::Softmax { normalize: true },
        };
        let activation = Activation::ClampedSwiglu {
            alpha: SWIGLU_ALPHA,
            limit: cfg.swiglu_limit as f32,
        };
        Ok(Layer {
            input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), hidden)?,
            self_attn,
            post_attention_layernorm: ld
                .vector(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
            mlp: Mlp::gpt_oss(ld, i, &format!("{p}.mlp"), &dims, activation)?,
        })
    }
}

impl<B: Backend> GptOss<B> {
    /// Attention with biased projections, YaRN rotary embeddings, the layer's sinks and
    /// window; each segment's rows attend through its own cache of layer `i`.
    fn attention(
        &self,
        l: &Attention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let [mut q, mut k, mut v] = b.matmuls(x, [&l.q_proj.0, &l.k_proj.0, &l.v_proj.0]);
        b.add_bias(&mut q, &l.q_proj.1);
        b.add_bias(&mut k, &l.k_proj.1);
        b.add_bias(&mut v, &l.v_proj.1);
        let spec = AttentionSpec {
            window: l.window,
            sinks: Some(&l.sinks),
            ..AttentionSpec::new(self.cfg.num_attention_heads, self.scale)
        };
        let (mut caches, rows) = attention_caches(segments, i)?;
        let o = b.attention_rope_segments(
            &q,
            &k,
            &v,
            None,
            self.decoder.eps(),
            self.rope,
            &mut caches,
            &rows,
            spec,
        );
        let mut out = b.matmul(&o, &l.o_proj.0);
        b.add_bias(&mut out, &l.o_proj.1);
        Ok(out)
    }
}

impl<B: Backend> Architecture<B> for GptOss<B> {
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
            let next = self.layers.get(i + 1).map(|n| &n.mlp);
            moe_out = Some(l.mlp.forward(b, &x, k, next)?);
        }
        Ok(self.decoder.end_layers(h, moe_out, segments))
    }

    fn new_state(&self) -> Result<State<B>, ModelError> {
        self.decoder.attention_only_state(
            self.layers.len(),
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
        )
    }
}

/// What one request's state holds, from the config.
pub(crate) fn state_dims(cfg: &GptOssConfig) -> StateDims {
    StateDims {
        // Keys and values of every layer (the sliding layers keep every position too).
        kv_values_per_token: cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim,
        kv_head_dim: cfg.head_dim,
        fixed_bytes: 0,
        pass_values_per_token: pass_values(
            cfg.hidden_size,
            attention_values(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                false,
            ),
            moe_values(
                cfg.experts_per_tok(),
                cfg.intermediate_size,
                cfg.hidden_size,
                0,
            ),
        ),
    }
}
