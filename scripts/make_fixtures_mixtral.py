#!/usr/bin/env python3
"""Generate the Mixtral reference fixtures (the driver is scripts/family_fixtures.py).

    tests/fixtures/mixtral-q4     mlx-community layout (block_sparse_moe.switch_mlp stacks),
                                  mlx_lm convert -q: 4-bit g64 (router too), top-3, rope_theta 1e4
    tests/fixtures/mixtral-hf     official layout: per-expert block_sparse_moe.experts.E.w1/w2/w3,
                                  2 shards, 1 KV head, a sliding_window longer than the context

mlx-lm's `sanitize()` stacks w1/w3/w2 into switch_mlp gate/up/down for the mlx fixture. An
independent float64 numpy forward pass cross-checks mlx-lm's logits.

Usage:
    .venv/bin/python scripts/make_fixtures_mixtral.py [--only NAME...] [-v]
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
from mlx_lm.models import mixtral  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

VOCAB = ff.VOCAB
H, HEADS, LAYERS, EXPERTS, INTER = 128, 4, 3, 8, 64


@dataclass
class Spec:
    name: str
    layout: str  # "mlx" | "hf"
    seed: int
    text: str
    kv_heads: int = 2
    top_k: int = 2
    rope_theta: float = 1e6
    sliding_window: int | None = None
    quant_bits: int | None = None
    quant_group: int | None = None
    shards: int = 1
    description: str = ""


SPECS = [
    Spec(
        name="mixtral-q4",
        layout="mlx",
        seed=7100,
        text="Bob counted 42 boats near the old harbour in 2003.",
        top_k=3,
        rope_theta=1e4,
        quant_bits=4,
        quant_group=64,
        description="mlx_lm convert -q: 4-bit affine g64 for every linear layer including the "
        "router and embeddings (mixtral has no quant_predicate); top-3 of 8; rope_theta=1e4.",
    ),
    Spec(
        name="mixtral-hf",
        layout="hf",
        seed=7200,
        text="<|im_start|>system\nAnswer in one line.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
        kv_heads=1,
        sliding_window=4096,
        shards=2,
        description="official Hugging Face layout (block_sparse_moe.experts.E.w1/w2/w3, router "
        "block_sparse_moe.gate), bf16, two shards + index; 4 heads / 1 KV head; "
        "sliding_window=4096 (longer than the context: no effect).",
    ),
]

# Gains as in make_fixtures.py: comparable residual updates, decisive routing, logits of std ~1.
ROUTER_GAIN, ATTN_OUT_GAIN, MLP_OUT_GAIN, EMBED_STD, ROW_SCALE_SIGMA = 2.0, 0.02, 0.03, 0.02, 0.5


def hf_config(spec: Spec, tok: Tokenizer) -> dict:
    """config.json as the official Mixtral checkpoints ship it."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 512,
        "model_type": "mixtral",
        "num_attention_heads": HEADS,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": spec.kv_heads,
        "num_local_experts": EXPERTS,
        "output_router_logits": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": float(spec.rope_theta),
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
        "sliding_window": spec.sliding_window,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd, nkv = H // HEADS, spec.kv_heads

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((VOCAB, H), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        # No q/k norm: q and k keep the embedding's small scale unless the projections lift it.
        w[f"{p}.self_attn.q_proj.weight"] = normal((HEADS * hd, H), 2.5 * H**-0.5)
        w[f"{p}.self_attn.k_proj.weight"] = normal((nkv * hd, H), 2.5 * H**-0.5)
        w[f"{p}.self_attn.v_proj.weight"] = normal((nkv * hd, H), H**-0.5)
        w[f"{p}.self_attn.o_proj.weight"] = normal((H, HEADS * hd), ATTN_OUT_GAIN * (HEADS * hd) ** -0.5 * 2)
        w[f"{p}.post_attention_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        m = f"{p}.block_sparse_moe"
        w[f"{m}.gate.weight"] = normal((EXPERTS, H), ROUTER_GAIN * H**-0.5)
        for e in range(EXPERTS):
            w[f"{m}.experts.{e}.w1.weight"] = normal((INTER, H), H**-0.5)
            w[f"{m}.experts.{e}.w2.weight"] = normal((H, INTER), MLP_OUT_GAIN * INTER**-0.5 * 2)
            w[f"{m}.experts.{e}.w3.weight"] = normal((INTER, H), H**-0.5)
    rng = np.random.default_rng(head_seed)
    w["model.norm.weight"] = uniform((H,), 0.6, 1.4)
    s = np.exp(rng.standard_normal((VOCAB, 1)) * ROW_SCALE_SIGMA)
    s = (s / np.sqrt(np.mean(s * s))).astype(np.float32)
    w["lm_head.weight"] = normal((VOCAB, H), H**-0.5) * s
    return w


def numpy_forward(path: Path, tokens: list[int]) -> np.ndarray:
    """Mixtral forward in float64 numpy, written from the math (not from mlx ops)."""
    c = json.loads((path / "config.json").read_text())
    w = mf.load_dequantized_f64(path, c)
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd, eps, theta, k, T = H // nh, c["rms_norm_eps"], c["rope_theta"], c["num_experts_per_tok"], len(tokens)

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

    def expert(p, e, x):
        if f"{p}.switch_mlp.gate_proj.weight" in w:  # mlx stacks [E, out, in]
            g_, u_, d_ = (w[f"{p}.switch_mlp.{n}.weight"][e] for n in ("gate_proj", "up_proj", "down_proj"))
        else:  # official: w1 gate, w3 up, w2 down
            g_, u_, d_ = (w[f"{p}.experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
        return d_ @ (silu(g_ @ x) * (u_ @ x))

    h = w["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x = rms(h, w[f"{p}.input_layernorm.weight"])
        qh = rope((x @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, nh, hd))
        kh = rope((x @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, nkv, hd))
        vh = (x @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            sc = np.where(causal, (qh[:, hh] @ kh[:, kv].T) / np.sqrt(hd), -np.inf)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ vh[:, kv]
        h = h + att.reshape(T, nh * hd) @ w[f"{p}.self_attn.o_proj.weight"].T
        x = rms(h, w[f"{p}.post_attention_layernorm.weight"])
        m = f"{p}.block_sparse_moe"
        logits = x @ w[f"{m}.gate.weight"].T
        for t in range(T):
            top = np.argsort(-logits[t])[:k]
            sc = np.exp(logits[t, top] - logits[t, top].max())
            sc /= sc.sum()  # softmax over the top-k logits
            h[t] += sum(s_ * expert(m, e, x[t]) for e, s_ in zip(top, sc))
    h = rms(h, w["model.norm.weight"])
    return h @ w["lm_head.weight"].T


def router_scores(block, x):
    """Softmax over the router's logits: the top-k of those picks the experts."""
    return [(mx.softmax(block.gate(x), axis=-1, precise=True), block.num_experts_per_tok)]


FAMILY = ff.Family(
    specs=SPECS,
    hf_config=hf_config,
    make_weights=make_weights,
    moe_class=mixtral.MixtralSparseMoeBlock,
    router_scores=router_scores,
    numpy_forward=numpy_forward,
)

if __name__ == "__main__":
    sys.exit(ff.main(FAMILY, __doc__))
