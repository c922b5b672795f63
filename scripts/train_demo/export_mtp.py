#!/usr/bin/env python3
"""Adds the MTP layer train_mtp.py trained (RUN_DIR/mtp.safetensors: bf16, official names,
zero-centred norms, fused experts) to models/demo in models/demo's own mlx layout:

- a new shard `model-mtp.safetensors` with the tensors at the checkpoint root, `mtp.*`, named after
  the layer prefix exactly as the main layers are (`mtp.layers.0.self_attn.q_proj.weight`,
  `mtp.layers.0.mlp.switch_mlp.{gate,up,down}_proj.weight` stacked [E, out, in], ...), plus
  `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`;
- quantised as mlx_lm.convert quantised the rest: affine, group 64, 4 bits (mx.quantize on the
  bf16 weights: `.weight` uint32 + bf16 `.scales` / `.biases`), `mlp.gate` and
  `mlp.shared_expert_gate` at 8 bits with per-module entries in config.json's `quantization` and
  `quantization_config`; RMSNorm weights stored as 1 + w (bf16), like the rest of the layout;
- model.safetensors.index.json gets the shard's names (total_size / total_parameters updated) and
  the text config `"mtp_num_hidden_layers": 1`.

Re-running replaces an earlier MTP. mlx-lm ignores the layer (its qwen3_5 sanitize drops `mtp.`).

    .venv/bin/python scripts/train_demo/export_mtp.py RUN_DIR [--out models/demo] [--check]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SHARD = "model-mtp.safetensors"
GROUP, BITS, GATE_BITS = 64, 4, 8
NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                 ".k_norm.weight")
EIGHT_BIT = (".mlp.gate", ".mlp.shared_expert_gate")


def to_mlx_layout(sd):
    """official (transformers) names -> mlx-layout float arrays (not yet quantised)."""
    import mlx.core as mx
    out = {}
    for name, w in sd.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            p = name[: -len(".experts.gate_up_proj")]
            mid = w.shape[1] // 2
            out[p + ".switch_mlp.gate_proj.weight"] = w[:, :mid, :]
            out[p + ".switch_mlp.up_proj.weight"] = w[:, mid:, :]
        elif name.endswith(".mlp.experts.down_proj"):
            p = name[: -len(".experts.down_proj")]
            out[p + ".switch_mlp.down_proj.weight"] = w
        elif name in NORMS or name.endswith(NORM_SUFFIXES):
            assert w.ndim == 1, name
            out[name] = (w.astype(mx.float32) + 1.0).astype(mx.bfloat16)
        else:
            out[name] = w
    return out


def quantise(arrays):
    """-> (tensors to write, {module: bits} of the 8-bit modules, parameter count)."""
    import mlx.core as mx
    tensors, eight, n_params = {}, {}, 0
    for name in sorted(arrays):
        w = arrays[name].astype(mx.bfloat16)
        n_params += w.size
        if w.ndim >= 2 and name.endswith(".weight"):
            base = name[: -len(".weight")]
            bits = GATE_BITS if base.endswith(EIGHT_BIT) else BITS
            assert w.shape[-1] % GROUP == 0, name
            wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=bits)
            tensors[name], tensors[base + ".scales"], tensors[base + ".biases"] = wq, scales, biases
            if bits != BITS:
                eight[base] = {"group_size": GROUP, "bits": bits}
            err = mx.abs(mx.dequantize(wq, scales, biases, group_size=GROUP, bits=bits)
                         - w.astype(mx.float32))
            rel = (mx.sqrt(mx.mean(err * err)) / mx.sqrt(mx.mean(w.astype(mx.float32) ** 2))).item()
            print(f"  {name:55s} {str(tuple(w.shape)):16s} {bits}-bit  rms rel err {rel:.3f}")
        else:
            tensors[name] = w
            print(f"  {name:55s} {str(tuple(w.shape)):16s} bf16")
    return tensors, eight, n_params


def param_count(tensors, cfg):
    """Unquantised parameters of a shard in the mlx layout."""
    q = cfg["quantization"]
    n = 0
    for k, v in tensors.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k[: -len(".weight")]
        if base + ".scales" in tensors:
            n += v.size * 32 // q.get(base, {}).get("bits", q["bits"])
        else:
            n += v.size
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "demo"))
    ap.add_argument("--check", action="store_true",
                    help="reload with mlx-lm and compare its logits with the demo reference")
    a = ap.parse_args()
    import mlx.core as mx

    sd = mx.load(os.path.join(a.run_dir, "mtp.safetensors"))
    assert all(k.startswith("mtp.") for k in sd), "expected official mtp.* names"
    tensors, eight, n_params = quantise(to_mlx_layout(sd))

    # index: the shard's names, sorted as mlx-lm writes them; total_size = bytes of all tensors,
    # total_parameters = unquantised parameter count (mlx-lm's get_total_parameters)
    ip = os.path.join(a.out, "model.safetensors.index.json")
    index = json.load(open(ip))
    meta = index["metadata"]
    if os.path.exists(os.path.join(a.out, SHARD)) and SHARD in index["weight_map"].values():
        old = mx.load(os.path.join(a.out, SHARD))  # an earlier export: take it out again
        meta["total_size"] -= sum(v.nbytes for v in old.values())
        meta["total_parameters"] -= param_count(old, json.load(open(os.path.join(a.out, "config.json"))))
    wm = {k: v for k, v in index["weight_map"].items() if v != SHARD}
    wm.update({k: SHARD for k in tensors})
    index["weight_map"] = {k: wm[k] for k in sorted(wm)}
    meta["total_size"] += sum(v.nbytes for v in tensors.values())
    meta["total_parameters"] += n_params
    mx.save_safetensors(os.path.join(a.out, SHARD), tensors, metadata={"format": "mlx"})
    json.dump(index, open(ip, "w"), indent=4)

    # config
    cp = os.path.join(a.out, "config.json")
    cfg = json.load(open(cp))
    for key in ("quantization", "quantization_config"):
        q = {k: v for k, v in cfg[key].items() if not k.startswith("mtp.")}
        q.update(eight)
        cfg[key] = q
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(cp, "w"), indent=4)
    size = os.path.getsize(os.path.join(a.out, SHARD))
    print(f"wrote {os.path.join(a.out, SHARD)}: {len(tensors)} tensors, {n_params / 1e6:.3f} M "
          f"parameters, {size / 2**20:.2f} MiB; 8-bit: {sorted(eight)}; index and config.json updated")

    if a.check:
        from mlx_lm import load
        from mlx.utils import tree_map
        model, _ = load(a.out)
        model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating)
                              else p, model.parameters()))
        ref_dir = os.path.join(ROOT, "tests", "fixtures", "demo-reference")
        ref = json.load(open(os.path.join(ref_dir, "reference.json")))
        want = np.load(os.path.join(ref_dir, "logits_prefill.npy"))
        got = np.array(model(mx.array([ref["tokens"]]))[0].astype(mx.float32))
        print(f"mlx-lm still loads {a.out} (MTP ignored): max|diff| / max|ref| vs the reference "
              f"logits {np.abs(got - want).max() / np.abs(want).max():.1e}")


if __name__ == "__main__":
    main()
