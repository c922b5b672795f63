#!/usr/bin/env python3
"""GGUF reference fixtures made by llama.cpp's own tools, with transformers' float32 logits.

    python scripts/make_fixtures_gguf.py --llama-cpp DIR [--quantize BIN] [--out tests/fixtures]

Needs torch, transformers (the lent GPU machine has both; everything runs on the CPU in float32),
a llama.cpp source tree (for `convert_hf_to_gguf.py` and its `gguf-py`) and its `llama-quantize`
(built from the same tree: `cmake -B build -DGGML_NATIVE=OFF && cmake --build build --target
llama-quantize`; `--quantize` names the binary, default DIR/build/bin/llama-quantize).

1. A tiny random Qwen3-MoE (hidden 256, expert width 256, so every matrix can take the 256-wide
   K-quant blocks) is saved by transformers with the shared fixture tokenizer; weights are redrawn
   until its routing and argmaxes are decisive, as in make_fixtures_transformers.py.
2. `convert_hf_to_gguf.py --outtype f32` writes the GGUF. The tiny tokenizer is byte-level BPE
   with Qwen2's pre-tokenizer, which the converter identifies by hashing the encoding of a probe
   text against known models' hashes; a 500-token vocabulary matches none, so the converter is
   told "qwen2" (its `get_vocab_base_pre`) instead of failing. Nothing else is changed.
3. `llama-quantize` makes each variant below from that file (the K-quant mixes as llama.cpp
   chooses them; `legacy` sets per-tensor types to cover the 32-blocks and F16/BF16).
4. The reference: each GGUF dequantised by gguf-py's own code into a float32 Hugging Face
   checkpoint, loaded by transformers, logits in float32 (all tokens at once, and one at a time
   through the cache). The f32 GGUF must reproduce the original model's logits (checks the name
   mapping). Each variant's routing gap and argmax margin are measured on its dequantised weights.

With `--family qwen35moe` the model is a tiny Qwen3.5-MoE (two Gated DeltaNet layers, one gated
attention layer, two value heads per key head so that llama.cpp's tiled value-head order differs
from Hugging Face's grouped one; converted with `--no-mtp`), and the dequantised checkpoint undoes
llama.cpp's changes: norms less the 1 it adds, `A_log = ln(-ssm_a)`, the value heads regrouped,
conv1d as `[C, 1, K]`. It writes `qwen3_5_moe-gguf-<variant>/`. `--family qwen3next`: a tiny
Qwen3-Next of the same shape (llama.cpp keeps its value heads grouped, splits `in_proj_qkvz` into
q/k/v and z and keeps `in_proj_ba` fused; undone likewise), written as `qwen3_next-gguf-<variant>/`.

With `--family qwen3` the model is a tiny dense Qwen3 (the draft models' family: Qwen3-0.6B for
Qwen3-30B-A3B, the usual `-md` of llama.cpp), written as `qwen3-gguf-<variant>/` (Q8_0, the
usual type of a draft model, and Q4_K_M); there is no routing to condition.

Writes `qwen3_moe-gguf-<variant>/` with `model.gguf`, `logits_prefill.npy`, `logits_decode.npy`,
`reference.json` (text, tokens, tensor types, margins, versions).
"""
import argparse, json, os, shutil, subprocess, sys, tempfile
from collections import Counter

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures_transformers import init_, routing_gap, TOKENIZER_FROM, TOKENIZER_FILES  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the river runs to the sea."

