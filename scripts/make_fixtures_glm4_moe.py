#!/usr/bin/env python3
"""Generate the GLM-4.5 MoE (glm4_moe) reference fixtures (the driver is scripts/family_fixtures.py).

    tests/fixtures/glm4_moe-q4   mlx-community layout (mlp.switch_mlp stacks), mlx_lm convert -q
                                 (4-bit g64; the router, not a Linear, stays bf16), GLM-4.5-Air's
                                 options: no q/k norm, one group, scaling 1.0, one shared expert
    tests/fixtures/glm4_moe-hf   official layout (per-expert mlp.experts.E.*_proj), 2 shards,
                                 GLM-4.5's and DeepSeek-V3's options: q/k norm, 4 groups of 2
                                 experts (best 2 kept), routed_scaling_factor 2.5, two shared
                                 experts' width, head_dim 48, one KV head, and a
                                 multi-token-prediction layer after the last (not run)

Both: biases on q, k, v; rotary on the first half of each head; layer 0 dense
(first_k_dense_replace 1); a float32 e_score_correction_bias that moves the choices. An independent
float64 numpy forward pass cross-checks mlx-lm's logits.

Usage:
    .venv/bin/python scripts/make_fixtures_glm4_moe.py [--only NAME...] [-v]
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "family_fixtures", Path(__file__).resolve().parent / "family_fixtures.py")
ff = importlib.util.module_from_spec(_spec)
sys.modules["family_fixtures"] = ff
_spec.loader.exec_module(ff)

np, mx = ff.np, ff.mx
from mlx_lm.models import glm4_moe  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

VOCAB = ff.VOCAB
H, HEADS, LAYERS, EXPERTS, MOE_INTER, DENSE_INTER = 128, 4, 3, 8, 64, 192


@dataclass
class Spec:
    name: str
    layout: str  # "mlx" | "hf"
    seed: int
    text: str
    head_dim: int = 32
    kv_heads: int = 2
    top_k: int = 3
    groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0
    shared_experts: int = 1
    qk_norm: bool = False
    mtp_layer: bool = False
    quant_bits: int | None = None
    quant_group: int | None = None
    shards: int = 1
    description: str = ""


SPECS = [
    Spec(
        name="glm4_moe-q4",
        layout="mlx",
        seed=8000,
        text="<|im_start|>user\nWhat makes the tide come back twice a day?<|im_end|>\n",
        quant_bits=4,
        quant_group=64,
        description="mlx_lm convert -q: 4-bit affine g64 (router weight bf16: mlx-lm's MoEGate is "
        "not a Linear; e_score_correction_bias float32); top-3 of 8, one group, "
        "routed_scaling_factor 1.0, one shared expert of 64, no q/k norm, q/k/v biases, "
        "rotary on 16 of 32, layer 0 dense.",
    ),
    Spec(
        name="glm4_moe-hf",
        layout="hf",
        seed=8100,
        text="Carol found 7 keys under the bridge in 1987.",
        head_dim=48,
        kv_heads=1,
        top_k=2,
        groups=4,
        top_groups=2,
        scaling=2.5,
        shared_experts=2,
        qk_norm=True,
        mtp_layer=True,
        shards=2,
        description="official Hugging Face layout (per-expert mlp.experts.E.*_proj, router "
        "mlp.gate with a float32 e_score_correction_bias), bf16, two shards + index; top-2 of 8 "
        "in 4 groups of 2 (best 2 groups kept), routed_scaling_factor 2.5, shared experts 2 x 64, "
        "q/k norm, q/k/v biases, head_dim 48 (q_proj out 192), 1 KV head, rotary on 24 of 48, "
        "layer 0 dense; a multi-token-prediction layer 3 that is not run.",
    ),
]

ROUTER_GAIN, ATTN_OUT_GAIN, MLP_OUT_GAIN, EMBED_STD, ROW_SCALE_SIGMA = 2.0, 0.02, 0.03, 0.02, 0.5


def hf_config(spec: Spec, tok: Tokenizer) -> dict:
    """config.json as the official GLM-4.5 checkpoints ship it."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        "first_k_dense_replace": 1,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": DENSE_INTER,
        "max_position_embeddings": 512,
        "model_type": "glm4_moe",
        "moe_intermediate_size": MOE_INTER,
        "n_group": spec.groups,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": spec.shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": spec.kv_heads,
        "num_nextn_predict_layers": 1 if spec.mtp_layer else 0,
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 1e6,
        "routed_scaling_factor": spec.scaling,
        "tie_word_embeddings": False,
        "topk_group": spec.top_groups,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0",
        "use_cache": True,
        "use_qk_norm": spec.qk_norm,
        "vocab_size": VOCAB,
    }


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd, nkv = spec.head_dim, spec.kv_heads

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
        # Without q/k norms the projections lift q and k to sharp attention themselves.
        gain = 1.0 if spec.qk_norm else 2.5
        for n, rows in (("q", HEADS * hd), ("k", nkv * hd), ("v", nkv * hd)):
            w[f"{a}.{n}_proj.weight"] = normal((rows, H), gain * H**-0.5)
            w[f"{a}.{n}_proj.bias"] = normal((rows,), 0.3)
        w[f"{a}.o_proj.weight"] = normal((H, HEADS * hd), ATTN_OUT_GAIN * (HEADS * hd) ** -0.5 * 2)
        if spec.qk_norm:
            w[f"{a}.q_norm.weight"] = uniform((hd,), 0.8, 2.2)
            w[f"{a}.k_norm.weight"] = uniform((hd,), 0.8, 2.2)
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
    if spec.mtp_layer:
        # GLM-4.5's next-token-prediction layer: a whole MoE layer and its projections.
        layer(LAYERS)
        p = f"model.layers.{LAYERS}"
        w[f"{p}.enorm.weight"] = uniform((H,), 0.6, 1.4)
        w[f"{p}.hnorm.weight"] = uniform((H,), 0.6, 1.4)
        w[f"{p}.eh_proj.weight"] = normal((H, 2 * H), (2 * H) ** -0.5)
        w[f"{p}.shared_head.norm.weight"] = uniform((H,), 0.6, 1.4)
    rng = np.random.default_rng(head_seed)
    w["model.norm.weight"] = uniform((H,), 0.6, 1.4)
    s = np.exp(rng.standard_normal((VOCAB, 1)) * ROW_SCALE_SIGMA)
    s = (s / np.sqrt(np.mean(s * s))).astype(np.float32)
    w["lm_head.weight"] = normal((VOCAB, H), H**-0.5) * s
    return w


