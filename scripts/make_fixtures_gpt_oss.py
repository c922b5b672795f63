#!/usr/bin/env python3
"""Generate the gpt-oss reference fixtures (the driver is scripts/family_fixtures.py).

    tests/fixtures/gpt_oss-q4     mlx layout (experts.{gate,up,down}_proj stacks with .bias),
                                  mlx_lm convert -q: 4-bit affine g64, the router 8-bit (gpt-oss's
                                  quant_predicate); YaRN with truncate (mlx-lm always truncates)
    tests/fixtures/gpt_oss-mxfp4  the same converted with q_mode mxfp4 (every linear layer mxfp4,
                                  embeddings too; the router 8-bit affine)
    tests/fixtures/gpt_oss-hf     the released layout: bf16 attention with biases and sinks,
                                  experts as mxfp4 `experts.gate_up_proj_blocks/_scales` (gate and
                                  up rows interleaved) and `experts.down_proj_blocks/_scales`, with
                                  `_bias` tensors; quantization_config quant_method mxfp4; YaRN
                                  with truncate false as the released config; two shards

Every fixture: 4 layers alternating sliding (window 6, shorter than the text) and full attention,
sinks drawn around the scores' range, gate and up projections large enough that the clamped
SwiGLU's limit (7) bites, biases everywhere gpt-oss has them.

mlx-lm is the reference. Its YaRN always rounds the correction range to whole dimensions;
transformers (and the released config's `truncate: false`) do not: for gpt_oss-hf this script
makes mlx-lm's YarnRoPE honour `truncate: false`, as transformers computes it. An independent
float64 numpy forward pass (written from the math, reading `truncate` from the config)
cross-checks mlx-lm's logits.

Usage:
    /work/venv/bin/python scripts/make_fixtures_gpt_oss.py [--only NAME...] [-v]
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "family_fixtures", Path(__file__).resolve().parent / "family_fixtures.py")
ff = importlib.util.module_from_spec(_spec)
sys.modules["family_fixtures"] = ff
_spec.loader.exec_module(ff)

np, mx, mf = ff.np, ff.mx, ff.mf
from mlx_lm.models import gpt_oss, rope_utils  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

VOCAB = ff.VOCAB
H, HEADS, KV_HEADS, HD, LAYERS, EXPERTS, INTER = 128, 4, 2, 32, 4, 8, 64
WINDOW, LIMIT, ALPHA = 6, 7.0, 1.702
THETA = 150000.0


@dataclass
class Spec:
    name: str
    layout: str  # "mlx" | "hf"
    seed: int
    text: str
    top_k: int = 2
    truncate: bool = True
    quant_bits: int | None = None
    quant_group: int | None = None
    quant_mode: str = "affine"
    shards: int = 1
    description: str = ""


SPECS = [
    Spec(
        name="gpt_oss-q4",
        layout="mlx",
        seed=8100,
        text="Bob counted 42 boats near the old harbour in 2003.",
        top_k=3,
        quant_bits=4,
        quant_group=64,
        description="mlx_lm convert -q: 4-bit affine g64 (the router 8-bit g64 by gpt-oss's "
        "quant_predicate); top-3 of 8; window 6 on layers 0 and 2; YaRN factor 32 (truncate).",
    ),
    Spec(
        name="gpt_oss-mxfp4",
        layout="mlx",
        seed=8200,
        text="The quick brown fox jumps over the dog.",
        quant_bits=4,
        quant_group=32,
        quant_mode="mxfp4",
        description="mlx_lm convert -q --q-mode mxfp4: every linear layer and the embeddings "
        "mxfp4, the router 8-bit affine g64 (its quant_predicate entry names no mode); top-2 "
        "of 8; window 6 on layers 0 and 2; YaRN factor 32 (truncate).",
    ),
    Spec(
        name="gpt_oss-hf",
        layout="hf",
        seed=8300,
        text="<|im_start|>system\nAnswer in one line.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
        truncate=False,
        shards=2,
        description="the released Hugging Face layout: bf16 attention (biases, sinks), router "
        "with bias, experts in mxfp4 blocks (gate_up_proj_blocks, gate and up rows "
        "interleaved; down_proj_blocks) with bf16 _bias tensors, quantization_config "
        "quant_method mxfp4, two shards; top-2 of 8; window 6 on layers 0 and 2; YaRN factor "
        "32 with truncate false (mlx-lm's YarnRoPE patched to honour it, as transformers).",
    ),
]

# Gains: comparable residual updates, decisive routing, logits of std ~1. Gate and up are large
# so that the clamped SwiGLU's limit bites; the down projection brings the update back.
ROUTER_GAIN, ATTN_OUT_GAIN, MLP_OUT_GAIN, EMBED_STD, ROW_SCALE_SIGMA = 2.0, 0.02, 0.0015, 0.02, 0.5
GATE_UP_STD = 4.0


def rope_scaling(spec: Spec) -> dict:
    return {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn",
            "truncate": spec.truncate}


def layer_types() -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]


def hf_config(spec: Spec, tok: Tokenizer) -> dict:
    """config.json as the released gpt-oss checkpoints ship it (smaller)."""
    c = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "experts_per_token": spec.top_k,
        "head_dim": HD,
        "hidden_act": "silu",
        "hidden_size": H,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": layer_types(),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": HEADS,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": EXPERTS,
        "output_router_logits": False,
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "rms_norm_eps": 1e-5,
        "rope_scaling": rope_scaling(spec),
        "rope_theta": THETA,
        "router_aux_loss_coef": 0.9,
        "sliding_window": WINDOW,
        "swiglu_limit": LIMIT,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }
    if spec.layout == "hf":
        c["quantization_config"] = {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        }
    return c


def mxfp4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[.., out, in]` floats to the released layout: U8 blocks `[.., out, in / 32, 16]` and U8
    exponents `[.., out, in / 32]` (mlx's mxfp4 quantisation: the same bytes)."""
    q, s = mx.quantize(mx.array(w.astype(np.float32)), group_size=32, bits=4, mode="mxfp4")
    blocks = np.array(q).view(np.uint8).reshape(*w.shape[:-1], w.shape[-1] // 32, 16)
    return blocks, np.array(s).astype(np.uint8)


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((VOCAB, H), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        w[f"{p}.input_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        w[f"{a}.q_proj.weight"] = normal((HEADS * HD, H), 2.5 * H**-0.5)
        w[f"{a}.q_proj.bias"] = normal((HEADS * HD,), 0.3)
        w[f"{a}.k_proj.weight"] = normal((KV_HEADS * HD, H), 2.5 * H**-0.5)
        w[f"{a}.k_proj.bias"] = normal((KV_HEADS * HD,), 0.3)
        w[f"{a}.v_proj.weight"] = normal((KV_HEADS * HD, H), H**-0.5)
        w[f"{a}.v_proj.bias"] = normal((KV_HEADS * HD,), 0.3)
        w[f"{a}.o_proj.weight"] = normal((H, HEADS * HD), ATTN_OUT_GAIN * (HEADS * HD) ** -0.5 * 2)
        w[f"{a}.o_proj.bias"] = normal((H,), 0.01)
        # Around the scores' range, so that each sink takes a visible share of the weight.
        w[f"{a}.sinks"] = normal((HEADS,), 1.0) + 1.0
        w[f"{p}.post_attention_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        m = f"{p}.mlp"
        w[f"{m}.router.weight"] = normal((EXPERTS, H), ROUTER_GAIN * H**-0.5)
        w[f"{m}.router.bias"] = normal((EXPERTS,), 0.5)
        gate = normal((EXPERTS, INTER, H), GATE_UP_STD * H**-0.5)
        up = normal((EXPERTS, INTER, H), GATE_UP_STD * H**-0.5)
        down = normal((EXPERTS, H, INTER), MLP_OUT_GAIN * INTER**-0.5 * 2)
        gate_bias, up_bias = normal((EXPERTS, INTER), 1.0), normal((EXPERTS, INTER), 1.0)
        down_bias = normal((EXPERTS, H), 0.01)
        if spec.layout == "hf":
            gate_up = np.empty((EXPERTS, 2 * INTER, H), np.float32)
            gate_up[:, 0::2], gate_up[:, 1::2] = gate, up
            gu_bias = np.empty((EXPERTS, 2 * INTER), np.float32)
            gu_bias[:, 0::2], gu_bias[:, 1::2] = gate_bias, up_bias
            e = f"{m}.experts"
            w[f"{e}.gate_up_proj_blocks"], w[f"{e}.gate_up_proj_scales"] = mxfp4_blocks(gate_up)
            w[f"{e}.gate_up_proj_bias"] = gu_bias
            w[f"{e}.down_proj_blocks"], w[f"{e}.down_proj_scales"] = mxfp4_blocks(down)
            w[f"{e}.down_proj_bias"] = down_bias
        else:
            # mlx-lm's names (its sanitize keeps them), converted by mlx_lm.convert.
            e = f"{m}.experts"
            for name, mat, bias in (("gate_proj", gate, gate_bias), ("up_proj", up, up_bias),
                                    ("down_proj", down, down_bias)):
                w[f"{e}.{name}.weight"], w[f"{e}.{name}.bias"] = mat, bias
    rng = np.random.default_rng(head_seed)
    w["model.norm.weight"] = uniform((H,), 0.6, 1.4)
    s = np.exp(rng.standard_normal((VOCAB, 1)) * ROW_SCALE_SIGMA)
    s = (s / np.sqrt(np.mean(s * s))).astype(np.float32)
    w["lm_head.weight"] = normal((VOCAB, H), H**-0.5) * s
    return w


# --------------------------------------------------------------------------------------------
# mlx-lm's YaRN with transformers' `truncate: false`
# --------------------------------------------------------------------------------------------

def yarn_freqs(dims, base, factor, original, beta_fast, beta_slow, truncate) -> np.ndarray:
    """YaRN's per-pair frequencies (transformers' `_compute_yarn_parameters`), float64."""
    def dim_of(rot):
        return dims * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    pos = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor  # inverse frequencies


_orig_initialize_rope = rope_utils.initialize_rope


def initialize_rope_honouring_truncate(dims, base, traditional, scaling_config=None,
                                       max_position_embeddings=None):
    rope = _orig_initialize_rope(dims, base, traditional, scaling_config, max_position_embeddings)
    if scaling_config and scaling_config.get("truncate") is False:
        inv = yarn_freqs(dims, base, scaling_config["factor"],
                         scaling_config["original_max_position_embeddings"],
                         scaling_config.get("beta_fast", 32), scaling_config.get("beta_slow", 1),
                         truncate=False)
        rope._freqs = mx.array((1.0 / inv).astype(np.float32))  # mx.fast.rope takes periods
    return rope


gpt_oss.initialize_rope = initialize_rope_honouring_truncate


# --------------------------------------------------------------------------------------------
# The independent float64 forward pass
# --------------------------------------------------------------------------------------------

FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def load_f64(path: Path, c: dict) -> dict[str, np.ndarray]:
    """Every tensor as float64: affine and mxfp4 (mlx's U32 codes or the released U8 blocks)
    dequantised from the definitions; gate and up split from the interleaved released layout."""
    raw = {}
    for f in sorted(path.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    q = c.get("quantization") or {}
    out = {}

    def fp4(codes_u8: np.ndarray, exps: np.ndarray) -> np.ndarray:
        lo, hi = codes_u8 & 15, codes_u8 >> 4
        vals = np.stack([FP4[lo], FP4[hi]], axis=-1).reshape(*codes_u8.shape[:-1], -1)
        vals = vals.reshape(*exps.shape, 32)
        return (vals * np.exp2(exps.astype(np.float64) - 127)[..., None]).reshape(*exps.shape[:-1], -1)

    for name, arr in raw.items():
        if name.endswith((".scales", ".biases", "_scales")):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            blocks = np.array(arr)
            codes = blocks.reshape(*blocks.shape[:-2], -1)
            out[base] = fp4(codes, np.array(raw[f"{base}_scales"]))
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in raw:
            per = q.get(base) if isinstance(q.get(base), dict) else None
            mode = (per or {}).get("mode", "affine") if per is not None else q.get("mode", "affine")
            wq = np.array(arr)
            if mode == "mxfp4":
                out[name] = fp4(wq.view(np.uint8), np.array(raw[f"{base}.scales"]))
                continue
            gs = (per or {}).get("group_size", q["group_size"])
            scales = np.array(raw[f"{base}.scales"].astype(mx.float32)).astype(np.float64)
            biases = np.array(raw[f"{base}.biases"].astype(mx.float32)).astype(np.float64)
            in_dims = scales.shape[-1] * gs
            bits = wq.shape[-1] * 32 // in_dims
            shifts = np.arange(32 // bits, dtype=np.uint32) * bits
            vals = ((wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.float64)
            vals = vals.reshape(*wq.shape[:-1], in_dims // gs, gs)
            out[name] = (vals * scales[..., None] + biases[..., None]).reshape(*wq.shape[:-1], in_dims)
        else:
            out[name] = np.array(arr.astype(mx.float32)).astype(np.float64)
    return out


def numpy_forward(path: Path, tokens: list[int]) -> np.ndarray:
    """gpt-oss forward in float64 numpy, written from the math (not from mlx ops)."""
    c = json.loads((path / "config.json").read_text())
    w = load_f64(path, c)
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, k, T = c["rms_norm_eps"], c["num_experts_per_tok"], len(tokens)
    rs = c["rope_scaling"]
    inv = yarn_freqs(hd, c["rope_theta"], rs["factor"], rs["original_max_position_embeddings"],
                     rs["beta_fast"], rs["beta_slow"], rs.get("truncate", True))
    mscale = 0.1 * math.log(rs["factor"]) + 1.0
    limit = c["swiglu_limit"]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x):  # rotate-half pairing (i, i + hd/2); YaRN's attention factor on cos and sin
        half = hd // 2
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = (np.cos(ang) * mscale)[:, None, :], (np.sin(ang) * mscale)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def expert(m, e, x):
        if f"{m}.experts.gate_up_proj" in w:  # released: interleaved rows
            gu = w[f"{m}.experts.gate_up_proj"][e] @ x + w[f"{m}.experts.gate_up_proj_bias"][e]
            g, u = gu[0::2], gu[1::2]
            d_, db = w[f"{m}.experts.down_proj"][e], w[f"{m}.experts.down_proj_bias"][e]
        else:
            g = w[f"{m}.experts.gate_proj.weight"][e] @ x + w[f"{m}.experts.gate_proj.bias"][e]
            u = w[f"{m}.experts.up_proj.weight"][e] @ x + w[f"{m}.experts.up_proj.bias"][e]
            d_, db = w[f"{m}.experts.down_proj.weight"][e], w[f"{m}.experts.down_proj.bias"][e]
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
        hidden = (u + 1) * g / (1 + np.exp(-ALPHA * g))
        return d_ @ hidden + db

    emb = w["model.embed_tokens.weight"]
    h = emb[tokens].copy()
    sliding = [t == "sliding_attention" for t in c["layer_types"]]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        x = rms(h, w[f"{p}.input_layernorm.weight"])

        def proj(n):
            return x @ w[f"{a}.{n}.weight"].T + w[f"{a}.{n}.bias"]

        qh = rope(proj("q_proj").reshape(T, nh, hd))
        kh = rope(proj("k_proj").reshape(T, nkv, hd))
        vh = proj("v_proj").reshape(T, nkv, hd)
        pos = np.arange(T)
        visible = pos[None, :] <= pos[:, None]
        if sliding[i]:
            visible &= pos[None, :] > pos[:, None] - c["sliding_window"]
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            sc = np.where(visible, (qh[:, hh] @ kh[:, kv].T) / np.sqrt(hd), -np.inf)
            sink = w[f"{a}.sinks"][hh]
            mx_ = np.maximum(sc.max(-1, keepdims=True), sink)
            e_ = np.exp(sc - mx_)
            att[:, hh] = e_ @ vh[:, kv] / (e_.sum(-1, keepdims=True) + np.exp(sink - mx_))
        h = h + att.reshape(T, nh * hd) @ w[f"{a}.o_proj.weight"].T + w[f"{a}.o_proj.bias"]
        x = rms(h, w[f"{p}.post_attention_layernorm.weight"])
        m = f"{p}.mlp"
        logits = x @ w[f"{m}.router.weight"].T + w[f"{m}.router.bias"]
        for t in range(T):
            top = np.argsort(-logits[t])[:k]
            sc = np.exp(logits[t, top] - logits[t, top].max())
            sc /= sc.sum()  # softmax over the top-k logits
            h[t] += sum(s_ * expert(m, e, x[t]) for e, s_ in zip(top, sc))
    h = rms(h, w["model.norm.weight"])
    return h @ w["lm_head.weight"].T


def router_scores(block, x):
    """The router's logits (with its bias): gpt-oss takes its top k over them."""
    return [(block.router(x).astype(mx.float32), block.num_experts_per_tok)]


def post_build(spec: Spec, dst: Path) -> None:
    """mlx_lm.convert writes the mlx layouts' quantisation; nothing to add. The released
    layout's u8 tensors are written as they are by the driver."""


FAMILY = ff.Family(
    specs=SPECS,
    hf_config=hf_config,
    make_weights=make_weights,
    moe_class=gpt_oss.MLPBlock,
    router_scores=router_scores,
    numpy_forward=numpy_forward,
)

if __name__ == "__main__":
    sys.exit(ff.main(FAMILY, __doc__))
