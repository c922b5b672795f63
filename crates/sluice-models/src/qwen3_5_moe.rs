//! Qwen3.5-MoE (`model_type: qwen3_5_moe`): Qwen3.5-35B-A3B, Qwen3.5-122B-A10B and their kin; and
//! its forerunner Qwen3-Next (`qwen3_next`), the same network with a flat config and fused input
//! projections (`in_proj_qkvz`, `in_proj_ba`, grouped per key head); and the dense Qwen3.5
//! (`qwen3_5`: every MLP a dense SwiGLU; the small ones draft for the MoE models).
//!
//! Qwen3-Next's fused projections are de-interleaved into Qwen3.5's separate ones at load, so
//! both run the same forward pass.
//!
//! A hybrid pre-norm decoder. Most layers are Gated DeltaNet linear attention (a causal depthwise
//! conv over the q/k/v projection, then the gated delta rule with a fixed-size recurrent state,
//! then an RMSNorm gated by `silu(z)`); every `full_attention_interval`-th layer is gated softmax
//! attention (q/k RMSNorm, partial rotary embedding, output multiplied by `sigmoid(gate)` where
//! `gate` comes out of `q_proj` beside the query). Every layer ends in an MoE block: softmax
//! router and top-k experts plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! The checkpoints are vision-language; only the text model is read (vision tensors are never
//! touched). Two layouts are accepted and told apart by the conv weight's shape:
//! mlx-community (`language_model.model.*`, conv `[C, K, 1]`, norm weights already holding
//! `1 + w`) and the official Hugging Face layout (`model.language_model.*`, conv `[C, 1, K]`,
//! zero-centred norms applied as `1 + w`).

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use serde::Deserialize;
use sluice_backend::{
    AttentionSpec, Backend, DeltaNetDims, DeltaNetWeights, ExpertSource, Rope, ValueHeadOrder,
};
use sluice_format::ModelDir;

use crate::decoder::{
    attention_caches, attention_values, moe_values, pass_values, per_segment, wrong_state,
    Architecture, Decoder, Dims, Ends, StateDims,
};
use crate::loader::Loader;
use crate::moe::{Mlp, MoeDims, Routing, SharedDims};
use crate::{config_error, LayerState, ModelError, MultiTokenPredictor, Segment, State};

/// The fields of the text config this architecture reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen35MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    pub linear_num_value_heads: usize,
    pub linear_num_key_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    #[serde(default = "default_conv_kernel")]
    pub linear_conv_kernel_dim: usize,
    /// Per layer; else every `full_attention_interval`-th layer is full attention.
    #[serde(default)]
    pub layer_types: Option<Vec<LayerType>>,
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default)]
    pub intermediate_size: usize,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "yes")]
    pub attn_output_gate: bool,
    /// Qwen3-Next: layers with a dense MLP instead of the MoE block.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// Not a Hugging Face key: set for llama.cpp GGUF files, whose value heads are in
    /// [`ValueHeadOrder::Tiled`] order (every tensor of the linear attention permuted alike).
    #[serde(default)]
    pub linear_value_heads_tiled: bool,
}

/// The token mixer of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Gated DeltaNet.
    LinearAttention,
    /// Gated softmax attention.
    FullAttention,
}

fn one() -> usize {
    1
}

fn default_max_positions() -> usize {
    262144
}
fn default_conv_kernel() -> usize {
    4
}
fn default_interval() -> usize {
    4
}
fn yes() -> bool {
    true
}

impl Qwen35MoeConfig {
    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    fn layer_type(&self, layer: usize) -> LayerType {
        match &self.layer_types {
            Some(types) => types[layer],
            None if (layer + 1).is_multiple_of(self.full_attention_interval.max(1)) => {
                LayerType::FullAttention
            }
            None => LayerType::LinearAttention,
        }
    }

