#!/usr/bin/env python3
"""Reference fixtures from transformers (the official Hugging Face layout), complementing the mlx-lm
ones written by make_fixtures.py. Needs torch and transformers (the GPU machine has both; the math
runs on the CPU in float32, so no GPU is required).

    python scripts/make_fixtures_transformers.py [--out tests/fixtures]

Writes `qwen3_moe-transformers/` and `qwen3_5_moe-transformers/`: tiny random models saved by
`save_pretrained` in bf16 exactly as this transformers version writes them, with the shared fixture
tokenizer, and the logits transformers computes from the saved files (reloaded in float32):
`logits_decode.npy` (one token at a time through the cache) and `logits_prefill.npy` (one call).
Weights are redrawn until routing and argmax are decisive, as in make_fixtures.py.
"""
import argparse, json, os, shutil, sys
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_FROM = os.path.join(HERE, "..", "tests", "fixtures", "qwen3_moe-bf16")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def config():
    return Qwen3MoeConfig(
        vocab_size=500, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[2], rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
        output_router_logits=False, eos_token_id=[495, 493],
    )


def config_qwen3_5():
    """A tiny text-only Qwen3.5-MoE: 3 Gated DeltaNet layers, then one gated attention layer."""
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(
        vocab_size=500, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        eos_token_id=[495, 493],
    )


def config_mixtral():
    """A tiny Mixtral: 3 layers, top-2 of 8, no q/k norm; head_dim from hidden / heads."""
    from transformers import MixtralConfig
    return MixtralConfig(
        vocab_size=500, hidden_size=128, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=512, sliding_window=None,
        tie_word_embeddings=False, router_jitter_noise=0.0, eos_token_id=[495, 493],
    )


def config_glm4_moe():
    """A tiny GLM-4.5 MoE: a dense first layer, sigmoid routing in 2 groups (best 1 kept) with a
    selection bias, scaling 1.5, a shared expert, q/k norm, q/k/v biases, half-head rotary."""
    from transformers import Glm4MoeConfig
    return Glm4MoeConfig(
        vocab_size=500, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=64, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5,
        rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=[495, 493],
    )


def config_deepseek_v3():
    """A tiny DeepSeek-V3: Multi-head Latent Attention (q through rank 64, latent 128, 64 + 32
    query values and 32 value values per head), interleaved rotary with YaRN (factor 40, mscale
    and mscale_all_dim 1), a dense first layer, sigmoid routing in 4 groups (best 2 kept) with a
    selection bias, scaling 2.5, a shared expert."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=500, hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=64,
        qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=64, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_interleave=True, attention_bias=False, eos_token_id=[495, 493],
    )


def config_gpt_oss():
    """A tiny gpt-oss: 4 layers alternating a sliding window of 6 and full attention, sinks,
    biases, YaRN (factor 32, truncate false as released), top-2 of 8 experts of 96 with the
    clamped SwiGLU (limit 7). Written in the released layout (mxfp4 expert blocks; see
    `make_gpt_oss`)."""
    from transformers import GptOssConfig
    return GptOssConfig(
        vocab_size=500, hidden_size=128, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
        num_experts_per_tok=2, experts_per_token=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=7.0,
        rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
        tie_word_embeddings=False, attention_bias=True, eos_token_id=[495, 493],
    )


MODELS = {
    "qwen3_moe": (config, Qwen3MoeForCausalLM),
    "qwen3_5_moe": (config_qwen3_5, AutoModelForCausalLM),
    "mixtral": (config_mixtral, AutoModelForCausalLM),
    "glm4_moe": (config_glm4_moe, AutoModelForCausalLM),
    "deepseek_v3": (config_deepseek_v3, AutoModelForCausalLM),
    "gpt_oss": (config_gpt_oss, AutoModelForCausalLM),
}

FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4(w):
    """`[.., out, in]` float32 -> (U8 blocks `[.., out, in / 32, 16]`, U8 exponents
    `[.., out, in / 32]`, the dequantised values): per 32 values the smallest power of two that
    fits the largest in FP4's +-6, each value rounded to the nearest FP4 code."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float64)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 1e-30)
    e = np.ceil(np.log2(amax / 6.0))
    x = g / np.exp2(e)
    codes = np.abs(x[..., None] - FP4[None, :]).argmin(-1).astype(np.uint8)
    deq = (FP4[codes] * np.exp2(e)).reshape(w.shape).astype(np.float32)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (e[..., 0] + 127).astype(np.uint8), deq


