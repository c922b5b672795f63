//! Which tensors a preset's checkpoint holds (names, dtypes and shapes as mlx-lm writes them) and
//! how each is filled.
//!
//! Scaling: every matrix has weights of mean 0 and standard deviation `gain / sqrt(fan_in)`, so a
//! unit-RMS input gives a unit-RMS output and the residual stream grows only like sqrt(layers)
//! (RMSNorm in front of every block keeps each block's input at unit RMS). The router's gain of 4
//! gives logits of standard deviation ~4, so each token picks a decisive, token-dependent top-k
//! and routing spreads over all experts, with a trained model's skew in popularity
//! ([`ROUTER_SPREAD`]).

use sluice_format::StDtype;

use crate::presets::{Family, Preset};

/// Gain of the router (`mlp.gate`): logits of standard deviation ~4.
pub const ROUTER_GAIN: f32 = 4.0;
/// Spread of the router rows' gains (log-normal, per expert). Top-k picks from the upper tail of
/// the logits, so experts with wider logits are picked more often: popularity is skewed, as in
/// trained models (at 0.12 the most popular expert of a layer is picked ~3x as often as the
/// median one, and the most popular third of the experts take about half of the picks).
pub const ROUTER_SPREAD: f32 = 0.12;

/// How a tensor's bytes are made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    /// Packed quantised codes: uniform random bits, or with `Some(bits)` codes of that width
    /// whose zero code is replaced by the middle one (`2^(bits-1)`), so that they are
    /// symmetric about ggml's zero point (see [`ZeroPoint::Ggml`]).
    Codes(Option<u32>),
    /// Per-group scales: `base * row_gain * (0.8 + 0.4 u)` with `u` uniform, keyed by element
    /// index so the matching biases can recompute them.
    Scales(GroupScales),
    /// Per-group biases `-scale * zero_point` ([`ZeroPoint`]).
    Biases(GroupScales, f32),
    /// Every element equal (norm weights).
    Constant(f32),
    /// Uniform on [lo, hi).
    Uniform { lo: f32, hi: f32 },
    /// Normal of mean `mean` and standard deviation `std` (gpt-oss's attention sinks).
    Normal { mean: f32, std: f32 },
    /// `ln(u)`, u uniform on [lo, hi): Gated DeltaNet's `A_log`.
    LogUniform { lo: f32, hi: f32 },
    /// Inverse softplus of a log-uniform time step in [lo, hi): Gated DeltaNet's `dt_bias`.
    InvSoftplusLogUniform { lo: f32, hi: f32 },
}

/// How the scales of a quantised matrix are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupScales {
    pub base: f32,
    pub key: u64,
    /// Groups per output row.
    pub row_groups: usize,
    /// Each output row is scaled by `exp(row_spread * z)`, z standard normal per row (0: none).
    pub row_spread: f32,
}

/// One tensor to write.
#[derive(Debug, Clone)]
pub struct TensorPlan {
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub fill: Fill,
    /// Seed of this tensor's random stream (derived from the name and the user's seed).
    pub seed: u64,
}

impl TensorPlan {
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Quantisation of the checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct Quant {
    pub bits: u32,
    pub group_size: usize,
}

/// Where the biases put a quantised weight's zero: each group's bias is `-scale * zero_point`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroPoint {
    /// `(2^bits - 1) / 2`: codes centred on zero, as a trained checkpoint's are on average.
    #[default]
    Centred,
    /// `2^(bits - 1)`: ggml's Q4_0 and Q8_0 zero, so that `bench/gguf_from_mlx.py` writes those
    /// (4.5 and 8.5 bits per weight, as mlx's) holding exactly the same numbers. The codes then
    /// avoid 0 (it becomes the middle code) so that the weights still average zero: uniform codes
    /// would average half a step below the zero point, a shift every matrix shares, which
    /// measurably collapses the routing onto a few experts.
    Ggml,
}

impl ZeroPoint {
    pub fn value(self, bits: u32) -> f32 {
        match self {
            ZeroPoint::Centred => ((1u64 << bits) - 1) as f32 / 2.0,
            ZeroPoint::Ggml => (1u64 << (bits - 1)) as f32,
        }
    }