    fn is_sparse(&self, layer: usize) -> bool {
        self.num_experts > 0
            && !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    fn delta_dims(&self) -> DeltaNetDims {
        DeltaNetDims {
            key_heads: self.linear_num_key_heads,
            value_heads: self.linear_num_value_heads,
            key_dim: self.linear_key_head_dim,
            value_dim: self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
            value_order: if self.linear_value_heads_tiled {
                ValueHeadOrder::Tiled
            } else {
                ValueHeadOrder::Grouped
            },
        }
    }

    /// (theta, rotary dims) from `rope_parameters` or the flat fields.
    fn rope(&self, dir: &ModelDir) -> Result<(f64, usize), ModelError> {
        let p = self.rope_parameters.as_ref();
        let get = |k: &str| p.and_then(|p| p.get(k)).and_then(|v| v.as_f64());
        let kind = p
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        // M-RoPE with text alone gives every section the same position: plain 1-D rotary.
        if kind != "default" && kind != "mrope" {
            return Err(config_error(
                dir,
                format!(
                    "rope type `{kind}` is not supported yet (only the default rotary embedding)"
                ),
            ));
        }
        let theta = get("rope_theta").or(self.rope_theta).unwrap_or(1e7);
        let factor = get("partial_rotary_factor")
            .or(self.partial_rotary_factor)
            .unwrap_or(0.25);
        let dims = (self.head_dim() as f64 * factor).round() as usize;
        Ok((theta, dims))
    }

    pub(crate) fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
        let err = |m: String| Err(config_error(dir, m));
        let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
        if h == 0 || kv == 0 || !h.is_multiple_of(kv) {
            return err(format!(
                "num_attention_heads ({h}) must be a positive multiple of num_key_value_heads ({kv})"
            ));
        }
        let (lk, lv) = (self.linear_num_key_heads, self.linear_num_value_heads);
        if lk == 0 || lv == 0 || !lv.is_multiple_of(lk) {
            return err(format!(
                "linear_num_value_heads ({lv}) must be a positive multiple of linear_num_key_heads ({lk})"
            ));
        }
        if self.linear_conv_kernel_dim == 0 {
            return err("linear_conv_kernel_dim must be at least 1".into());
        }
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers {
                return err(format!(
                    "layer_types lists {} layers but num_hidden_layers is {}",
                    types.len(),
                    self.num_hidden_layers
                ));
            }
        }
        if self.num_experts > 0
            && (self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts)
        {
            return err(format!(
                "num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.attention_bias {
            return err("attention_bias = true is not supported yet".into());
        }
        if !self.attn_output_gate {
            return err("attn_output_gate = false is not supported yet".into());
        }
        Ok(())
    }
}

/// Gated DeltaNet: the q/k/v projection convolved over time, the gated delta rule, an RMSNorm
/// gated by `silu(z)`.
struct LinearAttention<B: Backend> {
    /// q, k and v (all key heads' q, then k, then v): `[conv_channels, hidden]`.
    in_proj_qkv: B::Weight,
    in_proj_z: B::Weight,
    in_proj_b: B::Weight,
    in_proj_a: B::Weight,
    /// `[channels, kernel]`.
    conv1d: B::Vector,
    dt_bias: B::Vector,
    a_log: B::Vector,
    norm: B::Vector,
    out_proj: B::Weight,
}

struct FullAttention<B: Backend> {
    /// Query and output gate, interleaved per head: `[heads * 2 * head_dim, hidden]`.
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Vector,
    k_norm: B::Vector,
}

enum Mixer<B: Backend> {
    Linear(LinearAttention<B>),
    Full(FullAttention<B>),
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    mixer: Mixer<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct Qwen35Moe<B: Backend> {
    cfg: Qwen35MoeConfig,
    rope_theta: f32,
    rotary_dim: usize,
    decoder: Decoder<B>,
    layers: Vec<Layer<B>>,
    /// Where the multi-token-prediction layer is, when the checkpoint has one: loaded on first
    /// use into `mtp` (an error kept as its message).
    mtp_source: Option<(ModelDir, Layout)>,
    mtp: OnceLock<Result<Mtp<B>, String>>,
}

/// The multi-token-prediction layer of the official checkpoints (`mtp.*`; mlx-community
/// conversions drop it): the token's embedding and the model's final hidden state, each
/// normed, concatenated and projected by `fc`, then one full-attention decoder layer and a
/// final norm, read by the model's own output head.
struct Mtp<B: Backend> {
    pre_fc_norm_embedding: B::Vector,
    pre_fc_norm_hidden: B::Vector,
    /// `fc` (`[hidden, 2 * hidden]`) split by input columns: the embedding's half and the hidden
    /// state's half, so that nothing is concatenated per row.
    fc_embedding: B::Weight,
    fc_hidden: B::Weight,
    layer: Layer<B>,
    norm: B::Vector,
    /// Bytes of its weights but the routed experts, and of those.
    dense_bytes: usize,
    expert_bytes: usize,
}

/// Where checkpoints keep the multi-token-prediction layer: the official layout at the root.
const MTP_PREFIXES: [&str; 2] = ["mtp", "language_model.mtp"];

/// Where `dir` keeps a multi-token-prediction layer, if it has one.
fn mtp_prefix(dir: &ModelDir) -> Option<&'static str> {
    MTP_PREFIXES
        .into_iter()
        .find(|p| dir.tensors.contains(&format!("{p}.fc.weight")))
}

impl<B: Backend> Mtp<B> {
    /// The layer under `p`. Its experts are always resident (a packed directory's expert store
    /// holds the model's layers only), and its bytes are not the model's: a token reads them
    /// only when drafting.
    fn load(
        dir: &ModelDir,
        p: &str,
        backend: &B,
        cfg: &Qwen35MoeConfig,
        layout: &Layout,
    ) -> Result<Self, ModelError> {
        let mut ld = Loader::new(dir, backend, None);
        let hidden = cfg.hidden_size;
        let shift = layout.norm_shift;
        let fc = ld.host_matrix(&format!("{p}.fc"), hidden, 2 * hidden)?;
        let split = |range| {
            fc.columns(range).ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "tensor `{p}.fc`: its halves do not start on a quantisation group ({})",
                    fc.format
                ))
            })
        };
        let (embedding_half, hidden_half) = (split(0..hidden)?, split(hidden..2 * hidden)?);
        let fc_embedding = ld.upload(&format!("{p}.fc"), embedding_half)?;
        let fc_hidden = ld.upload(&format!("{p}.fc"), hidden_half)?;
        let layer = Layer::load_at(
            &mut ld,
            cfg,
            layout,
            &format!("{p}.layers.0"),
            cfg.num_hidden_layers,
            LayerType::FullAttention,
            cfg.num_experts > 0,
        )?;
        let norm = |ld: &mut Loader<B>, name: &str| {
            ld.vector_plus(&format!("{p}.{name}.weight"), hidden, shift)
        };
        let pre_fc_norm_embedding = norm(&mut ld, "pre_fc_norm_embedding")?;
        let pre_fc_norm_hidden = norm(&mut ld, "pre_fc_norm_hidden")?;
        let final_norm = norm(&mut ld, "norm")?;
        Ok(Mtp {
            pre_fc_norm_embedding,
            pre_fc_norm_hidden,
            fc_embedding,
            fc_hidden,
            layer,
            norm: final_norm,
            dense_bytes: ld.counted().0,
            expert_bytes: ld.counted().1,
        })
    }
}