def make_gpt_oss(out_root):
    """gpt-oss in the released layout, with transformers as the reference: a random model whose
    expert weights are rounded to mxfp4 values; the checkpoint written as the released one
    (`experts.gate_up_proj_blocks/_scales` with gate and up rows interleaved,
    `experts.down_proj_blocks/_scales`, `_bias` tensors, bf16 elsewhere, quantization_config
    quant_method mxfp4); the logits from transformers reading that checkpoint back
    (`Mxfp4Config(dequantize=True)`, eager attention, float32), else from the model in memory
    (`reference.json` says which)."""
    from safetensors.torch import save_file
    torch.set_num_threads(8)
    text = "The quick brown fox jumps over the lazy dog while the river runs to the sea."
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(TOKENIZER_FROM, "tokenizer.json"))
    tokens = tok.encode(text, add_special_tokens=False).ids
    ids = torch.tensor([tokens])
    out = os.path.join(out_root, "gpt_oss-transformers")
    cfg = config_gpt_oss()
    cfg._attn_implementation = "eager"

    def router_gap(model):
        gaps = []
        hooks = []

        def hook(m, inp, _out):
            x = inp[0].float().reshape(-1, m.weight.shape[1])
            logits = x @ m.weight.float().T + m.bias.float()
            top = torch.topk(logits, cfg.num_experts_per_tok + 1, -1).values
            gaps.append((top[:, -2] - top[:, -1]).min().item())

        for layer in model.model.layers:
            hooks.append(layer.mlp.router.register_forward_hook(hook))
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        return min(gaps)

    for seed in range(400):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            with torch.no_grad():
                if name.endswith("sinks"):
                    p.copy_(1.0 + torch.randn(p.shape, generator=g))
                elif name.endswith(("gate_up_proj_bias",)):
                    p.copy_(torch.randn(p.shape, generator=g))
                elif name.endswith("bias"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
                elif p.ndim == 1:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif "embed_tokens" in name:
                    p.copy_(torch.randn(p.shape, generator=g))
                elif name.endswith("experts.gate_up_proj"):
                    # Wide, so that the clamped SwiGLU's limit bites.
                    fan_in = cfg.hidden_size
                    p.copy_(4.0 * torch.randn(p.shape, generator=g) / fan_in**0.5)
                elif name.endswith("experts.down_proj"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=g) / cfg.intermediate_size**0.5)
                else:
                    fan_in = p.shape[-1]
                    gain = 2.0 if name.endswith("router.weight") else 1.0
                    p.copy_(gain * torch.randn(p.shape, generator=g) / fan_in**0.5)
        # Experts to mxfp4 values, everything else to bf16: the reference uses the weights on disk.
        model = model.to(torch.bfloat16).float()
        for layer in model.model.layers:
            ex = layer.mlp.experts
            with torch.no_grad():
                for name in ("gate_up_proj", "down_proj"):
                    p = getattr(ex, name)
                    w = p.detach().numpy()
                    # transformers keeps [E, in, out]: quantise along `in` as [E, out, in].
                    if w.shape[1] == (cfg.hidden_size if name == "gate_up_proj" else cfg.intermediate_size):
                        _, _, deq = mxfp4(np.ascontiguousarray(w.transpose(0, 2, 1)))
                        p.copy_(torch.from_numpy(deq.transpose(0, 2, 1).copy()))
                    else:
                        _, _, deq = mxfp4(w)
                        p.copy_(torch.from_numpy(deq))
        gap = router_gap(model)
        if seed < 5 or gap > 2e-2:
            print(f"body seed {seed}: routing gap {gap:.5f}")
        if gap > 2e-2:
            break
    else:
        sys.exit("no seed gave decisive routing")
    g = torch.Generator().manual_seed(1000)
    for head_seed in range(1000, 3000):
        with torch.no_grad():
            w = model.lm_head.weight
            w.copy_((torch.randn(w.shape, generator=g) * 3 / w.shape[1] ** 0.5).bfloat16().float())
            logits = model(ids).logits[0]
        top2 = torch.topk(logits, 2, -1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        scale = logits.abs().max().item()
        if margin > 0.01 * scale:
            break
    else:
        sys.exit("no output head gave clear argmaxes")
    print(f"seed {seed}, head draw {head_seed}: routing gap {gap:.4f}, margin {margin:.4f}, max|logit| {scale:.2f}")

    # The released layout.
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    tensors = {}
    for name, p in model.state_dict().items():
        t = p.detach().float().numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n_in = cfg.hidden_size if name.endswith("gate_up_proj") else cfg.intermediate_size
            if t.shape[1] == n_in:  # [E, in, out] -> [E, out, in]
                t = np.ascontiguousarray(t.transpose(0, 2, 1))
            blocks, scales, deq = mxfp4(t)
            assert np.array_equal(deq, t), f"{name} is not exactly mxfp4"
            tensors[f"{name}_blocks"] = torch.from_numpy(blocks)  # [E, out, in / 32, 16]
            tensors[f"{name}_scales"] = torch.from_numpy(scales)
        else:
            tensors[name] = p.detach().to(torch.bfloat16).contiguous()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    conf = cfg.to_dict()
    conf["quantization_config"] = {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4"}
    conf.pop("_attn_implementation", None)
    conf["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), out)

    source = "transformers reading the written released-layout checkpoint (Mxfp4Config(dequantize=True))"
    try:
        from transformers import Mxfp4Config
        ref = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager",
            quantization_config=Mxfp4Config(dequantize=True)).float().eval()
        with torch.no_grad():
            drift = max((a.float() - b.float()).abs().max().item() for (_, a), (_, b) in
                        zip(sorted(ref.state_dict().items()), sorted(model.state_dict().items())))
        print("reloaded vs in-memory weights, max |diff|:", drift)
    except Exception as e:  # noqa: BLE001
        print("transformers could not read the released layout back:", repr(e)[:400])
        ref, source = model, "the transformers model in memory (its weights are the checkpoint's values)"
    with torch.no_grad():
        prefill = ref(ids).logits[0].numpy().astype(np.float32)
        past, rows = None, []
        for t in tokens:
            o = ref(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            rows.append(o.logits[0, -1].numpy())
        decode = np.stack(rows).astype(np.float32)
        mem = model(ids).logits[0].numpy()
    print("reference vs in-memory prefill:", float(np.abs(prefill - mem).max()))
    np.save(os.path.join(out, "logits_prefill.npy"), prefill)
    np.save(os.path.join(out, "logits_decode.npy"), decode)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({
            "text": text, "tokens": tokens, "seed": seed, "head_draw": head_seed,
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "min_routing_gap": gap, "min_argmax_margin": margin, "max_abs_logit": scale,
            "max_abs_decode_vs_prefill": float(np.abs(decode - prefill).max()),
            "notes": "tiny random GptOssForCausalLM, experts rounded to mxfp4, written in the "
                     "released layout by scripts/make_fixtures_transformers.py; logits from "
                     + source + ", float32 on the CPU, eager attention",
        }, f, indent=1)
    print("decode vs prefill:", float(np.abs(decode - prefill).max()))
    print("files:", sorted(os.listdir(out)))
    # The same model as transformers saves it (dense bf16 experts, its own layout), with the same
    # reference logits: every weight is a bf16 value, the experts' mxfp4 values too.
    dense = os.path.join(out_root, "gpt_oss-transformers-dense")
    shutil.rmtree(dense, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(dense, safe_serialization=True, max_shard_size="500KB")
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), dense)
    check = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        again = check(ids).logits[0].numpy()
    print("dense layout reloaded vs reference prefill:", float(np.abs(again - prefill).max()))
    np.save(os.path.join(dense, "logits_prefill.npy"), prefill)
    np.save(os.path.join(dense, "logits_decode.npy"), decode)
    with open(os.path.join(dense, "reference.json"), "w") as f:
        json.dump({
            "text": text, "tokens": tokens, "seed": seed, "head_draw": head_seed,
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "max_abs_reloaded_vs_reference": float(np.abs(again - prefill).max()),
            "notes": "gpt_oss-transformers's model saved by transformers save_pretrained in bf16 "
                     "(its dense expert layout); the reference logits are gpt_oss-transformers's",
        }, f, indent=1)
    names = sorted(json.load(open(os.path.join(dense, "model.safetensors.index.json")))["weight_map"]) \
        if os.path.exists(os.path.join(dense, "model.safetensors.index.json")) else []
    print("dense tensors of layer 0:", [n for n in names if ".layers.0." in n])


def moe_block(layer):
    """The layer's MoE block: `mlp` (Qwen; Mixtral in transformers 5) or `block_sparse_moe`."""
    return getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)


def init_(model, seed, router_gain=1.0):
    g = torch.Generator().manual_seed(seed)
    zero_centred = model.config.model_type.startswith("qwen3_5")
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):  # decay exp(-e^A softplus(.)) spread over (0.5, 1)
                p.copy_(torch.log(0.05 + 0.45 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(2 * torch.rand(p.shape, generator=g) - 1)
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):  # moves the choices, not the weights
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):  # attention biases
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # norms: away from their neutral value so a wrong formula shows
                base = 0.0 if zero_centred and not name.endswith("linear_attn.norm.weight") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                gain = router_gain if name.endswith(("mlp.gate.weight", "moe.gate.weight")) else 1.0
                if name.endswith("in_proj_a.weight"):
                    gain = 0.5
                p.copy_(gain * torch.randn(p.shape, generator=g) / fan_in**0.5)
    # DeepSeek-V3's selection bias is a buffer in transformers, not a parameter: drawn too.
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias") and not b.abs().any():
            with torch.no_grad():
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def routing_gap(model, ids):
    """Smallest gap between the k-th and (k+1)-th router probability over all layers and tokens."""
    gaps = []
    hooks = []
    k = model.config.num_experts_per_tok

    def hook(m, inp, _out):
        # From the input and weight: what the router module returns differs between versions.
        x = inp[0].float().reshape(-1, m.weight.shape[1])
        logits = x @ m.weight.float().T
        if hasattr(m, "e_score_correction_bias"):  # sigmoid + selection bias, in groups
            p = torch.sigmoid(logits) + m.e_score_correction_bias.float()
            groups, keep = model.config.n_group, model.config.topk_group
            if groups > 1:
                g = p.reshape(p.shape[0], groups, -1)
                scores = torch.topk(g, 2, -1).values.sum(-1)
                top_g = torch.topk(scores, keep + 1, -1).values
                gaps.append((top_g[:, keep - 1] - top_g[:, keep]).min().item())
                kept = torch.zeros_like(scores, dtype=torch.bool)
                kept.scatter_(1, torch.topk(scores, keep, -1).indices, True)
                p = torch.where(kept[..., None], g, torch.zeros_like(g)).reshape(p.shape)
        else:
            p = torch.softmax(logits, -1)
        top = torch.topk(p, k + 1, -1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    for layer in model.model.layers:
        moe = moe_block(layer)
        gate = getattr(moe, "gate", None)
        if gate is not None and not hasattr(gate, "weight"):
            gate = None
        if gate is not None and hasattr(moe, "experts"):
            hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return min(gaps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures"))
    ap.add_argument("--model", choices=sorted(MODELS), action="append")
    a = ap.parse_args()
    for name in a.model or sorted(MODELS):
        if name == "gpt_oss":
            make_gpt_oss(a.out)
        else:
            make(name, a.out)


def make(name, out_root):
    make_config, model_class = MODELS[name]
    torch.set_num_threads(4)
    text = "The quick brown fox jumps over the lazy dog while the river runs to the sea."
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(TOKENIZER_FROM, "tokenizer.json"))
    tokens = tok.encode(text, add_special_tokens=False).ids
    ids = torch.tensor([tokens])
    out = os.path.join(out_root, f"{name}-transformers")
    # Stage 1: a body whose routing is decisive; stage 2: an output head with clear argmaxes.
    for seed in range(400):
        torch.manual_seed(seed)
        model = model_class.from_config(make_config()) if model_class is AutoModelForCausalLM \
            else model_class(make_config())
        model = model.float().eval()
        init_(model, seed)
        # Round to bf16 first: the reference must use exactly the weights on disk.
        model = model.to(torch.bfloat16).float()
        gap = routing_gap(model, ids)
        if seed < 5 or gap > 2e-3:
            print(f"body seed {seed}: routing gap {gap:.5f}")
        if gap > 2e-3:
            break
    else:
        sys.exit("no seed gave decisive routing")
    g = torch.Generator().manual_seed(1000)
    for head_seed in range(1000, 3000):
        with torch.no_grad():
            w = model.lm_head.weight
            w.copy_((torch.randn(w.shape, generator=g) * 3 / w.shape[1] ** 0.5).bfloat16().float())
            logits = model(ids).logits[0]
        top2 = torch.topk(logits, 2, -1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        scale = logits.abs().max().item()
        if head_seed < 1005:
            print(f"head draw {head_seed}: margin {margin:.4f}, max|logit| {scale:.2f}")
        if margin > 0.01 * scale:
            break
    else:
        sys.exit("no output head gave clear argmaxes")
    print(f"seed {seed}, head draw {head_seed}: routing gap {gap:.4f}, argmax margin {margin:.4f}, max|logit| {scale:.2f}")

    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="500KB")
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), out)

    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        prefill = ref(ids).logits[0].numpy().astype(np.float32)
        past, rows = None, []
        for t in tokens:
            o = ref(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            rows.append(o.logits[0, -1].numpy())
        decode = np.stack(rows).astype(np.float32)
    np.save(os.path.join(out, "logits_prefill.npy"), prefill)
    np.save(os.path.join(out, "logits_decode.npy"), decode)
    names = sorted(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"])             if os.path.exists(os.path.join(out, "model.safetensors.index.json")) else None
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({
            "text": text, "tokens": tokens, "seed": seed, "head_draw": head_seed,
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "min_routing_gap": gap, "min_argmax_margin": margin, "max_abs_logit": scale,
            "max_abs_decode_vs_prefill": float(np.abs(decode - prefill).max()),
            "notes": f"tiny random {type(model).__name__} saved by transformers save_pretrained in bf16; "
                     "logits from the saved files reloaded in float32 on the CPU",
        }, f, indent=1)
    print("decode vs prefill:", float(np.abs(decode - prefill).max()))
    print("files:", sorted(os.listdir(out)))

    if names:
        print("tensors of layers 0 and 3:", [n for n in names if ".layers.0." in n or ".layers.3." in n])
    print("config:", open(os.path.join(out, "config.json")).read())


if __name__ == "__main__":
    main()
