#!/usr/bin/env python3
"""Write a llama.cpp GGUF from an mlx-community affine-quantised MoE checkpoint directory.

Supported: model_type `qwen3_moe` (llama.cpp arch `qwen3moe`) and `qwen3_5_moe` (Qwen3.5 MoE,
text model under `language_model.`, llama.cpp arch `qwen35moe`; vision tower skipped), 4-bit weights with a group size
that is a multiple of 32 (mlx-community's default is 4-bit g64), router gates 4- or 8-bit.

The 4-bit codes are carried over directly into Q4_0 (4.5 bits/weight, the same size as mlx q4
g64): mlx stores element i of a row in u32 word i//8 at bits 4*(i%8); a Q4_0 block of 32 is an
f16 scale d and 16 bytes where byte j holds element j (low nibble) and element j+16 (high
nibble), value = d*(q-8). d is the mlx scale of the element's group, and the mlx bias is dropped:
the value becomes scale*q - 8*scale instead of scale*q + bias. That is exact only when
bias == -8*scale, so the GGUF is for speed measurements, not for accuracy comparisons. Router
gates are dequantised exactly to F32, norms are written as F32.

Memory stays bounded (a few hundred MB): the safetensors are memory-mapped and each tensor is
converted and written in row chunks. Needs numpy and the `gguf` package (PyPI).

Usage: gguf_from_mlx.py MODEL_DIR OUT.gguf
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
def q4_rows_to_q4_0(w, scales, st_scale_dtype, group):
    """w: (R, K/8) uint32 mlx 4-bit codes; scales: (R, K/group). Returns (R, K/32*18) uint8."""
    R = w.shape[0]
    K = w.shape[1] * 8
    nb = K // 32
    b = np.ascontiguousarray(w).view(np.uint8).reshape(R, nb, 16)  # bytes: elems 2m (lo), 2m+1 (hi)
    A, B = b[:, :, :8], b[:, :, 8:]
    even = (A & 0x0F) | (B << 4)        # qs[2m]   = e[2m]   | e[2m+16]   << 4
    odd = (A >> 4) | (B & 0xF0)         # qs[2m+1] = e[2m+1] | e[2m+17]   << 4
    out = np.empty((R, nb, 18), np.uint8)
    out[:, :, 2:] = np.stack((even, odd), axis=-1).reshape(R, nb, 16)
    s = to_f32(scales, st_scale_dtype)
    s = np.nan_to_num(s, nan=0.0, posinf=65504.0, neginf=-65504.0)
    d = np.clip(s, -65504.0, 65504.0).astype(np.float16)
    d = np.repeat(d, group // 32, axis=1)  # (R, nb)
    out[:, :, :2] = d.view(np.uint8).reshape(R, nb, 2)
    return out.reshape(R, nb * 18)


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


def make_q4_item(st, cfg, gname, src):
    """A 4-bit mlx linear (2-D or stacked 3-D experts) written as Q4_0."""
    qi = quant_info(cfg, src)
    w = st.get(src + ".weight")
    if qi is None or w.dtype != np.uint32:
        die(f"{src}: expected an mlx-quantised weight (uint32 codes + scales/biases), got "
            f"{st.dtype(src + '.weight')}; only 4-bit mlx checkpoints are supported")
    bits, group = qi
    if bits != 4 or group % 32:
        die(f"{src}: {bits}-bit group {group}: only 4-bit with a group size multiple of 32 maps "
            f"onto Q4_0")
    lead = w.shape[:-1]
    K = w.shape[-1] * 8
    rows = int(np.prod(lead))
    nbytes = rows * (K // 32) * 18
    sdt = st.dtype(src + ".scales")

    def produce():
        w2 = st.get(src + ".weight").reshape(rows, -1)
        s2 = st.get(src + ".scales").reshape(rows, -1)
        step = max(1, CHUNK_ELEMS // K)
        for r in range(0, rows, step):
            yield q4_rows_to_q4_0(w2[r:r + step], s2[r:r + step], sdt, group)

    return Item(gname, tuple(lead) + (K // 32 * 18,), gguf.GGMLQuantizationType.Q4_0, nbytes,
                produce)


def make_f32_linear_item(st, cfg, gname, src):
    """Any linear (mlx-quantised at any bit width, or float) dequantised to F32 (small tensors)."""
    w = st.get(src + ".weight")
    qi = quant_info(cfg, src)
    if w.dtype == np.uint32 and qi is not None:
        bits, group = qi
        lead = w.shape[:-1]
        K = w.shape[-1] * 32 // bits
        rows = int(np.prod(lead))
        sdt = st.dtype(src + ".scales")

        def produce():
            w2 = st.get(src + ".weight").reshape(rows, -1)
            s2 = st.get(src + ".scales").reshape(rows, -1)
            b2 = st.get(src + ".biases").reshape(rows, -1)
            step = max(1, CHUNK_ELEMS // 4 // K)
            for r in range(0, rows, step):
                yield dequant_rows(w2[r:r + step], s2[r:r + step], b2[r:r + step], sdt, bits, group)
    else:
        lead, K = w.shape[:-1], w.shape[-1]
        rows = int(np.prod(lead))
        sdt = st.dtype(src + ".weight")

        def produce():
            yield to_f32(st.get(src + ".weight"), sdt).reshape(rows, K)
    return Item(gname, tuple(lead) + (K,), gguf.GGMLQuantizationType.F32, rows * K * 4, produce)


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

    items = [make_q4_item(st, cfg, "token_embd.weight", p + "embed_tokens")]
    for i in range(n_layer):
        L = f"{p}layers.{i}."
        b = f"blk.{i}."
        items += [
            make_f32_item(st, b + "attn_norm.weight", L + "input_layernorm.weight"),
            make_q4_item(st, cfg, b + "attn_q.weight", L + "self_attn.q_proj"),
            make_q4_item(st, cfg, b + "attn_k.weight", L + "self_attn.k_proj"),
            make_q4_item(st, cfg, b + "attn_v.weight", L + "self_attn.v_proj"),
            make_q4_item(st, cfg, b + "attn_output.weight", L + "self_attn.o_proj"),
            make_f32_item(st, b + "attn_q_norm.weight", L + "self_attn.q_norm.weight"),
            make_f32_item(st, b + "attn_k_norm.weight", L + "self_attn.k_norm.weight"),
            make_f32_item(st, b + "ffn_norm.weight", L + "post_attention_layernorm.weight"),
            make_f32_linear_item(st, cfg, b + "ffn_gate_inp.weight", L + "mlp.gate"),
        ]
        items += expert_items(st, cfg, b, L + "mlp.")
    items.append(make_f32_item(st, "output_norm.weight", p + "norm.weight"))
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in st:
        pass  # llama.cpp falls back to token_embd
    else:
        items.append(make_q4_item(st, cfg, "output.weight", "lm_head"))
    return arch, items


def expert_items(st, cfg, b, M):
    if M + "switch_mlp.gate_proj.weight" not in st:
        die(f"{M}switch_mlp.*: expected mlx's stacked expert layout (switch_mlp); per-expert "
            f"checkpoints are not supported")
    return [
        make_q4_item(st, cfg, b + "ffn_gate_exps.weight", M + "switch_mlp.gate_proj"),
        make_q4_item(st, cfg, b + "ffn_up_exps.weight", M + "switch_mlp.up_proj"),
        make_q4_item(st, cfg, b + "ffn_down_exps.weight", M + "switch_mlp.down_proj"),
    ]


def make_linear_item(st, cfg, gname, src):
    """Q4_0 for 4-bit mlx weights; F32 for anything else (8-bit gates, unquantised small ones)."""
    qi = quant_info(cfg, src)
    w = st.get(src + ".weight")
    if w.dtype == np.uint32 and qi is not None and qi[0] == 4 and qi[1] % 32 == 0:
        return make_q4_item(st, cfg, gname, src)
    return make_f32_linear_item(st, cfg, gname, src)


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
    copied as they are. The V-head reordering llama.cpp's converter applies when
    linear_num_key_heads != linear_num_value_heads is NOT applied (it only permutes rows, so speed
    is unaffected, but outputs differ from the real model's): the GGUF is for speed only."""
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
            a_log = A + "A_log"
            a_dt = st.dtype(a_log)
            n_v = st.get(a_log).shape[0]

            def neg_exp(a_log=a_log, a_dt=a_dt):
                yield -np.exp(to_f32(st.get(a_log), a_dt))
            items += [
                make_linear_item(st, cfg, b + "attn_qkv.weight", A + "in_proj_qkv"),
                make_linear_item(st, cfg, b + "attn_gate.weight", A + "in_proj_z"),
                reshape_item(make_f32_item(st, b + "ssm_conv1d.weight", A + "conv1d.weight"),
                             (conv.shape[0], conv.shape[1])),
                make_f32_item(st, b + "ssm_dt.bias", A + "dt_bias"),
                Item(b + "ssm_a", (n_v,), gguf.GGMLQuantizationType.F32, n_v * 4, neg_exp),
                make_linear_item(st, cfg, b + "ssm_beta.weight", A + "in_proj_b"),
                make_linear_item(st, cfg, b + "ssm_alpha.weight", A + "in_proj_a"),
                make_f32_item(st, b + "ssm_norm.weight", A + "norm.weight"),
                make_linear_item(st, cfg, b + "ssm_out.weight", A + "out_proj"),
            ]
        M = L + "mlp."
        items.append(make_f32_linear_item(st, cfg, b + "ffn_gate_inp.weight", M + "gate"))
        items += expert_items(st, cfg, b, M)
        sg = make_f32_linear_item(st, cfg, b + "ffn_gate_inp_shexp.weight", M + "shared_expert_gate")
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
                                 epilog="Supports model_type qwen3_moe and qwen3_5_moe (mlx 4-bit).")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = ap.parse_args()

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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    arch, items = planners[mt](st, tcfg, w)
    assert arch == arch_name
    n_real, n_vocab = add_tokenizer(w, args.model_dir, tcfg["vocab_size"], gen_cfg, cfg)
    print(f"tokenizer: {n_real} tokens from tokenizer.json, padded to {n_vocab}", file=sys.stderr)

    for it in items:
        w.add_tensor_info(it.name, it.shape, np.dtype(np.uint8) if it.qtype != gguf.GGMLQuantizationType.F32 else np.dtype(np.float32),
                          it.nbytes, raw_dtype=it.qtype if it.qtype != gguf.GGMLQuantizationType.F32 else None)
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


if __name__ == "__main__":
    main()
