//! The real models' shapes, and the config.json each synthetic checkpoint carries.
//!
//! Every number of a full-size preset is the published `config.json` value of the model it is
//! named after; `source` says where it was read and which second source agreed. The `tiny-*`
//! presets keep each family's structure (layer schedule, shared expert, gated attention) at a
//! size that writes in milliseconds, for tests.

use serde_json::{json, Map, Value};

/// Which architecture (and config.json layout) a preset has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_moe`: full attention in every layer, no shared expert.
    Qwen3Moe,
    /// `qwen3_5_moe`: Gated DeltaNet + gated full attention every `full_attention_interval`
    /// layers, shared expert; config under `text_config`, tensors under `language_model.`.
    Qwen35Moe,
    /// `mixtral`: full attention without q/k norms, MoE under `block_sparse_moe`, no shared
    /// expert.
    Mixtral,
    /// `glm4_moe`: attention with q/k/v biases and half-head rotary, q/k norms where `qk_norm`,
    /// leading dense layers, a sigmoid router with a selection bias (kept in bf16, as mlx-lm
    /// leaves it) and an ungated shared expert.
    Glm4Moe,
    /// `deepseek_v3` (or `kimi_k2`): Multi-head Latent Attention ([`Mla`]) in mlx-lm's layout
    /// (per-head `embed_q` / `unembed_out`), leading dense layers, GLM's sigmoid router and
    /// ungated shared experts.
    DeepseekV3,
    /// `gpt_oss`: attention with biases on q/k/v/o, a learned sink per head and a sliding window
    /// on every other layer (sliding first), YaRN; a biased softmax router (`mlp.router`, 8-bit
    /// as mlx-lm's `quant_predicate` writes it) and biased experts (`mlp.experts.*`, stacked)
    /// with the clamped SwiGLU, no shared expert ([`GptOssAttention`]).
    GptOss,
}

/// gpt-oss's sliding window, YaRN rotary scaling and SwiGLU clamp.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptOssAttention {
    /// Window of the `sliding_attention` layers (layers 0, 2, 4, ...).
    pub sliding_window: usize,
    pub swiglu_limit: f64,
    /// YaRN: factor, original context, beta_fast, beta_slow (`truncate: false`).
    pub yarn: (f64, usize, f64, f64),
}

/// Multi-head Latent Attention dimensions and rotary scaling of a `deepseek_v3` preset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mla {
    pub model_type: &'static str,
    /// `None`: queries straight from `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// YaRN: factor, original context, beta_fast, beta_slow (mscale = mscale_all_dim = 1).
    pub yarn: (f64, usize, f64, f64),
}

/// Gated DeltaNet (linear attention) dimensions of a `qwen3_5_moe` preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttention {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
    /// Every n-th layer (1-based) is full attention, the rest linear.
    pub full_attention_interval: usize,
}

/// The shape of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub family: Family,
    /// Where the numbers come from.
    pub source: &'static str,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate_size: usize,
    /// 0 when the model has no shared expert.
    pub shared_expert_intermediate_size: usize,
    /// The dense FFN width the config declares (unused by all-MoE layer schedules).
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub max_position_embeddings: usize,
    pub linear: Option<LinearAttention>,
    /// Leading layers with a dense SwiGLU of `intermediate_size` instead of experts.
    pub first_dense_layers: usize,
    /// GLM: per-head RMSNorm of q and k (`use_qk_norm`; the Qwen families always have it,
    /// Mixtral never), and the routed weights' `routed_scaling_factor`.
    pub qk_norm: bool,
    pub routed_scaling_factor: f64,
    /// Id of `<|endoftext|>`; the other special tokens follow it (as in Qwen's vocabularies).
    pub special_tokens_start: usize,
    /// DeepSeek-V3's attention (`heads`; `kv_heads` and `head_dim` unused).
    pub mla: Option<Mla>,
    /// gpt-oss's attention settings.
    pub gpt_oss: Option<GptOssAttention>,
}

/// The special tokens every preset's tokenizer has, in id order from `special_tokens_start`.
pub const SPECIAL_TOKENS: [(&str, bool); 7] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
];

const QWEN35_LINEAR: LinearAttention = LinearAttention {
    key_heads: 16,
    value_heads: 32,
    key_head_dim: 128,
    value_head_dim: 128,
    conv_kernel: 4,
    full_attention_interval: 4,
};

/// Both sizes' (gpt-oss-20b's config.json and openai/gpt-oss's ModelConfig, the 120b's, agree).
const GPT_OSS_ATTENTION: GptOssAttention = GptOssAttention {
    sliding_window: 128,
    swiglu_limit: 7.0,
    yarn: (32.0, 4096, 32.0, 1.0),
};

