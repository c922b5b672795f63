#!/usr/bin/env python3
"""Write a llama.cpp GGUF that holds exactly the numbers of an mlx-community affine-quantised MoE
checkpoint directory, so that llama.cpp and sluice run the same model.

Supported: model_type `qwen3_moe` (llama.cpp arch `qwen3moe`) and `qwen3_5_moe` (Qwen3.5 MoE,
text model under `language_model.`, llama.cpp arch `qwen35moe`; vision tower skipped), with
quantisation groups that are a multiple of 32 (mlx-community's default is 4-bit g64).

mlx stores a weight as codes q with a float scale s and bias b per group: value = s*q + b.
ggml's blocks of 32 carry the same values exactly when:
  Q4_1 (5.0 bits/weight)  d = s, m = b: any 4-bit checkpoint whose scales and biases are exact in
                          float16 (bf16 ones are, within float16's range);
  Q4_0 (4.5 bits/weight)  d = s, value d*(q-8): only when every bias is exactly -8*s, which
                          `sluice synth --ggml-zero-point` writes (same size as mlx's 4-bit g64);
  Q8_0 (8.5 bits/weight)  d = s, q-128 as int8: 8-bit with every bias exactly -128*s.
Each tensor gets the smallest of these that is exact; anything else (8-bit with other biases,
unquantised weights) is dequantised to F32, which is exact. Router gates are always F32 (small,
and llama.cpp then does not quantise the activations that pick the experts). A scale or bias that
float16 cannot hold stops the conversion (--allow-inexact rounds it and says so). The 4-bit codes
are moved, never re-quantised: mlx keeps element i of a row in u32 word i//8 at bits 4*(i%8); a
ggml block keeps element j in the low nibble of byte j and element j+16 in its high nibble.

Memory stays bounded (a few hundred MB): the safetensors are memory-mapped and each tensor is
converted and written in row chunks. Needs numpy and the `gguf` package (PyPI).

Usage: gguf_from_mlx.py MODEL_DIR OUT.gguf [--force] [--allow-inexact]
"""
import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("gguf_from_mlx.py: needs the `gguf` package: pip install gguf numpy")

CHUNK_ELEMS = 32 * 1024 * 1024  # elements per conversion chunk (~16 MB of 4-bit input)
ST_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32,
             "U8": np.uint8, "I32": np.int32}


def die(msg):
    sys.exit(f"gguf_from_mlx.py: {msg}")


# ---------------------------------------------------------------- safetensors (mmap, no copy)
class SafeTensors:
    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            die(f"no *.safetensors in {model_dir}")
        self.index = {}
        for f in files:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                self.index[name] = (f, base, info)

    def __contains__(self, name):
        return name in self.index

    def names(self):
        return self.index.keys()

    def get(self, name):
        """Memory-mapped array; BF16 comes back as uint16."""
        if name not in self.index:
            die(f"tensor {name!r} not in checkpoint")
        f, base, info = self.index[name]
        dt = ST_DTYPES.get(info["dtype"])
        if dt is None:
            die(f"tensor {name!r}: dtype {info['dtype']} not supported")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, dt)
        return np.memmap(f, dtype=dt, mode="r", offset=base + start, shape=shape)

    def dtype(self, name):
        return self.index[name][2]["dtype"]


def to_f32(a, st_dtype):
    a = np.asarray(a)
    if st_dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


# ---------------------------------------------------------------- conversions
GT = gguf.GGMLQuantizationType
BLOCK_BYTES = {GT.Q4_0: 18, GT.Q4_1: 20, GT.Q8_0: 34}


class Inexact(Exception):
    pass


def f16_exact(x, what):
    """x (float32) as float16, or Inexact if any value does not survive the round trip."""
    h = np.clip(x, -65504.0, 65504.0).astype(np.float16)
    bad = h.astype(np.float32) != x
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise Inexact(f"{int(bad.sum())} of {x.size} {what} are not exact in float16 "
                      f"(e.g. {x.reshape(-1)[i]!r})")
    return h