# (fixture suffix, llama-quantize ftype, extra arguments): together every type sluice runs
# (Q2_K..Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, MXFP4) and F16/BF16/F32. (Q5_K_M, Q6_K and
# Q8_0 files were made too and dropped: their types are covered here.)
VARIANTS = [
    ("q4_k_m", "Q4_K_M", []),
    ("q3_k_m", "Q3_K_M", []),
    ("q2_k", "Q2_K", []),
    ("legacy", "Q4_0", ["--tensor-type", "attn_q=q4_1", "--tensor-type", "attn_k=q5_0",
                        "--tensor-type", "attn_v=q5_1", "--tensor-type", "attn_output=f16",
                        "--tensor-type", "ffn_up_exps=q5_1", "--tensor-type", "ffn_down_exps=q4_1",
                        "--output-tensor-type", "bf16", "--token-embedding-type", "q8_0"]),
    # The codebook types as llama-quantize writes them: IQ4_XS, with IQ4_NL and MXFP4 (gpt-oss's
    # expert type) per tensor.
    ("iq4", "IQ4_XS", ["--tensor-type", "attn_v=iq4_nl", "--tensor-type", "ffn_up_exps=iq4_nl",
                       "--tensor-type", "ffn_down_exps=mxfp4", "--tensor-type", "attn_k=mxfp4"]),
]


VARIANTS_QWEN35 = [("q4_k_m", "Q4_K_M", [])]
VARIANTS_QWEN3 = [("q8_0", "Q8_0", []), ("q4_k_m", "Q4_K_M", [])]


def config_qwen35():
    """Tiny Qwen3.5-MoE with every matrix 256 columns wide (K-quant blocks) and 2 value heads per
    key head."""
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(
        vocab_size=500, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        eos_token_id=[495, 493],
    )


def deltanet_common_to_hf(name, v):
    """What llama.cpp's converter writes alike for qwen35moe and qwen3next (conversion/qwen.py):
    [(HF name, values)] for the embeddings, head, norms (+1 on the zero-centred ones undone),
    full attention, router, experts and shared expert; None for the other tensors."""
    fixed = {"token_embd.weight": ("model.embed_tokens.weight", v),
             "output_norm.weight": ("model.norm.weight", v - 1),
             "output.weight": ("lm_head.weight", v)}
    if name in fixed:
        return [fixed[name]]
    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}."
    if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
        proj = rest.split("_")[1]
        return [(p + f"mlp.experts.{e}.{proj}_proj.weight", v[e]) for e in range(v.shape[0])]
    table = {
        "attn_norm.weight": ("input_layernorm.weight", lambda: v - 1),
        "post_attention_norm.weight": ("post_attention_layernorm.weight", lambda: v - 1),
        "attn_q_norm.weight": ("self_attn.q_norm.weight", lambda: v - 1),
        "attn_k_norm.weight": ("self_attn.k_norm.weight", lambda: v - 1),
        "attn_q.weight": ("self_attn.q_proj.weight", lambda: v),
        "attn_k.weight": ("self_attn.k_proj.weight", lambda: v),
        "attn_v.weight": ("self_attn.v_proj.weight", lambda: v),
        "attn_output.weight": ("self_attn.o_proj.weight", lambda: v),
        "ssm_norm.weight": ("linear_attn.norm.weight", lambda: v),
        "ffn_gate_inp.weight": ("mlp.gate.weight", lambda: v),
        "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", lambda: v.reshape(1, -1)),
        "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", lambda: v),
        "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", lambda: v),
        "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", lambda: v),
    }
    if rest not in table:
        return None
    hf, values = table[rest]
    return [(p + hf, np.ascontiguousarray(values()))]


def qwen35_to_hf(name, v, cfg):
    """llama.cpp qwen35moe tensor `name` with values `v` (HF axis order) -> [(HF name, values)],
    undoing its converter (conversion/qwen.py): deltanet_common_to_hf, then A = -exp(A_log),
    value heads tiled, conv1d squeezed, dt_bias renamed."""
    common = deltanet_common_to_hf(name, v)
    if common is not None:
        return common
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    hk, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_k = nv // nk
    # Grouped head g = i * per_k + j sits at tiled position j * nk + i.
    tiled_of = [(g % per_k) * nk + g // per_k for g in range(nv)]

    def grouped(x, size, axis=0):
        idx = np.concatenate([np.arange(t * size, (t + 1) * size) for t in tiled_of])
        return np.take(x, idx, axis=axis)

    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}."
    qk = 2 * nk * hk
    table = {
        "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight",
                            lambda: np.concatenate([v[:qk], grouped(v[qk:], hv)])),
        "attn_gate.weight": ("linear_attn.in_proj_z.weight", lambda: grouped(v, hv)),
        "ssm_beta.weight": ("linear_attn.in_proj_b.weight", lambda: grouped(v, 1)),
        "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", lambda: grouped(v, 1)),
        "ssm_conv1d.weight": ("linear_attn.conv1d.weight",
                              lambda: np.concatenate([v[:qk], grouped(v[qk:], hv)])[:, None, :]),
        "ssm_dt.bias": ("linear_attn.dt_bias", lambda: grouped(v, 1)),
        # As sluice computes it: ln in float64, rounded once to float32.
        "ssm_a": ("linear_attn.A_log",
                  lambda: grouped(np.log(-v.astype(np.float64)).astype(np.float32), 1)),
        "ssm_out.weight": ("linear_attn.out_proj.weight", lambda: grouped(v, hv, axis=1)),
    }
    hf, values = table[rest]
    return [(p + hf, np.ascontiguousarray(values()))]


