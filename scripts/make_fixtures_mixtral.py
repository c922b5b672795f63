#!/usr/bin/env python3
"""Generate the Mixtral reference fixtures.

Companion of scripts/make_fixtures.py (whose helpers it imports, without changing that
script's outputs). Writes

    tests/fixtures/mixtral-q4     mlx-community layout (block_sparse_moe.switch_mlp stacks),
                                  mlx_lm convert -q: 4-bit g64 (router too), rope_theta 1e4
    tests/fixtures/mixtral-hf     official layout: per-expert block_sparse_moe.experts.E.w1/w2/w3,
                                  2 shards, 1 KV head, a sliding_window longer than the context

Each random checkpoint is written in the official Hugging Face layout; the mlx fixtures are what
mlx-lm's own `convert()` makes of it (its `sanitize()` stacks w1/w3/w2 into switch_mlp
gate/up/down). The reference logits are mlx-lm's, with every floating parameter cast to float32
on the CPU: decode (one token per call through the cache) and prefill (one call). An independent
float64 numpy forward pass cross-checks them. Draws are repeated until routing and argmax are
decisive, as in make_fixtures.py.

Usage:
    .venv/bin/python scripts/make_fixtures_mixtral.py [--only NAME...] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
sys.modules["make_fixtures"] = mf
_spec.loader.exec_module(mf)

np = mf.np
mx = mf.mx
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models import mixtral  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

DEFAULT_OUT = mf.DEFAULT_OUT
TOK_SRC = DEFAULT_OUT / "qwen3_moe-bf16"
VOCAB = mf.VOCAB_SIZE
H, HEADS, LAYERS, EXPERTS, INTER = 128, 4, 3, 8, 64
MIN_TOKENS, MAX_TOKENS = 20, 32


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


def save_hf(spec: Spec, weights: dict, out: Path, tok: Tokenizer, shards: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v).astype(mx.bfloat16) for k, v in weights.items()}
    names = list(arrays)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        keys = names[s * per:(s + 1) * per]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(out / fname), {k: arrays[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    if shards > 1:
        total = sum(a.nbytes for a in arrays.values())
        mf.write_json(out / "model.safetensors.index.json",
                      {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))})
    mf.write_json(out / "config.json", hf_config(spec, tok))


def copy_tokenizer(dst: Path) -> None:
    for f in mf.TOKENIZER_FILES:
        shutil.copy(TOK_SRC / f, dst / f)


def build(spec: Spec, seed: int, head_seed: int, dst: Path, tok: Tokenizer) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    weights = make_weights(spec, seed, head_seed)
    if spec.layout == "hf":
        save_hf(spec, weights, dst, tok, spec.shards)
        copy_tokenizer(dst)
        return
    with tempfile.TemporaryDirectory(prefix="sluice-src-") as tmp:
        src = Path(tmp) / "hf"
        save_hf(spec, weights, src, tok, 1)
        copy_tokenizer(src)
        kwargs = dict(hf_path=str(src), mlx_path=str(dst), dtype="bfloat16")
        if spec.quant_bits is not None:
            kwargs.update(quantize=True, q_bits=spec.quant_bits, q_group_size=spec.quant_group)
        with contextlib.redirect_stdout(io.StringIO()):
            mf.mlx_convert.convert(**kwargs)
    keep = {"config.json", "model.safetensors.index.json"}
    for f in dst.iterdir():
        if f.name not in keep and not (f.name.startswith("model") and f.suffix == ".safetensors"):
            f.unlink()
    copy_tokenizer(dst)


_ROUTER_LOG: list | None = None
_orig_moe_call = mixtral.MixtralSparseMoeBlock.__call__


def _logging_moe_call(self, x):
    if _ROUTER_LOG is not None:
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        _ROUTER_LOG.append((getattr(self, "_fixture_layer", -1), np.array(probs.astype(mx.float32))))
    return _orig_moe_call(self, x)


mixtral.MixtralSparseMoeBlock.__call__ = _logging_moe_call


def load_f32(path: Path):
    model, _ = mf.mlx_load_model(path)

    def f(p):
        return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(f, model.parameters()))
    for i, layer in enumerate(model.model.layers):
        layer.block_sparse_moe._fixture_layer = i
    return model


def evaluate(spec: Spec, path: Path, tok: Tokenizer):
    global _ROUTER_LOG
    tokens = tok.encode(spec.text).ids
    if not (MIN_TOKENS <= len(tokens) <= MAX_TOKENS):
        raise RuntimeError(f"text of {spec.name} encodes to {len(tokens)} tokens")
    model = load_f32(path)
    _ROUTER_LOG = []
    pre = mf.prefill_logits(model, tokens)
    pre_log, _ROUTER_LOG = _ROUTER_LOG, []
    cache = make_prompt_cache(model)
    rows = []
    for t in tokens:
        out = model(mx.array([[t]], dtype=mx.int32), cache=cache)
        rows.append(np.array(out[0, -1].astype(mx.float32)))
    dec = np.stack(rows)
    dec_log, _ROUTER_LOG = _ROUTER_LOG, None
    gap_pre, usage = mf.router_analysis(pre_log, spec.top_k)
    gap_dec, _ = mf.router_analysis(dec_log, spec.top_k)
    h = model.model.embed_tokens(mx.array([tokens], dtype=mx.int32))
    ratios = []
    for layer in model.model.layers:
        h2 = layer(h, "causal", None)
        ratios.append(float(mx.sqrt(mx.mean((h2 - h) ** 2)) / mx.sqrt(mx.mean(h * h))))
        h = h2
    return dict(
        tokens=tokens, prefill=pre, decode=dec, max_abs_logit=float(np.max(np.abs(pre))),
        logit_std=float(np.std(pre)),
        min_margin=float(min(mf.margins(pre).min(), mf.margins(dec).min())),
        min_gap=float(min(gap_pre, gap_dec)),
        usage={int(l): u.tolist() for l, u in sorted(usage.items())},
        dec_vs_pre=float(np.max(np.abs(dec - pre))), ratios=ratios, rms=[],
        argmax=[int(a) for a in pre.argmax(-1)],
    )


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", help="fixture names to (re)build")
    ap.add_argument("-v", "--verbose", action="store_true", help="print rejected draws")
    args = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    tok = Tokenizer.from_file(str(TOK_SRC / "tokenizer.json"))
    ver = mf.versions()
    print(f"versions: {json.dumps(ver)}")
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        dst = args.out / spec.name
        found = False
        for attempt in range(mf.MAX_ATTEMPTS):
            seed = spec.seed + attempt
            for hs in range(mf.MAX_HEAD_ATTEMPTS):
                head_seed = seed * 1000 + hs
                build(spec, seed, head_seed, dst, tok)
                m = evaluate(spec, dst, tok)
                bad_body, bad_head = mf.well_conditioned(m)
                if not bad_body and not bad_head:
                    found = True
                    break
                if args.verbose:
                    print(f"[{spec.name}] seeds {seed}/{head_seed} rejected: " + "; ".join(bad_body + bad_head))
                if bad_body:
                    break
            if found:
                break
        if not found:
            raise RuntimeError(f"{spec.name}: no well-conditioned draw found")
        np_logits = numpy_forward(dst, m["tokens"])
        np_rel = float(np.max(np.abs(np_logits - m["prefill"])) / m["max_abs_logit"])
        if np_rel > 1e-4:
            raise RuntimeError(f"{spec.name}: numpy float64 forward disagrees with mlx-lm: {np_rel:.3g}")
        np.save(dst / "logits_decode.npy", m["decode"].astype("<f4"))
        np.save(dst / "logits_prefill.npy", m["prefill"].astype("<f4"))
        notes = (
            f"{spec.description} Weights drawn with numpy default_rng(seed={seed}) (output head: "
            f"default_rng({head_seed})) in float32, cast to bfloat16"
            + (" and converted by mlx_lm.convert" if spec.layout == "mlx" else "")
            + ". Reference logits: mlx_lm.load(dir), every floating parameter cast to float32, "
            "decode one token per call through mlx_lm's KVCache, prefill in one call. "
            "Tolerance meant: max|ours - ref| <= 1e-3 * max|ref|."
        )
        mf.write_json(dst / "reference.json", {
            "fixture": spec.name, "text": spec.text, "tokens": m["tokens"],
            "num_tokens": len(m["tokens"]), "vocab_size": VOCAB, "seed": seed, "head_seed": head_seed,
            "mlx_version": ver["mlx"], "mlx_lm_version": ver["mlx_lm"],
            "tokenizers_version": ver["tokenizers"], "max_abs_logit": m["max_abs_logit"],
            "min_argmax_margin": m["min_margin"], "min_routing_gap": m["min_gap"],
            "max_abs_decode_vs_prefill": m["dec_vs_pre"], "max_rel_numpy_f64_vs_prefill": np_rel,
            "argmax_prefill": m["argmax"],
            "expert_usage_prefill": {str(k): v for k, v in m["usage"].items()}, "notes": notes,
        }, compact_lists=True)
        print(f"== {spec.name} (seed {seed}, head seed {head_seed}): {len(m['tokens'])} tokens, "
              f"max|logit| {m['max_abs_logit']:.3f}, min margin {m['min_margin']:.4f}, "
              f"min routing gap {m['min_gap']:.4f}, decode-vs-prefill {m['dec_vs_pre']:.2e}, "
              f"numpy f64 vs mlx-lm {np_rel:.2e}, update ratios "
              + ", ".join(f"{r:.2f}" for r in m["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
