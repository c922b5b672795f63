#!/usr/bin/env python3
"""A GGUF fixture in the codebook types (IQ4_NL, IQ4_XS, MXFP4), with float32 reference logits
from a numpy forward pass that is first checked against transformers.

    target/tmp/gguf-venv/bin/python scripts/make_fixtures_gguf_codebooks.py

Needs gguf==0.19.0 and numpy (2.4.6 was used); no torch. Writes
tests/fixtures/qwen3_moe-gguf-codebooks/ (`model.gguf`, `logits_prefill.npy`,
`logits_decode.npy`, `reference.json`).

1. The tiny Qwen3-MoE of tests/fixtures/qwen3_moe-gguf-q4_k_m (made by llama.cpp's tools, see
   make_fixtures_gguf.py) is read and dequantised with gguf-py, llama.cpp's own Python package.
2. The numpy forward pass below runs those weights, and must reproduce that fixture's
   transformers logits (float32, both files) to 1e-4 of their largest magnitude: so it is a
   reference for this family.
3. Its matrices are quantised again (experts' gate and down IQ4_XS, up IQ4_NL; attention q
   IQ4_XS, k and output MXFP4 with gguf-py's quantiser, v IQ4_NL); the embedding (Q4_K), output
   (Q6_K) and norms (F32) are copied as they are. The
   IQ4 quantisers are written here (gguf-py has none, and this environment has no llama-quantize):
   a block's scale from its largest value, each value the nearest code; the format, not the
   choice of codes, is what the fixture tests.
4. The new file, read back and dequantised by gguf-py, runs through the numpy forward pass: its
   logits are the reference. Prefill and decode are the same causal computation here, so both
   files hold the same logits (transformers' own two differ by ~1e-5).
"""
import json
import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "tests", "fixtures")
SOURCE = os.path.join(FIX, "qwen3_moe-gguf-q4_k_m")
OUT = os.path.join(FIX, "qwen3_moe-gguf-codebooks")

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                          113], dtype=np.float32)

# Tensor name suffix -> the type it is written in; others are copied. Of twelve assignments
# drawn at random, this one routes and predicts most decisively on the reference tokens (router
# gap 0.006, argmax margin 0.16; the source fixture's are 0.003 and 0.14): the first one tried
# gave 0.0003 and 0.002, which a rounding could flip.
TYPES = {
    "ffn_gate_exps.weight": T.IQ4_XS,
    "ffn_up_exps.weight": T.IQ4_NL,
    "ffn_down_exps.weight": T.IQ4_XS,
    "attn_q.weight": T.IQ4_XS,
    "attn_output.weight": T.MXFP4,
    "attn_k.weight": T.MXFP4,
    "attn_v.weight": T.IQ4_NL,
}


def read(path):
    """{name: float32 array in row-major HF orientation}, {name: type}, and the reader."""
    reader = gguf.GGUFReader(path)
    values, types = {}, {}
    for t in reader.tensors:
        v = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values[t.name] = v.reshape([int(d) for d in reversed(t.shape)])
        types[t.name] = t.tensor_type
    return values, types, reader


def meta(reader, key):
    return reader.fields[key].contents()


def forward(w, reader, tokens):
    """Qwen3-MoE in float32, as transformers computes it: the logits of every position, and the
    smallest gap between a token's k-th and (k+1)-th router probability over all layers."""
    arch = meta(reader, "general.architecture")
    m = lambda k: meta(reader, f"{arch}.{k}")  # noqa: E731
    layers, heads, kv_heads = m("block_count"), m("attention.head_count"), m("attention.head_count_kv")
    hd, eps, theta = m("attention.key_length"), m("attention.layer_norm_rms_epsilon"), m("rope.freq_base")
    top_k = m("expert_used_count")
    n = len(tokens)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    ang = np.arange(n, dtype=np.float32)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]

    def rope(x):  # [n, heads, hd], halves rotated (transformers' rotate_half)
        rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    x = w["token_embd.weight"][tokens]
    gaps = []
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for i in range(layers):
        p = lambda s: w[f"blk.{i}.{s}"]  # noqa: E731
        h = rms(x, p("attn_norm.weight"))
        q = (h @ p("attn_q.weight").T).reshape(n, heads, hd)
        k = (h @ p("attn_k.weight").T).reshape(n, kv_heads, hd)
        v = (h @ p("attn_v.weight").T).reshape(n, kv_heads, hd)
        q, k = rope(rms(q, p("attn_q_norm.weight"))), rope(rms(k, p("attn_k_norm.weight")))
        group = heads // kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", scores, v).reshape(n, heads * hd)
        x = x + attn @ p("attn_output.weight").T

        h = rms(x, p("ffn_norm.weight"))
        router = h @ p("ffn_gate_inp.weight").T
        probs = np.exp(router - router.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ranked = -np.sort(-probs, -1)
        gaps.append(float((ranked[:, top_k - 1] - ranked[:, top_k]).min()))
        out = np.zeros_like(h)
        for t in range(n):
            chosen = np.argsort(-probs[t], kind="stable")[:top_k]
            weights = probs[t, chosen] / probs[t, chosen].sum()
            for e, wt in zip(chosen, weights):
                g = p("ffn_gate_exps.weight")[e] @ h[t]
                u = p("ffn_up_exps.weight")[e] @ h[t]
                out[t] += wt * (p("ffn_down_exps.weight")[e] @ (g / (1 + np.exp(-g)) * u))
        x = x + out
    return rms(x, w["output_norm.weight"]) @ w["output.weight"].T, min(gaps)


def iq4_nl_blocks(x):
    """[rows, cols] float32 -> IQ4_NL blocks (uint8 [rows, cols / 32 * 18])."""
    b = x.reshape(-1, 32)
    imax = np.argmax(np.abs(b), -1)
    d = (b[np.arange(len(b)), imax] / -127.0).astype(np.float16)
    q = nearest(b, d.astype(np.float32)[:, None])
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), pack_nibbles(q)], -1)
    return out.reshape(x.shape[0], -1)