def config_qwen3next():
    """Tiny Qwen3-Next, shaped like config_qwen35 (256-wide matrices, 2 value heads per key
    head)."""
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(
        vocab_size=500, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        eos_token_id=[495, 493],
    )


def qwen3next_to_hf(name, v, cfg):
    """llama.cpp qwen3next tensor `name` with values `v` -> [(HF name, values)], undoing its
    converter (conversion/qwen.py, Qwen3NextModel): deltanet_common_to_hf, then A = -exp(A_log),
    conv1d squeezed, dt_bias renamed, and `in_proj_qkvz` split into `attn_qkv` ([all q; all k; all
    v]) and `attn_gate` (z): those two come back as parts that qwen3next_finish interleaves again
    per key head. `in_proj_ba` is written as it is (`ssm_ba`)."""
    common = deltanet_common_to_hf(name, v)
    if common is not None:
        return common
    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}."
    table = {
        "attn_qkv.weight": ("linear_attn.part_qkv", lambda: v),
        "attn_gate.weight": ("linear_attn.part_z", lambda: v),
        "ssm_in.weight": ("linear_attn.in_proj_qkvz.weight", lambda: v),
        "ssm_ba.weight": ("linear_attn.in_proj_ba.weight", lambda: v),
        "ssm_conv1d.weight": ("linear_attn.conv1d.weight", lambda: v[:, None, :]),
        "ssm_dt.bias": ("linear_attn.dt_bias", lambda: v),
        # As sluice computes it: ln in float64, rounded once to float32.
        "ssm_a": ("linear_attn.A_log", lambda: np.log(-v.astype(np.float64)).astype(np.float32)),
        "ssm_out.weight": ("linear_attn.out_proj.weight", lambda: v),
    }
    hf, values = table[rest]
    return [(p + hf, np.ascontiguousarray(values()))]


