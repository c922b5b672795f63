#!/usr/bin/env python3
"""The shared driver of the per-family fixture scripts (make_fixtures_mixtral.py,
make_fixtures_glm4_moe.py): builds a random checkpoint in the official Hugging Face layout, converts
it with mlx-lm's own `convert()` for the mlx layouts, redraws until routing and argmax are decisive,
and writes the mlx-lm reference logits (every floating parameter cast to float32, CPU; decode one
token per call through the cache, prefill in one call) with `reference.json`, after an independent
float64 numpy forward pass agrees. Not run by itself.

A family gives a `Family`: its specs (each with `name`, `layout` "mlx" | "hf", `seed`, `text`,
`shards`, `quant_bits`, `quant_group`, `description`), `hf_config(spec, tok)`, `make_weights(spec,
seed, head_seed)`, the mlx module whose MoE block to watch (`moe_class`, and `router_scores(block,
x)` giving `[(values, k), ...]`: each set of values a top-k is taken over, the experts' last), and
`numpy_forward(path, tokens)`, and optionally `post_build(spec, dir)`.
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
from typing import Callable

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
sys.modules["make_fixtures"] = mf
_spec.loader.exec_module(mf)

np = mf.np
mx = mf.mx
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

DEFAULT_OUT = mf.DEFAULT_OUT
TOK_SRC = DEFAULT_OUT / "qwen3_moe-bf16"
VOCAB = mf.VOCAB_SIZE
MIN_TOKENS, MAX_TOKENS = 20, 32


@dataclass
class Family:
    specs: list
    hf_config: Callable
    make_weights: Callable
    moe_class: type
    router_scores: Callable
    numpy_forward: Callable
    # Called with (spec, dir) after a fixture's files are written (say, to rename a model_type
    # that transformers' config loader, which mlx_lm.convert uses, does not know).
    post_build: Callable | None = None


def noaux_tc_select(sig, bias, k, groups, top_groups):
    """noaux_tc: (choice values with the groups left out at 0, group scores or None)."""
    choice = sig + bias
    group_scores = None
    if groups > 1:
        g = choice.reshape(*choice.shape[:-1], groups, -1)
        group_scores = np.sort(g, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[..., :top_groups]
        mask = np.zeros_like(group_scores, dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(mask[..., None], g, 0.0).reshape(choice.shape)
    return choice, group_scores


def noaux_tc_router_scores(block, x):
    """A `noaux_tc` MoE block's (GLM-4.5, DeepSeek-V3) `router_scores`: the group scores (when
    grouped) and the values the experts are picked from."""
    gate = block.gate
    sig = np.array(mx.sigmoid((x @ gate.weight.T).astype(mx.float32)))
    bias = np.array(gate.e_score_correction_bias.astype(mx.float32))
    choice, group_scores = noaux_tc_select(sig, bias, gate.top_k, gate.n_group, gate.topk_group)
    out = [] if group_scores is None else [(mx.array(group_scores), gate.topk_group)]
    return out + [(mx.array(choice), gate.top_k)]


def save_hf(config: dict, weights: dict, out: Path, shards: int) -> None:
    """bf16 safetensors in `shards` files (with an index when more than one), and config.json.
    Tensors named `*e_score_correction_bias` stay float32, as the official checkpoints keep them;
    integer tensors (gpt-oss's mxfp4 blocks and scales) are written as they are."""
    out.mkdir(parents=True, exist_ok=True)

    def stored(k, v):
        if not np.issubdtype(v.dtype, np.floating):
            return mx.array(v)
        return mx.array(v).astype(mx.float32 if k.endswith("e_score_correction_bias") else mx.bfloat16)

    arrays = {k: stored(k, v) for k, v in weights.items()}
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
    mf.write_json(out / "config.json", config)


def copy_tokenizer(dst: Path) -> None:
    for f in mf.TOKENIZER_FILES:
        shutil.copy(TOK_SRC / f, dst / f)


def build(fam: Family, spec, seed: int, head_seed: int, dst: Path, tok: Tokenizer) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    weights = fam.make_weights(spec, seed, head_seed)
    config = fam.hf_config(spec, tok)
    if spec.layout == "hf":
        save_hf(config, weights, dst, spec.shards)
        copy_tokenizer(dst)
        if fam.post_build:
            fam.post_build(spec, dst)
        return
    with tempfile.TemporaryDirectory(prefix="sluice-src-") as tmp:
        src = Path(tmp) / "hf"
        save_hf(config, weights, src, 1)
        copy_tokenizer(src)
        kwargs = dict(hf_path=str(src), mlx_path=str(dst), dtype="bfloat16")
        if spec.quant_bits is not None:
            kwargs.update(quantize=True, q_bits=spec.quant_bits, q_group_size=spec.quant_group)
            if getattr(spec, "quant_mode", "affine") != "affine":
                kwargs.update(q_mode=spec.quant_mode)
        with contextlib.redirect_stdout(io.StringIO()):
            mf.mlx_convert.convert(**kwargs)
    keep = {"config.json", "model.safetensors.index.json"}
    for f in dst.iterdir():
        if f.name not in keep and not (f.name.startswith("model") and f.suffix == ".safetensors"):
            f.unlink()
    copy_tokenizer(dst)
    if fam.post_build:
        fam.post_build(spec, dst)


_ROUTER_LOG: list | None = None


def watch_router(fam: Family) -> None:
    """Logs, per call of the family's MoE block, the values its top-k is taken over."""
    orig = fam.moe_class.__call__

    def logging_call(self, x):
        if _ROUTER_LOG is not None:
            layer = getattr(self, "_fixture_layer", -1)
            for s, k in fam.router_scores(self, x):
                _ROUTER_LOG.append((layer, np.array(s.astype(mx.float32)), k))
        return orig(self, x)

    fam.moe_class.__call__ = logging_call


def load_f32(fam: Family, path: Path):
    model, _ = mf.mlx_load_model(path)

    def f(p):
        return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(f, model.parameters()))
    for i, layer in enumerate(model.model.layers):
        for m in layer.children().values():
            if isinstance(m, fam.moe_class):
                m._fixture_layer = i
    return model


