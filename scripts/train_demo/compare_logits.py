#!/usr/bin/env python3
"""Compares the logits transformers computed on the GPU machine for the trained bf16 model
(train.py's ref_logits.npz: the bf16 weights upcast to float32, float32 CPU forward) with mlx-lm
(all floating parameters cast to float32, CPU) on

- work/hf: the same bf16 weights in the official layout (should agree to float32 round-off), and
- models/demo: the 4-bit export (differs by the quantization error; a sanity check).

    .venv/bin/python scripts/train_demo/compare_logits.py RUN_DIR [--hf work/hf] [--q models/demo]
"""
import argparse
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
         ".q_norm.weight", ".k_norm.weight")


def mlx_logits(path, seqs, exact_norms=False):
    """exact_norms: recompute the zero-centred norms as float32 (1 + w) from the HF file, where
    mlx-lm's sanitize adds the 1 in bf16 (a rounding of up to 2^-9 relative)."""
    import mlx.core as mx
    from mlx.utils import tree_map, tree_unflatten
    from mlx_lm import load
    model, _ = load(path)
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating)
                          else p, model.parameters()))
    if exact_norms:
        fix = []
        for k, v in mx.load(os.path.join(path, "model.safetensors")).items():
            k = k.replace("model.language_model", "language_model.model")
            if v.ndim == 1 and k.endswith(NORMS):
                fix.append((k, v.astype(mx.float32) + 1.0))
        model.update(tree_unflatten(fix))
    return {k: np.array(model(mx.array(ids[None].astype(np.int32)))[0].astype(mx.float32))
            for k, ids in seqs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--hf", default=os.path.join(HERE, "work", "hf"))
    ap.add_argument("--q", default=os.path.join(ROOT, "models", "demo"))
    a = ap.parse_args()
    ref = np.load(os.path.join(a.run_dir, "ref_logits.npz"))
    seqs = {k: ref[k] for k in ref.files if not k.endswith("_logits")}
    for name, path, exact in (
            ("mlx-lm, bf16 HF checkpoint (work/hf), norms 1+w in f32", a.hf, True),
            ("mlx-lm, bf16 HF checkpoint (work/hf), as loaded (1+w rounded to bf16)", a.hf, False),
            ("mlx-lm, 4-bit export (models/demo)", a.q, False)):
        got = mlx_logits(path, seqs, exact)
        for k in seqs:
            r, g = ref[k + "_logits"], got[k]
            rel = np.abs(g - r).max() / np.abs(r).max()
            agree = (g.argmax(-1) == r.argmax(-1)).mean()
            print(f"{name} vs transformers, {k} ({len(seqs[k])} tokens): "
                  f"max|diff|/max|ref| = {rel:.2e}, argmax agreement {agree:.0%}")


if __name__ == "__main__":
    main()