def qwen3next_finish(tensors, cfg):
    """`in_proj_qkvz` again from qwen3next_to_hf's parts: per key head [q | k | v | z]."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    w = nv // nk * dv
    for key in [k for k in tensors if k.endswith("linear_attn.part_qkv")]:
        prefix = key[: -len("part_qkv")]
        qkv = tensors.pop(key).numpy()
        z = tensors.pop(prefix + "part_z").numpy()
        q, k, v = qkv[: nk * dk], qkv[nk * dk: 2 * nk * dk], qkv[2 * nk * dk:]
        rows = []
        for h in range(nk):
            rows += [q[h * dk:(h + 1) * dk], k[h * dk:(h + 1) * dk], v[h * w:(h + 1) * w],
                     z[h * w:(h + 1) * w]]
        tensors[prefix + "in_proj_qkvz.weight"] = torch.from_numpy(
            np.ascontiguousarray(np.concatenate(rows), dtype=np.float32))


def config():
    return Qwen3MoeConfig(
        vocab_size=500, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
        output_router_logits=False, eos_token_id=[495, 493],
    )


def config_qwen3():
    """Tiny dense Qwen3, every matrix 256 columns wide (K-quant blocks)."""
    return Qwen3Config(
        vocab_size=500, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=[495, 493],
    )


def gguf_to_hf_name(name):
    """GGUF tensor name (llama.cpp's qwen3moe) -> Hugging Face name(s), `{e}` for experts."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}."
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
        "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
        "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
        # dense Qwen3
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    return p + per_layer[rest]


def dequantized_checkpoint(gguf_path, hf_dir, out_dir, to_hf=None, finish=None):
    """The GGUF's values (gguf-py's dequantisation) as a float32 HF checkpoint in `out_dir`;
    `to_hf(name, values)` maps a tensor to HF (name, values) pairs (default: qwen3moe's names),
    and `finish(tensors)` then joins what comes from several GGUF tensors."""
    import gguf
    from safetensors.torch import save_file
    reader = gguf.GGUFReader(gguf_path)
    tensors, types = {}, Counter()
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]
        values = values.reshape(shape)
        types[t.tensor_type.name] += 1
        if to_hf is not None:
            for hf, v in to_hf(t.name, values):
                tensors[hf] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
            continue
        hf = gguf_to_hf_name(t.name)
        if "{e}" in hf:
            for e in range(shape[0]):
                tensors[hf.format(e=e)] = torch.from_numpy(values[e].copy())
        else:
            tensors[hf] = torch.from_numpy(values.copy())
    if finish is not None:
        finish(tensors)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    for f in os.listdir(hf_dir):
        if f.endswith(".json") and "safetensors" not in f:
            shutil.copy(os.path.join(hf_dir, f), out_dir)
    return dict(types), {t.name: t.tensor_type.name for t in reader.tensors}