def evaluate(fam: Family, spec, path: Path, tok: Tokenizer):
    global _ROUTER_LOG
    tokens = tok.encode(spec.text).ids
    if not (MIN_TOKENS <= len(tokens) <= MAX_TOKENS):
        raise RuntimeError(f"text of {spec.name} encodes to {len(tokens)} tokens")
    model = load_f32(fam, path)
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
    gaps = [mf.router_analysis([(l, s)], k)[0] for l, s, k in pre_log + dec_log]
    # Expert usage from the last values of each call: the experts'.
    last = [e for i, e in enumerate(pre_log) if i + 1 == len(pre_log) or pre_log[i + 1][0] != e[0]]
    usage = {}
    for l, s, k in last:
        usage[l] = usage.get(l, 0) + mf.router_analysis([(l, s)], k)[1][l]
    h = model.model.embed_tokens(mx.array([tokens], dtype=mx.int32))
    ratios = []
    # A boolean causal mask (DeepSeek-V3's attention takes no "causal" string).
    mask = mx.tril(mx.ones((len(tokens), len(tokens)), dtype=mx.bool_))
    for layer in model.model.layers:
        h2 = layer(h, mask, None)
        ratios.append(float(mx.sqrt(mx.mean((h2 - h) ** 2)) / mx.sqrt(mx.mean(h * h))))
        h = h2
    return dict(
        tokens=tokens, prefill=pre, decode=dec, max_abs_logit=float(np.max(np.abs(pre))),
        logit_std=float(np.std(pre)),
        min_margin=float(min(mf.margins(pre).min(), mf.margins(dec).min())),
        # A dense model routes nothing: no gap to condition.
        min_gap=float(min(gaps)) if gaps else None,
        usage={int(l): u.tolist() for l, u in sorted(usage.items())},
        dec_vs_pre=float(np.max(np.abs(dec - pre))), ratios=ratios, rms=[],
        argmax=[int(a) for a in pre.argmax(-1)],
    )


def main(fam: Family, doc: str, argv=None) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", help="fixture names to (re)build")
    ap.add_argument("-v", "--verbose", action="store_true", help="print rejected draws")
    args = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    watch_router(fam)
    tok = Tokenizer.from_file(str(TOK_SRC / "tokenizer.json"))
    ver = mf.versions()
    print(f"versions: {json.dumps(ver)}")
    for spec in fam.specs:
        if args.only and spec.name not in args.only:
            continue
        dst = args.out / spec.name
        found = False
        for attempt in range(mf.MAX_ATTEMPTS):
            seed = spec.seed + attempt
            for hs in range(mf.MAX_HEAD_ATTEMPTS):
                head_seed = seed * 1000 + hs
                build(fam, spec, seed, head_seed, dst, tok)
                m = evaluate(fam, spec, dst, tok)
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
        np_logits = fam.numpy_forward(dst, m["tokens"])
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
              f"min routing gap {m['min_gap'] or 0:.4f}, decode-vs-prefill {m['dec_vs_pre']:.2e}, "
              f"numpy f64 vs mlx-lm {np_rel:.2e}, update ratios "
              + ", ".join(f"{r:.2f}" for r in m["ratios"]))
    return 0