    /// The standard deviation of `code - zero point` over the codes this mode writes.
    pub fn code_std(self, bits: u32) -> f32 {
        let levels = (1u64 << bits) as f64;
        match self {
            ZeroPoint::Centred => ((levels * levels - 1.0) / 12.0).sqrt() as f32,
            ZeroPoint::Ggml => {
                // Codes 1..levels-1 once each and the middle twice, about the middle.
                let m = levels / 2.0;
                let sum_sq = 2.0 * (m - 1.0) * m * (2.0 * m - 1.0) / 6.0;
                (sum_sq / levels).sqrt() as f32
            }
        }
    }
}

struct Builder {
    seed: u64,
    quant: Quant,
    zero_point: ZeroPoint,
    out: Vec<TensorPlan>,
}

impl Builder {
    fn push(&mut self, name: String, dtype: StDtype, shape: Vec<usize>, fill: Fill) {
        let seed = mix(self.seed ^ fnv1a(name.as_bytes()));
        self.out.push(TensorPlan {
            name,
            dtype,
            shape,
            fill,
            seed,
        });
    }

    /// A linear layer (or stack of `lead` expert layers) `[lead.., out, in]`, quantised as mlx
    /// does: when `in` is a multiple of the group size, else kept in bf16.
    fn linear(&mut self, name: &str, lead: &[usize], out: usize, inp: usize, gain: f32, q: Quant) {
        self.linear_spread(name, lead, out, inp, gain, 0.0, q);
    }

    /// [`Builder::linear`] with output rows scaled by `exp(row_spread * z)`, z normal per row.
    #[allow(clippy::too_many_arguments)]
    fn linear_spread(
        &mut self,
        name: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
        gain: f32,
        row_spread: f32,
        q: Quant,
    ) {
        let std = gain / (inp as f32).sqrt();
        if !inp.is_multiple_of(q.group_size) {
            let mut shape = lead.to_vec();
            shape.extend([out, inp]);
            let a = std * 3f32.sqrt();
            self.push(
                format!("{name}.weight"),
                StDtype::BF16,
                shape,
                Fill::Uniform { lo: -a, hi: a },
            );
            return;
        }
        let base = std / self.zero_point.code_std(q.bits);
        let key = mix(self.seed ^ fnv1a(name.as_bytes()) ^ 0x5ca1e);
        let mut wshape = lead.to_vec();
        wshape.extend([out, inp * q.bits as usize / 32]);
        let mut sshape = lead.to_vec();
        sshape.extend([out, inp / q.group_size]);
        let codes = match self.zero_point {
            ZeroPoint::Centred => Fill::Codes(None),
            ZeroPoint::Ggml => Fill::Codes(Some(q.bits)),
        };
        self.push(format!("{name}.weight"), StDtype::U32, wshape, codes);
        let scales = GroupScales {
            base,
            key,
            row_groups: inp / q.group_size,
            row_spread,
        };
        self.push(
            format!("{name}.scales"),
            StDtype::BF16,
            sshape.clone(),
            Fill::Scales(scales),
        );
        self.push(
            format!("{name}.biases"),
            StDtype::BF16,
            sshape,
            Fill::Biases(scales, self.zero_point.value(q.bits)),
        );
    }

    /// A bf16 `[out, in]` matrix of standard deviation `gain / sqrt(in)`, never quantised.
    fn dense(&mut self, name: &str, out: usize, inp: usize, gain: f32) {
        let a = gain / (inp as f32).sqrt() * 3f32.sqrt();
        let fill = Fill::Uniform { lo: -a, hi: a };
        self.push(
            format!("{name}.weight"),
            StDtype::BF16,
            vec![out, inp],
            fill,
        );
    }

    /// `n` values uniform on [-a, a).
    fn uniform(&mut self, name: String, dtype: StDtype, n: usize, a: f32) {
        self.push(name, dtype, vec![n], Fill::Uniform { lo: -a, hi: a });
    }

