#!/usr/bin/env python3
"""Turns what train.py brought back (packed bf16 state dict + config.json) into

1. work/hf/: the checkpoint in the official Qwen3.5-MoE Hugging Face layout (nested config with
   `text_config`, `model_type: qwen3_5_moe`, tensors `model.language_model.*` + `lm_head.weight`,
   A_log float32), bf16, like the source of scripts/make_fixtures_qwen3_5.py's fixtures; and
2. models/demo/: that checkpoint converted by mlx-lm's own convert() to the mlx-community 4-bit
   layout (affine, group 64; mlx-lm's qwen3_5_moe quant predicate puts `mlp.gate` and
   `shared_expert_gate` at 8 bits), plus the tokenizer files. models/demo/eval/ is kept.

    .venv/bin/python scripts/train_demo/export.py RUN_DIR [--work work] [--out models/demo]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import lzma
import os
import shutil
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def unpack(run_dir: str) -> dict[str, np.ndarray]:
    """Inverse of train.pack_state_dict: name -> uint16 (bf16 bits) or float32 array."""
    meta = json.load(open(os.path.join(run_dir, "weights.json")))
    blob = b"".join(open(os.path.join(run_dir, p), "rb").read() for p in meta["parts"])
    a, b, c = meta["streams"]
    hi = np.frombuffer(lzma.decompress(blob[:a]), np.uint8)
    lo = np.frombuffer(lzma.decompress(blob[a:a + b]), np.uint8)
    f32 = np.frombuffer(lzma.decompress(blob[a + b:a + b + c]), np.float32)
    bits = (hi.astype(np.uint16) << 8) | lo
    out, pb, pf = {}, 0, 0
    for t in meta["tensors"]:
        n = int(np.prod(t["shape"])) if t["shape"] else 1
        if t["dtype"] == "bfloat16":
            out[t["name"]] = bits[pb:pb + n].reshape(t["shape"])
            pb += n
        else:
            out[t["name"]] = f32[pf:pf + n].reshape(t["shape"])
            pf += n
    assert pb == bits.size and pf == f32.size
    return out


def write_hf(run_dir: str, tok_dir: str, dst: str) -> None:
    import mlx.core as mx
    os.makedirs(dst, exist_ok=True)
    sd = unpack(run_dir)
    arrays = {}
    for name, v in sd.items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        if v.dtype == np.uint16:
            arrays[name] = mx.array(v).view(mx.bfloat16)
        else:
            arrays[name] = mx.array(v)
    mx.save_safetensors(os.path.join(dst, "model.safetensors"), arrays, metadata={"format": "pt"})
    text = json.load(open(os.path.join(run_dir, "config.json")))
    text.pop("architectures", None)
    text.pop("output_router_logits", None)
    text["output_router_logits"] = False
    # mlx-lm derives the layer pattern from full_attention_interval (default 4), not layer_types.
    types = text["layer_types"]
    interval = types.index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types))
    text["full_attention_interval"] = interval
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False),
           "transformers_version": text.get("transformers_version")}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(tok_dir, f), dst)


def convert(hf: str, out: str, tok_dir: str) -> None:
    from mlx_lm import convert as mlx_convert
    with tempfile.TemporaryDirectory(prefix="sluice-demo-") as tmp:
        q = os.path.join(tmp, "q")
        with contextlib.redirect_stdout(io.StringIO()):
            mlx_convert(hf_path=hf, mlx_path=q, quantize=True, q_bits=4, q_group_size=64,
                        dtype="bfloat16")
        os.makedirs(out, exist_ok=True)
        for f in os.listdir(out):  # keep eval/ and SOURCES.md
            p = os.path.join(out, f)
            if os.path.isfile(p) and f != "SOURCES.md":
                os.unlink(p)
        for f in os.listdir(q):
            if f in ("config.json", "model.safetensors.index.json") or (
                    f.startswith("model") and f.endswith(".safetensors")):
                shutil.copy(os.path.join(q, f), out)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(tok_dir, f), out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--work", default=os.path.join(HERE, "work"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "demo"))
    ap.add_argument("--tokenizer", help="the tokenizer directory the run was trained with "
                    "(default: RUN_DIR if it holds one, else WORK/tokenizer)")
    a = ap.parse_args()
    tok_dir = a.tokenizer or (a.run_dir if os.path.exists(os.path.join(a.run_dir, "tokenizer.json"))
                              else os.path.join(a.work, "tokenizer"))
    hf = os.path.join(a.work, "hf")
    shutil.rmtree(hf, ignore_errors=True)
    write_hf(a.run_dir, tok_dir, hf)
    convert(hf, a.out, tok_dir)
    total = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out)
                if os.path.isfile(os.path.join(a.out, f)))
    print(f"wrote {a.out}: {sorted(os.listdir(a.out))}, {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
