#!/usr/bin/env python3
"""Generate the DeepSeek-V3 (deepseek_v3 / kimi_k2) reference fixtures (the driver is
scripts/family_fixtures.py).

    tests/fixtures/deepseek_v3-q4   mlx-community layout, mlx_lm convert -q (4-bit g64): the
                                    per-head embed_q / unembed_out that mlx-lm makes of kv_b_proj
                                    (quantized), stacked mlp.switch_mlp experts; Kimi K2's options:
                                    model_type kimi_k2, one group, routed_scaling_factor 2.5,
                                    queries from q_proj (no q_lora_rank)
    tests/fixtures/deepseek_v3-hf   official layout (kv_b_proj, per-expert mlp.experts.E.*_proj),
                                    2 shards, bf16; DeepSeek-V3's options: q_a_proj / q_b_proj,
                                    4 groups of 2 experts (best 2 kept), two shared experts' width

Both: Multi-head Latent Attention (kv_lora_rank 128, 64 values without position and 32 rotated per
query head, 32 per value head), the interleaved rotary form with YaRN (factor 40 over 4096
positions, mscale = mscale_all_dim = 1: the softmax scale grows by 1.369^2), layer 0 dense, a
float32 e_score_correction_bias that moves the choices. An independent float64 numpy forward pass
(the un-absorbed attention, written from the math) cross-checks mlx-lm's logits.

Usage:
    .venv/bin/python scripts/make_fixtures_deepseek_v3.py [--only NAME...] [-v]
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "family_fixtures", Path(__file__).resolve().parent / "family_fixtures.py")
ff = importlib.util.module_from_spec(_spec)
sys.modules["family_fixtures"] = ff
_spec.loader.exec_module(ff)

np, mx = ff.np, ff.mx
from mlx_lm.models import deepseek_v3  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

VOCAB = ff.VOCAB
H, HEADS, LAYERS, EXPERTS, MOE_INTER, DENSE_INTER = 128, 4, 3, 8, 64, 192
KV_LORA, NOPE, ROPE, V_DIM = 128, 64, 32, 32
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclass
class Spec:
    name: str
    layout: str  # "mlx" | "hf"
    seed: int
    text: str
    model_type: str = "deepseek_v3"
    q_lora_rank: int | None = 64
    top_k: int = 3
    groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0
    shared_experts: int = 1
    quant_bits: int | None = None
    quant_group: int | None = None
    shards: int = 1
    description: str = ""


SPECS = [
    Spec(
        name="deepseek_v3-q4",
        layout="mlx",
        seed=9000,
        text="<|im_start|>user\nWhy do cats land on their feet when they fall?<|im_end|>\n",
        model_type="kimi_k2",
        q_lora_rank=None,
        scaling=2.5,
        quant_bits=4,
        quant_group=64,
        description="model_type kimi_k2; mlx_lm convert -q: 4-bit affine g64, kv_b_proj split by "
        "mlx-lm into per-head embed_q [4, 128, 64] and unembed_out [4, 32, 128] (quantized); router "
        "weight bf16, e_score_correction_bias float32; q_proj (no q_lora_rank); top-3 of 8, one "
        "group, routed_scaling_factor 2.5, one shared expert of 64; layer 0 dense.",
    ),
    Spec(
        name="deepseek_v3-hf",
        layout="hf",
        seed=9100,
        text="Dave sold 12 kites at the fair in 2003.",
        top_k=2,
        groups=4,
        top_groups=2,
        shared_experts=2,
        shards=2,
        description="official Hugging Face layout (kv_b_proj [4 x (64 + 32), 128], per-expert "
        "mlp.experts.E.*_proj, router mlp.gate with a float32 e_score_correction_bias), bf16, two "
        "shards + index; q_a_proj (rank 64) / q_a_layernorm / q_b_proj; top-2 of 8 in 4 groups of "
        "2 (best 2 groups kept), routed_scaling_factor 1.0, shared experts 2 x 64; layer 0 dense.",
    ),
]

ROUTER_GAIN, ATTN_OUT_GAIN, MLP_OUT_GAIN, EMBED_STD, ROW_SCALE_SIGMA = 2.0, 0.02, 0.03, 0.02, 0.5


def hf_config(spec: Spec, tok: Tokenizer) -> dict:
    """config.json as the official DeepSeek-V3 checkpoints ship it (bf16 here, no fp8)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": DENSE_INTER,
        "kv_lora_rank": KV_LORA,
        "max_position_embeddings": 163840,
        # kimi_k2 is set after conversion (post_build): transformers does not know it.
        "model_type": "deepseek_v3",
        "moe_intermediate_size": MOE_INTER,
        "moe_layer_freq": 1,
        "n_group": spec.groups,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": spec.shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": HEADS,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": spec.q_lora_rank,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "rms_norm_eps": 1e-6,
        "rope_scaling": YARN,
        "rope_theta": 10000,
        "routed_scaling_factor": spec.scaling,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": spec.top_groups,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": True,
        "v_head_dim": V_DIM,
        "vocab_size": VOCAB,
    }


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    qh = NOPE + ROPE

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    def ffn(p, inter):
        w[f"{p}.gate_proj.weight"] = normal((inter, H), H**-0.5)
        w[f"{p}.up_proj.weight"] = normal((inter, H), H**-0.5)
        w[f"{p}.down_proj.weight"] = normal((H, inter), MLP_OUT_GAIN * inter**-0.5 * 2)

    def layer(i):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        a = f"{p}.self_attn"
        # Queries and keys at moderate gain: attention sharp enough to matter, not so sharp that
        # a 4-bit rounding flips it (the latent is normalised; its gain is in kv_b_proj).
        if spec.q_lora_rank is None:
            w[f"{a}.q_proj.weight"] = normal((HEADS * qh, H), 1.5 * H**-0.5)
        else:
            r = spec.q_lora_rank
            w[f"{a}.q_a_proj.weight"] = normal((r, H), H**-0.5)
            w[f"{a}.q_a_layernorm.weight"] = uniform((r,), 0.6, 1.4)
            w[f"{a}.q_b_proj.weight"] = normal((HEADS * qh, r), 1.5 * r**-0.5)
        w[f"{a}.kv_a_proj_with_mqa.weight"] = normal((KV_LORA + ROPE, H), 1.5 * H**-0.5)
        w[f"{a}.kv_a_layernorm.weight"] = uniform((KV_LORA,), 0.6, 1.4)
        w[f"{a}.kv_b_proj.weight"] = normal((HEADS * (NOPE + V_DIM), KV_LORA), 1.5 * KV_LORA**-0.5)
        w[f"{a}.o_proj.weight"] = normal((H, HEADS * V_DIM), ATTN_OUT_GAIN * (HEADS * V_DIM) ** -0.5 * 2)
        w[f"{p}.post_attention_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        m = f"{p}.mlp"
        if i == 0:
            ffn(m, DENSE_INTER)
            return
        w[f"{m}.gate.weight"] = normal((EXPERTS, H), ROUTER_GAIN * H**-0.5)
        w[f"{m}.gate.e_score_correction_bias"] = uniform((EXPERTS,), -0.1, 0.1)
        for e in range(EXPERTS):
            ffn(f"{m}.experts.{e}", MOE_INTER)
        ffn(f"{m}.shared_experts", MOE_INTER * spec.shared_experts)

    w = {"model.embed_tokens.weight": normal((VOCAB, H), EMBED_STD)}
    for i in range(LAYERS):
        layer(i)
    rng = np.random.default_rng(head_seed)
    w["model.norm.weight"] = uniform((H,), 0.6, 1.4)
    s = np.exp(rng.standard_normal((VOCAB, 1)) * ROW_SCALE_SIGMA)
    s = (s / np.sqrt(np.mean(s * s))).astype(np.float32)
    w["lm_head.weight"] = normal((VOCAB, H), H**-0.5) * s
    return w


def yarn_inv_freq(dims, base, s):
    """YaRN's blended frequencies, as transformers computes them (truncated ramp ends)."""
    def corr(turns):
        return dims * math.log(s["original_max_position_embeddings"] / (turns * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(corr(s["beta_fast"])), 0)
    high = min(math.ceil(corr(s["beta_slow"])), dims - 1)
    if low == high:
        high += 0.001
    extra = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return extra / s["factor"] * ramp + extra * (1 - ramp)


def numpy_forward(path: Path, tokens: list[int]) -> np.ndarray:
    """DeepSeek-V3 forward in float64 numpy, written from the math (not from mlx ops): the
    un-absorbed attention, each head's keys and values expanded from the latent."""
    c = json.loads((path / "config.json").read_text())
    w = ff.mf.load_dequantized_f64(path, c)
    nh, nope, rd, vd, lora = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                              c["v_head_dim"], c["kv_lora_rank"])
    eps, k, T = c["rms_norm_eps"], c["num_experts_per_tok"], len(tokens)
    s = c["rope_scaling"]
    inv = yarn_inv_freq(rd, c["rope_theta"], s)
    m_all = 0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1.0
    scale = (nope + rd) ** -0.5 * m_all * m_all

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def rope(x):  # interleaved pairs (2i, 2i + 1) at frequency i
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    def ffn(p, x):
        return w[f"{p}.down_proj.weight"] @ (silu(w[f"{p}.gate_proj.weight"] @ x) * (w[f"{p}.up_proj.weight"] @ x))

    def expert(m, e, x):
        if f"{m}.switch_mlp.gate_proj.weight" in w:  # mlx stacks [E, out, in]
            g_, u_, d_ = (w[f"{m}.switch_mlp.{n}.weight"][e] for n in ("gate_proj", "up_proj", "down_proj"))
            return d_ @ (silu(g_ @ x) * (u_ @ x))
        return ffn(f"{m}.experts.{e}", x)

    h = w["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        x = rms(h, w[f"{p}.input_layernorm.weight"])
        if f"{a}.q_proj.weight" in w:
            q = x @ w[f"{a}.q_proj.weight"].T
        else:
            q = rms(x @ w[f"{a}.q_a_proj.weight"].T, w[f"{a}.q_a_layernorm.weight"]) @ w[f"{a}.q_b_proj.weight"].T
        q = q.reshape(T, nh, nope + rd)
        q_nope, q_pe = q[..., :nope], rope(q[..., nope:])
        ckv = x @ w[f"{a}.kv_a_proj_with_mqa.weight"].T
        latent = rms(ckv[:, :lora], w[f"{a}.kv_a_layernorm.weight"])
        k_pe = rope(ckv[:, None, lora:])[:, 0]
        if f"{a}.kv_b_proj.weight" in w:
            kvb = w[f"{a}.kv_b_proj.weight"].reshape(nh, nope + vd, lora)
            wk, wv = kvb[:, :nope], kvb[:, nope:]
        else:  # mlx's per-head split: embed_q [nh, lora, nope], unembed_out [nh, vd, lora]
            wk, wv = w[f"{a}.embed_q.weight"].transpose(0, 2, 1), w[f"{a}.unembed_out.weight"]
        att = np.zeros((T, nh, vd))
        for hh in range(nh):
            k_nope = latent @ wk[hh].T
            v = latent @ wv[hh].T
            sc = (q_nope[:, hh] @ k_nope.T + q_pe[:, hh] @ k_pe.T) * scale
            sc = np.where(causal, sc, -np.inf)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ v
        h = h + att.reshape(T, nh * vd) @ w[f"{a}.o_proj.weight"].T
        x = rms(h, w[f"{p}.post_attention_layernorm.weight"])
        m = f"{p}.mlp"
        if i < c["first_k_dense_replace"]:
            h = h + np.stack([ffn(m, x[t]) for t in range(T)])
            continue
        sig = 1.0 / (1.0 + np.exp(-(x @ w[f"{m}.gate.weight"].T)))
        choice, _ = ff.noaux_tc_select(sig, w[f"{m}.gate.e_score_correction_bias"], k, c["n_group"], c["topk_group"])
        for t in range(T):
            top = np.argsort(-choice[t], kind="stable")[:k]
            wt = sig[t, top]
            if c["norm_topk_prob"] and k > 1:
                wt = wt / wt.sum()
            wt = wt * c["routed_scaling_factor"]
            h[t] += sum(s_ * expert(m, e, x[t]) for e, s_ in zip(top, wt)) + ffn(f"{m}.shared_experts", x[t])
    h = rms(h, w["model.norm.weight"])
    return h @ w["lm_head.weight"].T


def post_build(spec: Spec, dst: Path) -> None:
    """Kimi K2's model_type, which mlx-lm reads as deepseek_v3."""
    if spec.model_type != "deepseek_v3":
        c = json.loads((dst / "config.json").read_text())
        c["model_type"] = spec.model_type
        ff.mf.write_json(dst / "config.json", c)


FAMILY = ff.Family(
    specs=SPECS,
    hf_config=hf_config,
    make_weights=make_weights,
    moe_class=deepseek_v3.DeepseekV3MoE,
    router_scores=ff.noaux_tc_router_scores,
    numpy_forward=numpy_forward,
    post_build=post_build,
)

if __name__ == "__main__":
    sys.exit(ff.main(FAMILY, __doc__))
