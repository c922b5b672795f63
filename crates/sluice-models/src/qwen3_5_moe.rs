//! Qwen3.5-MoE (`model_type: qwen3_5_moe`): Qwen3.5-35B-A3B, Qwen3.5-122B-A10B and their kin; and
//! its forerunner Qwen3-Next (`qwen3_next`), the same network with a flat config and fused input
//! projections (`in_proj_qkvz`, `in_proj_ba`, grouped per key head).
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

use std::sync::Arc;

use serde::Deserialize;
use sluice_backend::{Backend, DeltaNetDims, FfnWeights};
use sluice_format::ModelDir;
use sluice_store::ExpertStore;

use crate::{config_error, CausalLm, Experts, LayerState, Loader, ModelError, ModelInfo, State};

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
    /// `"linear_attention"` or `"full_attention"` per layer; else from the interval.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
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

    fn is_linear(&self, layer: usize) -> bool {
        match &self.layer_types {
            Some(types) => types[layer] == "linear_attention",
            None => !(layer + 1).is_multiple_of(self.full_attention_interval.max(1)),
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

    fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
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
            if let Some(t) = types
                .iter()
                .find(|t| *t != "linear_attention" && *t != "full_attention")
            {
                return err(format!("unknown layer type `{t}` in layer_types"));
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

enum InProj<B: Backend> {
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Separate {
        qkv: B::Weight,
        z: B::Weight,
        b: B::Weight,
        a: B::Weight,
    },
    /// Qwen3-Next: per key head, `in_proj_qkvz` rows are `[q | k | v (r heads) | z (r heads)]`
    /// and `in_proj_ba` rows `[b (r) | a (r)]`, with `r = value_heads / key_heads`.
    Fused { qkvz: B::Weight, ba: B::Weight },
}

struct LinearAttention<B: Backend> {
    in_proj: InProj<B>,
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

enum Mlp<B: Backend> {
    Sparse {
        gate: B::Weight,
        experts: Experts<B>,
        shared_expert: FfnWeights<B::Weight>,
        /// `[1, hidden]`.
        shared_expert_gate: B::Weight,
    },
    Dense(FfnWeights<B::Weight>),
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    mixer: Mixer<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct Qwen35Moe<B: Backend> {
    backend: Arc<B>,
    cfg: Qwen35MoeConfig,
    info: ModelInfo,
    rope_theta: f32,
    rotary_dim: usize,
    embed_tokens: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Vector,
    lm_head: Option<B::Weight>,
}

/// Where the text model's tensors live in each layout.
const TEXT_PREFIXES: [&str; 3] = ["language_model.model", "model.language_model", "model"];

impl<B: Backend> Qwen35Moe<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        store: Option<ExpertStore>,
    ) -> Result<Self, ModelError> {
        let cfg: Qwen35MoeConfig = dir.parse_config()?;
        cfg.check(dir)?;
        let (rope_theta, rotary_dim) = cfg.rope(dir)?;
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let dims = cfg.delta_dims();
        let mut ld = Loader::new(dir, backend.as_ref());
        ld.store = store;

        let root = TEXT_PREFIXES
            .into_iter()
            .find(|p| ld.has(&format!("{p}.embed_tokens.weight")))
            .ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "{}: no text-model embeddings found (looked for {})",
                    dir.path.display(),
                    TEXT_PREFIXES
                        .map(|p| format!("`{p}.embed_tokens.weight`"))
                        .join(", ")
                ))
            })?;
        // The official layout stores conv weights as [C, 1, K] and zero-centred norms.
        let official = (0..cfg.num_hidden_layers)
            .filter(|&i| cfg.is_linear(i))
            .map(|i| format!("{root}.layers.{i}.linear_attn.conv1d.weight"))
            .find_map(|n| dir.tensors.get(&n).ok())
            .is_some_and(|t| t.shape.last() != Some(&1));
        let norm_shift = if official { 1.0 } else { 0.0 };
        let norm =
            |ld: &mut Loader<B>, name: &str, len: usize| ld.vector_plus(name, len, norm_shift);

        let embed_tokens = ld.matrix(&format!("{root}.embed_tokens"), cfg.vocab_size, hidden)?;
        let embed_bytes = ld.bytes;
        let mut expert_bytes = 0;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("{root}.layers.{i}");
            let input_layernorm = norm(&mut ld, &format!("{p}.input_layernorm.weight"), hidden)?;
            let mixer = if cfg.is_linear(i) {
                let a = format!("{p}.linear_attn");
                let channels = dims.conv_channels();
                let value_width = dims.value_heads * dims.value_dim;
                let conv_name = format!("{a}.conv1d.weight");
                let (conv, shape) = dir.tensors.to_f32(&conv_name)?;
                if conv.len() != channels * dims.conv_kernel {
                    return Err(ModelError::Unsupported(format!(
                        "tensor `{conv_name}` has shape {shape:?}, expected {channels} channels x {} taps",
                        dims.conv_kernel
                    )));
                }
                let hv = dims.value_heads;
                let in_proj = if ld.has(&format!("{a}.in_proj_qkvz.weight")) {
                    InProj::Fused {
                        qkvz: ld.matrix(
                            &format!("{a}.in_proj_qkvz"),
                            channels + value_width,
                            hidden,
                        )?,
                        ba: ld.matrix(&format!("{a}.in_proj_ba"), 2 * hv, hidden)?,
                    }
                } else {
                    InProj::Separate {
                        qkv: ld.matrix(&format!("{a}.in_proj_qkv"), channels, hidden)?,
                        z: ld.matrix(&format!("{a}.in_proj_z"), value_width, hidden)?,
                        b: ld.matrix(&format!("{a}.in_proj_b"), hv, hidden)?,
                        a: ld.matrix(&format!("{a}.in_proj_a"), hv, hidden)?,
                    }
                };
                Mixer::Linear(LinearAttention {
                    in_proj,
                    conv1d: backend.vector(&conv),
                    dt_bias: ld.vector(&format!("{a}.dt_bias"), dims.value_heads)?,
                    a_log: ld.vector(&format!("{a}.A_log"), dims.value_heads)?,
                    norm: ld.vector(&format!("{a}.norm.weight"), dims.value_dim)?,
                    out_proj: ld.matrix(&format!("{a}.out_proj"), hidden, value_width)?,
                })
            } else {
                let a = format!("{p}.self_attn");
                Mixer::Full(FullAttention {
                    q_proj: ld.matrix(&format!("{a}.q_proj"), heads * hd * 2, hidden)?,
                    k_proj: ld.matrix(&format!("{a}.k_proj"), kv_heads * hd, hidden)?,
                    v_proj: ld.matrix(&format!("{a}.v_proj"), kv_heads * hd, hidden)?,
                    o_proj: ld.matrix(&format!("{a}.o_proj"), hidden, heads * hd)?,
                    q_norm: norm(&mut ld, &format!("{a}.q_norm.weight"), hd)?,
                    k_norm: norm(&mut ld, &format!("{a}.k_norm.weight"), hd)?,
                })
            };
            let post_attention_layernorm = norm(
                &mut ld,
                &format!("{p}.post_attention_layernorm.weight"),
                hidden,
            )?;
            let m = format!("{p}.mlp");
            let mlp = if cfg.is_sparse(i) {
                let gate = ld.matrix(&format!("{m}.gate"), cfg.num_experts, hidden)?;
                let before = ld.bytes;
                let experts =
                    ld.experts(i, &m, cfg.num_experts, hidden, cfg.moe_intermediate_size)?;
                expert_bytes += ld.bytes - before;
                Mlp::Sparse {
                    gate,
                    experts,
                    shared_expert: ld.ffn(
                        &format!("{m}.shared_expert"),
                        hidden,
                        cfg.shared_expert_intermediate_size,
                    )?,
                    shared_expert_gate: ld.matrix(&format!("{m}.shared_expert_gate"), 1, hidden)?,
                }
            } else {
                Mlp::Dense(ld.ffn(&m, hidden, cfg.intermediate_size)?)
            };
            layers.push(Layer {
                input_layernorm,
                mixer,
                post_attention_layernorm,
                mlp,
            });
        }
        let final_norm = norm(&mut ld, &format!("{root}.norm.weight"), hidden)?;
        // Tied models use the embeddings even if a stray `lm_head` is stored, as mlx-lm and
        // transformers do.
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            let head = ["language_model.lm_head", "lm_head"]
                .into_iter()
                .find(|p| ld.has(&format!("{p}.weight")))
                .unwrap_or("lm_head");
            Some(ld.matrix(head, cfg.vocab_size, hidden)?)
        };
        let info = ModelInfo {
            model_type: dir.model_type()?.to_string(),
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
        Ok(Qwen35Moe {
            backend,
            cfg,
            info,
            rope_theta: rope_theta as f32,
            rotary_dim,
            embed_tokens,
            layers,
            norm: final_norm,
            lm_head,
        })
    }

    fn linear_attention(
        &self,
        l: &LinearAttention<B>,
        x: &B::Act,
        state: &mut B::LinearState,
    ) -> B::Act {
        let b = self.backend.as_ref();
        let (qkv, z, beta_logits, a) = match &l.in_proj {
            InProj::Separate { qkv, z, b: wb, a } => (
                b.matmul(x, qkv),
                b.matmul(x, z),
                b.matmul(x, wb),
                b.matmul(x, a),
            ),
            InProj::Fused { qkvz, ba } => {
                let d = self.cfg.delta_dims();
                // Per key head: dk of q, dk of k, then `width` of v and of z.
                let (dk, width) = (d.key_dim, d.value_heads / d.key_heads * d.value_dim);
                let (qk, vz) = b.split_chunks(&b.matmul(x, qkvz), 2 * dk + 2 * width, 2 * dk);
                let (q, k) = b.split_chunks(&qk, 2 * dk, dk);
                let (v, z) = b.split_chunks(&vz, 2 * width, width);
                let r = d.value_heads / d.key_heads;
                let (beta_logits, a) = b.split_chunks(&b.matmul(x, ba), 2 * r, r);
                (b.concat_cols(&[&q, &k, &v]), z, beta_logits, a)
            }
        };
        let qkv = b.causal_conv1d_silu(&qkv, &l.conv1d, state);
        let y = b.gated_delta_rule(&qkv, &a, &beta_logits, &l.a_log, &l.dt_bias, state);
        let y = b.rms_norm_gated(&y, &z, &l.norm, self.cfg.rms_norm_eps as f32);
        b.matmul(&y, &l.out_proj)
    }

    fn full_attention(&self, l: &FullAttention<B>, x: &B::Act, cache: &mut B::KvCache) -> B::Act {
        let b = self.backend.as_ref();
        let (hd, eps) = (self.cfg.head_dim(), self.cfg.rms_norm_eps as f32);
        let position = b.kv_len(cache);
        let (q, gate) = b.split_chunks(&b.matmul(x, &l.q_proj), 2 * hd, hd);
        let mut q = b.rms_norm(&q, &l.q_norm, eps);
        let mut k = b.rms_norm(&b.matmul(x, &l.k_proj), &l.k_norm, eps);
        let v = b.matmul(x, &l.v_proj);
        b.rope(&mut q, hd, self.rotary_dim, self.rope_theta, position);
        b.rope(&mut k, hd, self.rotary_dim, self.rope_theta, position);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o = b.attention(&q, &k, &v, cache, self.cfg.num_attention_heads, scale);
        b.sigmoid_mul(&mut o, &gate);
        b.matmul(&o, &l.o_proj)
    }

    fn mlp(&self, i: usize, x: &B::Act) -> Result<B::Act, ModelError> {
        let b = self.backend.as_ref();
        match &self.layers[i].mlp {
            Mlp::Sparse {
                gate,
                experts,
                shared_expert,
                shared_expert_gate,
            } => {
                let routing = b.route(
                    &b.matmul(x, gate),
                    self.info.experts_per_token,
                    self.cfg.norm_topk_prob,
                );
                let mut y = experts.run(b, x, &routing, &mut || self.prefetch_after(i, x))?;
                let mut shared = b.ffn(x, shared_expert);
                b.sigmoid_mul(&mut shared, &b.matmul(x, shared_expert_gate));
                b.add_assign(&mut y, &shared);
                Ok(y)
            }
            Mlp::Dense(ffn) => Ok(b.ffn(x, ffn)),
        }
    }

    /// Starts reading the next layer's likely experts: its router applied to this layer's input.
    fn prefetch_after(&self, i: usize, x: &B::Act) {
        if let Some(Mlp::Sparse { gate, experts, .. }) = self.layers.get(i + 1).map(|l| &l.mlp) {
            let k = self.info.experts_per_token;
            experts.prefetch(self.backend.as_ref(), gate, x, k, self.cfg.norm_topk_prob);
        }
    }
}

impl<B: Backend> CausalLm<B> for Qwen35Moe<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> State<B> {
        let b = self.backend.as_ref();
        let dims = self.cfg.delta_dims();
        State {
            layers: self
                .layers
                .iter()
                .map(|l| match l.mixer {
                    Mixer::Linear(_) => LayerState::Linear(b.linear_state(&dims)),
                    Mixer::Full(_) => LayerState::Attention(
                        b.kv_cache(self.cfg.num_key_value_heads, self.cfg.head_dim()),
                    ),
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
            let x = b.rms_norm(&h, &l.input_layernorm, eps);
            let mixed = match (&l.mixer, layer_state) {
                (Mixer::Linear(m), LayerState::Linear(s)) => self.linear_attention(m, &x, s),
                (Mixer::Full(m), LayerState::Attention(c)) => self.full_attention(m, &x, c),
                _ => {
                    return Err(ModelError::Input(
                        "state does not belong to this model".into(),
                    ))
                }
            };
            b.add_assign(&mut h, &mixed);
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