/// Where the text model's tensors live in each layout.
const TEXT_PREFIXES: [&str; 3] = ["language_model.model", "model.language_model", "model"];

/// How the checkpoint stores what differs between layouts.
#[derive(Clone, Copy)]
struct Layout {
    /// Prefix of the text model's tensors.
    root: &'static str,
    /// Added to RMSNorm weights: the official layout stores zero-centred norms (`w - 1`).
    norm_shift: f32,
}

impl Layout {
    fn find(dir: &ModelDir, cfg: &Qwen35MoeConfig) -> Result<Layout, ModelError> {
        let root = TEXT_PREFIXES
            .into_iter()
            .find(|p| dir.tensors.contains(&format!("{p}.embed_tokens.weight")))
            .ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "{}: no text-model embeddings found (looked for {})",
                    dir.path.display(),
                    TEXT_PREFIXES
                        .map(|p| format!("`{p}.embed_tokens.weight`"))
                        .join(", ")
                ))
            })?;
        // The official layout stores conv weights as [C, 1, K] (mlx: [C, K, 1]; a GGUF: [C, K],
        // its norms folded like mlx's), and zero-centred norms.
        let official = (0..cfg.num_hidden_layers)
            .filter(|&i| cfg.layer_type(i) == LayerType::LinearAttention)
            .map(|i| format!("{root}.layers.{i}.linear_attn.conv1d.weight"))
            .find_map(|n| dir.tensors.get(&n).ok())
            .is_some_and(|t| t.shape.len() == 3 && t.shape.last() != Some(&1));
        Ok(Layout {
            root,
            norm_shift: if official { 1.0 } else { 0.0 },
        })
    }
}