def nibbles_to_blocks(w):
    """(R, K/8) uint32 mlx 4-bit codes -> (R, K/32, 16) bytes in ggml's order: byte j of a block
    of 32 holds element j (low nibble) and element j+16 (high nibble)."""
    R = w.shape[0]
    nb = w.shape[1] // 4
    b = np.ascontiguousarray(w).view(np.uint8).reshape(R, nb, 16)  # bytes: elems 2m (lo), 2m+1 (hi)
    A, B = b[:, :, :8], b[:, :, 8:]
    even = (A & 0x0F) | (B << 4)        # qs[2m]   = e[2m]   | e[2m+16]   << 4
    odd = (A >> 4) | (B & 0xF0)         # qs[2m+1] = e[2m+1] | e[2m+17]   << 4
    return np.stack((even, odd), axis=-1).reshape(R, nb, 16)


def affine_to_blocks(qtype, w, scales, biases, sdt, group):
    """mlx affine rows (codes w, per-group scales and biases) as ggml blocks of 32, exactly:
    Q4_1 (d = scale, m = bias), Q4_0 (d = scale; every bias is -8*scale) or Q8_0 (8-bit codes,
    d = scale, q = code - 128; every bias is -128*scale). Raises Inexact otherwise."""
    R = w.shape[0]
    s = to_f32(scales, sdt)
    b = to_f32(biases, sdt)
    per = group // 32
    d = np.repeat(f16_exact(s, "scales"), per, axis=1)
    nb = d.shape[1]
    out = np.empty((R, nb, BLOCK_BYTES[qtype]), np.uint8)
    out[:, :, :2] = d.view(np.uint8).reshape(R, nb, 2)
    if qtype == GT.Q4_1:
        m = np.repeat(f16_exact(b, "biases"), per, axis=1)
        out[:, :, 2:4] = m.view(np.uint8).reshape(R, nb, 2)
        out[:, :, 4:] = nibbles_to_blocks(w)
    elif qtype == GT.Q4_0:
        if not np.array_equal(b, -8.0 * s):
            raise Inexact("biases are not all -8 x scale (Q4_0's zero point)")
        out[:, :, 2:] = nibbles_to_blocks(w)
    elif qtype == GT.Q8_0:
        if not np.array_equal(b, -128.0 * s):
            raise Inexact("biases are not all -128 x scale (Q8_0's zero point)")
        # mlx packs 8-bit element i into byte i of the row; code - 128 as int8 flips the top bit
        out[:, :, 2:] = (np.ascontiguousarray(w).view(np.uint8) ^ 0x80).reshape(R, nb, 32)
    else:
        raise ValueError(qtype)
    return out.reshape(R, -1)


def dequant_rows(w, scales, biases, st_dtype, bits, group):
    """mlx affine dequantisation to float32. w: (R, K*bits/32) uint32."""
    R = w.shape[0]
    per_word = 32 // bits
    K = w.shape[1] * per_word
    words = np.ascontiguousarray(w)[:, :, None]
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    q = ((words >> shifts) & ((1 << bits) - 1)).reshape(R, K).astype(np.float32)
    s = np.repeat(to_f32(scales, st_dtype), group, axis=1)
    bi = np.repeat(to_f32(biases, st_dtype), group, axis=1)
    return q * s + bi


# ---------------------------------------------------------------- plan
class Item:
    """One GGUF tensor: name, numpy byte/element shape, raw type, nbytes, and a chunk producer."""

    def __init__(self, name, shape, qtype, nbytes, produce):
        self.name, self.shape, self.qtype, self.nbytes, self.produce = name, shape, qtype, nbytes, produce


def quant_info(cfg, src_prefix):
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if not q:
        return None
    over = q.get(src_prefix)
    if isinstance(over, dict):
        return over["bits"], over["group_size"]
    if over is False:
        return None
    return q["bits"], q["group_size"]


ALLOW_INEXACT = False  # --allow-inexact
CHOICES = {}  # ggml type name -> [tensors, bytes], for the summary