    fn ones(&mut self, name: String, n: usize) {
        self.push(name, StDtype::BF16, vec![n], Fill::Constant(1.0));
    }
}

/// The tensors of `preset`'s checkpoint, in file order (embeddings, layer by layer, head).
pub fn tensors(preset: &Preset, quant: Quant, zero_point: ZeroPoint, seed: u64) -> Vec<TensorPlan> {
    let mut b = Builder {
        seed: mix(seed),
        quant,
        zero_point,
        out: Vec::new(),
    };
    let q = quant;
    let router = Quant {
        bits: 8,
        group_size: 64,
    };
    let h = preset.hidden_size;
    let m = preset.model_prefix();
    // Embedding rows of unit RMS: mlx quantises the embedding like a linear layer.
    b.linear(
        &format!("{m}.embed_tokens"),
        &[],
        preset.vocab_size,
        h,
        (h as f32).sqrt(),
        q,
    );
    for l in 0..preset.layers {
        let p = format!("{m}.layers.{l}");
        b.ones(format!("{p}.input_layernorm.weight"), h);
        b.ones(format!("{p}.post_attention_layernorm.weight"), h);
        if let Some(mla) = preset.mla {
            let a = format!("{p}.self_attn");
            let nh = preset.heads;
            let (nope, rope, lora, v) = (
                mla.qk_nope_head_dim,
                mla.qk_rope_head_dim,
                mla.kv_lora_rank,
                mla.v_head_dim,
            );
            let q_rows = nh * (nope + rope);
            match mla.q_lora_rank {
                Some(r) => {
                    b.linear(&format!("{a}.q_a_proj"), &[], r, h, 1.0, q);
                    b.ones(format!("{a}.q_a_layernorm.weight"), r);
                    b.linear(&format!("{a}.q_b_proj"), &[], q_rows, r, 1.0, q);
                }
                None => b.linear(&format!("{a}.q_proj"), &[], q_rows, h, 1.0, q),
            }
            b.linear(
                &format!("{a}.kv_a_proj_with_mqa"),
                &[],
                lora + rope,
                h,
                1.0,
                q,
            );
            b.ones(format!("{a}.kv_a_layernorm.weight"), lora);
            // mlx-lm's per-head halves of kv_b_proj: [heads, lora, nope] and [heads, v, lora].
            b.linear(&format!("{a}.embed_q"), &[nh], lora, nope, 1.0, q);
            b.linear(&format!("{a}.unembed_out"), &[nh], v, lora, 1.0, q);
            b.linear(&format!("{a}.o_proj"), &[], h, nh * v, 1.0, q);
        } else if preset.is_full_attention(l) {
            let (nh, kv, hd) = (preset.heads, preset.kv_heads, preset.head_dim);
            // Qwen3.5's gated attention projects queries and their gates together.
            let q_rows = match preset.family {
                Family::Qwen35Moe => 2 * nh * hd,
                _ => nh * hd,
            };
            b.linear(&format!("{p}.self_attn.q_proj"), &[], q_rows, h, 1.0, q);
            b.linear(&format!("{p}.self_attn.k_proj"), &[], kv * hd, h, 1.0, q);
            b.linear(&format!("{p}.self_attn.v_proj"), &[], kv * hd, h, 1.0, q);
            b.linear(&format!("{p}.self_attn.o_proj"), &[], h, nh * hd, 1.0, q);
            if preset.qk_norm {
                b.ones(format!("{p}.self_attn.q_norm.weight"), hd);
                b.ones(format!("{p}.self_attn.k_norm.weight"), hd);
            }
            if matches!(preset.family, Family::Glm4Moe | Family::GptOss) {
                for (n, rows) in [("q", nh * hd), ("k", kv * hd), ("v", kv * hd)] {
                    b.uniform(
                        format!("{p}.self_attn.{n}_proj.bias"),
                        StDtype::BF16,
                        rows,
                        0.1,
                    );
                }
            }
            if preset.family == Family::GptOss {
                b.uniform(format!("{p}.self_attn.o_proj.bias"), StDtype::BF16, h, 0.1);
                // One logit per head joins each softmax: of the order of the scores.
                b.push(
                    format!("{p}.self_attn.sinks"),
                    StDtype::BF16,
                    vec![nh],
                    Fill::Normal {
                        mean: 0.0,
                        std: 1.0,
                    },
                );
            }
        } else if let Some(lin) = preset.linear {
            let la = format!("{p}.linear_attn");
            let key_dim = lin.key_heads * lin.key_head_dim;
            let value_dim = lin.value_heads * lin.value_head_dim;
            let conv_dim = 2 * key_dim + value_dim;
            b.linear(&format!("{la}.in_proj_qkv"), &[], conv_dim, h, 1.0, q);
            b.linear(&format!("{la}.in_proj_z"), &[], value_dim, h, 1.0, q);
            b.linear(&format!("{la}.in_proj_b"), &[], lin.value_heads, h, 1.0, q);
            b.linear(&format!("{la}.in_proj_a"), &[], lin.value_heads, h, 1.0, q);
            b.linear(&format!("{la}.out_proj"), &[], h, value_dim, 1.0, q);
            let a = 1.0 / (lin.conv_kernel as f32).sqrt() * 3f32.sqrt();
            // mlx keeps Conv1d weights as [channels, kernel, 1].
            b.push(
                format!("{la}.conv1d.weight"),
                StDtype::BF16,
                vec![conv_dim, lin.conv_kernel, 1],
                Fill::Uniform { lo: -a, hi: a },
            );
            // As the official initialisation: A ~ U(1, 16), dt ~ logU(1e-3, 0.1).
            b.push(
                format!("{la}.A_log"),
                StDtype::F32,
                vec![lin.value_heads],
                Fill::LogUniform { lo: 1.0, hi: 16.0 },
            );
            b.push(
                format!("{la}.dt_bias"),
                StDtype::BF16,
                vec![lin.value_heads],
                Fill::InvSoftplusLogUniform { lo: 1e-3, hi: 0.1 },
            );
            b.ones(format!("{la}.norm.weight"), lin.value_head_dim);
        }
        let mlp = format!("{p}.{}", preset.moe_module());
        if l < preset.first_dense_layers {
            let i = preset.intermediate_size;
            b.linear(&format!("{mlp}.gate_proj"), &[], i, h, 1.0, q);
            b.linear(&format!("{mlp}.up_proj"), &[], i, h, 1.0, q);
            b.linear(&format!("{mlp}.down_proj"), &[], h, i, 1.0, q);
            continue;
        }
        let (e, i) = (preset.experts, preset.moe_intermediate_size);
        let sigmoid_router = matches!(preset.family, Family::Glm4Moe | Family::DeepseekV3);
        if sigmoid_router {
            // A bf16 router (no popularity skew) and the selection bias, float32.
            b.dense(&format!("{mlp}.gate"), e, h, ROUTER_GAIN);
            b.uniform(
                format!("{mlp}.gate.e_score_correction_bias"),
                StDtype::F32,
                e,
                0.02,
            );
        } else {
            let gate = format!("{mlp}.{}", preset.router_module());
            b.linear_spread(&gate, &[], e, h, ROUTER_GAIN, ROUTER_SPREAD, router);
            if preset.family == Family::GptOss {
                // Small beside the logits' spread of ~4: it shifts popularity, not routing.
                b.uniform(format!("{gate}.bias"), StDtype::BF16, e, 0.1);
            }
        }
        // mlx-lm stacks gpt-oss's experts under `experts`, with a bias per expert and row.
        let stack = match preset.family {
            Family::GptOss => "experts",
            _ => "switch_mlp",
        };
        for (proj, out, inp) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            let name = format!("{mlp}.{stack}.{proj}");
            b.linear(&name, &[e], out, inp, 1.0, q);
            if preset.family == Family::GptOss {
                b.push(
                    format!("{name}.bias"),
                    StDtype::BF16,
                    vec![e, out],
                    Fill::Uniform { lo: -0.1, hi: 0.1 },
                );
            }
        }
        let s = preset.shared_expert_intermediate_size;
        if s > 0 {
            // GLM's and DeepSeek's shared experts are ungated and named in the plural.
            let glm = sigmoid_router;
            let se = format!(
                "{mlp}.{}",
                if glm {
                    "shared_experts"
                } else {
                    "shared_expert"
                }
            );
            b.linear(&format!("{se}.gate_proj"), &[], s, h, 1.0, q);
            b.linear(&format!("{se}.up_proj"), &[], s, h, 1.0, q);
            b.linear(&format!("{se}.down_proj"), &[], h, s, 1.0, q);
            if !glm {
                b.linear(&format!("{mlp}.shared_expert_gate"), &[], 1, h, 1.0, router);
            }
        }
    }
    b.ones(format!("{m}.norm.weight"), h);
    b.linear(preset.lm_head(), &[], preset.vocab_size, h, 1.0, b.quant);
    b.out
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::Preset;

    fn q4() -> Quant {
        Quant {
            bits: 4,
            group_size: 64,
        }
    }

    #[test]
    fn qwen35_35b_has_the_published_size() {
        let p = Preset::find("qwen3.5-35b-a3b").unwrap();
        let t = tensors(p, q4(), ZeroPoint::Centred, 0);
        let total: u64 = t.iter().map(|t| t.nbytes()).sum();
        let experts: u64 = t
            .iter()
            .filter(|t| t.name.contains("switch_mlp"))
            .map(|t| t.nbytes())
            .sum();
        // 40 x 256 x 3 x 2048 x 512 x 4.5 bits = 18.1 GB of routed experts (shared notes).
        assert_eq!(experts, 40 * 256 * 3 * 2048 * 512 * 9 / 16);
        // mlx-community's Qwen3.5-35B-A3B-4bit text weights are ~19.5 GB.
        assert!((19.0e9..20.5e9).contains(&(total as f64)), "{total}");
    }

    #[test]
    fn deepseek_v3_has_the_published_size() {
        let p = Preset::find("deepseek-v3").unwrap();
        let t = tensors(p, q4(), ZeroPoint::Centred, 0);
        let experts: u64 = t
            .iter()
            .filter(|t| t.name.contains("switch_mlp"))
            .map(|t| t.nbytes())
            .sum();
        // 58 MoE layers x 256 x 3 x 7168 x 2048 x 4.5 bits.
        assert_eq!(experts, 58 * 256 * 3 * 7168 * 2048 * 9 / 16);
        // 671B parameters at 4.5 bits (the embedding and head too): ~377 GB.
        let total: u64 = t.iter().map(|t| t.nbytes()).sum();
        assert!((370e9..385e9).contains(&(total as f64)), "{total}");
        let mla = t
            .iter()
            .find(|t| t.name.ends_with("layers.5.self_attn.embed_q.weight"));
        assert_eq!(mla.unwrap().shape, [128, 512, 128 * 4 / 32]);
    }

    #[test]
    fn gpt_oss_has_the_published_size_and_mlx_layout() {
        let p = Preset::find("gpt-oss-120b").unwrap();
        let t = tensors(p, q4(), ZeroPoint::Centred, 0);
        let experts: u64 = t
            .iter()
            .filter(|t| t.name.contains(".mlp.experts.") && !t.name.ends_with(".bias"))
            .map(|t| t.nbytes())
            .sum();
        // 36 x 128 x 3 x 2880 x 2880 x 4.5 bits.
        assert_eq!(experts, 36 * 128 * 3 * 2880 * 2880 * 9 / 16);
        // The model card's 116.8B parameters, nearly all at 4.5 bits: ~66 GB.
        let total: u64 = t.iter().map(|t| t.nbytes()).sum();
        assert!((65e9..67e9).contains(&(total as f64)), "{total}");

        // One layer of the tiny preset, name by name as mlx-lm writes gpt-oss.
        let p = Preset::find("tiny-gpt-oss").unwrap();
        let t = tensors(p, q4(), ZeroPoint::Centred, 0);
        let shape = |name: &str| {
            let found = t.iter().find(|x| x.name == name);
            let x = found.unwrap_or_else(|| panic!("no {name}"));
            (x.dtype, x.shape.clone())
        };
        let (u32, bf16) = (StDtype::U32, StDtype::BF16);
        let layer: [(&str, StDtype, &[usize]); 18] = [
            ("self_attn.q_proj.weight", u32, &[128, 16]),
            ("self_attn.q_proj.bias", bf16, &[128]),
            ("self_attn.k_proj.bias", bf16, &[64]),
            ("self_attn.v_proj.bias", bf16, &[64]),
            ("self_attn.o_proj.weight", u32, &[128, 16]),
            ("self_attn.o_proj.bias", bf16, &[128]),
            ("self_attn.sinks", bf16, &[4]),
            ("input_layernorm.weight", bf16, &[128]),
            ("post_attention_layernorm.weight", bf16, &[128]),
            // The router at 8 bits, group 64, with its bias.
            ("mlp.router.weight", u32, &[8, 32]),
            ("mlp.router.scales", bf16, &[8, 2]),
            ("mlp.router.bias", bf16, &[8]),
            ("mlp.experts.gate_proj.weight", u32, &[8, 64, 16]),
            ("mlp.experts.gate_proj.bias", bf16, &[8, 64]),
            ("mlp.experts.up_proj.scales", bf16, &[8, 64, 2]),
            ("mlp.experts.up_proj.bias", bf16, &[8, 64]),
            ("mlp.experts.down_proj.weight", u32, &[8, 128, 8]),
            ("mlp.experts.down_proj.bias", bf16, &[8, 128]),
        ];
        let named = layer
            .iter()
            .map(|&(n, d, s)| (format!("model.layers.1.{n}"), d, s))
            .chain([
                (
                    "model.embed_tokens.weight".to_string(),
                    u32,
                    &[1024, 16][..],
                ),
                ("model.norm.weight".to_string(), bf16, &[128][..]),
                ("lm_head.weight".to_string(), u32, &[1024, 16][..]),
            ]);
        for (name, dtype, dims) in named {
            assert_eq!(shape(&name), (dtype, dims.to_vec()), "{name}");
        }
        assert!(!t.iter().any(|x| x.name.contains("switch_mlp")
            || x.name.contains(".gate.")
            || x.name.contains("q_norm")));
        // 18 tensors per layer: 4 projections x 4, sinks, 2 norms, router x 4, experts x 3 x 4.
        let per_layer = t
            .iter()
            .filter(|x| x.name.starts_with("model.layers.0."))
            .count();
        assert_eq!(per_layer, 4 * 4 + 1 + 2 + 4 + 3 * 4);
    }

    #[test]
    fn names_are_unique_and_shapes_consistent() {
        for p in crate::presets::PRESETS {
            let t = tensors(p, q4(), ZeroPoint::Centred, 1);
            let mut names: Vec<_> = t.iter().map(|t| t.name.as_str()).collect();
            names.sort();
            let n = names.len();
            names.dedup();
            assert_eq!(n, names.len(), "{}", p.name);
            for x in &t {
                if let Some(stem) = x.name.strip_suffix(".scales") {
                    let w = t
                        .iter()
                        .find(|w| w.name == format!("{stem}.weight"))
                        .unwrap();
                    let per_word = 32 / q4().bits as usize;
                    let router = stem.ends_with("gate") || stem.ends_with("router");
                    let bits = if router { 8 } else { 4 };
                    let cols = w.shape.last().unwrap() * 32 / bits;
                    assert_eq!(*x.shape.last().unwrap() * 64, cols, "{}", x.name);
                    assert!(per_word > 0);
                }
            }
        }
    }

    #[test]
    fn seeds_differ_between_tensors_and_user_seeds() {
        let p = Preset::find("tiny-qwen3-moe").unwrap();
        let a = tensors(p, q4(), ZeroPoint::Centred, 1);
        let b = tensors(p, q4(), ZeroPoint::Centred, 2);
        assert_ne!(a[0].seed, a[1].seed);
        assert_ne!(a[0].seed, b[0].seed);
    }
}