/// All presets, full-size first.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "qwen3.5-35b-a3b",
        family: Family::Qwen35Moe,
        source: "huggingface.co/Qwen/Qwen3.5-35B-A3B config.json (text_config); \
                 agrees with THUDM/slime scripts/models/qwen3.5-35B-A3B.sh",
        hidden_size: 2048,
        layers: 40,
        heads: 16,
        kv_heads: 2,
        head_dim: 256,
        experts: 256,
        experts_per_token: 8,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
        intermediate_size: 0,
        vocab_size: 248320,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(QWEN35_LINEAR),
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 248044,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "qwen3.5-122b-a10b",
        family: Family::Qwen35Moe,
        source: "huggingface.co/Qwen/Qwen3.5-122B-A10B config.json (text_config); \
                 agrees with slime scripts/models/qwen3.5-122B-A10B.sh (Aphoh/slime)",
        hidden_size: 3072,
        layers: 48,
        heads: 32,
        kv_heads: 2,
        head_dim: 256,
        experts: 256,
        experts_per_token: 8,
        moe_intermediate_size: 1024,
        shared_expert_intermediate_size: 1024,
        intermediate_size: 0,
        vocab_size: 248320,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(LinearAttention {
            value_heads: 64,
            ..QWEN35_LINEAR
        }),
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 248044,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "qwen3.5-397b-a17b",
        family: Family::Qwen35Moe,
        source: "Qwen3.5-397B-A17B text_config as NVIDIA's Megatron MIMO config for it states \
                 (\"all values match the HuggingFace text_config\": 60 layers, hidden 4096, 32 \
                 heads, 2 kv heads of 256, 512 experts top-10 of 1024, shared 1024, DeltaNet \
                 16 key / 64 value heads of 128, 3 linear : 1 full, partial rotary 0.25, theta \
                 1e7); agrees with Flash-MoE's 397B profile; vocabulary as the Qwen3.5 family",
        hidden_size: 4096,
        layers: 60,
        heads: 32,
        kv_heads: 2,
        head_dim: 256,
        experts: 512,
        experts_per_token: 10,
        moe_intermediate_size: 1024,
        shared_expert_intermediate_size: 1024,
        intermediate_size: 0,
        vocab_size: 248320,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(LinearAttention {
            value_heads: 64,
            ..QWEN35_LINEAR
        }),
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 248044,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "qwen3-30b-a3b",
        family: Family::Qwen3Moe,
        source: "huggingface.co/Qwen/Qwen3-30B-A3B config.json; \
                 agrees with THUDM/slime scripts/models/qwen3-30B-A3B.sh",
        hidden_size: 2048,
        layers: 48,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        experts: 128,
        experts_per_token: 8,
        moe_intermediate_size: 768,
        shared_expert_intermediate_size: 0,
        intermediate_size: 6144,
        vocab_size: 151936,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 40960,
        linear: None,
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 151643,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "qwen3-235b-a22b",
        family: Family::Qwen3Moe,
        source: "huggingface.co/Qwen/Qwen3-235B-A22B config.json; \
                 agrees with THUDM/slime scripts/models/qwen3-235B-A22B.sh",
        hidden_size: 4096,
        layers: 94,
        heads: 64,
        kv_heads: 4,
        head_dim: 128,
        experts: 128,
        experts_per_token: 8,
        moe_intermediate_size: 1536,
        shared_expert_intermediate_size: 0,
        intermediate_size: 12288,
        vocab_size: 151936,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 40960,
        linear: None,
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 151643,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "mixtral-8x7b",
        family: Family::Mixtral,
        source: "huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json; \
                 agrees with llama.cpp's and mlx-lm's Mixtral defaults (mlx_lm/models/mixtral.py)",
        hidden_size: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        experts: 8,
        experts_per_token: 2,
        // Mixtral's `intermediate_size` is each expert's width.
        moe_intermediate_size: 14336,
        shared_expert_intermediate_size: 0,
        intermediate_size: 14336,
        vocab_size: 32000,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 32768,
        linear: None,
        first_dense_layers: 0,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 31993,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "glm-4.5-air",
        family: Family::Glm4Moe,
        source: "huggingface.co/zai-org/GLM-4.5-Air config.json; agrees with THUDM/slime \
                 scripts/models/glm4.5-106B-A12B.sh (1 dense + 45 MoE layers, 96 heads, 8 KV \
                 groups of 128, hidden 4096, dense 10944, experts 1408 and shared 1408, rotary \
                 0.5, theta 1e6, vocabulary 151552)",
        hidden_size: 4096,
        layers: 46,
        heads: 96,
        kv_heads: 8,
        head_dim: 128,
        experts: 128,
        experts_per_token: 8,
        moe_intermediate_size: 1408,
        shared_expert_intermediate_size: 1408,
        intermediate_size: 10944,
        vocab_size: 151552,
        rope_theta: 1e6,
        partial_rotary_factor: 0.5,
        max_position_embeddings: 131072,
        linear: None,
        first_dense_layers: 1,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 151329,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "glm-4.5",
        family: Family::Glm4Moe,
        source: "huggingface.co/zai-org/GLM-4.5 config.json; agrees with THUDM/slime \
                 scripts/models/glm4.5-355B-A32B.sh (3 dense + 89 MoE layers, 96 heads, 8 KV \
                 groups of 128, q/k norm, hidden 5120, dense 12288, 160 experts of 1536 top-8 \
                 scaled by 2.5, shared 1536, rotary 0.5, theta 1e6, vocabulary 151552)",
        hidden_size: 5120,
        layers: 92,
        heads: 96,
        kv_heads: 8,
        head_dim: 128,
        experts: 160,
        experts_per_token: 8,
        moe_intermediate_size: 1536,
        shared_expert_intermediate_size: 1536,
        intermediate_size: 12288,
        vocab_size: 151552,
        rope_theta: 1e6,
        partial_rotary_factor: 0.5,
        max_position_embeddings: 131072,
        linear: None,
        first_dense_layers: 3,
        qk_norm: true,
        routed_scaling_factor: 2.5,
        special_tokens_start: 151329,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "deepseek-v3",
        family: Family::DeepseekV3,
        source: "huggingface.co/deepseek-ai/DeepSeek-V3 config.json (V3-0324, V3.1 and R1 share \
                 the shape): 3 dense + 58 MoE layers, hidden 7168, 128 heads, q_lora_rank 1536, \
                 kv_lora_rank 512, 128 + 64 query values per head, 128 value values, 256 experts \
                 of 2048 top-8 in 8 groups (best 4) scaled by 2.5, one shared expert, dense 18432, \
                 vocabulary 129280, YaRN factor 40 over 4096; agrees with mlx-lm's deepseek_v3 \
                 defaults and the DeepSeek-V3 technical report (671B, 37B active)",
        hidden_size: 7168,
        layers: 61,
        heads: 128,
        kv_heads: 128,
        head_dim: 192,
        experts: 256,
        experts_per_token: 8,
        moe_intermediate_size: 2048,
        shared_expert_intermediate_size: 2048,
        intermediate_size: 18432,
        vocab_size: 129280,
        rope_theta: 10000.0,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 163840,
        linear: None,
        first_dense_layers: 3,
        qk_norm: false,
        routed_scaling_factor: 2.5,
        special_tokens_start: 129200,
        mla: Some(Mla {
            model_type: "deepseek_v3",
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            n_group: 8,
            topk_group: 4,
            yarn: (40.0, 4096, 32.0, 1.0),
        }),
        gpt_oss: None,
    },
    Preset {
        name: "kimi-k2",
        family: Family::DeepseekV3,
        source: "huggingface.co/moonshotai/Kimi-K2-Instruct-0905 config.json as reported by \
                 hf-model-inspector (61 layers, hidden 7168, 64 heads, dense 18432, vocabulary \
                 163840, theta 50000, YaRN factor 64 over 4096 with beta 1/1); the MoE (384 \
                 experts of 2048, top-8, one group, one shared expert, 1 dense layer, scaling \
                 2.827) and MLA ranks as DeepSeek-V3's, per the Kimi K2 technical report",
        hidden_size: 7168,
        layers: 61,
        heads: 64,
        kv_heads: 64,
        head_dim: 192,
        experts: 384,
        experts_per_token: 8,
        moe_intermediate_size: 2048,
        shared_expert_intermediate_size: 2048,
        intermediate_size: 18432,
        vocab_size: 163840,
        rope_theta: 50000.0,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 262144,
        linear: None,
        first_dense_layers: 1,
        qk_norm: false,
        routed_scaling_factor: 2.827,
        special_tokens_start: 163584,
        mla: Some(Mla {
            model_type: "kimi_k2",
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            n_group: 1,
            topk_group: 1,
            yarn: (64.0, 4096, 1.0, 1.0),
        }),
        gpt_oss: None,
    },
    Preset {
        name: "mixtral-8x22b",
        family: Family::Mixtral,
        source: "huggingface.co/mistralai/Mixtral-8x22B-v0.1 config.json (hidden 6144, 56 layers, \
                 48 heads, 8 KV heads, experts of 16384, vocabulary 32768, theta 1e6, 65536 \
                 positions)",
        hidden_size: 6144,
        layers: 56,
        heads: 48,
        kv_heads: 8,
        head_dim: 128,
        experts: 8,
        experts_per_token: 2,
        moe_intermediate_size: 16384,
        shared_expert_intermediate_size: 0,
        intermediate_size: 16384,
        vocab_size: 32768,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 65536,
        linear: None,
        first_dense_layers: 0,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 32761,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "gpt-oss-20b",
        family: Family::GptOss,
        source: "huggingface.co/openai/gpt-oss-20b config.json (as mirrored in EchoCog/gpt-oss-20b: \
                 24 layers, hidden 2880, 64 heads, 8 KV heads of 64, 32 experts of 2880 top-4, \
                 vocabulary 201088, theta 150000, YaRN factor 32 over 4096 with beta 32/1 and \
                 truncate false, window 128 on sliding/full alternating layers, swiglu_limit 7, \
                 131072 positions, untied); agrees with NVIDIA Megatron-Bridge's gpt-oss page \
                 (20B: 24 layers, 32 experts top-4) and with openai/gpt-oss gpt_oss/torch/model.py \
                 and mlx-lm mlx_lm/models/gpt_oss.py (same widths); special tokens: \
                 <|endoftext|> at 199999 as in o200k_harmony, the synthetic Qwen-style ones after it",
        hidden_size: 2880,
        layers: 24,
        heads: 64,
        kv_heads: 8,
        head_dim: 64,
        experts: 32,
        experts_per_token: 4,
        // gpt-oss's `intermediate_size` is each expert's width.
        moe_intermediate_size: 2880,
        shared_expert_intermediate_size: 0,
        intermediate_size: 2880,
        vocab_size: 201088,
        rope_theta: 150000.0,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 131072,
        linear: None,
        first_dense_layers: 0,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 199999,
        mla: None,
        gpt_oss: Some(GPT_OSS_ATTENTION),
    },
    Preset {
        name: "gpt-oss-120b",
        family: Family::GptOss,
        source: "openai/gpt-oss gpt_oss/torch/model.py ModelConfig defaults, which are \
                 gpt-oss-120b's (36 layers, 128 experts, 4 per token, hidden and expert width \
                 2880, 64 heads, 8 KV heads of 64, vocabulary 201088, window 128, theta 150000, \
                 YaRN factor 32 over 4096 with beta 32/1, swiglu_limit 7); agrees with mlx-lm \
                 mlx_lm/models/gpt_oss.py ModelArgs defaults and NVIDIA Megatron-Bridge's gpt-oss \
                 page (120B: 36 layers, 128 experts top-4); the rest as gpt-oss-20b's config.json",
        hidden_size: 2880,
        layers: 36,
        heads: 64,
        kv_heads: 8,
        head_dim: 64,
        experts: 128,
        experts_per_token: 4,
        moe_intermediate_size: 2880,
        shared_expert_intermediate_size: 0,
        intermediate_size: 2880,
        vocab_size: 201088,
        rope_theta: 150000.0,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 131072,
        linear: None,
        first_dense_layers: 0,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 199999,
        mla: None,
        gpt_oss: Some(GPT_OSS_ATTENTION),
    },
    Preset {
        name: "tiny-qwen3.5-moe",
        family: Family::Qwen35Moe,
        source: "qwen3.5-35b-a3b's structure at test size",
        hidden_size: 128,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        experts: 16,
        experts_per_token: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 64,
        intermediate_size: 0,
        vocab_size: 1024,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 4096,
        linear: Some(LinearAttention {
            key_heads: 2,
            value_heads: 4,
            key_head_dim: 32,
            value_head_dim: 32,
            conv_kernel: 4,
            full_attention_interval: 4,
        }),
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 1000,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "tiny-qwen3-moe",
        family: Family::Qwen3Moe,
        source: "qwen3-30b-a3b's structure at test size",
        hidden_size: 128,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        experts: 16,
        experts_per_token: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 0,
        intermediate_size: 256,
        vocab_size: 1024,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 4096,
        linear: None,
        first_dense_layers: 0,
        qk_norm: true,
        routed_scaling_factor: 1.0,
        special_tokens_start: 1000,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "tiny-glm4-moe",
        family: Family::Glm4Moe,
        source: "glm-4.5-air's structure at test size",
        hidden_size: 128,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        experts: 16,
        experts_per_token: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 64,
        intermediate_size: 256,
        vocab_size: 1024,
        rope_theta: 1e6,
        partial_rotary_factor: 0.5,
        max_position_embeddings: 4096,
        linear: None,
        first_dense_layers: 1,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 1000,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "tiny-deepseek-v3",
        family: Family::DeepseekV3,
        source: "deepseek-v3's structure at test size",
        hidden_size: 128,
        layers: 4,
        heads: 4,
        kv_heads: 4,
        head_dim: 96,
        experts: 16,
        experts_per_token: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 64,
        intermediate_size: 256,
        vocab_size: 1024,
        rope_theta: 10000.0,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 4096,
        linear: None,
        first_dense_layers: 1,
        qk_norm: false,
        routed_scaling_factor: 2.5,
        special_tokens_start: 1000,
        mla: Some(Mla {
            model_type: "deepseek_v3",
            q_lora_rank: Some(64),
            kv_lora_rank: 128,
            qk_nope_head_dim: 64,
            qk_rope_head_dim: 32,
            v_head_dim: 32,
            n_group: 4,
            topk_group: 2,
            yarn: (40.0, 4096, 32.0, 1.0),
        }),
        gpt_oss: None,
    },
    Preset {
        name: "tiny-mixtral",
        family: Family::Mixtral,
        source: "mixtral-8x7b's structure at test size",
        hidden_size: 128,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        experts: 8,
        experts_per_token: 2,
        moe_intermediate_size: 96,
        shared_expert_intermediate_size: 0,
        intermediate_size: 96,
        vocab_size: 1024,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 4096,
        linear: None,
        first_dense_layers: 0,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 1000,
        mla: None,
        gpt_oss: None,
    },
    Preset {
        name: "tiny-gpt-oss",
        family: Family::GptOss,
        source: "gpt-oss-20b's structure at test size (a window of 8, so that short tests cross it)",
        hidden_size: 128,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        experts: 8,
        experts_per_token: 2,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 0,
        intermediate_size: 64,
        vocab_size: 1024,
        rope_theta: 150000.0,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 4096,
        linear: None,
        first_dense_layers: 0,
        qk_norm: false,
        routed_scaling_factor: 1.0,
        special_tokens_start: 1000,
        mla: None,
        gpt_oss: Some(GptOssAttention {
            sliding_window: 8,
            ..GPT_OSS_ATTENTION
        }),
    },
];