def pick_type(st, src, qi, w):
    """The smallest ggml type that holds src's values exactly (see the module doc)."""
    if qi is None or w.dtype != np.uint32:
        return GT.F32
    bits, group = qi
    if group % 32:
        return GT.F32
    sdt = st.dtype(src + ".scales")
    s = to_f32(st.get(src + ".scales"), sdt)
    b = to_f32(st.get(src + ".biases"), sdt)
    for qtype in {4: [GT.Q4_0, GT.Q4_1], 8: [GT.Q8_0]}.get(bits, []):
        if qtype == GT.Q4_0 and not np.array_equal(b, -8.0 * s):
            continue
        if qtype == GT.Q8_0 and not np.array_equal(b, -128.0 * s):
            continue
        try:
            f16_exact(s, "scales")
            if qtype == GT.Q4_1:
                f16_exact(b, "biases")
        except Inexact as e:
            if not ALLOW_INEXACT:
                die(f"{src}: {e}; the GGUF would not hold the checkpoint's numbers "
                    f"(--allow-inexact rounds them to float16)")
            print(f"gguf_from_mlx.py: warning: {src}: {e}: rounded to float16", file=sys.stderr)
        return qtype
    return GT.F32  # 8-bit without ggml's zero point, other widths: dequantised exactly


