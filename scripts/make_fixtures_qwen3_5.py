#!/usr/bin/env python3
"""Generate the Qwen3.5-MoE / Qwen3-Next (Gated DeltaNet hybrid) reference fixtures.

Companion of scripts/make_fixtures.py (whose helpers it imports, without
changing that script's outputs). Writes

    tests/fixtures/qwen3_5_moe-bf16   model_type qwen3_5_moe (nested text_config), bf16
    tests/fixtures/qwen3_5_moe-q4     same architecture, mlx_lm convert -q (4-bit g64)
    tests/fixtures/qwen3_5_moe-q8     8-bit g32, norm_topk_prob=false, tied embeddings
    tests/fixtures/qwen3_next-bf16    model_type qwen3_next (flat config), bf16
    tests/fixtures/qwen3_5-q4         dense Qwen3.5 (model_type qwen3_5: every MLP a dense
                                      SwiGLU, as the small Qwen3.5 models that draft for the MoE
                                      ones), 4-bit g64

Each is produced like the qwen3_moe fixtures: a random checkpoint in the official
Hugging Face layout (zero-centred (1+w) norms, conv1d [C,1,K], fused/per-expert
experts, vision tower + MTP tensors) is written to a temp dir and converted by
mlx-lm's own `convert()` (= `mlx_lm convert [-q ...]`), so the fixture is exactly
what mlx-lm writes after its `sanitize()`. The reference logits are computed by
`mlx_lm.load`ing the fixture directory, casting every floating parameter to float32
and running on the CPU: decode (one token per call through the cache) and prefill
(one call). An independent float64 numpy forward pass cross-checks them.

Usage:
    .venv/bin/python scripts/make_fixtures_qwen3_5.py [--only NAME...] [--no-sensitivity] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
sys.modules["make_fixtures"] = mf
_spec.loader.exec_module(mf)

np = mf.np
mx = mf.mx
nn = mf.nn
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models import qwen3_5, qwen3_next  # noqa: E402
from mlx_lm.models import gated_delta  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

ROOT = mf.ROOT
DEFAULT_OUT = mf.DEFAULT_OUT
TOK_SRC = DEFAULT_OUT / "qwen3_moe-bf16"
VOCAB = mf.VOCAB_SIZE
H = 128
MIN_TOKENS, MAX_TOKENS = 20, 32


@dataclass
class Spec:
    name: str
    kind: str  # "qwen3_5_moe" | "qwen3_next" | "qwen3_5" (dense)
    seed: int
    text: str
    num_hidden_layers: int = 4
    head_dim: int = 64
    num_experts_per_tok: int = 2
    rope_theta: float = 1e6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64
    intermediate_size: int = 192  # dense MLPs (qwen3_5)
    quant_bits: int | None = None
    quant_group: int | None = None
    description: str = ""


COMMON = dict(
    hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8,
    rms_norm_eps=1e-6, max_position_embeddings=512, full_attention_interval=4,
    partial_rotary_factor=0.25,
)

SPECS = [
    Spec("qwen3_5_moe-bf16", "qwen3_5_moe", 11000,
         "The boat crossed the river at night, and the teacher watched.",
         head_dim=64, num_experts_per_tok=2, rope_theta=1e6,
         description="qwen3_5_moe (Qwen3.5-35B-A3B-style nested text_config + vision_config stub), "
         "bf16, 4 layers (0-2 Gated DeltaNet, 3 full attention), head_dim 64, rotary dim 16, "
         "rope_theta 1e6, top-2 of 8 + shared expert, untied lm_head. Extra vision-tower tensors "
         "(vision_tower.*, model.visual.*) are in the safetensors; mlx-lm's sanitize drops them."),
    Spec("qwen3_5_moe-q4", "qwen3_5_moe", 12000,
         "Alice asked why the golden bridge was so quiet.",
         head_dim=32, num_experts_per_tok=3, rope_theta=1e4, quant_bits=4, quant_group=64,
         shared_expert_intermediate_size=32,
         description="qwen3_5_moe, mlx_lm convert -q (4-bit affine g64, bf16 scales/biases; "
         "router mlp.gate and shared_expert_gate 8-bit g64 by mlx-lm's qwen3_5 quant_predicate); "
         "head_dim 32 (rotary dim 8), rope_theta 1e4, top-3 of 8, shared_expert_intermediate_size 32."),
    Spec("qwen3_5_moe-q8", "qwen3_5_moe", 13000,
         "<|im_start|>user\nWhere does the cold wind go?<|im_end|>\n<|im_start|>assistant\n",
         head_dim=64, num_experts_per_tok=2, rope_theta=1e6, norm_topk_prob=False,
         tie_word_embeddings=True, quant_bits=8, quant_group=32,
         description="qwen3_5_moe, mlx_lm convert -q --q-bits 8 --q-group-size 32 (router and "
         "shared_expert_gate 8-bit g64); norm_topk_prob=false; tie_word_embeddings=true "
         "(no lm_head tensor)."),
    Spec("qwen3_next-bf16", "qwen3_next", 14000,
         "Bob said the red train would leave the town before the rain.",
         head_dim=64, num_experts_per_tok=2, rope_theta=1e6, moe_intermediate_size=32,
         description="qwen3_next (flat config), bf16, 4 layers (0-2 Gated DeltaNet with fused "
         "in_proj_qkvz / in_proj_ba, 3 full attention), head_dim 64, rotary dim 16, top-2 of 8 "
         "+ shared expert (moe_intermediate_size 32, shared_expert_intermediate_size 64), untied lm_head."),
    Spec("qwen3_5-q4", "qwen3_5", 15000,
         "The old lighthouse keeper counted 12 ships before dawn.",
         head_dim=32, rope_theta=1e4, quant_bits=4, quant_group=64,
         description="dense qwen3_5 (Qwen3_5ForConditionalGeneration, nested text_config, no "
         "experts: every MLP a dense SwiGLU of width 192), mlx_lm convert -q (4-bit affine g64); "
         "head_dim 32 (rotary dim 8), rope_theta 1e4, untied lm_head."),
]


def dense(spec: Spec) -> bool:
    return spec.kind == "qwen3_5"


def is_linear(i: int) -> bool:
    return (i + 1) % COMMON["full_attention_interval"] != 0


# --------------------------------------------------------------------------
# Configs (official HF style)
# --------------------------------------------------------------------------


def text_config(spec: Spec, eos: int) -> dict:
    c = COMMON
    L = spec.num_hidden_layers
    if dense(spec):
        t = text_config(Spec(spec.name, "qwen3_5_moe", spec.seed, spec.text,
                             num_hidden_layers=L, head_dim=spec.head_dim,
                             rope_theta=spec.rope_theta,
                             tie_word_embeddings=spec.tie_word_embeddings), eos)
        for k in ("moe_intermediate_size", "norm_topk_prob", "num_experts", "num_experts_per_tok",
                  "router_aux_loss_coef", "shared_expert_intermediate_size", "output_router_logits"):
            del t[k]
        t.update(model_type="qwen3_5_text", intermediate_size=spec.intermediate_size)
        return dict(sorted(t.items()))
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "full_attention_interval": c["full_attention_interval"],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention" if is_linear(i) else "full_attention" for i in range(L)],
        "linear_conv_kernel_dim": c["linear_conv_kernel_dim"],
        "linear_key_head_dim": c["linear_key_head_dim"],
        "linear_num_key_heads": c["linear_num_key_heads"],
        "linear_num_value_heads": c["linear_num_value_heads"],
        "linear_value_head_dim": c["linear_value_head_dim"],
        "max_position_embeddings": c["max_position_embeddings"],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": spec.moe_intermediate_size,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "norm_topk_prob": spec.norm_topk_prob,
        "num_attention_heads": c["num_attention_heads"],
        "num_experts": c["num_experts"],
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": L,
        "num_key_value_heads": c["num_key_value_heads"],
        "output_router_logits": False,
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 3, 3] if spec.head_dim == 64 else [1, 1, 2],
            "rope_type": "default",
            "rope_theta": float(spec.rope_theta),
            "partial_rotary_factor": c["partial_rotary_factor"],
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def hf_config(spec: Spec, eos: int) -> dict:
    if spec.kind in ("qwen3_5_moe", "qwen3_5"):
        family = spec.kind
        arch = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
        return {
            "architectures": [arch],
            "model_type": family,
            "text_config": text_config(spec, eos),
            "tie_word_embeddings": spec.tie_word_embeddings,
            "transformers_version": "4.57.0.dev0",
            "vision_config": {
                "deepstack_visual_indexes": [],
                "depth": 1,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": 16,
                "in_channels": 3,
                "initializer_range": 0.02,
                "intermediate_size": 32,
                "model_type": family,
                "num_heads": 2,
                "num_position_embeddings": 16,
                "out_hidden_size": H,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
        }
    c = COMMON
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos - 2,
        "decoder_sparse_step": 1,
        "eos_token_id": eos,
        "full_attention_interval": c["full_attention_interval"],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 192,
        "linear_conv_kernel_dim": c["linear_conv_kernel_dim"],
        "linear_key_head_dim": c["linear_key_head_dim"],
        "linear_num_key_heads": c["linear_num_key_heads"],
        "linear_num_value_heads": c["linear_num_value_heads"],
        "linear_value_head_dim": c["linear_value_head_dim"],
        "max_position_embeddings": c["max_position_embeddings"],
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "num_attention_heads": c["num_attention_heads"],
        "num_experts": c["num_experts"],
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": c["num_key_value_heads"],
        "output_router_logits": False,
        "partial_rotary_factor": c["partial_rotary_factor"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": float(spec.rope_theta),
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


# --------------------------------------------------------------------------
# Random weights in the official HF layout (float32 numpy)
# --------------------------------------------------------------------------

EMBED_STD = 0.02
ATTN_OUT_GAIN = 0.04
LIN_OUT_GAIN = 0.04
MLP_OUT_GAIN = 0.03
ROUTER_GAIN = 2.0


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = COMMON
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], spec.head_dim
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"],
                      c["linear_key_head_dim"], c["linear_value_head_dim"])
    kd, vd, K = nk * dk, nv * dv, c["linear_conv_kernel_dim"]
    E, I, Is = c["num_experts"], spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    nxt = spec.kind == "qwen3_next"
    P = "model" if nxt else "model.language_model"

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    def zc_norm(shape, lo, hi):
        # Zero-centred HF norm: effective weight (1 + w) in [lo, hi].
        return uniform(shape, lo, hi) - 1.0

    w = {}
    w[f"{P}.embed_tokens.weight"] = normal((VOCAB, H), EMBED_STD)
    if spec.tie_word_embeddings:
        s = np.exp(rng.standard_normal((VOCAB, 1)) * 0.5)
        w[f"{P}.embed_tokens.weight"] *= (s / np.sqrt(np.mean(s * s))).astype(np.float32)
    for i in range(spec.num_hidden_layers):
        p = f"{P}.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = zc_norm((H,), 0.6, 1.4)
        if is_linear(i):
            a = f"{p}.linear_attn"
            # q,k,v then z, b, a projections (Qwen3.5 layout), or Qwen3-Next's fused
            # per-key-head-grouped in_proj_qkvz / in_proj_ba.
            Wq, Wk, Wv = normal((kd, H), H**-0.5), normal((kd, H), H**-0.5), normal((vd, H), H**-0.5)
            Wz = normal((vd, H), H**-0.5)
            Wb = normal((nv, H), 1.0 * H**-0.5)      # b ~ N(0, ~1): beta = sigmoid(b) in ~(0.15, 0.85)
            Wa = normal((nv, H), 0.8 * H**-0.5)      # a ~ N(0, ~0.8)
            if nxt:
                r = nv // nk
                qkvz = np.concatenate([
                    Wq.reshape(nk, dk, H), Wk.reshape(nk, dk, H),
                    Wv.reshape(nk, r * dv, H), Wz.reshape(nk, r * dv, H)], axis=1)
                w[f"{a}.in_proj_qkvz.weight"] = qkvz.reshape(-1, H)
                ba = np.concatenate([Wb.reshape(nk, r, H), Wa.reshape(nk, r, H)], axis=1)
                w[f"{a}.in_proj_ba.weight"] = ba.reshape(-1, H)
            else:
                w[f"{a}.in_proj_qkv.weight"] = np.concatenate([Wq, Wk, Wv], 0)
                w[f"{a}.in_proj_z.weight"] = Wz
                w[f"{a}.in_proj_b.weight"] = Wb
                w[f"{a}.in_proj_a.weight"] = Wa
            w[f"{a}.conv1d.weight"] = normal((2 * kd + vd, 1, K), 0.5)  # HF [C, 1, K]
            # decay g = exp(-exp(A_log) * softplus(a + dt_bias)): rates 0.02..1 -> g ~0.4..0.98
            w[f"{a}.dt_bias"] = uniform((nv,), -1.0, 0.5)
            w[f"{a}.A_log"] = np.log(uniform((nv,), 0.05, 0.6))
            w[f"{a}.norm.weight"] = uniform((dv,), 0.5, 1.5)  # gated RMSNorm: plain weight
            w[f"{a}.out_proj.weight"] = normal((H, vd), LIN_OUT_GAIN * vd**-0.5 * 2)
        else:
            s = f"{p}.self_attn"
            w[f"{s}.q_proj.weight"] = normal((nh * hd * 2, H), H**-0.5)  # per head [q | gate]
            w[f"{s}.k_proj.weight"] = normal((nkv * hd, H), H**-0.5)
            w[f"{s}.v_proj.weight"] = normal((nkv * hd, H), H**-0.5)
            w[f"{s}.o_proj.weight"] = normal((H, nh * hd), ATTN_OUT_GAIN * (nh * hd) ** -0.5 * 2)
            w[f"{s}.q_norm.weight"] = zc_norm((hd,), 0.8, 2.2)
            w[f"{s}.k_norm.weight"] = zc_norm((hd,), 0.8, 2.2)
        w[f"{p}.post_attention_layernorm.weight"] = zc_norm((H,), 0.6, 1.4)
        m = f"{p}.mlp"
        if dense(spec):
            Id = spec.intermediate_size
            w[f"{m}.gate_proj.weight"] = normal((Id, H), H**-0.5)
            w[f"{m}.up_proj.weight"] = normal((Id, H), H**-0.5)
            w[f"{m}.down_proj.weight"] = normal((H, Id), MLP_OUT_GAIN * Id**-0.5 * 2)
            continue
        w[f"{m}.gate.weight"] = normal((E, H), ROUTER_GAIN * H**-0.5)
        g_ = normal((E, I, H), H**-0.5)
        u_ = normal((E, I, H), H**-0.5)
        d_ = normal((E, H, I), MLP_OUT_GAIN * I**-0.5 * 2)
        if nxt:
            for e in range(E):
                w[f"{m}.experts.{e}.gate_proj.weight"] = g_[e]
                w[f"{m}.experts.{e}.up_proj.weight"] = u_[e]
                w[f"{m}.experts.{e}.down_proj.weight"] = d_[e]
        else:  # transformers 5 fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            w[f"{m}.experts.gate_up_proj"] = np.concatenate([g_, u_], axis=1)
            w[f"{m}.experts.down_proj"] = d_
        w[f"{m}.shared_expert.gate_proj.weight"] = normal((Is, H), H**-0.5)
        w[f"{m}.shared_expert.up_proj.weight"] = normal((Is, H), H**-0.5)
        w[f"{m}.shared_expert.down_proj.weight"] = normal((H, Is), MLP_OUT_GAIN * Is**-0.5 * 2)
        w[f"{m}.shared_expert_gate.weight"] = normal((1, H), 1.5 * H**-0.5)
    # MTP head and vision tower: present in the HF checkpoint, dropped by mlx-lm's sanitize.
    w["mtp.fc.weight"] = normal((H, 2 * H), H**-0.5)
    if not nxt:
        w["model.visual.blocks.0.attn.qkv.weight"] = normal((48, 16), 0.1)
        w["model.visual.patch_embed.proj.weight"] = normal((16, 3, 2, 16, 16), 0.1)
    rng = np.random.default_rng(head_seed)
    if spec.tie_word_embeddings:
        w[f"{P}.norm.weight"] = rng.uniform(0.6, 1.4, (H,)).astype(np.float32) / (EMBED_STD * H**0.5) - 1.0
    else:
        w[f"{P}.norm.weight"] = rng.uniform(0.6, 1.4, (H,)).astype(np.float32) - 1.0
        s = np.exp(rng.standard_normal((VOCAB, 1)) * 0.5)
        s = (s / np.sqrt(np.mean(s * s))).astype(np.float32)
        w["lm_head.weight"] = (rng.standard_normal((VOCAB, H)) * H**-0.5).astype(np.float32) * s
    return w


def save_hf(spec: Spec, weights: dict, out: Path, eos: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v).astype(mx.float32 if k.endswith("A_log") else mx.bfloat16)
              for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "pt"})
    mf.write_json(out / "config.json", hf_config(spec, eos))


# Tensors appended to the qwen3_5_moe-bf16 fixture after conversion: mlx-vlm style
# (`vision_tower.*`) and HF style (`model.visual.*`) names; mlx-lm's qwen3_5_moe
# sanitize skips both prefixes when loading, so a loader must ignore them too.
EXTRA_VISION = {
    "vision_tower.blocks.0.attn.qkv.weight": (48, 16),
    "vision_tower.blocks.0.attn.qkv.bias": (48,),
    "model.visual.merger.linear_fc1.weight": (64, 64),
}


def add_vision_tensors(dst: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    f = dst / "model.safetensors"
    arrays = dict(mx.load(str(f)))
    for k, shape in EXTRA_VISION.items():
        arrays[k] = mx.array((rng.standard_normal(shape) * 0.1).astype(np.float32)).astype(mx.bfloat16)
    mx.save_safetensors(str(f), arrays, metadata={"format": "mlx"})
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    for k in EXTRA_VISION:
        idx["weight_map"][k] = "model.safetensors"
    idx["weight_map"] = dict(sorted(idx["weight_map"].items()))
    idx["metadata"]["total_size"] = int(sum(a.nbytes for a in arrays.values()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx, indent=4))


def copy_tokenizer(dst: Path) -> None:
    for name in mf.TOKENIZER_FILES:
        shutil.copyfile(TOK_SRC / name, dst / name)


def build(spec: Spec, seed: int, head_seed: int, dst: Path, eos: int) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    weights = make_weights(spec, seed, head_seed)
    with tempfile.TemporaryDirectory(prefix="sluice-src-") as tmp:
        src = Path(tmp) / "hf"
        save_hf(spec, weights, src, eos)
        copy_tokenizer(src)
        kwargs = dict(hf_path=str(src), mlx_path=str(dst), dtype="bfloat16")
        if spec.quant_bits is not None:
            kwargs.update(quantize=True, q_bits=spec.quant_bits, q_group_size=spec.quant_group)
        with contextlib.redirect_stdout(io.StringIO()):
            mf.mlx_convert.convert(**kwargs)
    keep = {"config.json", "model.safetensors.index.json"}
    for f in dst.iterdir():
        if f.name not in keep and not (f.name.startswith("model") and f.suffix == ".safetensors"):
            f.unlink()
    copy_tokenizer(dst)
    if spec.name == "qwen3_5_moe-bf16":
        add_vision_tensors(dst, seed + 777)


# --------------------------------------------------------------------------
# Reference + instrumentation (patched copies of mlx-lm's __call__s with switches)
# --------------------------------------------------------------------------

SW = dict(router_log=None, attn_gate=True, shared=True, shared_gate=True)
_orig_moe = qwen3_next.Qwen3NextSparseMoeBlock.__call__
_orig_attn = qwen3_next.Qwen3NextAttention.__call__


def _moe_call(self, x):
    if SW["router_log"] is not None:
        SW["router_log"].append((getattr(self, "_layer", -1),
                                 np.array(mx.softmax(self.gate(x), axis=-1, precise=True))))
    if SW["shared"] and SW["shared_gate"]:
        return _orig_moe(self, x)
    gates = mx.softmax(self.gate(x), axis=-1, precise=True)
    k = self.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if self.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
    if SW["shared"]:
        y = y + self.shared_expert(x)  # sigmoid gate dropped
    return y


def _attn_call(self, x, mask=None, cache=None):
    if SW["attn_gate"]:
        return _orig_attn(self, x, mask, cache)
    B, L, D = x.shape
    queries, gate = mx.split(self.q_proj(x).reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)
    keys, values = self.k_proj(x), self.v_proj(x)
    queries = self.q_norm(queries).transpose(0, 2, 1, 3)
    keys = self.k_norm(keys.reshape(B, L, self.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    off = cache.offset if cache is not None else 0
    queries, keys = self.rope(queries, offset=off), self.rope(keys, offset=off)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))  # no sigmoid(gate)


qwen3_next.Qwen3NextSparseMoeBlock.__call__ = _moe_call
qwen3_next.Qwen3NextAttention.__call__ = _attn_call


def layers_of(model):
    return model.model.layers  # qwen3_5: Model.model -> language_model.model


def cast_f32(model):
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    for i, l in enumerate(layers_of(model)):
        l.mlp._layer = i


def load_f32(path: Path, over: dict | None = None):
    cfg = None
    if over:
        cfg = json.loads((path / "config.json").read_text())
        tgt = cfg.get("text_config", cfg)
        for k, v in over.items():
            if k == "rope_theta" and "rope_parameters" in tgt:
                tgt["rope_parameters"]["rope_theta"] = v
            else:
                tgt[k] = v
    model, _ = mf.mlx_load_model(path, model_config=cfg)
    cast_f32(model)
    return model


def gdn_stats(model, tokens):
    """Per linear layer: ranges of decay g and beta over tokens/heads."""
    out = []
    h = model.model.embed_tokens(mx.array([tokens]))
    for i, layer in enumerate(layers_of(model)):
        x = layer.input_layernorm(h)
        if layer.is_linear:
            la = layer.linear_attn
            if hasattr(la, "in_proj_a"):
                a, b = la.in_proj_a(x), la.in_proj_b(x)
            else:
                _, _, _, _, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
            g = np.array(gated_delta.compute_g(la.A_log, a, la.dt_bias))
            beta = np.array(mx.sigmoid(b))
            out.append((i, float(g.min()), float(np.median(g)), float(g.max()),
                        float(beta.min()), float(beta.max())))
        h = layer(h, None if layer.is_linear else "causal", None)
    return out


def residual_stats(model, tokens):
    h = model.model.embed_tokens(mx.array([tokens]))
    rms, ratios = [float(mx.sqrt(mx.mean(h * h)))], []
    for layer in layers_of(model):
        h2 = layer(h, None if layer.is_linear else "causal", None)
        u = h2 - h
        ratios.append(float(mx.sqrt(mx.mean(u * u)) / mx.sqrt(mx.mean(h * h))))
        h = h2
        rms.append(float(mx.sqrt(mx.mean(h * h))))
    return rms, ratios


def decode_logits(model, tokens, reset_at=None, reset_idx=None):
    cache = make_prompt_cache(model)
    rows = []
    for t, tok in enumerate(tokens):
        if reset_at is not None and t == reset_at:
            for c, l in zip(cache, layers_of(model)):
                if l.is_linear:
                    c[reset_idx] = mx.zeros_like(c[reset_idx])
        out = model(mx.array([[tok]], dtype=mx.int32), cache=cache)
        mx.eval(out)
        rows.append(np.array(out[0, -1].astype(mx.float32)))
    return np.stack(rows)


def evaluate(spec: Spec, path: Path, tok: Tokenizer):
    model, hf_tok = mf.mlx_load(str(path))
    tokens = tok.encode(spec.text).ids
    if tokens != hf_tok.encode(spec.text):
        raise RuntimeError("tokenizers vs transformers encode mismatch")
    if not (MIN_TOKENS <= len(tokens) <= MAX_TOKENS):
        raise RuntimeError(f"{spec.name}: text encodes to {len(tokens)} tokens")
    cast_f32(model)
    for _, p in tree_flatten(model.parameters()):
        assert p.dtype in (mx.float32, mx.uint32), p.dtype
    SW["router_log"] = []
    pre = mf.prefill_logits(model, tokens)
    log_pre, SW["router_log"] = SW["router_log"], []
    dec = decode_logits(model, tokens)
    log_dec, SW["router_log"] = SW["router_log"], None
    gap_pre, usage = mf.router_analysis(log_pre, spec.num_experts_per_tok)
    gap_dec, _ = mf.router_analysis(log_dec, spec.num_experts_per_tok)
    if dense(spec):  # nothing routed: no gap to condition
        gap_pre = gap_dec = None
    rms, ratios = residual_stats(model, tokens)
    return dict(
        tokens=tokens, prefill=pre, decode=dec,
        max_abs_logit=float(np.max(np.abs(pre))), logit_std=float(np.std(pre)),
        min_margin=float(min(mf.margins(pre).min(), mf.margins(dec).min())),
        min_gap=None if gap_pre is None else float(min(gap_pre, gap_dec)),
        usage={int(l): u.tolist() for l, u in sorted(usage.items())},
        dec_vs_pre=float(np.max(np.abs(dec - pre))), rms=rms, ratios=ratios,
        argmax=[int(a) for a in pre.argmax(-1)], gdn=gdn_stats(model, tokens),
    )


def well_conditioned(m):
    """make_fixtures.py's checks, plus a useful spread of Gated DeltaNet decays."""
    body, head = mf.well_conditioned(m)
    for (i, gmin, gmed, gmax, bmin, bmax) in m["gdn"]:
        if not (gmin < 0.6 and gmax > 0.9 and gmin > 0.05):
            body.append(f"layer {i} decay range {gmin:.3f}..{gmax:.3f}")
    return body, head


