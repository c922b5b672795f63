#!/usr/bin/env python3
"""Compare llama.cpp's logits on a GGUF with sluice's on the mlx checkpoint it was converted from
(or on the GGUF itself: pass it as MODEL_DIR too).

Both engines run the same seeded token list, as one batch (prefill) and one token at a time
(decode); the script prints one JSON line per mode with the mean and largest KL divergence
KL(sluice || llama.cpp) over positions (nats), the argmax agreement, and max|diff| / max|ref|.
llama.cpp quantises activations (to 8 bits for its quantised dot products), so its logits are
close to sluice's but not equal; a GGUF that holds other numbers shows as a large KL and a low
argmax agreement.

Usage: compare_llama_logits.py MODEL_DIR MODEL.gguf --llama-logits BIN [--sluice BIN]
                               [--tokens N] [--seed S] [--threads T]
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare_llama_logits.py: {' '.join(map(str, cmd))} failed:\n{r.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--llama-logits", required=True, type=Path, help="bench/llama_logits.cpp, built")
    ap.add_argument("--sluice", default="sluice", help="the sluice binary (default: on PATH)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    if args.model_dir.is_file():
        # A GGUF: its leading run of ordinary tokens (type NORMAL), with llama.cpp's gguf-py.
        import gguf
        types = gguf.GGUFReader(args.model_dir).fields["tokenizer.ggml.token_type"].contents()
        n_real = next((i for i, t in enumerate(types) if t != 1), len(types))
    else:
        tok = json.loads((args.model_dir / "tokenizer.json").read_text())
        n_real = len(tok["model"]["vocab"])  # ordinary tokens only: no specials, no padding
    ids = np.random.default_rng(args.seed).integers(0, n_real, args.tokens)
    tokens = ",".join(map(str, ids))
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("prefill", "decode"):
            ours, theirs = Path(tmp) / f"s-{mode}.npy", Path(tmp) / f"l-{mode}.npy"
            run([args.sluice, "logits", "-m", args.model_dir, "--device", "cpu", "--tokens", tokens,
                 "--mode", mode, "-o", ours, "-t", str(args.threads)])
            run([args.llama_logits, args.gguf, tokens, theirs, mode, str(args.threads)])
            a, b = np.load(ours), np.load(theirs)
            if a.shape[0] != b.shape[0] or a.shape[1] > b.shape[1]:
                sys.exit(f"compare_llama_logits.py: shapes differ: sluice {a.shape}, llama.cpp {b.shape}")
            b = b[:, : a.shape[1]]  # llama.cpp's vocabulary may carry padding rows
            la, lb = log_softmax(a), log_softmax(b)
            kl = (np.exp(la) * (la - lb)).sum(axis=-1)
            print(json.dumps({
                "model": args.model_dir.name, "gguf": args.gguf.name, "mode": mode,
                "tokens": args.tokens, "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
                "max_abs_diff_over_max_ref": float(np.abs(a - b).max() / np.abs(a).max()),
            }), flush=True)


if __name__ == "__main__":
    main()