def iq4_xs_blocks(x):
    """[rows, cols] float32 -> IQ4_XS blocks (uint8 [rows, cols / 256 * 136])."""
    sb = x.reshape(-1, 8, 32)
    imax = np.argmax(np.abs(sb), -1)
    dl = np.take_along_axis(sb, imax[..., None], -1)[..., 0] / -127.0
    jmax = np.argmax(np.abs(dl), -1)
    d = (dl[np.arange(len(dl)), jmax] / -32.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d32 != 0, np.round(dl / d32), 0)
    ls = (np.clip(ls, -32, 31) + 32).astype(np.uint8)
    q = nearest(sb.reshape(-1, 32), (d32 * (ls.astype(np.float32) - 32)).reshape(-1, 1))
    qs = pack_nibbles(q).reshape(len(sb), 8 * 16)
    scales_h = np.zeros(len(sb), dtype=np.uint16)
    for ib in range(8):
        scales_h |= ((ls[:, ib] >> 4) & 3).astype(np.uint16) << (2 * ib)
    scales_l = (ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), scales_h.view(np.uint8).reshape(-1, 2),
                          scales_l.astype(np.uint8), qs], -1)
    return out.reshape(x.shape[0], -1)


def nearest(blocks, scale):
    """Index of the codebook value nearest each value / scale (a zero scale codes 0 as 1 * 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(scale != 0, blocks / scale, 0)
    return np.argmin(np.abs(r[..., None] - KVALUES_IQ4NL), -1).astype(np.uint8)


def pack_nibbles(q):
    """32 codes per block -> 16 bytes: value j in the low nibble of byte j, j + 16 in its high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def quantize(values, ty):
    rows = values.reshape(-1, values.shape[-1])
    if ty == T.IQ4_NL:
        blocks = iq4_nl_blocks(rows)
    elif ty == T.IQ4_XS:
        blocks = iq4_xs_blocks(rows)
    else:
        blocks = gguf.quants.quantize(rows, ty)
    return blocks.reshape(*values.shape[:-1], -1)


def main():
    tokens = json.load(open(os.path.join(SOURCE, "reference.json")))["tokens"]
    src_w, src_types, reader = read(os.path.join(SOURCE, "model.gguf"))

    # 2. The numpy pass against transformers on the source fixture.
    mine, src_gap = forward(src_w, reader, tokens)
    print(f"source routing gap {src_gap:.4f}")
    for f in ["logits_prefill.npy", "logits_decode.npy"]:
        ref = np.load(os.path.join(SOURCE, f))
        err = float(np.abs(mine - ref).max() / np.abs(ref).max())
        assert err < 1e-4 and (mine.argmax(-1) == ref.argmax(-1)).all(), (f, err)
        print(f"numpy forward vs transformers ({f}): max|diff| / max|ref| = {err:.2e}")

    # 3. The codebook file.
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "model.gguf")
    writer = gguf.GGUFWriter(path, meta(reader, "general.architecture"))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        ty = next((ty for s, ty in TYPES.items() if t.name.endswith(s)), None)
        if ty is None:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, quantize(src_w[t.name], ty), raw_dtype=ty)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # 4. Its reference logits.
    w, types, back = read(path)
    logits, gaps = forward(w, back, tokens)
    logits = logits.astype(np.float32)
    np.save(os.path.join(OUT, "logits_prefill.npy"), logits)
    np.save(os.path.join(OUT, "logits_decode.npy"), logits)
    top2 = np.sort(logits, -1)[:, -2:]
    counts = {}
    for ty in types.values():
        counts[ty.name] = counts.get(ty.name, 0) + 1
    reference = {
        "text": json.load(open(os.path.join(SOURCE, "reference.json")))["text"],
        "tokens": tokens,
        "tensor_types": counts,
        "types_by_tensor": {k: v.name for k, v in types.items()},
        "min_routing_gap": gaps,
        "min_argmax_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "max_abs_logit": float(np.abs(logits).max()),
        "source": "qwen3_moe-gguf-q4_k_m",
        "gguf_py_version": "0.19.0",
        "numpy_version": np.__version__,
        "notes": "qwen3_moe-gguf-q4_k_m dequantised by gguf-py, its matrices quantised again to "
                 "IQ4_NL / IQ4_XS (quantisers in this script) and MXFP4 (gguf-py's); logits: this "
                 "file dequantised by gguf-py, through this script's numpy forward pass (checked "
                 "against transformers on the source fixture); prefill and decode files equal",
    }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(json.dumps({k: reference[k] for k in ["tensor_types", "min_routing_gap",
                                                "min_argmax_margin", "max_abs_logit"]}))


if __name__ == "__main__":
    main()