impl<B: Backend> Qwen35Moe<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        experts: Option<Arc<dyn ExpertSource>>,
    ) -> Result<Self, ModelError> {
        let cfg: Qwen35MoeConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let (rope_theta, rotary_dim) = cfg.rope(dir)?;
        let layout = Layout::find(dir, &cfg)?;
        let (root, hidden) = (layout.root, cfg.hidden_size);
        let mut ld = Loader::new(dir, backend.as_ref(), experts);
        let embed_tokens =
            ld.embeddings(&format!("{root}.embed_tokens"), cfg.vocab_size, hidden)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(&mut ld, &cfg, &layout, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = ld.vector_plus(&format!("{root}.norm.weight"), hidden, layout.norm_shift)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            let head = ["language_model.lm_head", "lm_head"]
                .into_iter()
                .find(|p| ld.has(&format!("{p}.weight")))
                .unwrap_or("lm_head");
            Some(ld.matrix(head, cfg.vocab_size, hidden)?)
        };
        let dims = Dims {
            model_type: dir.model_type()?.to_string(),
            vocab_size: cfg.vocab_size,
            hidden_size: hidden,
            layers: cfg.num_hidden_layers,
            max_context: cfg.max_position_embeddings,
            experts: cfg.num_experts,
            experts_per_token: cfg.num_experts_per_tok,
            rms_norm_eps: cfg.rms_norm_eps as f32,
            state: state_dims(&cfg),
        };
        let ends = Ends {
            embed_tokens,
            norm,
            lm_head,
        };
        let decoder = Decoder::new(&ld, backend.clone(), dims, ends);
        Ok(Qwen35Moe {
            cfg,
            rope_theta: rope_theta as f32,
            rotary_dim,
            decoder,
            layers,
            mtp_source: mtp_prefix(dir).map(|_| (dir.clone(), layout)),
            mtp: OnceLock::new(),
        })
    }
}

impl<B: Backend> Layer<B> {
    /// Decoder layer `i` of the model.
    fn load(
        ld: &mut Loader<B>,
        cfg: &Qwen35MoeConfig,
        layout: &Layout,
        i: usize,
    ) -> Result<Self, ModelError> {
        let p = format!("{}.layers.{i}", layout.root);
        Self::load_at(ld, cfg, layout, &p, i, cfg.layer_type(i), cfg.is_sparse(i))
    }

    /// The layer under `p`, of type `kind`, with the MoE block if `sparse` (its experts those of
    /// expert-source layer `i`).
    fn load_at(
        ld: &mut Loader<B>,
        cfg: &Qwen35MoeConfig,
        layout: &Layout,
        p: &str,
        i: usize,
        kind: LayerType,
        sparse: bool,
    ) -> Result<Self, ModelError> {
        let hidden = cfg.hidden_size;
        let shift = layout.norm_shift;
        let mixer = match kind {
            LayerType::LinearAttention => {
                Mixer::Linear(LinearAttention::load(ld, cfg, &format!("{p}.linear_attn"))?)
            }
            LayerType::FullAttention => Mixer::Full(FullAttention::load(
                ld,
                cfg,
                layout,
                &format!("{p}.self_attn"),
            )?),
        };
        let m = format!("{p}.mlp");
        Ok(Layer {
            input_layernorm: ld.vector_plus(
                &format!("{p}.input_layernorm.weight"),
                hidden,
                shift,
            )?,
            mixer,
            post_attention_layernorm: ld.vector_plus(
                &format!("{p}.post_attention_layernorm.weight"),
                hidden,
                shift,
            )?,
            mlp: if sparse {
                let dims = MoeDims {
                    experts: cfg.num_experts,
                    hidden,
                    inter: cfg.moe_intermediate_size,
                    shared: Some(SharedDims {
                        name: "shared_expert",
                        inter: cfg.shared_expert_intermediate_size,
                        gated: true,
                    }),
                    routing: Routing::Softmax {
                        normalize: cfg.norm_topk_prob,
                    },
                };
                Mlp::sparse(ld, i, &m, &dims)?
            } else {
                Mlp::dense(ld, &m, hidden, cfg.intermediate_size)?
            },
        })
    }
}