impl Preset {
    /// The preset called `name`, or an error listing the known ones.
    pub fn find(name: &str) -> Result<&'static Preset, String> {
        PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
            let names: Vec<_> = PRESETS.iter().map(|p| p.name).collect();
            format!(
                "unknown preset `{name}`; known presets: {}",
                names.join(", ")
            )
        })
    }

    /// Whether layer `l` (0-based) is full attention.
    pub fn is_full_attention(&self, l: usize) -> bool {
        match self.linear {
            None => true,
            Some(lin) => (l + 1).is_multiple_of(lin.full_attention_interval),
        }
    }

    /// Id of `<|im_end|>`, the end-of-turn token.
    pub fn eos_token_id(&self) -> usize {
        self.special_tokens_start + 2
    }

    /// Module-path prefix of the decoder stack as mlx-lm writes it (`...layers.N`).
    pub fn model_prefix(&self) -> &'static str {
        match self.family {
            Family::Qwen3Moe
            | Family::Mixtral
            | Family::Glm4Moe
            | Family::DeepseekV3
            | Family::GptOss => "model",
            Family::Qwen35Moe => "language_model.model",
        }
    }

    /// Path of the output head.
    pub fn lm_head(&self) -> &'static str {
        match self.family {
            Family::Qwen3Moe
            | Family::Mixtral
            | Family::Glm4Moe
            | Family::DeepseekV3
            | Family::GptOss => "lm_head",
            Family::Qwen35Moe => "language_model.lm_head",
        }
    }

    /// The MoE block's module name under `...layers.N.`.
    pub fn moe_module(&self) -> &'static str {
        match self.family {
            Family::Mixtral => "block_sparse_moe",
            Family::Qwen3Moe
            | Family::Qwen35Moe
            | Family::Glm4Moe
            | Family::DeepseekV3
            | Family::GptOss => "mlp",
        }
    }

    /// The router's module name under the MoE block (`gate`; gpt-oss's `router`).
    pub fn router_module(&self) -> &'static str {
        match self.family {
            Family::GptOss => "router",
            _ => "gate",
        }
    }

    /// Whether layer `l` (0-based) attends through a sliding window (gpt-oss: the even layers,
    /// as its `layer_types` starts with `sliding_attention`).
    pub fn is_sliding(&self, l: usize) -> bool {
        self.gpt_oss.is_some() && l.is_multiple_of(2)
    }

    /// The config.json mlx-lm writes for this model quantised to `bits` with `group_size`
    /// (router gates at 8 bits, as mlx-lm's `quant_predicate` does for these families).
    pub fn config_json(&self, bits: u32, group_size: usize) -> Value {
        let mut quant = Map::new();
        quant.insert("group_size".into(), json!(group_size));
        quant.insert("bits".into(), json!(bits));
        quant.insert("mode".into(), json!("affine"));
        let router = json!({"group_size": 64, "bits": 8});
        // GLM's and DeepSeek's router is not a linear layer for mlx-lm: it stays in bf16, with
        // no entry.
        let router_layers = match self.family {
            Family::Glm4Moe | Family::DeepseekV3 => 0,
            _ => self.layers,
        };
        for l in 0..router_layers {
            let p = format!("{}.layers.{l}.{}", self.model_prefix(), self.moe_module());
            quant.insert(format!("{p}.{}", self.router_module()), router.clone());
            if self.shared_expert_intermediate_size > 0 {
                quant.insert(format!("{p}.shared_expert_gate"), router.clone());
            }
        }
        let quant = Value::Object(quant);
        let eos = self.eos_token_id();
        let endoftext = self.special_tokens_start;
        match (self.family, self.linear) {
            (Family::Qwen35Moe, Some(lin)) => {
                let layer_types: Vec<&str> = (0..self.layers)
                    .map(|l| {
                        if self.is_full_attention(l) {
                            "full_attention"
                        } else {
                            "linear_attention"
                        }
                    })
                    .collect();
                let rotary_pairs = (self.head_dim as f64 * self.partial_rotary_factor) as usize / 2;
                // Qwen3.5's multimodal rotary sections (t, h, w); text positions make them plain
                // rope. Split as the published [11, 11, 10] for 32 pairs.
                let s0 = rotary_pairs.div_ceil(3);
                let s1 = (rotary_pairs - s0).div_ceil(2);
                let mrope_section = json!([s0, s1, rotary_pairs - s0 - s1]);
                json!({
                    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                    "model_type": "qwen3_5_moe",
                    "eos_token_id": [eos, endoftext],
                    "tie_word_embeddings": false,
                    "quantization": quant,
                    "quantization_config": quant,
                    "text_config": {
                        "model_type": "qwen3_5_moe_text",
                        "attention_bias": false,
                        "attn_output_gate": true,
                        "dtype": "bfloat16",
                        "eos_token_id": eos,
                        "full_attention_interval": lin.full_attention_interval,
                        "head_dim": self.head_dim,
                        "hidden_act": "silu",
                        "hidden_size": self.hidden_size,
                        "layer_types": layer_types,
                        "linear_conv_kernel_dim": lin.conv_kernel,
                        "linear_key_head_dim": lin.key_head_dim,
                        "linear_num_key_heads": lin.key_heads,
                        "linear_num_value_heads": lin.value_heads,
                        "linear_value_head_dim": lin.value_head_dim,
                        "max_position_embeddings": self.max_position_embeddings,
                        "moe_intermediate_size": self.moe_intermediate_size,
                        "norm_topk_prob": true,
                        "num_attention_heads": self.heads,
                        "num_experts": self.experts,
                        "num_experts_per_tok": self.experts_per_token,
                        "num_hidden_layers": self.layers,
                        "num_key_value_heads": self.kv_heads,
                        "rms_norm_eps": 1e-6,
                        "rope_parameters": {
                            "mrope_interleaved": true,
                            "mrope_section": mrope_section,
                            "rope_theta": self.rope_theta,
                            "partial_rotary_factor": self.partial_rotary_factor,
                            "type": "default",
                        },
                        "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                        "tie_word_embeddings": false,
                        "vocab_size": self.vocab_size,
                    },
                })
            }
            (Family::Glm4Moe, _) => json!({
                "architectures": ["Glm4MoeForCausalLM"],
                "model_type": "glm4_moe",
                "attention_bias": true,
                "eos_token_id": [eos, endoftext],
                "first_k_dense_replace": self.first_dense_layers,
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "max_position_embeddings": self.max_position_embeddings,
                "moe_intermediate_size": self.moe_intermediate_size,
                "n_group": 1,
                "n_routed_experts": self.experts,
                "n_shared_experts": self.shared_expert_intermediate_size / self.moe_intermediate_size,
                "norm_topk_prob": true,
                "num_attention_heads": self.heads,
                "num_experts_per_tok": self.experts_per_token,
                "num_hidden_layers": self.layers,
                "num_key_value_heads": self.kv_heads,
                "partial_rotary_factor": self.partial_rotary_factor,
                "rms_norm_eps": 1e-5,
                "rope_scaling": null,
                "rope_theta": self.rope_theta,
                "routed_scaling_factor": self.routed_scaling_factor,
                "tie_word_embeddings": false,
                "topk_group": 1,
                "torch_dtype": "bfloat16",
                "use_qk_norm": self.qk_norm,
                "vocab_size": self.vocab_size,
                "quantization": quant,
                "quantization_config": quant,
            }),
            (Family::DeepseekV3, _) => {
                let mla = self.mla.expect("deepseek_v3 presets have MLA dimensions");
                let (factor, original, beta_fast, beta_slow) = mla.yarn;
                json!({
                    "architectures": ["DeepseekV3ForCausalLM"],
                    "model_type": mla.model_type,
                    "attention_bias": false,
                    "bos_token_id": endoftext,
                    "eos_token_id": eos,
                    "first_k_dense_replace": self.first_dense_layers,
                    "hidden_act": "silu",
                    "hidden_size": self.hidden_size,
                    "intermediate_size": self.intermediate_size,
                    "kv_lora_rank": mla.kv_lora_rank,
                    "max_position_embeddings": self.max_position_embeddings,
                    "moe_intermediate_size": self.moe_intermediate_size,
                    "moe_layer_freq": 1,
                    "n_group": mla.n_group,
                    "n_routed_experts": self.experts,
                    "n_shared_experts": self.shared_expert_intermediate_size / self.moe_intermediate_size,
                    "norm_topk_prob": true,
                    "num_attention_heads": self.heads,
                    "num_experts_per_tok": self.experts_per_token,
                    "num_hidden_layers": self.layers,
                    "num_key_value_heads": self.heads,
                    "q_lora_rank": mla.q_lora_rank,
                    "qk_nope_head_dim": mla.qk_nope_head_dim,
                    "qk_rope_head_dim": mla.qk_rope_head_dim,
                    "rms_norm_eps": 1e-6,
                    "rope_scaling": {
                        "type": "yarn",
                        "factor": factor,
                        "original_max_position_embeddings": original,
                        "beta_fast": beta_fast,
                        "beta_slow": beta_slow,
                        "mscale": 1.0,
                        "mscale_all_dim": 1.0,
                    },
                    "rope_theta": self.rope_theta,
                    "routed_scaling_factor": self.routed_scaling_factor,
                    "scoring_func": "sigmoid",
                    "tie_word_embeddings": false,
                    "topk_group": mla.topk_group,
                    "topk_method": "noaux_tc",
                    "torch_dtype": "bfloat16",
                    "v_head_dim": mla.v_head_dim,
                    "vocab_size": self.vocab_size,
                    "quantization": quant,
                    "quantization_config": quant,
                })
            }
            (Family::GptOss, _) => {
                let g = self
                    .gpt_oss
                    .expect("gpt_oss presets have their attention settings");
                let (factor, original, beta_fast, beta_slow) = g.yarn;
                let layer_types: Vec<&str> = (0..self.layers)
                    .map(|l| {
                        if self.is_sliding(l) {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                json!({
                    "architectures": ["GptOssForCausalLM"],
                    "model_type": "gpt_oss",
                    "attention_bias": true,
                    "attention_dropout": 0.0,
                    "eos_token_id": eos,
                    "experts_per_token": self.experts_per_token,
                    "head_dim": self.head_dim,
                    "hidden_act": "silu",
                    "hidden_size": self.hidden_size,
                    "initial_context_length": original,
                    "initializer_range": 0.02,
                    "intermediate_size": self.moe_intermediate_size,
                    "layer_types": layer_types,
                    "max_position_embeddings": self.max_position_embeddings,
                    "num_attention_heads": self.heads,
                    "num_experts_per_tok": self.experts_per_token,
                    "num_hidden_layers": self.layers,
                    "num_key_value_heads": self.kv_heads,
                    "num_local_experts": self.experts,
                    "output_router_logits": false,
                    "pad_token_id": endoftext,
                    "rms_norm_eps": 1e-5,
                    "rope_scaling": {
                        "beta_fast": beta_fast,
                        "beta_slow": beta_slow,
                        "factor": factor,
                        "original_max_position_embeddings": original,
                        "rope_type": "yarn",
                        "truncate": false,
                    },
                    "rope_theta": self.rope_theta,
                    "router_aux_loss_coef": 0.9,
                    "sliding_window": g.sliding_window,
                    "swiglu_limit": g.swiglu_limit,
                    "tie_word_embeddings": false,
                    "use_cache": true,
                    "vocab_size": self.vocab_size,
                    "quantization": quant,
                    "quantization_config": quant,
                })
            }
            (Family::Mixtral, _) => json!({
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "bos_token_id": endoftext,
                "eos_token_id": eos,
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.moe_intermediate_size,
                "max_position_embeddings": self.max_position_embeddings,
                "num_attention_heads": self.heads,
                "num_experts_per_tok": self.experts_per_token,
                "num_hidden_layers": self.layers,
                "num_key_value_heads": self.kv_heads,
                "num_local_experts": self.experts,
                "rms_norm_eps": 1e-5,
                "rope_theta": self.rope_theta,
                "sliding_window": null,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "vocab_size": self.vocab_size,
                "quantization": quant,
                "quantization_config": quant,
            }),
            _ => json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "attention_bias": false,
                "bos_token_id": endoftext,
                "decoder_sparse_step": 1,
                "eos_token_id": eos,
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "max_position_embeddings": self.max_position_embeddings,
                "mlp_only_layers": [],
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": true,
                "num_attention_heads": self.heads,
                "num_experts": self.experts,
                "num_experts_per_tok": self.experts_per_token,
                "num_hidden_layers": self.layers,
                "num_key_value_heads": self.kv_heads,
                "rms_norm_eps": 1e-6,
                "rope_scaling": null,
                "rope_theta": self.rope_theta,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "vocab_size": self.vocab_size,
                "quantization": quant,
                "quantization_config": quant,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mrope_sections_cover_the_rotary_pairs() {
        let p = Preset::find("qwen3.5-35b-a3b").unwrap();
        let c = p.config_json(4, 64);
        let rp = &c["text_config"]["rope_parameters"];
        // The published value for head_dim 256 at a 0.25 rotary factor.
        assert_eq!(rp["mrope_section"], json!([11, 11, 10]));
        let tiny = Preset::find("tiny-qwen3.5-moe").unwrap().config_json(4, 64);
        let s = &tiny["text_config"]["rope_parameters"]["mrope_section"];
        let sum: u64 = s
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(sum, 8);
    }

    #[test]
    fn layer_schedule_is_three_linear_then_one_full() {
        let p = Preset::find("qwen3.5-122b-a10b").unwrap();
        let full: Vec<usize> = (0..p.layers).filter(|&l| p.is_full_attention(l)).collect();
        assert_eq!(full.len(), 12);
        assert_eq!(full[0], 3);
        assert!(Preset::find("qwen3-30b-a3b").unwrap().is_full_attention(0));
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let e = Preset::find("qwen9").unwrap_err();
        assert!(
            e.contains("qwen3.5-35b-a3b") && e.contains("tiny-qwen3-moe"),
            "{e}"
        );
    }

    #[test]
    fn gpt_oss_presets_have_the_published_numbers() {
        let small = Preset::find("gpt-oss-20b").unwrap();
        let big = Preset::find("gpt-oss-120b").unwrap();
        for p in [small, big] {
            assert_eq!(p.family, Family::GptOss);
            assert_eq!(
                (p.hidden_size, p.heads, p.kv_heads, p.head_dim),
                (2880, 64, 8, 64)
            );
            assert_eq!((p.moe_intermediate_size, p.experts_per_token), (2880, 4));
            assert_eq!((p.vocab_size, p.max_position_embeddings), (201088, 131072));
            assert_eq!(p.rope_theta, 150000.0);
            assert_eq!(p.shared_expert_intermediate_size, 0);
            assert_eq!(
                p.gpt_oss,
                Some(GptOssAttention {
                    sliding_window: 128,
                    swiglu_limit: 7.0,
                    yarn: (32.0, 4096, 32.0, 1.0),
                })
            );
            // o200k_harmony's <|endoftext|>; the end of turn is a real token below the vocabulary.
            assert_eq!(p.special_tokens_start, 199999);
            assert!(p.eos_token_id() < p.vocab_size);
        }
        assert_eq!((small.layers, small.experts), (24, 32));
        assert_eq!((big.layers, big.experts), (36, 128));
        let tiny = Preset::find("tiny-gpt-oss").unwrap();
        assert_eq!(
            (tiny.hidden_size, tiny.layers, tiny.heads, tiny.kv_heads),
            (128, 4, 4, 2)
        );
        assert_eq!((tiny.experts, tiny.experts_per_token), (8, 2));
        assert_eq!(tiny.gpt_oss.unwrap().sliding_window, 8);
    }

    #[test]
    fn gpt_oss_config_is_what_the_engine_reads() {
        let p = Preset::find("gpt-oss-20b").unwrap();
        let c = p.config_json(4, 64);
        assert_eq!(c["model_type"], "gpt_oss");
        for (key, want) in [
            ("hidden_size", json!(2880)),
            ("intermediate_size", json!(2880)),
            ("num_hidden_layers", json!(24)),
            ("num_attention_heads", json!(64)),
            ("num_key_value_heads", json!(8)),
            ("head_dim", json!(64)),
            ("num_local_experts", json!(32)),
            ("num_experts_per_tok", json!(4)),
            ("experts_per_token", json!(4)),
            ("vocab_size", json!(201088)),
            ("rope_theta", json!(150000.0)),
            ("sliding_window", json!(128)),
            ("swiglu_limit", json!(7.0)),
            ("max_position_embeddings", json!(131072)),
            ("tie_word_embeddings", json!(false)),
            ("eos_token_id", json!(200001)),
        ] {
            assert_eq!(c[key], want, "{key}");
        }
        assert_eq!(
            c["rope_scaling"],
            json!({"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                   "truncate": false})
        );
        let types = c["layer_types"].as_array().unwrap();
        assert_eq!(types.len(), 24);
        for (l, t) in types.iter().enumerate() {
            let want = ["sliding_attention", "full_attention"][l % 2];
            assert_eq!(t, want, "layer {l}");
        }
        for q in [&c["quantization"], &c["quantization_config"]] {
            assert_eq!((&q["bits"], &q["group_size"]), (&json!(4), &json!(64)));
            for l in 0..24 {
                let r = &q[format!("model.layers.{l}.mlp.router")];
                assert_eq!(r, &json!({"group_size": 64, "bits": 8}), "layer {l}");
            }
            assert!(q.get("model.layers.0.mlp.gate").is_none());
        }
    }

    #[test]
    fn special_tokens_fit_the_vocabulary() {
        for p in PRESETS {
            assert!(
                p.special_tokens_start + SPECIAL_TOKENS.len() <= p.vocab_size,
                "{}",
                p.name
            );
        }
    }
}
