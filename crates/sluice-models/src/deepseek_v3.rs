//! DeepSeek-V3 (`model_type: deepseek_v3`: DeepSeek-V3, V3.1, R1) and Kimi K2 (`kimi_k2`, the
//! same architecture).
//!
//! Pre-norm decoder. Each layer: Multi-head Latent Attention, then, after
//! `first_k_dense_replace` dense SwiGLU layers, a sparse MoE block with the `noaux_tc` sigmoid
//! router (experts chosen by `sigmoid + bias` within the best `topk_group` of `n_group` groups,
//! weighted by their sigmoid, renormalised when `norm_topk_prob`, times `routed_scaling_factor`)
//! and ungated shared experts. The multi-token-prediction layer after the last is not run.
//!
//! **Multi-head Latent Attention.** Queries come through a low-rank pair (`q_a_proj`,
//! `q_a_layernorm`, `q_b_proj`) or `q_proj`; each head has `qk_nope_head_dim` values without
//! position and `qk_rope_head_dim` rotated ones. Keys and values come from one compressed latent
//! per token (`kv_a_proj_with_mqa`: `kv_lora_rank` latent values, normalised by
//! `kv_a_layernorm`, and one rotated key part shared by every head); `kv_b_proj` expands the
//! latent into each head's key and value. Here the expansion is absorbed, for prefill and decode
//! alike: each head's query is taken into latent space (`embed_q`, the key half of `kv_b_proj`
//! transposed), attention runs with ONE key head of `[rotated part, latent]` (576 values for
//! DeepSeek-V3) over the compressed cache, and each head's output leaves latent space through
//! `unembed_out` (the value half of `kv_b_proj`) before `o_proj`. The cache holds the latent and
//! the rotated key per token, not 128 heads of keys and values.
//!
//! The rotary embedding is the interleaved (GPT-J) form with YaRN frequencies. The rotated parts of
//! q and k meet only in their dot product, so their rows of `q_b_proj` and `kv_a_proj_with_mqa` are
//! permuted once at load into the rotate-half order the backends compute: the same scores.
//!
//! Weights come in the official layout (`kv_b_proj`, per-expert `mlp.experts.{e}`) or mlx-lm's
//! (`embed_q` / `unembed_out`, stacked `mlp.switch_mlp`).

use std::ops::Range;
use std::sync::Arc;

use serde::Deserialize;
use sluice_backend::{
    AttentionSpec, Backend, Dtype, ExpertSource, HostBytes, HostMatrix, Rope, SigmoidRouting,
    WeightFormat,
};
use sluice_format::ModelDir;

use crate::decoder::{
    attention_caches, moe_values, pass_values, Architecture, Decoder, Dims, Ends, StateDims,
};
use crate::loader::Loader;
use crate::moe::{check_sigmoid_router, Mlp, MoeDims, Routing, SharedDims};
use crate::{config_error, yarn_rope_theta, ModelError, Segment, State};

/// The fields of config.json this architecture reads.
#[derive(Debug, Clone, Deserialize)]
pub struct DeepseekV3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Of the leading dense layers.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// `None`: queries come from `q_proj` directly.
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers >= 5 keeps `rope_theta` and the scaling here.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// transformers' switch for the interleaved rotary form (DeepSeek's own); mlx-lm always
    /// interleaves.
    #[serde(default = "yes")]
    pub rope_interleave: bool,
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
    #[serde(default = "one")]
    pub moe_layer_freq: usize,
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
    163840
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

impl DeepseekV3Config {
    /// A query head: the part without position, then the rotated part.
    fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The one key head of the absorbed attention: the rotated part, then the latent.
    fn latent_head_dim(&self) -> usize {
        self.qk_rope_head_dim + self.kv_lora_rank
    }