def make_linear_item(st, cfg, gname, src, rows=None, col_blocks=None, f32=False):
    """A linear (2-D, or 3-D stacked experts) in the smallest ggml type that holds its values
    exactly (Q4_0, Q4_1, Q8_0, else F32 dequantised). `rows` permutes the output rows of a 2-D
    weight; `col_blocks=(block, perm)` permutes its input columns in blocks of `block` elements
    (both exact on the codes: qwen35moe's V-head reorder)."""
    w = st.get(src + ".weight")
    qi = quant_info(cfg, src) if w.dtype == np.uint32 else None
    qtype = GT.F32 if f32 else pick_type(st, src, qi, w)
    bits, group = qi if qi else (32, 1)
    lead = tuple(w.shape[:-2])
    N = w.shape[-2]
    K = w.shape[-1] * 32 // bits
    n_rows = int(np.prod(lead, dtype=np.int64)) * N
    if (rows is not None or col_blocks is not None) and lead:
        die(f"{src}: head reordering of a stacked tensor")
    if col_blocks is not None and qi and col_blocks[0] % group:
        # V heads narrower than a quantisation group: reorder the dequantised values instead
        qtype = GT.F32
    sdt = st.dtype(src + (".scales" if qi else ".weight"))

    def reorder(x, per_elem):
        """x's rows with the input-column blocks permuted (per_elem: x's columns per element)."""
        if col_blocks is None:
            return x
        block, perm = col_blocks
        return x.reshape(x.shape[0], -1, int(block * per_elem))[:, perm].reshape(x.shape[0], -1)

    def take(a, r0, r1):
        a = a.reshape(n_rows, -1)
        return np.asarray(a[r0:r1] if rows is None else a[rows[r0:r1]])

    def produce(as_type=None):
        as_type = qtype if as_type is None else as_type
        step = max(1, CHUNK_ELEMS // K)
        for r in range(0, n_rows, step):
            r1 = min(n_rows, r + step)
            if not qi:
                yield reorder(to_f32(take(st.get(src + ".weight"), r, r1), sdt), 1)
                continue
            wq = take(st.get(src + ".weight"), r, r1)
            sc = take(st.get(src + ".scales"), r, r1)
            bi = take(st.get(src + ".biases"), r, r1)
            if as_type == GT.F32:
                yield reorder(dequant_rows(wq, sc, bi, sdt, bits, group), 1)
            else:
                wq, sc, bi = reorder(wq, bits / 32), reorder(sc, 1 / group), reorder(bi, 1 / group)
                yield affine_to_blocks(as_type, wq, sc, bi, sdt, group)

    if qtype == GT.F32:
        shape, nbytes = lead + (N, K), n_rows * K * 4
    else:
        row_bytes = K // 32 * BLOCK_BYTES[qtype]
        shape, nbytes = lead + (N, row_bytes), n_rows * row_bytes
    c = CHOICES.setdefault(qtype.name, [0, 0])
    c[0] += 1
    c[1] += nbytes
    item = Item(gname, shape, qtype, nbytes, produce)
    item.reference = lambda: produce(GT.F32)  # the checkpoint's values, for --verify
    return item


def verify(path, items):
    """Dequantise every tensor of the written GGUF with the gguf package's own reference
    dequantiser and require it to equal the checkpoint's values (mlx's s*q + b, in float32)."""
    from gguf.quants import dequantize
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    worst = 0.0
    for it in items:
        t = tensors.get(it.name)
        if t is None:
            die(f"--verify: {it.name} missing from {path}")
        ref = getattr(it, "reference", it.produce)
        data = np.asarray(t.data).reshape(-1, np.asarray(t.data).shape[-1]) \
            if t.tensor_type != GT.F32 else np.asarray(t.data).reshape(-1, it.shape[-1])
        r = 0
        for chunk in ref():
            chunk = np.asarray(chunk, np.float32).reshape(-1, chunk.shape[-1] if chunk.ndim > 1 else chunk.size)
            got = dequantize(data[r:r + chunk.shape[0]], t.tensor_type).reshape(chunk.shape)
            if not np.array_equal(got, chunk):
                diff = float(np.max(np.abs(got - chunk)))
                if not ALLOW_INEXACT:
                    die(f"--verify: {it.name} ({t.tensor_type.name}) differs from the checkpoint "
                        f"by up to {diff:g}")
                worst = max(worst, diff)
            r += chunk.shape[0]
    print(f"verified: {len(items)} tensors of {path} dequantise to the checkpoint's values "
          + ("exactly" if worst == 0 else f"within {worst:g} (--allow-inexact)"), file=sys.stderr)


def make_f32_item(st, gname, src, add=0.0):
    a = st.get(src)
    sdt = st.dtype(src)

    def produce():
        x = to_f32(st.get(src), sdt)
        yield (x + np.float32(add)) if add else x
    return Item(gname, tuple(a.shape), gguf.GGMLQuantizationType.F32, int(np.prod(a.shape)) * 4,
                produce)


# ---------------------------------------------------------------- qwen3_moe
def plan_qwen3_moe(st, cfg, w):
    p = "model."
    n_layer = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers", []))
    arch = "qwen3moe"
    w.add_context_length(cfg.get("max_position_embeddings", 40960))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(cfg.get("intermediate_size", 0))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.get("rope_theta", 1e6))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if dense or step != 1:
        die("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) is not supported "
            "by llama.cpp's qwen3moe either")

    items = [make_linear_item(st, cfg, "token_embd.weight", p + "embed_tokens")]
    for i in range(n_layer):
        L = f"{p}layers.{i}."
        b = f"blk.{i}."
        items += [
            make_f32_item(st, b + "attn_norm.weight", L + "input_layernorm.weight"),
            make_linear_item(st, cfg, b + "attn_q.weight", L + "self_attn.q_proj"),
            make_linear_item(st, cfg, b + "attn_k.weight", L + "self_attn.k_proj"),
            make_linear_item(st, cfg, b + "attn_v.weight", L + "self_attn.v_proj"),
            make_linear_item(st, cfg, b + "attn_output.weight", L + "self_attn.o_proj"),
            make_f32_item(st, b + "attn_q_norm.weight", L + "self_attn.q_norm.weight"),
            make_f32_item(st, b + "attn_k_norm.weight", L + "self_attn.k_norm.weight"),
            make_f32_item(st, b + "ffn_norm.weight", L + "post_attention_layernorm.weight"),
            make_linear_item(st, cfg, b + "ffn_gate_inp.weight", L + "mlp.gate", f32=True),
        ]
        items += expert_items(st, cfg, b, L + "mlp.")
    items.append(make_f32_item(st, "output_norm.weight", p + "norm.weight"))
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in st:
        pass  # llama.cpp falls back to token_embd
    else:
        items.append(make_linear_item(st, cfg, "output.weight", "lm_head"))
    return arch, items


def expert_items(st, cfg, b, M):
    if M + "switch_mlp.gate_proj.weight" not in st:
        die(f"{M}switch_mlp.*: expected mlx's stacked expert layout (switch_mlp); per-expert "
            f"checkpoints are not supported")
    return [
        make_linear_item(st, cfg, b + "ffn_gate_exps.weight", M + "switch_mlp.gate_proj"),
        make_linear_item(st, cfg, b + "ffn_up_exps.weight", M + "switch_mlp.up_proj"),
        make_linear_item(st, cfg, b + "ffn_down_exps.weight", M + "switch_mlp.down_proj"),
    ]