impl<B: Backend> LinearAttention<B> {
    fn load(ld: &mut Loader<B>, cfg: &Qwen35MoeConfig, a: &str) -> Result<Self, ModelError> {
        let d = cfg.delta_dims();
        let hidden = cfg.hidden_size;
        let channels = d.conv_channels();
        let (hv, value_width) = (d.value_heads, d.value_heads * d.value_dim);
        // Qwen3-Next fuses per key head: `in_proj_qkvz` rows are `[q | k | v (r heads) | z (r
        // heads)]` and `in_proj_ba` rows `[b (r) | a (r)]`, `r = value_heads / key_heads`;
        // gathered here into Qwen3.5's separate projections. Each pair is looked for on its own:
        // llama.cpp's GGUFs split q/k/v/z but keep b/a fused.
        let (dk, hk) = (d.key_dim, d.key_heads);
        let r = hv / hk;
        let part = |start: usize, len: usize, stride: usize| -> Vec<Range<usize>> {
            (0..hk)
                .map(|h| h * stride + start..h * stride + start + len)
                .collect()
        };
        let (in_proj_qkv, in_proj_z) = if ld.has(&format!("{a}.in_proj_qkvz.weight")) {
            let width = r * d.value_dim;
            let per_head = 2 * dk + 2 * width;
            let qkv: Vec<Range<usize>> = [
                part(0, dk, per_head),
                part(dk, dk, per_head),
                part(2 * dk, width, per_head),
            ]
            .concat();
            let qkvz = format!("{a}.in_proj_qkvz");
            let rows = channels + value_width;
            (
                ld.matrix_rows(&qkvz, rows, hidden, &qkv)?,
                ld.matrix_rows(&qkvz, rows, hidden, &part(2 * dk + width, width, per_head))?,
            )
        } else {
            (
                ld.matrix(&format!("{a}.in_proj_qkv"), channels, hidden)?,
                ld.matrix(&format!("{a}.in_proj_z"), value_width, hidden)?,
            )
        };
        let (in_proj_b, in_proj_a) = if ld.has(&format!("{a}.in_proj_ba.weight")) {
            let ba = format!("{a}.in_proj_ba");
            (
                ld.matrix_rows(&ba, 2 * hv, hidden, &part(0, r, 2 * r))?,
                ld.matrix_rows(&ba, 2 * hv, hidden, &part(r, r, 2 * r))?,
            )
        } else {
            (
                ld.matrix(&format!("{a}.in_proj_b"), hv, hidden)?,
                ld.matrix(&format!("{a}.in_proj_a"), hv, hidden)?,
            )
        };
        Ok(LinearAttention {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
            conv1d: ld.flat(&format!("{a}.conv1d.weight"), channels * d.conv_kernel)?,
            dt_bias: ld.vector(&format!("{a}.dt_bias"), hv)?,
            a_log: ld.vector(&format!("{a}.A_log"), hv)?,
            norm: ld.vector(&format!("{a}.norm.weight"), d.value_dim)?,
            out_proj: ld.matrix(&format!("{a}.out_proj"), hidden, value_width)?,
        })
    }
}

impl<B: Backend> FullAttention<B> {
    fn load(
        ld: &mut Loader<B>,
        cfg: &Qwen35MoeConfig,
        layout: &Layout,
        a: &str,
    ) -> Result<Self, ModelError> {
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        Ok(FullAttention {
            q_proj: ld.matrix(&format!("{a}.q_proj"), heads * hd * 2, hidden)?,
            k_proj: ld.matrix(&format!("{a}.k_proj"), kv_heads * hd, hidden)?,
            v_proj: ld.matrix(&format!("{a}.v_proj"), kv_heads * hd, hidden)?,
            o_proj: ld.matrix(&format!("{a}.o_proj"), hidden, heads * hd)?,
            q_norm: ld.vector_plus(&format!("{a}.q_norm.weight"), hd, layout.norm_shift)?,
            k_norm: ld.vector_plus(&format!("{a}.k_norm.weight"), hd, layout.norm_shift)?,
        })
    }
}