    fn is_sparse(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    fn routing(&self) -> SigmoidRouting {
        SigmoidRouting {
            groups: self.n_group,
            top_groups: self.topk_group,
            normalize: self.norm_topk_prob,
            scale: self.routed_scaling_factor as f32,
        }
    }

    /// The rotary embedding of the absorbed key head and the softmax scale (YaRN's
    /// `mscale_all_dim` temperature squared on `1/sqrt(q_head_dim)`, as both references apply it).
    fn rope(&self, dir: &ModelDir) -> Result<(Rope, f32), ModelError> {
        let (theta, yarn) = yarn_rope_theta(
            dir,
            self.rope_theta,
            [&self.rope_scaling, &self.rope_parameters],
        )?;
        let mut scale = 1.0 / (self.q_head_dim() as f64).sqrt();
        if let Some(y) = yarn {
            // The rotated values' own temperature: DeepSeek's configs set it to 1.
            let rotated = y.temperature(y.mscale) / y.temperature(y.mscale_all_dim);
            if (rotated - 1.0).abs() > 1e-6 {
                return Err(config_error(
                    dir,
                    format!(
                        "yarn rope scaling with mscale {} and mscale_all_dim {} scales the rotated \
                         values by {rotated}; only equal values (a scale of 1) are supported",
                        y.mscale, y.mscale_all_dim
                    ),
                ));
            }
            if y.mscale_all_dim != 0.0 {
                let t = y.temperature(y.mscale_all_dim);
                scale *= t * t;
            }
        }
        let rope = Rope {
            yarn: yarn.map(|y| y.yarn),
            ..Rope::new(self.latent_head_dim(), self.qk_rope_head_dim, theta as f32)
        };
        Ok((rope, scale as f32))
    }

    pub(crate) fn check(&self, dir: &ModelDir) -> Result<(), ModelError> {
        let err = |m: String| Err(config_error(dir, m));
        if self.num_attention_heads == 0 || self.kv_lora_rank == 0 || self.v_head_dim == 0 {
            return err("num_attention_heads, kv_lora_rank and v_head_dim must be positive".into());
        }
        let rope = self.qk_rope_head_dim;
        if rope == 0 || !rope.is_multiple_of(2) {
            return err(format!("qk_rope_head_dim {rope} must be even and positive"));
        }
        if self.qk_nope_head_dim == 0 {
            return err("qk_nope_head_dim must be positive".into());
        }
        if self.moe_layer_freq == 0 {
            return err("moe_layer_freq must be positive".into());
        }
        check_sigmoid_router(
            (self.n_routed_experts, self.num_experts_per_tok),
            (self.n_group, self.topk_group),
            (&self.scoring_func, &self.topk_method),
        )
        .or_else(err)?;
        if self.attention_bias {
            return err("attention_bias is not supported for deepseek_v3".into());
        }
        if self.first_k_dense_replace > 0 && self.intermediate_size == 0 {
            return err("dense layers need `intermediate_size`".into());
        }
        Ok(())
    }
}

struct Attention<B: Backend> {
    /// `q_a_proj`, `q_a_layernorm` when queries are low-rank.
    q_a: Option<(B::Weight, B::Vector)>,
    /// `q_b_proj` (or `q_proj`), each head's rows reordered to `[rotated (rotate-half order),
    /// without position]`.
    q_b_proj: B::Weight,
    /// `kv_a_proj_with_mqa`, rows reordered to `[rotated key part, latent]`.
    kv_a_proj_with_mqa: B::Weight,
    kv_a_layernorm: B::Vector,
    /// Per head `[kv_lora_rank, qk_nope_head_dim]`: a query into latent space.
    embed_q: B::Weight,
    /// Per head `[v_head_dim, kv_lora_rank]`: an output out of latent space.
    unembed_out: B::Weight,
    o_proj: B::Weight,
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

pub struct DeepseekV3<B: Backend> {
    cfg: DeepseekV3Config,
    rope: Rope,
    scale: f32,
    decoder: Decoder<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> DeepseekV3<B> {
    pub fn load(
        dir: &ModelDir,
        backend: Arc<B>,
        experts: Option<Arc<dyn ExpertSource>>,
    ) -> Result<Self, ModelError> {
        let cfg: DeepseekV3Config = dir.parse_config()?;
        cfg.check(dir)?;
        let (rope, scale) = cfg.rope(dir)?;
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
            model_type: dir.model_type()?.to_string(),
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
        Ok(DeepseekV3 {
            cfg,
            rope,
            scale,
            decoder,
            layers,
        })
    }
}

/// Row ranges that put a rotated part of `dim` rows starting at `at` in rotate-half order: the
/// even rows of each interleaved pair first, then the odd ones. Exact: rows move whole.
fn rotate_half_rows(at: usize, dim: usize, interleaved: bool) -> Vec<Range<usize>> {
    if !interleaved {
        return std::iter::once(at..at + dim).collect();
    }
    (0..dim / 2)
        .map(|i| at + 2 * i)
        .chain((0..dim / 2).map(|i| at + 2 * i + 1))
        .map(|r| r..r + 1)
        .collect()
}

/// Each head's `[rows, cols]` block of `m` (`heads` of them stacked) transposed, in the source's
/// dtype when dense (exact) or in f32 when quantised (exact too: affine values are f32 sums).
fn transpose_heads(m: &HostMatrix, heads: usize) -> HostMatrix {
    let (rows, cols) = (m.rows / heads, m.cols);
    let dense: Vec<f32> = (0..m.rows)
        .flat_map(|r| sluice_backend::reference::dequantize_row(&m.as_ref(), r))
        .collect();
    let mut t = vec![0.0f32; dense.len()];
    for h in 0..heads {
        let (src, dst) = (&dense[h * rows * cols..], &mut t[h * rows * cols..]);
        for r in 0..rows {
            for c in 0..cols {
                dst[c * rows + r] = src[r * cols + c];
            }
        }
    }
    let (dtype, bytes): (Dtype, Vec<u8>) = match m.format {
        WeightFormat::Dense(Dtype::Bf16) => (
            Dtype::Bf16,
            t.iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
        ),
        _ => (Dtype::F32, t.iter().flat_map(|v| v.to_le_bytes()).collect()),
    };
    HostMatrix::new(
        WeightFormat::Dense(dtype),
        heads * cols,
        rows,
        HostBytes::from_vec(bytes),
        HostBytes::empty(),
        HostBytes::empty(),
    )
    .expect("a dense matrix of the bytes just made")
}

impl<B: Backend> Layer<B> {
    fn load(ld: &mut Loader<B>, cfg: &DeepseekV3Config, i: usize) -> Result<Self, ModelError> {
        let hidden = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let (nope, rope, lora, v) = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.kv_lora_rank,
            cfg.v_head_dim,
        );
        let qh = cfg.q_head_dim();
        let interleaved = cfg.rope_interleave;
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        // Each query head as [rotated, without position].
        let q_rows: Vec<Range<usize>> = (0..heads)
            .flat_map(|h| {
                let mut r = rotate_half_rows(h * qh + nope, rope, interleaved);
                r.push(h * qh..h * qh + nope);
                r
            })
            .collect();
        let (q_a, q_b_proj) = match cfg.q_lora_rank {
            Some(rank) => (
                Some((
                    ld.matrix(&format!("{a}.q_a_proj"), rank, hidden)?,
                    ld.vector(&format!("{a}.q_a_layernorm.weight"), rank)?,
                )),
                ld.matrix_rows(&format!("{a}.q_b_proj"), heads * qh, rank, &q_rows)?,
            ),
            None => (
                None,
                ld.matrix_rows(&format!("{a}.q_proj"), heads * qh, hidden, &q_rows)?,
            ),
        };
        let mut kv_rows = rotate_half_rows(lora, rope, interleaved);
        kv_rows.push(0..lora);
        let kv_a_proj_with_mqa = ld.matrix_rows(
            &format!("{a}.kv_a_proj_with_mqa"),
            lora + rope,
            hidden,
            &kv_rows,
        )?;
        let (embed_q, unembed_out) = if ld.has(&format!("{a}.kv_b_proj.weight")) {
            let kv_b = ld.host_matrix(&format!("{a}.kv_b_proj"), heads * (nope + v), lora)?;
            let per_head = |off: usize, len: usize| -> Vec<Range<usize>> {
                (0..heads)
                    .map(|h| h * (nope + v) + off..h * (nope + v) + off + len)
                    .collect()
            };
            let keys = kv_b.gather_rows(&per_head(0, nope));
            let values = kv_b.gather_rows(&per_head(nope, v));
            (
                ld.upload(&format!("{a}.kv_b_proj"), transpose_heads(&keys, heads))?,
                ld.upload(&format!("{a}.kv_b_proj"), values)?,
            )
        } else {
            (
                ld.stacked_matrix(&format!("{a}.embed_q"), heads, lora, nope)?,
                ld.stacked_matrix(&format!("{a}.unembed_out"), heads, v, lora)?,
            )
        };
        let mlp = format!("{p}.mlp");
        Ok(Layer {
            input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), hidden)?,
            self_attn: Attention {
                q_a,
                q_b_proj,
                kv_a_proj_with_mqa,
                kv_a_layernorm: ld.vector(&format!("{a}.kv_a_layernorm.weight"), lora)?,
                embed_q,
                unembed_out,
                o_proj: ld.matrix(&format!("{a}.o_proj"), hidden, heads * v)?,
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

impl<B: Backend> DeepseekV3<B> {
    /// Multi-head Latent Attention in its absorbed form; each segment's rows attend through its
    /// own cache of layer `i`.
    fn attention(
        &self,
        l: &Attention<B>,
        x: &B::Act,
        i: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Result<B::Act, ModelError> {
        let b = self.decoder.backend();
        let eps = self.decoder.eps();
        let cfg = &self.cfg;
        let heads = cfg.num_attention_heads;
        let (rope, lora) = (cfg.qk_rope_head_dim, cfg.kv_lora_rank);
        let q = match &l.q_a {
            Some((q_a_proj, q_a_layernorm)) => {
                let q = b.rms_norm(&b.matmul(x, q_a_proj), q_a_layernorm, eps);
                b.matmul(&q, &l.q_b_proj)
            }
            None => b.matmul(x, &l.q_b_proj),
        };
        let (q_pe, q_nope) = b.split_chunks(&q, cfg.q_head_dim(), rope);
        // Each head's query into latent space, beside its rotated part: [rotated, latent].
        let q = b.join_chunks(
            &q_pe,
            rope,
            &b.matmul_heads(&q_nope, &l.embed_q, heads),
            lora,
        );
        let (k_pe, latent) = b.split_chunks(
            &b.matmul(x, &l.kv_a_proj_with_mqa),
            cfg.latent_head_dim(),
            rope,
        );
        let latent = b.rms_norm(&latent, &l.kv_a_layernorm, eps);
        let k = b.join_chunks(&k_pe, rope, &latent, lora);
        // The values are the keys as they were before rotation: each head's output is then
        // [a sum of unrotated key parts, which is dropped, the attended latent].
        let (mut caches, rows) = attention_caches(segments, i)?;
        let o = b.attention_rope_segments(
            &q,
            &k,
            &k,
            None,
            eps,
            self.rope,
            &mut caches,
            &rows,
            AttentionSpec::new(heads, self.scale),
        );
        let (_, o_latent) = b.split_chunks(&o, cfg.latent_head_dim(), rope);
        let o = b.matmul_heads(&o_latent, &l.unembed_out, heads);
        Ok(b.matmul(&o, &l.o_proj))
    }
}

impl<B: Backend> Architecture<B> for DeepseekV3<B> {
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
        self.decoder
            .attention_only_state(self.layers.len(), 1, self.cfg.latent_head_dim())
    }
}

/// What one request's state holds, from the config.
pub(crate) fn state_dims(cfg: &DeepseekV3Config) -> StateDims {
    StateDims {
        // The cache's keys and values: both the latent head (see `attention`).
        kv_values_per_token: cfg.num_hidden_layers * 2 * cfg.latent_head_dim(),
        kv_head_dim: cfg.latent_head_dim(),
        fixed_bytes: 0,
        // Absorbed attention: per head a query and an output in the latent space, and the
        // output brought back.
        pass_values_per_token: pass_values(
            cfg.hidden_size,
            cfg.num_attention_heads * (cfg.latent_head_dim() + cfg.kv_lora_rank + cfg.v_head_dim)
                + cfg.latent_head_dim(),
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