def reshape_item(item, shape):
    item.shape = tuple(shape)
    inner = item.produce

    def produce():
        for c in inner():
            yield c.reshape(-1)
    item.produce = produce
    return item


# ---------------------------------------------------------------- qwen3_5_moe (Qwen3.5 MoE)
def plan_qwen3_5_moe(st, cfg, w):
    """llama.cpp arch qwen35moe. mlx-lm already folds the +1 of Qwen3.5's zero-centred RMSNorms
    into the stored norm weights (its sanitize step), which is what llama.cpp expects, so norms are
    copied as they are. When linear_num_key_heads < linear_num_value_heads, llama.cpp expects the
    Gated DeltaNet's V heads in tiled order (v0 of every K head, then v1, ...) where Hugging Face
    groups them by K head; its converter permutes them, and so does this one, on the codes
    (rows of in_proj_qkv's V part, in_proj_z, in_proj_a/b, A_log, dt_bias, conv1d's V channels;
    column blocks of out_proj), which is exact."""
    p = "language_model.model."
    if p + "embed_tokens.weight" not in st:
        p = "model."  # text-only export
    head = "language_model.lm_head" if p.startswith("language_model") else "lm_head"
    n_layer = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_context_length(cfg.get("max_position_embeddings", 262144))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layer)
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 1e7)))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    interval = cfg.get("full_attention_interval", 4)
    w.add_full_attention_interval(interval)
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer)]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    if cfg.get("linear_key_head_dim") != cfg.get("linear_value_head_dim"):
        die("linear_key_head_dim != linear_value_head_dim is not supported by llama.cpp's qwen35moe")

    # V heads grouped by K head (Hugging Face) -> tiled (llama.cpp): new head j*n_k + i is old
    # head i*per_k + j. As index arrays: heads, V rows of head_v_dim each, in_proj_qkv's rows.
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if n_v % n_k:
        die(f"linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads {n_k}")
    v_heads = np.arange(n_v).reshape(n_k, n_v // n_k).T.reshape(-1)
    v_rows = (v_heads[:, None] * hv + np.arange(hv)[None, :]).reshape(-1)
    qk_dim = 2 * n_k * hk
    qkv_rows = np.concatenate([np.arange(qk_dim), qk_dim + v_rows])

    items = [make_linear_item(st, cfg, "token_embd.weight", p + "embed_tokens")]
    for i in range(n_layer):
        L = f"{p}layers.{i}."
        b = f"blk.{i}."
        items += [
            make_f32_item(st, b + "attn_norm.weight", L + "input_layernorm.weight"),
            make_f32_item(st, b + "post_attention_norm.weight", L + "post_attention_layernorm.weight"),
        ]
        if layer_types[i] == "full_attention":
            A = L + "self_attn."
            items += [
                make_linear_item(st, cfg, b + "attn_q.weight", A + "q_proj"),
                make_linear_item(st, cfg, b + "attn_k.weight", A + "k_proj"),
                make_linear_item(st, cfg, b + "attn_v.weight", A + "v_proj"),
                make_linear_item(st, cfg, b + "attn_output.weight", A + "o_proj"),
                make_f32_item(st, b + "attn_q_norm.weight", A + "q_norm.weight"),
                make_f32_item(st, b + "attn_k_norm.weight", A + "k_norm.weight"),
            ]
        else:
            A = L + "linear_attn."
            conv = st.get(A + "conv1d.weight")  # mlx: (conv_dim, kernel, 1)
            conv_dt = st.dtype(A + "conv1d.weight")
            a_log, dt_bias = A + "A_log", A + "dt_bias"

            def neg_exp(a_log=a_log):
                yield -np.exp(to_f32(st.get(a_log), st.dtype(a_log)))[v_heads]

            def dt(dt_bias=dt_bias):
                yield to_f32(st.get(dt_bias), st.dtype(dt_bias))[v_heads]

            def conv_w(name=A + "conv1d.weight", dtype=conv_dt):
                c = to_f32(st.get(name), dtype).reshape(conv.shape[0], conv.shape[1])
                yield np.concatenate([c[:qk_dim], c[qk_dim:][v_rows]])
            items += [
                make_linear_item(st, cfg, b + "attn_qkv.weight", A + "in_proj_qkv", rows=qkv_rows),
                make_linear_item(st, cfg, b + "attn_gate.weight", A + "in_proj_z", rows=v_rows),
                Item(b + "ssm_conv1d.weight", (conv.shape[0], conv.shape[1]), GT.F32,
                     conv.shape[0] * conv.shape[1] * 4, conv_w),
                Item(b + "ssm_dt.bias", (n_v,), GT.F32, n_v * 4, dt),
                Item(b + "ssm_a", (n_v,), GT.F32, n_v * 4, neg_exp),
                make_linear_item(st, cfg, b + "ssm_beta.weight", A + "in_proj_b", rows=v_heads),
                make_linear_item(st, cfg, b + "ssm_alpha.weight", A + "in_proj_a", rows=v_heads),
                make_f32_item(st, b + "ssm_norm.weight", A + "norm.weight"),
                make_linear_item(st, cfg, b + "ssm_out.weight", A + "out_proj",
                                 col_blocks=(hv, v_heads)),
            ]
        M = L + "mlp."
        items.append(make_linear_item(st, cfg, b + "ffn_gate_inp.weight", M + "gate", f32=True))
        items += expert_items(st, cfg, b, M)
        sg = make_linear_item(st, cfg, b + "ffn_gate_inp_shexp.weight",
                              M + "shared_expert_gate", f32=True)
        items += [
            reshape_item(sg, (cfg["hidden_size"],)),
            make_linear_item(st, cfg, b + "ffn_gate_shexp.weight", M + "shared_expert.gate_proj"),
            make_linear_item(st, cfg, b + "ffn_up_shexp.weight", M + "shared_expert.up_proj"),
            make_linear_item(st, cfg, b + "ffn_down_shexp.weight", M + "shared_expert.down_proj"),
        ]
    items.append(make_f32_item(st, "output_norm.weight", p + "norm.weight"))
    if not cfg.get("tie_word_embeddings") and head + ".weight" in st:
        items.append(make_linear_item(st, cfg, "output.weight", head))
    return "qwen35moe", items


# ---------------------------------------------------------------- tokenizer
def add_tokenizer(w, model_dir: Path, vocab_size: int, gen_cfg: dict, cfg: dict):
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    model = tj["model"]
    if model.get("type") != "BPE":
        die(f"tokenizer.json model type {model.get('type')}: only byte-level BPE is supported")
    tokens = {}
    for t, i in model["vocab"].items():
        tokens[i] = (t, gguf.TokenType.NORMAL)
    for a in tj.get("added_tokens", []):
        tokens[a["id"]] = (a["content"],
                           gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    n = max(vocab_size, max(tokens) + 1)
    toks, types = [], []
    for i in range(n):
        t, ty = tokens.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        toks.append(t)
        types.append(ty)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    tc = {}
    if (model_dir / "tokenizer_config.json").exists():
        tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    by_text = {t: i for i, (t, _) in tokens.items()}

    def tok_id(x):
        if isinstance(x, dict):
            x = x.get("content")
        return by_text.get(x) if isinstance(x, str) else None

    eos = tok_id(tc.get("eos_token"))
    g_eos = gen_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None and g_eos is not None:
        eos = g_eos[0] if isinstance(g_eos, list) else g_eos
    bos = gen_cfg.get("bos_token_id", cfg.get("bos_token_id"))
    pad = tok_id(tc.get("pad_token"))
    if pad is None:
        pad = gen_cfg.get("pad_token_id")
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos))
    if pad is not None:
        w.add_pad_token_id(int(pad))
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])
    return len(tokens), n


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Supports model_type qwen3_moe and qwen3_5_moe.")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    ap.add_argument("--allow-inexact", action="store_true",
                    help="round scales or biases that float16 cannot hold (the GGUF then differs "
                         "from the checkpoint; each such tensor is named on stderr)")
    ap.add_argument("--verify", action="store_true",
                    help="after writing, dequantise every tensor with the gguf package and check "
                         "that it equals the checkpoint's values")
    args = ap.parse_args()
    global ALLOW_INEXACT
    ALLOW_INEXACT = args.allow_inexact

    cfg_path = args.model_dir / "config.json"
    if not cfg_path.exists():
        die(f"{cfg_path} not found")
    cfg = json.loads(cfg_path.read_text())
    gen_cfg = {}
    if (args.model_dir / "generation_config.json").exists():
        gen_cfg = json.loads((args.model_dir / "generation_config.json").read_text())
    if args.out.exists() and not args.force:
        die(f"{args.out} exists (use --force to overwrite)")

    st = SafeTensors(args.model_dir)
    mt = cfg.get("model_type")
    planners = {"qwen3_moe": plan_qwen3_moe, "qwen3_5_moe": plan_qwen3_5_moe}
    if mt not in planners:
        die(f"model_type {mt!r} not supported (supported: {', '.join(planners)})")
    tcfg = cfg.get("text_config", cfg)
    # quantization settings live at the top level even when the text model is nested
    if "quantization" not in tcfg and ("quantization" in cfg or "quantization_config" in cfg):
        tcfg = dict(tcfg, quantization=cfg.get("quantization") or cfg.get("quantization_config"))

    arch_name = {"qwen3_moe": "qwen3moe", "qwen3_5_moe": "qwen35moe"}[mt]
    tmp = args.out.with_name(args.out.name + ".part")
    w = gguf.GGUFWriter(tmp, arch_name)
    w.add_name(args.model_dir.name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    arch, items = planners[mt](st, tcfg, w)
    assert arch == arch_name
    main_type = max(CHOICES, key=lambda k: CHOICES[k][1])
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(main_type, gguf.LlamaFileType.ALL_F32))
    for name, (n, nbytes) in sorted(CHOICES.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name}: {n} tensors, {nbytes / 1e9:.3f} GB", file=sys.stderr)
    n_real, n_vocab = add_tokenizer(w, args.model_dir, tcfg["vocab_size"], gen_cfg, cfg)
    print(f"tokenizer: {n_real} tokens from tokenizer.json, padded to {n_vocab}", file=sys.stderr)

    for it in items:
        quantised = it.qtype != GT.F32
        w.add_tensor_info(it.name, it.shape, np.dtype(np.uint8 if quantised else np.float32),
                          it.nbytes, raw_dtype=it.qtype if quantised else None)
    total = sum(it.nbytes for it in items)
    free = os.statvfs(args.out.parent.resolve()).f_bavail * os.statvfs(args.out.parent.resolve()).f_frsize
    if free < total + (1 << 30):
        die(f"{args.out.parent}: {free / 2**30:.1f} GiB free, the GGUF needs {total / 2**30:.1f} GiB")
    print(f"writing {args.out}: arch {arch}, {len(items)} tensors, {total / 1e9:.2f} GB",
          file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    t0 = time.time()
    done = 0
    last = 0.0
    for k, it in enumerate(items):
        w.write_padding(fout, fout.tell())
        written = 0
        for chunk in it.produce():
            chunk = np.ascontiguousarray(chunk)
            if chunk.dtype == np.float32 and not np.all(np.isfinite(chunk)):
                die(f"{it.name}: non-finite values")
            chunk.tofile(fout)
            written += chunk.nbytes
        if written != it.nbytes:
            die(f"{it.name}: wrote {written} bytes, planned {it.nbytes}")
        w.write_padding(fout, it.nbytes)
        done += it.nbytes
        now = time.time()
        if now - last > 5 or k == len(items) - 1:
            last = now
            rate = done / max(now - t0, 1e-9) / 1e9
            print(f"  [{k + 1}/{len(items)}] {it.name}: {done / 1e9:.2f}/{total / 1e9:.2f} GB, "
                  f"{rate:.2f} GB/s, {now - t0:.0f} s", file=sys.stderr, flush=True)
        # keep the page cache from filling with what we wrote: flush and drop it as we go
        if it.nbytes > (64 << 20):
            fout.flush()
            os.fsync(fout.fileno())
            os.posix_fadvise(fout.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    w.close()
    os.replace(tmp, args.out)
    print(f"done: {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB) in {time.time() - t0:.0f} s",
          file=sys.stderr)
    if args.verify:
        verify(args.out, items)


if __name__ == "__main__":
    main()