# --------------------------------------------------------------------------
# Sensitivity (printed only)
# --------------------------------------------------------------------------


def sensitivity(spec: Spec, path: Path, tokens, ref_pre, ref_dec):
    out = []
    T = len(tokens)
    half = T // 2
    rel = mf._rel

    def late(a, b):
        return float(np.max(np.abs(a[half + 3:] - b[half + 3:])) / np.max(np.abs(b)))

    model = load_f32(path)
    out.append((f"conv state reset at t={half} (t>={half + 3})", late(decode_logits(model, tokens, half, 0), ref_dec)))
    out.append((f"recurrent state reset at t={half} (t>={half + 3})", late(decode_logits(model, tokens, half, 1), ref_dec)))

    def with_switch(label, **kw):
        old = dict(SW)
        SW.update(kw)
        try:
            out.append((label, rel(mf.prefill_logits(load_f32(path), tokens), ref_pre)))
        finally:
            SW.update(old)

    with_switch("shared expert dropped", shared=False)
    with_switch("shared_expert_gate sigmoid dropped", shared_gate=False)
    with_switch("attention output gate dropped", attn_gate=False)

    def patched(label, fn):
        model = load_f32(path)
        fn(model)
        out.append((label, rel(mf.prefill_logits(model, tokens), ref_pre)))

    def each_attn(f):
        def g(model):
            for l in layers_of(model):
                if not l.is_linear:
                    f(l.self_attn)
        return g

    def each_lin(f):
        def g(model):
            for l in layers_of(model):
                if l.is_linear:
                    f(l.linear_attn)
        return g

    hd, th = spec.head_dim, spec.rope_theta
    rd = int(hd * COMMON["partial_rotary_factor"])
    patched("full rotary (head_dim) instead of partial", each_attn(lambda a: setattr(a, "rope", nn.RoPE(hd, base=th))))
    patched("partial rotary, traditional (interleaved)", each_attn(lambda a: setattr(a, "rope", nn.RoPE(rd, traditional=True, base=th))))
    patched("rotary on the last dims instead of first",
            each_attn(lambda a: setattr(a, "rope", lambda x, offset=0: mx.concatenate(
                [x[..., : hd - rd], nn.RoPE(rd, base=th)(x[..., hd - rd:], offset=offset)], -1))))
    patched("q_norm/k_norm weight minus 1 (no +1 shift)",
            each_attn(lambda a: (setattr(a.q_norm, "weight", a.q_norm.weight - 1), setattr(a.k_norm, "weight", a.k_norm.weight - 1))))
    patched("gated RMSNorm weight ignored", each_lin(lambda a: setattr(a.norm, "weight", mx.ones_like(a.norm.weight))))
    patched("conv1d kernel flipped", each_lin(lambda a: setattr(a.conv1d, "weight", a.conv1d.weight[:, ::-1, :])))
    patched("dt_bias ignored", each_lin(lambda a: setattr(a, "dt_bias", mx.zeros_like(a.dt_bias))))
    patched("layernorm weights minus 1 (no +1 shift)", lambda m: [
        (setattr(l.input_layernorm, "weight", l.input_layernorm.weight - 1),
         setattr(l.post_attention_layernorm, "weight", l.post_attention_layernorm.weight - 1)) for l in layers_of(m)])

    # Gated RMSNorm: norm(x) * sigmoid(z) instead of silu(z); no gate at all.
    RN = qwen3_next.Qwen3NextRMSNormGated
    orig = RN.__call__
    for label, fn in [
        ("gated RMSNorm with sigmoid(z) not silu(z)", lambda self, x, z: mx.fast.rms_norm(x, self.weight, self.eps) * mx.sigmoid(z)),
        ("gated RMSNorm without the z gate", lambda self, x, z: mx.fast.rms_norm(x, self.weight, self.eps)),
    ]:
        RN.__call__ = fn
        try:
            out.append((label, rel(mf.prefill_logits(load_f32(path), tokens), ref_pre)))
        finally:
            RN.__call__ = orig

    # Module-level function swaps in both qwen3_5 and qwen3_next namespaces.
    mods = (qwen3_5, qwen3_next)

    def swap(label, name, fn):
        old = [getattr(m, name) for m in mods]
        for m in mods:
            setattr(m, name, fn)
        try:
            out.append((label, rel(mf.prefill_logits(load_f32(path), tokens), ref_pre)))
        finally:
            for m, o in zip(mods, old):
                setattr(m, name, o)

    gdu = gated_delta.gated_delta_update
    nqk = gated_delta.normalize_qk

    def tiled(q, k, v, a, b, A_log, dt_bias, state, mask, **kw):
        r = v.shape[-2] // q.shape[-2]
        return gdu(mx.tile(q, (1, 1, r, 1)), mx.tile(k, (1, 1, r, 1)), v, a, b, A_log, dt_bias, state, mask, **kw)

    swap("GDN head grouping tiled (hv % nk) not repeated", "gated_delta_update", tiled)
    swap("GDN q without Dk^-0.5 scale", "normalize_qk",
         lambda q, k, inv_scale, eps: (nqk(q, k, inv_scale=inv_scale, eps=eps)[0] / inv_scale,
                                        nqk(q, k, inv_scale=inv_scale, eps=eps)[1]))

    def beta_fixed(q, k, v, a, b, A_log, dt_bias, state, mask, **kw):
        return gdu(q, k, v, a, mx.zeros_like(b), A_log, dt_bias, state, mask, **kw)

    swap("GDN beta = 0.5 (b ignored)", "gated_delta_update", beta_fixed)
    return out