def numpy_forward(path: Path, tokens: list[int]) -> np.ndarray:
    """GLM-4.5 MoE forward in float64 numpy, written from the math (not from mlx ops)."""
    c = json.loads((path / "config.json").read_text())
    w = ff.mf.load_dequantized_f64(path, c)
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, theta, k, T = c["rms_norm_eps"], c["rope_theta"], c["num_experts_per_tok"], len(tokens)
    rd = int(hd * c["partial_rotary_factor"])

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def rope(x):  # rotate-half on the first rd values of each head
        half = rd // 2
        inv = theta ** (-np.arange(0, half, dtype=np.float64) * 2.0 / rd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2, rest = x[..., :half], x[..., half:rd], x[..., rd:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)

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
        proj = {n: x @ w[f"{a}.{n}_proj.weight"].T + w[f"{a}.{n}_proj.bias"] for n in "qkv"}
        qh, kh = proj["q"].reshape(T, nh, hd), proj["k"].reshape(T, nkv, hd)
        vh = proj["v"].reshape(T, nkv, hd)
        if c["use_qk_norm"]:
            qh, kh = rms(qh, w[f"{a}.q_norm.weight"]), rms(kh, w[f"{a}.k_norm.weight"])
        qh, kh = rope(qh), rope(kh)
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            sc = np.where(causal, (qh[:, hh] @ kh[:, kv].T) / np.sqrt(hd), -np.inf)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ vh[:, kv]
        h = h + att.reshape(T, nh * hd) @ w[f"{a}.o_proj.weight"].T
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


FAMILY = ff.Family(
    specs=SPECS,
    hf_config=hf_config,
    make_weights=make_weights,
    moe_class=glm4_moe.MoE,
    router_scores=ff.noaux_tc_router_scores,
    numpy_forward=numpy_forward,
)

if __name__ == "__main__":
    sys.exit(ff.main(FAMILY, __doc__))
