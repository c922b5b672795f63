#!/usr/bin/env python3
"""Checks a `sluice synth` checkpoint against mlx-lm: mlx-lm loads it, its logits match sluice's,
and the weights are well scaled (per-layer hidden-state RMS, routing spread over experts).

    .venv/bin/python scripts/check_synth_mlx.py DIR [--sluice target/release/sluice] [--tokens 24]

Needs mlx[cpu] and mlx-lm (scripts/requirements-fixtures.txt). Exits non-zero on a mismatch.
"""
import argparse, json, os, subprocess, sys, tempfile
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--tol", type=float, default=2e-3, help="max|diff| / max|ref| allowed")
    a = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    from mlx.utils import tree_map

    model, tok = load(a.model)
    # mlx-lm computes in the weights' dtype (bf16 here); sluice computes in f32. Cast the
    # floating parameters (scales, biases, norms) to f32, which is exact, to compare like with like.
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    text = cfg.get("text_config", cfg)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(text["vocab_size"], 1000), size=a.tokens).tolist()

    # The experts each layer picks, via a hook on the routers.
    lm = getattr(model, "language_model", model)
    layers = lm.model.layers
    chosen = []
    for layer in layers:
        # The MoE block (Mixtral's is `block_sparse_moe`); leading dense layers have no router.
        mlp = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if "gate" not in mlp:
            continue
        gate = mlp.gate

        def hooked_gate(x, gate=gate):
            out = gate(x)
            if isinstance(out, tuple):  # GLM's router returns (experts, weights)
                chosen.append(np.array(out[0]))
                return out
            k = text["num_experts_per_tok"]
            chosen.append(np.array(mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]))
            return out

        mlp.gate = hooked_gate
    final_in = []
    norm = lm.model.norm

    class Probe:
        def __call__(self, x):
            final_in.append(float(mx.sqrt(mx.mean(x.astype(mx.float32) ** 2))))
            return norm(x)

    lm.model.norm = Probe()
    emb = lm.model.embed_tokens(mx.array([ids]))
    emb_rms = float(mx.sqrt(mx.mean(emb.astype(mx.float32) ** 2)))
    logits = model(mx.array([ids]))
    mx.eval(logits)
    ref = np.array(logits[0].astype(mx.float32))

    experts = next(text[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in text)
    counts = np.zeros(experts, dtype=np.int64)
    for c in chosen:
        np.add.at(counts, c.reshape(-1), 1)
    used = (counts > 0).mean()
    print(f"mlx-lm loaded {a.model}: hidden RMS {emb_rms:.2f} after the embedding, "
          f"{final_in[0]:.2f} after {len(layers)} layers; logits std {ref.std():.3f}, "
          f"experts used {used * 100:.0f}% ({len(chosen)} routed layers x {a.tokens} tokens), "
          f"max share of one expert {counts.max() / counts.sum() * 100:.1f}% "
          f"({counts.max() / max(np.median(counts), 1):.1f}x the median)")

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "l.npy")
        subprocess.run([a.sluice, "logits", "--model", a.model, "--tokens", ",".join(map(str, ids)),
                        "--mode", "prefill", "--out", out], check=True)
        got = np.load(out)
    diff = np.abs(got - ref).max() / np.abs(ref).max()
    same_argmax = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"sluice vs mlx-lm: max|diff|/max|ref| = {diff:.2e}, argmax agreement {same_argmax * 100:.0f}%")
    ok = 0.1 < final_in[0] / emb_rms < 100 and diff <= a.tol and same_argmax == 1.0 and 0.1 < ref.std() < 100 and np.isfinite(ref).all()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