def logits(model_dir, tokens):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        prefill = ref(ids).logits[0].numpy().astype(np.float32)
        past, rows = None, []
        for t in tokens:
            o = ref(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            rows.append(o.logits[0, -1].numpy())
    return ref, prefill, np.stack(rows).astype(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree")
    ap.add_argument("--quantize", help="llama-quantize binary (default LLAMA_CPP/build/bin/llama-quantize)")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures"))
    ap.add_argument("--only", action="append", help="variant(s) to write")
    ap.add_argument("--family", choices=["qwen3moe", "qwen3", "qwen35moe", "qwen3next"],
                    default="qwen3moe")
    a = ap.parse_args()
    # Both DeltaNet families: converted with --no-mtp, one Q4_K_M variant.
    qwen35 = a.family in ("qwen35moe", "qwen3next")
    dense = a.family == "qwen3"
    finish = None
    if a.family == "qwen35moe":
        cfg35 = config_qwen35()
        to_hf = lambda name, v: qwen35_to_hf(name, v, cfg35)  # noqa: E731
        variants, prefix = VARIANTS_QWEN35, "qwen3_5_moe-gguf"
    elif a.family == "qwen3next":
        cfg35 = config_qwen3next()
        to_hf = lambda name, v: qwen3next_to_hf(name, v, cfg35)  # noqa: E731
        finish = lambda t: qwen3next_finish(t, cfg35)  # noqa: E731
        variants, prefix = VARIANTS_QWEN35, "qwen3_next-gguf"
    elif dense:
        to_hf, variants, prefix = None, VARIANTS_QWEN3, "qwen3-gguf"
    else:
        to_hf, variants, prefix = None, VARIANTS, "qwen3_moe-gguf"
    quantize = a.quantize or os.path.join(a.llama_cpp, "build", "bin", "llama-quantize")
    sys.path.insert(0, os.path.join(a.llama_cpp, "gguf-py"))
    torch.set_num_threads(8)

    from tokenizers import Tokenizer
    tokens = Tokenizer.from_file(os.path.join(TOKENIZER_FROM, "tokenizer.json")).encode(
        TEXT, add_special_tokens=False).ids
    ids = torch.tensor([tokens])
    work = tempfile.mkdtemp(prefix="gguf-fixtures-")
    hf = os.path.join(work, "hf")

    # 1. The model: decisive routing, then an output head with clear argmaxes.
    for seed in range(400):
        torch.manual_seed(seed)
        model = (AutoModelForCausalLM.from_config(cfg35) if qwen35
                 else Qwen3ForCausalLM(config_qwen3()) if dense
                 else Qwen3MoeForCausalLM(config())).float().eval()
        init_(model, seed)
        gap = 1.0 if dense else routing_gap(model, ids)
        if gap > 4e-3:
            break
    else:
        sys.exit("no seed gave decisive routing")
    g = torch.Generator().manual_seed(1000)
    for head_seed in range(1000, 3000):
        with torch.no_grad():
            w = model.lm_head.weight
            w.copy_(torch.randn(w.shape, generator=g) * 3 / w.shape[1] ** 0.5)
            out = model(ids).logits[0]
        top2 = torch.topk(out, 2, -1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        if margin > 0.01 * out.abs().max().item():
            break
    else:
        sys.exit("no output head gave clear argmaxes")
    print(f"model seed {seed}, head draw {head_seed}: routing gap {gap:.4f}, margin {margin:.4f}")
    model.save_pretrained(hf, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), hf)

    # 2. llama.cpp's converter, told the pre-tokenizer's name (see the module doc).
    f32 = os.path.join(work, "f32.gguf")
    runner = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {a.llama_cpp!r})\n"
        f"sys.path.insert(0, {os.path.join(a.llama_cpp, 'gguf-py')!r})\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {hf!r}, '--outtype', 'f32', '--outfile', {f32!r}"
        + (", '--no-mtp']\n" if qwen35 else "]\n") +
        f"runpy.run_path({os.path.join(a.llama_cpp, 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", runner], check=True)

    # The f32 GGUF holds the model: its dequantised checkpoint gives the original logits.
    _, want, _ = logits(hf, tokens)
    dq = os.path.join(work, "f32-dequantised")
    dequantized_checkpoint(f32, hf, dq, to_hf, finish)
    _, got, _ = logits(dq, tokens)
    err = float(np.abs(got - want).max())
    print(f"f32 GGUF vs the original model: max|diff| {err:.2e}")
    assert err < 1e-4, "name mapping or conversion is wrong"

    for suffix, ftype, extra in variants:
        if a.only and suffix not in a.only:
            continue
        name = f"{prefix}-{suffix}"
        out = os.path.join(a.out, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        path = os.path.join(out, "model.gguf")
        subprocess.run([quantize, *extra, f32, path, ftype], check=True,
                       stdout=subprocess.DEVNULL)
        dq = os.path.join(work, f"{suffix}-dequantised")
        counts, per_tensor = dequantized_checkpoint(path, hf, dq, to_hf, finish)
        ref, prefill, decode = logits(dq, tokens)
        gap = None if dense else routing_gap(ref, ids)
        top2 = np.sort(prefill, -1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        np.save(os.path.join(out, "logits_prefill.npy"), prefill)
        np.save(os.path.join(out, "logits_decode.npy"), decode)
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump({
                "text": TEXT, "tokens": tokens, "ftype": ftype, "quantize_args": extra,
                "tensor_types": counts, "types_by_tensor": per_tensor,
                "seed": seed, "head_draw": head_seed,
                "min_routing_gap": gap, "min_argmax_margin": margin,
                "max_abs_logit": float(np.abs(prefill).max()),
                "max_abs_decode_vs_prefill": float(np.abs(decode - prefill).max()),
                "torch_version": torch.__version__,
                "transformers_version": transformers.__version__,
                "notes": f"tiny random {a.family} -> llama.cpp convert_hf_to_gguf.py (f32) -> "
                         f"llama-quantize {ftype}; logits: gguf-py's dequantisation of model.gguf "
                         "as a float32 checkpoint, transformers on the CPU",
            }, f, indent=1)
        print(f"{name}: {os.path.getsize(path)} bytes, types {counts}, routing gap {gap or 0:.4f}, "
              f"margin {margin:.4f}, decode vs prefill {np.abs(decode - prefill).max():.2e}")
        if (gap is not None and gap < 1e-3) or margin < 1e-3:
            print(f"warning: {name} is not decisive enough for argmax checks", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