impl<B: Backend> Qwen35Moe<B> {
    /// The Gated DeltaNet mixer of layer `i`: the products over every row together, the
    /// convolution window and the recurrence per segment.
    fn linear_attention(
        &self,
        l: &LinearAttention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let [qkv, z, beta_logits, a] = b.matmuls(
            x,
            [&l.in_proj_qkv, &l.in_proj_z, &l.in_proj_b, &l.in_proj_a],
        );
        let weights = DeltaNetWeights {
            conv1d: &l.conv1d,
            a_log: &l.a_log,
            dt_bias: &l.dt_bias,
            norm: &l.norm,
            eps: self.decoder.eps(),
        };
        let y = per_segment(
            b,
            [&qkv, &z, &a, &beta_logits],
            segments,
            |[qkv, z, a, beta], s| {
                s.record(b, i, &[qkv, a, beta]);
                let LayerState::Linear(state) = &mut s.layers[i] else {
                    return Err(wrong_state());
                };
                Ok(b.gated_delta_net(qkv, z, a, beta, weights, state))
            },
        )?;
        Ok(b.matmul(&y, &l.out_proj))
    }

    /// Gated full attention of layer `i`; each segment's rows attend through its own cache.
    fn full_attention(
        &self,
        l: &FullAttention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let (hd, eps) = (self.cfg.head_dim(), self.decoder.eps());
        let [q_gate, k, v] = b.matmuls(x, [&l.q_proj, &l.k_proj, &l.v_proj]);
        let (q, gate) = b.split_chunks(&q_gate, 2 * hd, hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let (mut caches, rows) = attention_caches(segments, i)?;
        // q_norm and k_norm per head, partial rotary, at each cache's next positions.
        let mut o = b.attention_rope_segments(
            &q,
            &k,
            &v,
            Some((&l.q_norm, &l.k_norm)),
            eps,
            Rope::new(hd, self.rotary_dim, self.rope_theta),
            &mut caches,
            &rows,
            AttentionSpec::new(self.cfg.num_attention_heads, scale),
        );
        b.sigmoid_mul(&mut o, &gate);
        Ok(b.matmul(&o, &l.o_proj))
    }
}

impl<B: Backend> Architecture<B> for Qwen35Moe<B> {
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
            let mixed = match &l.mixer {
                Mixer::Linear(m) => self.linear_attention(m, &x, i, segments)?,
                Mixer::Full(m) => self.full_attention(m, &x, i, segments)?,
            };
            let x = b.add_rms_norm(&mut h, &mixed, &l.post_attention_layernorm, eps);
            let mlp = l
                .mlp
                .forward(b, &x, k, self.layers.get(i + 1).map(|n| &n.mlp))?;
            mlp_out = Some(mlp);
        }
        Ok(self.decoder.end_layers(h, mlp_out, segments))
    }

    fn new_state(&self) -> Result<State<B>, ModelError> {
        let b = self.decoder.backend();
        let dims = self.cfg.delta_dims();
        let (kv_heads, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim());
        let layers = self
            .layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Linear(_) => Ok(LayerState::Linear(b.linear_state(&dims)?)),
                Mixer::Full(_) => self.decoder.attention_state(kv_heads, hd),
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(State::new(layers, 0))
    }

    fn mtp(&self) -> Result<Option<&dyn MultiTokenPredictor<B>>, ModelError> {
        match self.mtp_layer() {
            None => Ok(None),
            Some(Ok(_)) => Ok(Some(self as &dyn MultiTokenPredictor<B>)),
            Some(Err(e)) => Err(ModelError::Unsupported(e.clone())),
        }
    }

    /// The convolution window and the recurrence of DeltaNet layer `layer` over the logged
    /// projections (`[qkv, a, beta]`, as `linear_attention` records them).
    fn replay_recurrent(&self, layer: usize, state: &mut B::LinearState, inputs: &[B::Act]) {
        let b = self.decoder.backend();
        if let (Mixer::Linear(l), [qkv, a, beta]) = (&self.layers[layer].mixer, inputs) {
            let qkv = b.causal_conv1d_silu(qkv, &l.conv1d, state);
            b.gated_delta_rule(&qkv, a, beta, &l.a_log, &l.dt_bias, state);
        }
    }
}

impl<B: Backend> Qwen35Moe<B> {
    /// The multi-token-prediction layer, loaded on first use; `None` without one.
    fn mtp_layer(&self) -> Option<&Result<Mtp<B>, String>> {
        let (dir, layout) = self.mtp_source.as_ref()?;
        Some(self.mtp.get_or_init(|| {
            let p = mtp_prefix(dir).expect("checked at load");
            Mtp::load(dir, p, self.decoder.backend(), &self.cfg, layout).map_err(|e| {
                format!(
                    "{}: the multi-token-prediction layer: {e}",
                    dir.path.display()
                )
            })
        }))
    }
}