# --------------------------------------------------------------------------
# Independent float64 numpy forward pass
# --------------------------------------------------------------------------


def numpy_forward(path: Path, tokens) -> np.ndarray:
    cfg = json.loads((path / "config.json").read_text())
    w = mf.load_dequantized_f64(path, cfg)
    c = cfg.get("text_config", cfg)
    if "text_config" in cfg:
        pre, head_key = "language_model.model", "language_model.lm_head.weight"
        theta = c["rope_parameters"]["rope_theta"]
        prf = c["rope_parameters"]["partial_rotary_factor"]
    else:
        pre, head_key = "model", "lm_head.weight"
        theta, prf = c["rope_theta"], c["partial_rotary_factor"]
    T = len(tokens)
    eps = c["rms_norm_eps"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"],
                      c["linear_key_head_dim"], c["linear_value_head_dim"])
    kd, K = nk * dk, c["linear_conv_kernel_dim"]
    k_top = c.get("num_experts_per_tok", 0)
    rd = int(hd * prf)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def rope(x):  # x [T, heads, hd]: rotate-half on the first rd dims only
        half = rd // 2
        inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:rd]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]], axis=-1)

    def mlp(x, p):
        return (silu(x @ w[f"{p}.gate_proj.weight"].T) * (x @ w[f"{p}.up_proj.weight"].T)) @ w[f"{p}.down_proj.weight"].T

    h = w[f"{pre}.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"{pre}.layers.{i}"
        x = rms(h, w[f"{p}.input_layernorm.weight"])
        if is_linear(i):
            a_ = f"{p}.linear_attn"
            if f"{a_}.in_proj_qkv.weight" in w:
                qkv = x @ w[f"{a_}.in_proj_qkv.weight"].T
                z = (x @ w[f"{a_}.in_proj_z.weight"].T).reshape(T, nv, dv)
                b = x @ w[f"{a_}.in_proj_b.weight"].T
                a = x @ w[f"{a_}.in_proj_a.weight"].T
            else:  # qwen3_next: per key-head groups [q dk | k dk | v r*dv | z r*dv], [b r | a r]
                r = nv // nk
                m_ = (x @ w[f"{a_}.in_proj_qkvz.weight"].T).reshape(T, nk, -1)
                q0, k0 = m_[..., :dk], m_[..., dk:2 * dk]
                v0, z0 = m_[..., 2 * dk:2 * dk + r * dv], m_[..., 2 * dk + r * dv:]
                qkv = np.concatenate([q0.reshape(T, -1), k0.reshape(T, -1), v0.reshape(T, -1)], -1)
                z = z0.reshape(T, nv, dv)
                ba = (x @ w[f"{a_}.in_proj_ba.weight"].T).reshape(T, nk, 2 * r)
                b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
            cw = w[f"{a_}.conv1d.weight"][:, :, 0]  # [C, K]; tap K-1 = current token
            xin = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv], 0)
            conv = np.stack([(xin[t:t + K] * cw.T).sum(0) for t in range(T)])
            conv = silu(conv)
            q = conv[:, :kd].reshape(T, nk, dk)
            k = conv[:, kd:2 * kd].reshape(T, nk, dk)
            v = conv[:, 2 * kd:].reshape(T, nv, dv)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk**-0.5
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            sp = np.log1p(np.exp(a + w[f"{a_}.dt_bias"]))
            g = np.exp(-np.exp(w[f"{a_}.A_log"]) * sp)  # [T, nv]
            beta = sigmoid(b)
            S = np.zeros((nv, dv, dk))
            y = np.zeros((T, nv, dv))
            for t in range(T):
                for hv in range(nv):
                    kh = hv // (nv // nk)
                    S[hv] *= g[t, hv]
                    delta = (v[t, hv] - S[hv] @ k[t, kh]) * beta[t, hv]
                    S[hv] += np.outer(delta, k[t, kh])
                    y[t, hv] = S[hv] @ q[t, kh]
            o = rms(y, w[f"{a_}.norm.weight"]) * silu(z)
            h = h + o.reshape(T, -1) @ w[f"{a_}.out_proj.weight"].T
        else:
            s = f"{p}.self_attn"
            qg = (x @ w[f"{s}.q_proj.weight"].T).reshape(T, nh, 2 * hd)
            qh, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
            kh_ = (x @ w[f"{s}.k_proj.weight"].T).reshape(T, nkv, hd)
            vh = (x @ w[f"{s}.v_proj.weight"].T).reshape(T, nkv, hd)
            qh = rope(rms(qh, w[f"{s}.q_norm.weight"]))
            kh_ = rope(rms(kh_, w[f"{s}.k_norm.weight"]))
            att = np.zeros((T, nh, hd))
            causal = np.tril(np.ones((T, T), dtype=bool))
            for hh in range(nh):
                kv = hh // (nh // nkv)
                sc = np.where(causal, (qh[:, hh] @ kh_[:, kv].T) / np.sqrt(hd), -np.inf)
                sc = np.exp(sc - sc.max(-1, keepdims=True))
                att[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ vh[:, kv]
            h = h + (att.reshape(T, -1) * sigmoid(gate)) @ w[f"{s}.o_proj.weight"].T
        x = rms(h, w[f"{p}.post_attention_layernorm.weight"])
        m = f"{p}.mlp"
        if f"{m}.gate.weight" not in w:  # dense
            h = h + mlp(x, m)
            continue
        lg = x @ w[f"{m}.gate.weight"].T
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        y = np.zeros_like(h)
        for t in range(T):
            top = np.argsort(-pr[t])[:k_top]
            sc = pr[t, top] / (pr[t, top].sum() if c["norm_topk_prob"] else 1.0)
            for e, s_ in zip(top, sc):
                gp = w[f"{m}.switch_mlp.gate_proj.weight"][e]
                up = w[f"{m}.switch_mlp.up_proj.weight"][e]
                dp = w[f"{m}.switch_mlp.down_proj.weight"][e]
                y[t] += s_ * (dp @ (silu(gp @ x[t]) * (up @ x[t])))
        y += sigmoid(x @ w[f"{m}.shared_expert_gate.weight"].T) * mlp(x, f"{m}.shared_expert")
        h = h + y
    h = rms(h, w[f"{pre}.norm.weight"])
    head = w[f"{pre}.embed_tokens.weight"] if c["tie_word_embeddings"] else w[head_key]
    return h @ head.T


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--no-sensitivity", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    out = args.out
    mx.random.seed(0)
    mx.set_default_device(mx.cpu)
    ver = mf.versions()
    print(f"versions: {json.dumps(ver)}")
    tok = Tokenizer.from_file(str(TOK_SRC / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    names = []
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        names.append(spec.name)
        dst = out / spec.name
        found = False
        for attempt in range(60):
            seed = spec.seed + attempt
            for hsd in range(60):
                head_seed = seed * 1000 + hsd
                build(spec, seed, head_seed, dst, eos)
                m = evaluate(spec, dst, tok)
                bad_body, bad_head = well_conditioned(m)
                if not bad_body and not bad_head:
                    found = True
                    break
                if args.verbose:
                    print(f"[{spec.name}] {seed}/{head_seed} rejected: " + "; ".join(bad_body + bad_head))
                if bad_body:
                    break
            if found:
                break
        if not found:
            raise RuntimeError(f"{spec.name}: no well-conditioned draw")
        cfg = json.loads((dst / "config.json").read_text())
        pack = mf.check_packing(dst, cfg)
        np_logits = numpy_forward(dst, m["tokens"])
        np_rel = float(np.max(np.abs(np_logits - m["prefill"])) / m["max_abs_logit"])
        if np_rel > 1e-4:
            raise RuntimeError(f"{spec.name}: numpy f64 forward disagrees: {np_rel:.3g}")
        np.save(dst / "logits_decode.npy", m["decode"].astype("<f4"))
        np.save(dst / "logits_prefill.npy", m["prefill"].astype("<f4"))
        notes = (
            f"{spec.description} Weights: numpy default_rng(seed={seed}) (output head: "
            f"default_rng({head_seed})) in float32, official HF layout (zero-centred norms, conv1d "
            "[C,1,K]), cast to bf16 (A_log kept float32), converted by mlx_lm.convert. tokens = "
            "tokenizer.json encode(text) (no BOS). Reference logits: mlx_lm.load(dir), every "
            "floating parameter cast to float32, CPU; decode = one token per call through "
            "mlx-lm's cache (ArraysCache conv+recurrent state for linear layers, KVCache for "
            "full attention); prefill = one call. Tolerance meant: max|ours - ref| <= 1e-3 * max|ref|."
        )
        ref = {
            "fixture": spec.name, "text": spec.text, "tokens": m["tokens"],
            "num_tokens": len(m["tokens"]), "vocab_size": VOCAB, "seed": seed,
            "head_seed": head_seed, "mlx_version": ver["mlx"], "mlx_lm_version": ver["mlx_lm"],
            "tokenizers_version": ver["tokenizers"], "max_abs_logit": m["max_abs_logit"],
            "min_argmax_margin": m["min_margin"], "min_routing_gap": m["min_gap"],
            "max_abs_decode_vs_prefill": m["dec_vs_pre"],
            "max_rel_numpy_f64_vs_prefill": np_rel, "argmax_prefill": m["argmax"],
            "expert_usage_prefill": {str(k): v for k, v in m["usage"].items()},
            "residual_rms_per_layer": [round(x, 6) for x in m["rms"]],
            "gdn_decay_beta_ranges": [
                {"layer": i, "g_min": round(a, 4), "g_median": round(b, 4), "g_max": round(c_, 4),
                 "beta_min": round(d, 4), "beta_max": round(e, 4)} for (i, a, b, c_, d, e) in m["gdn"]],
            "notes": notes,
        }
        mf.write_json(dst / "reference.json", ref, compact_lists=True)
        files = sorted(f for f in dst.iterdir() if f.is_file())
        print(f"\n== {spec.name} (seed {seed}, head seed {head_seed}) "
              f"{sum(f.stat().st_size for f in files)} bytes ==")
        print(f"  tokens ({len(m['tokens'])}): {m['tokens']}")
        print(f"  max|logit| {m['max_abs_logit']:.4f}  min margin {m['min_margin']:.4f}  "
              f"min routing gap {m['min_gap'] or 0:.4f}  decode-vs-prefill {m['dec_vs_pre']:.3g}  "
              f"np64 rel {np_rel:.3g}")
        print("  residual RMS: " + ", ".join(f"{x:.4g}" for x in m["rms"])
              + "; update ratios: " + ", ".join(f"{x:.3f}" for x in m["ratios"]))
        for (i, a, b, c_, d, e) in m["gdn"]:
            print(f"  layer {i} decay g {a:.3f}/{b:.3f}/{c_:.3f} (min/med/max)  beta {d:.3f}..{e:.3f}")
        for l, u in m["usage"].items():
            print(f"  layer {l} expert usage: {u}")
        if pack:
            print(f"  packing: {pack}")
        if not args.no_sensitivity and not dense(spec):
            print("  sensitivity (max|d logits| / max|ref|, must be >> 1e-3):")
            for label, r in sensitivity(spec, dst, m["tokens"], m["prefill"], m["decode"]):
                flag = "" if r > 1e-2 else "   (< 10x the 1e-3 tolerance)"
                print(f"    {label:50s} {r:.4f}{flag}")
    digest = hashlib.sha256()
    for n in sorted(names):
        for f in sorted((out / n).rglob("*")):
            if f.is_file():
                digest.update(str(f.relative_to(out)).encode())
                digest.update(f.read_bytes())
    print(f"\nsha256 of {', '.join(sorted(names))}: {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
