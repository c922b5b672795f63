#!/usr/bin/env python3
"""Generate the dense Qwen3 reference fixtures (the driver is scripts/family_fixtures.py).

    tests/fixtures/qwen3-q4    mlx layout, mlx_lm convert -q: 4-bit g64, head_dim 48 (q out 192,
                               not hidden), rope_theta 1e4, untied lm_head
    tests/fixtures/qwen3-hf    official layout (Qwen3ForCausalLM), bf16, tied embeddings, 1 KV head

Dense Qwen3 (Qwen3-0.6B ... 32B) is Qwen3-MoE with every MLP a dense SwiGLU: the small ones are
the draft models of Qwen3-30B-A3B and Qwen3-235B-A22B (`--speculate draft`). They share the
fixtures' tokenizer, so the engine's draft-model tests can pair them with the MoE fixtures. An
independent float64 numpy forward pass cross-checks mlx-lm's logits.

Usage:
    .venv/bin/python scripts/make_fixtures_qwen3.py [--only NAME...] [-v]
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

np, mx, mf = ff.np, ff.mx, ff.mf
from tokenizers import Tokenizer  # noqa: E402

VOCAB = ff.VOCAB
H, HEADS, LAYERS, INTER = 128, 4, 3, 192


@dataclass
class Spec:
    name: str
    layout: str  # "mlx" | "hf"
    seed: int
    text: str
    head_dim: int = 32
    kv_heads: int = 2
    rope_theta: float = 1e6
    tied: bool = False
    quant_bits: int | None = None
    quant_group: int | None = None
    shards: int = 1
    description: str = ""


SPECS = [
    Spec(
        name="qwen3-q4",
        layout="mlx",
        seed=8100,
        text="The small river ran past 17 houses and the mill by the bridge.",
        head_dim=48,
        rope_theta=1e4,
        quant_bits=4,
        quant_group=64,
        description="dense qwen3, mlx_lm convert -q: 4-bit affine g64 for every linear layer and "
        "the embeddings; head_dim 48 (q out 192 != hidden 128); rope_theta 1e4; untied lm_head.",
    ),
    Spec(
        name="qwen3-hf",
        layout="hf",
        seed=8200,
        text="<|im_start|>user\nWhat did the old captain find?<|im_end|>\n<|im_start|>assistant\n",
        kv_heads=1,
        tied=True,
        description="dense qwen3 in the official Hugging Face layout (Qwen3ForCausalLM), bf16; "
        "4 heads / 1 KV head; tie_word_embeddings (no lm_head tensor).",
    ),
]

ATTN_OUT_GAIN, MLP_OUT_GAIN, EMBED_STD, ROW_SCALE_SIGMA = 0.02, 0.03, 0.02, 0.5


def hf_config(spec: Spec, tok: Tokenizer) -> dict:
    """config.json as the official Qwen3 checkpoints ship it."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 512,
        "max_window_layers": LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": float(spec.rope_theta),
        "sliding_window": None,
        "tie_word_embeddings": spec.tied,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd, nkv = spec.head_dim, spec.kv_heads

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((VOCAB, H), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        w[f"{p}.input_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        w[f"{a}.q_proj.weight"] = normal((HEADS * hd, H), H**-0.5)
        w[f"{a}.k_proj.weight"] = normal((nkv * hd, H), H**-0.5)
        w[f"{a}.v_proj.weight"] = normal((nkv * hd, H), H**-0.5)
        w[f"{a}.o_proj.weight"] = normal((H, HEADS * hd), ATTN_OUT_GAIN * (HEADS * hd) ** -0.5 * 2)
        # Per-head q/k norms large enough that attention is not uniform.
        w[f"{a}.q_norm.weight"] = uniform((hd,), 0.8, 2.2)
        w[f"{a}.k_norm.weight"] = uniform((hd,), 0.8, 2.2)
        w[f"{p}.post_attention_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        m = f"{p}.mlp"
        w[f"{m}.gate_proj.weight"] = normal((INTER, H), H**-0.5)
        w[f"{m}.up_proj.weight"] = normal((INTER, H), H**-0.5)
        w[f"{m}.down_proj.weight"] = normal((H, INTER), MLP_OUT_GAIN * INTER**-0.5 * 2)
    rng = np.random.default_rng(head_seed)
    s = np.exp(rng.standard_normal((VOCAB, 1)) * ROW_SCALE_SIGMA)
    s = (s / np.sqrt(np.mean(s * s))).astype(np.float32)
    if spec.tied:
        # The embeddings are the output head: rows scaled, the final norm lifting them to logits
        # of a few units.
        w["model.embed_tokens.weight"] *= s
        w["model.norm.weight"] = rng.uniform(0.6, 1.4, (H,)).astype(np.float32) / (EMBED_STD * H**0.5)
    else:
        w["model.norm.weight"] = rng.uniform(0.6, 1.4, (H,)).astype(np.float32)
        w["lm_head.weight"] = normal((VOCAB, H), H**-0.5) * s
    return w


def numpy_forward(path: Path, tokens: list[int]) -> np.ndarray:
    """Dense Qwen3 forward in float64 numpy, written from the math (not from mlx ops)."""
    c = json.loads((path / "config.json").read_text())
    w = mf.load_dequantized_f64(path, c)
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, theta, T = c["rms_norm_eps"], c["rope_theta"], len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def rope(x):  # rotate-half pairing (i, i + hd/2)
        half = hd // 2
        inv = theta ** (-np.arange(0, half, dtype=np.float64) * 2.0 / hd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    h = w["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        x = rms(h, w[f"{p}.input_layernorm.weight"])
        q = rms((x @ w[f"{a}.q_proj.weight"].T).reshape(T, nh, hd), w[f"{a}.q_norm.weight"])
        k = rms((x @ w[f"{a}.k_proj.weight"].T).reshape(T, nkv, hd), w[f"{a}.k_norm.weight"])
        qh, kh = rope(q), rope(k)
        vh = (x @ w[f"{a}.v_proj.weight"].T).reshape(T, nkv, hd)
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            sc = np.where(causal, (qh[:, hh] @ kh[:, kv].T) / np.sqrt(hd), -np.inf)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ vh[:, kv]
        h = h + att.reshape(T, nh * hd) @ w[f"{a}.o_proj.weight"].T
        x = rms(h, w[f"{p}.post_attention_layernorm.weight"])
        m = f"{p}.mlp"
        h = h + (silu(x @ w[f"{m}.gate_proj.weight"].T) * (x @ w[f"{m}.up_proj.weight"].T)) @ w[
            f"{m}.down_proj.weight"].T
    h = rms(h, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return h @ head.T


class NoMoe:
    """Dense: no MoE block to watch (no routing to condition)."""


FAMILY = ff.Family(
    specs=SPECS,
    hf_config=hf_config,
    make_weights=make_weights,
    moe_class=NoMoe,
    router_scores=lambda block, x: [],
    numpy_forward=numpy_forward,
)

if __name__ == "__main__":
    sys.exit(ff.main(FAMILY, __doc__))