impl<B: Backend> MultiTokenPredictor<B> for Qwen35Moe<B> {
    fn new_state(&self) -> Result<State<B>, ModelError> {
        let (kv_heads, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim());
        self.decoder.attention_only_state(1, kv_heads, hd)
    }

    fn forward(
        &self,
        state: &mut State<B>,
        hidden: &B::Act,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<(B::Act, B::Act), ModelError> {
        let Some(Ok(mtp)) = self.mtp_layer() else {
            return Err(ModelError::Unsupported(
                "this checkpoint has no multi-token-prediction layer".into(),
            ));
        };
        let b = self.decoder.backend();
        let (eps, k) = (self.decoder.eps(), self.decoder.experts_per_token());
        let n = tokens.len();
        let max = self.decoder.info().max_context;
        if n == 0 || b.shape(hidden) != (n, self.cfg.hidden_size) {
            return Err(ModelError::Input(format!(
                "the MTP layer takes one hidden state of {} values per token: got {:?} for {n} \
                 tokens",
                self.cfg.hidden_size,
                b.shape(hidden)
            )));
        }
        if state.layers.len() != 1 || !state.can_rewind() {
            return Err(wrong_state());
        }
        if state.position + n > max {
            return Err(ModelError::Input(format!(
                "{} positions exceed the model's context of {max}",
                state.position + n
            )));
        }
        let embedded = self.decoder.embed_tokens(tokens)?;
        let e = b.rms_norm(&embedded, &mtp.pre_fc_norm_embedding, eps);
        let g = b.rms_norm(hidden, &mtp.pre_fc_norm_hidden, eps);
        let mut h = b.matmul(&e, &mtp.fc_embedding);
        b.add_assign(&mut h, &b.matmul(&g, &mtp.fc_hidden));
        let l = &mtp.layer;
        let Mixer::Full(attention) = &l.mixer else {
            unreachable!("the MTP layer is loaded as full attention");
        };
        let x = b.rms_norm(&h, &l.input_layernorm, eps);
        let mixed = self.full_attention(attention, &x, 0, &mut [Segment { state, tokens }])?;
        let x = b.add_rms_norm(&mut h, &mixed, &l.post_attention_layernorm, eps);
        let mlp = l.mlp.forward(b, &x, k, None)?;
        b.add_assign(&mut h, &mlp);
        state.position += n;
        let out = b.rms_norm(&h, &mtp.norm, eps);
        let last = match all_logits {
            true => b.slice_rows(&out, 0, n),
            false => b.slice_rows(&out, n - 1, 1),
        };
        let logits = self.decoder.head(last, true);
        Ok((logits, out))
    }

    fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }

    fn weight_bytes(&self) -> usize {
        let k = self.decoder.experts_per_token();
        self.mtp_layer()
            .and_then(|m| m.as_ref().ok())
            .map_or(0, |m| {
                m.dense_bytes + m.expert_bytes * k / self.cfg.num_experts.max(1)
            })
    }
}

/// What one request's state holds, from the config.
pub(crate) fn state_dims(cfg: &Qwen35MoeConfig) -> StateDims {
    let full_layers = (0..cfg.num_hidden_layers)
        .filter(|&i| cfg.layer_type(i) == LayerType::FullAttention)
        .count();
    let delta = cfg.delta_dims();
    StateDims {
        // Keys and values of the full-attention layers; each DeltaNet layer's recurrent
        // state and convolution window.
        kv_values_per_token: full_layers * 2 * cfg.num_key_value_heads * cfg.head_dim(),
        kv_head_dim: cfg.head_dim(),
        fixed_bytes: (cfg.num_hidden_layers - full_layers)
            * (delta.value_heads * delta.key_dim * delta.value_dim
                + delta.conv_channels() * delta.conv_kernel.saturating_sub(1))
            * 4,
        pass_values_per_token: pass_values(
            cfg.hidden_size,
            // Gated attention, or the DeltaNet's projections in and out of its convolution, its
            // output gate and output.
            attention_values(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim(),
                true,
            )
            .max(2 * delta.conv_channels() + 3 * delta.value_heads * delta.value_dim),
            moe_values(
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.hidden_size,
                cfg.shared_expert_intermediate_size,
            ),
        ),
    }
}
