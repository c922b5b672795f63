#!/usr/bin/env python3
"""GGUF fixtures of the other families sluice runs, made by llama.cpp's own tools, with
transformers' float32 logits: Mixtral (llama.cpp's `llama`), gpt-oss, GLM-4.5 (`glm4moe`) and
DeepSeek-V3 (`deepseek2`).

    python scripts/make_fixtures_gguf_families.py --llama-cpp DIR [--quantize BIN]
        [--family mixtral|gpt_oss|glm4_moe|deepseek_v3 ...] [--out tests/fixtures]

Needs what scripts/make_fixtures_gguf.py needs (torch, transformers, a llama.cpp tree with
`llama-quantize` built) and works the same way:
1. A tiny random model of the family (every matrix 256 columns wide where the family allows, so
   the K-quant blocks apply), weights redrawn until routing and argmaxes are decisive, saved by
   transformers with the shared fixture tokenizer.
2. `convert_hf_to_gguf.py --outtype f32`, told the pre-tokenizer's name ("qwen2": the tiny
   tokenizer matches no known model; GLM's converter, which looks up GLM's own special tokens,
   is given the generic BPE vocabulary writer instead). DeepSeek-V3's config.json loses the
   `head_dim` transformers writes (an alias of `qk_rope_head_dim` that DeepSeek's own configs do
   not have, which the converter would write as the key length too) and gains the
   `scoring_func: sigmoid` / `topk_method: noaux_tc` its own config.json has (transformers'
   config object drops them; the converter writes the gating function from them). GLM is
   converted with
   `--no-mtp`.
3. `llama-quantize` to the family's variant (Q4_K_M; gpt-oss: MXFP4_MOE, its experts in MXFP4
   as gpt-oss ships them).
4. The reference: the GGUF dequantised by gguf-py's own code into a float32 Hugging Face
   checkpoint, llama.cpp's changes undone (Mixtral's q/k row permutation; gpt-oss's split
   gate/up stacks interleaved again and transposed back; DeepSeek's `attn_k_b`/`attn_v_b` joined
   into `kv_b_proj`), logits from transformers in float32. The f32 GGUF must give the original
   model's logits (checks the mapping both ways).

Writes `<family>-gguf-<variant>/` with `model.gguf`, `logits_prefill.npy`, `logits_decode.npy`,
`reference.json`.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures_transformers import init_, routing_gap, TOKENIZER_FROM, TOKENIZER_FILES  # noqa: E402
from make_fixtures_gguf import TEXT, dequantized_checkpoint, logits  # noqa: E402


def config_mixtral():
    from transformers import MixtralConfig
    return MixtralConfig(
        vocab_size=500, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=512,
        sliding_window=None, tie_word_embeddings=False, router_jitter_noise=0.0,
        eos_token_id=[495, 493],
    )


def config_gpt_oss():
    from transformers import GptOssConfig
    return GptOssConfig(
        vocab_size=500, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, experts_per_token=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
        rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
        tie_word_embeddings=False, attention_bias=True, eos_token_id=[495, 493],
    )


def config_glm4_moe():
    from transformers import Glm4MoeConfig
    return Glm4MoeConfig(
        vocab_size=500, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.5,
        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=256, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5,
        rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False,
        num_nextn_predict_layers=0, eos_token_id=[495, 493],
    )


def config_deepseek_v3():
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=500, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=256, q_lora_rank=256,
        qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_interleave=True, attention_bias=False, eos_token_id=[495, 493],
    )


COMMON = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Per-layer tensors whose HF name is the same in every family here.
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # DeepSeek's Multi-head Latent Attention.
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_k_b.weight": "self_attn.part_k_b",
    "attn_v_b.weight": "self_attn.part_v_b",
}


def unpermute(v, heads):
    """Mixtral's q/k rows back from llama.cpp's pairs (LlamaModel.permute's inverse)."""
    rows = v.shape[0]
    d = rows // heads
    return v.reshape(heads, d // 2, 2, *v.shape[1:]).swapaxes(1, 2).reshape(v.shape)


def to_hf(family, cfg):
    """(name, values) of a GGUF tensor -> [(HF name, values)] for `family`."""
    def f(name, v):
        if name in COMMON:
            return [(COMMON[name], v)]
        _, layer, rest = name.split(".", 2)
        p = f"model.layers.{layer}."
        if family == "mixtral":
            if rest == "attn_q.weight":
                return [(p + "self_attn.q_proj.weight", unpermute(v, cfg.num_attention_heads))]
            if rest == "attn_k.weight":
                return [(p + "self_attn.k_proj.weight", unpermute(v, cfg.num_key_value_heads))]
            if rest == "ffn_gate_inp.weight":
                return [(p + "block_sparse_moe.gate.weight", v)]
            w = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3",
                 "ffn_down_exps.weight": "w2"}.get(rest)
            if w:
                return [(p + f"block_sparse_moe.experts.{e}.{w}.weight", v[e])
                        for e in range(v.shape[0])]
        if family == "gpt_oss":
            table = {
                "attn_sinks.weight": "self_attn.sinks",
                "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                # Joined by gpt_oss_finish.
                "ffn_gate_exps.weight": "mlp.experts.part_gate",
                "ffn_up_exps.weight": "mlp.experts.part_up",
                "ffn_gate_exps.bias": "mlp.experts.part_gate_bias",
                "ffn_up_exps.bias": "mlp.experts.part_up_bias",
                "ffn_down_exps.weight": "mlp.experts.part_down",
                "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
            }
            if rest in table:
                return [(p + table[rest], v)]
        if family in ("glm4_moe", "deepseek_v3"):
            w = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}.get(rest)
            if w:
                return [(p + f"mlp.experts.{e}.{w}.weight", v[e]) for e in range(v.shape[0])]
        return [(p + LAYER[rest], v)]
    return f


def finish(family, cfg):
    """Joins what to_hf left in parts."""
    def gpt_oss(t):
        for key in [k for k in t if k.endswith("mlp.experts.part_gate")]:
            pre = key[: -len("part_gate")]
            gate, up = t.pop(pre + "part_gate").numpy(), t.pop(pre + "part_up").numpy()
            e, inter, hidden = gate.shape
            gu = np.empty((e, hidden, 2 * inter), np.float32)
            gu[:, :, 0::2] = gate.transpose(0, 2, 1)
            gu[:, :, 1::2] = up.transpose(0, 2, 1)
            gb, ub = t.pop(pre + "part_gate_bias").numpy(), t.pop(pre + "part_up_bias").numpy()
            gub = np.empty((e, 2 * inter), np.float32)
            gub[:, 0::2], gub[:, 1::2] = gb, ub
            down = t.pop(pre + "part_down").numpy()
            t[pre + "gate_up_proj"] = torch.from_numpy(gu)
            t[pre + "gate_up_proj_bias"] = torch.from_numpy(gub)
            t[pre + "down_proj"] = torch.from_numpy(np.ascontiguousarray(down.transpose(0, 2, 1)))

    def deepseek(t):
        for key in [k for k in t if k.endswith("self_attn.part_k_b")]:
            pre = key[: -len("part_k_b")]
            k_b, v_b = t.pop(pre + "part_k_b").numpy(), t.pop(pre + "part_v_b").numpy()
            # k_b [heads, lora, nope] (transposed by the converter), v_b [heads, v, lora].
            rows = [np.concatenate([k_b[h].T, v_b[h]]) for h in range(k_b.shape[0])]
            t[pre + "kv_b_proj.weight"] = torch.from_numpy(
                np.ascontiguousarray(np.concatenate(rows), dtype=np.float32))
    return {"gpt_oss": gpt_oss, "deepseek_v3": deepseek}.get(family)


FAMILIES = {
    # name: (config, llama.cpp arch, variant suffix, llama-quantize ftype, converter extras)
    "mixtral": (config_mixtral, "llama", "q4_k_m", "Q4_K_M", []),
    "gpt_oss": (config_gpt_oss, "gpt-oss", "mxfp4", "MXFP4_MOE", []),
    "glm4_moe": (config_glm4_moe, "glm4moe", "q4_k_m", "Q4_K_M", ["--no-mtp"]),
    "deepseek_v3": (config_deepseek_v3, "deepseek2", "q4_k_m", "Q4_K_M", []),
}


# The routing gap a drawn model must have before quantisation: DeepSeek's grouped sigmoid
# router loses most of a small one to Q4_K_M (4e-3 became 5e-4).
# A larger router gain widens its gaps.
MIN_GAP = {"deepseek_v3": 1e-2}
ROUTER_GAIN = {"deepseek_v3": 3.0}


def gpt_oss_routing_gap(model, ids):
    """routing_gap for gpt-oss's router (`mlp.router`, with a bias; softmax over the top k)."""
    k, gaps, hooks = model.config.num_experts_per_tok, [], []

    def hook(m, inp, _out):
        x = inp[0].float().reshape(-1, m.weight.shape[1])
        logits = x @ m.weight.float().T + m.bias.float()
        top = torch.topk(logits, k + 1, -1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())
    for layer in model.model.layers:
        hooks.append(layer.mlp.router.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return min(gaps)


def make(family, a, tokens, first_seed=0):
    """Writes the family's fixture from the first decisive model from `first_seed` on; returns
    (the seed it used, whether it stayed decisive once quantised: if not, nothing is written
    and the caller tries the seeds after it)."""
    make_config, arch, suffix, ftype, convert_extra = FAMILIES[family]
    cfg = make_config()
    ids = torch.tensor([tokens])
    gap_of = gpt_oss_routing_gap if family == "gpt_oss" else routing_gap
    work = tempfile.mkdtemp(prefix=f"gguf-{family}-")
    hf = os.path.join(work, "hf")
    for seed in range(first_seed, first_seed + 2000):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
        init_(model, seed, ROUTER_GAIN.get(family, 1.0))
        gap = gap_of(model, ids)
        if gap > MIN_GAP.get(family, 4e-3):
            break
    else:
        sys.exit(f"{family}: no seed gave decisive routing")
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
        sys.exit(f"{family}: no output head gave clear argmaxes")
    print(f"{family}: model seed {seed}, head draw {head_seed}: routing gap {gap:.4f}, "
          f"margin {margin:.4f}")
    model.save_pretrained(hf, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), hf)
    want_prefill = model(ids).logits[0].detach().numpy()
    if family == "deepseek_v3":
        # As DeepSeek-V3's own config.json: no `head_dim`, the router named.
        path = os.path.join(hf, "config.json")
        c = json.load(open(path))
        c.pop("head_dim", None)
        c.update(scoring_func="sigmoid", topk_method="noaux_tc")
        json.dump(c, open(path, "w"), indent=1)

    f32 = os.path.join(work, "f32.gguf")
    runner = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {a.llama_cpp!r})\n"
        f"sys.path.insert(0, {os.path.join(a.llama_cpp, 'gguf-py')!r})\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        "from conversion import glm\n"
        "glm.Glm4MoeModel.set_vocab = base.TextModel._set_vocab_gpt2\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {hf!r}, '--outtype', 'f32', '--outfile', {f32!r}"
        f", *{convert_extra!r}]\n"
        f"runpy.run_path({os.path.join(a.llama_cpp, 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", runner], check=True)

    mapping, joined = to_hf(family, cfg), finish(family, cfg)
    dq = os.path.join(work, "f32-dequantised")
    dequantized_checkpoint(f32, hf, dq, mapping, joined)
    _, got, _ = logits(dq, tokens)
    err = float(np.abs(got - want_prefill).max())
    print(f"{family}: f32 GGUF vs the original model: max|diff| {err:.2e}")
    assert err < 1e-4, f"{family}: name mapping or conversion is wrong"

    name = f"{family}-gguf-{suffix}"
    out = os.path.join(a.out, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    path = os.path.join(out, "model.gguf")
    subprocess.run([a.quantize, f32, path, ftype], check=True, stdout=subprocess.DEVNULL)
    dq = os.path.join(work, f"{suffix}-dequantised")
    counts, per_tensor = dequantized_checkpoint(path, hf, dq, mapping, joined)
    ref, prefill, decode = logits(dq, tokens)
    gap = gap_of(ref, ids)
    top2 = np.sort(prefill, -1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    np.save(os.path.join(out, "logits_prefill.npy"), prefill)
    np.save(os.path.join(out, "logits_decode.npy"), decode)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({
            "text": TEXT, "tokens": tokens, "ftype": ftype, "architecture": arch,
            "tensor_types": counts, "types_by_tensor": per_tensor,
            "seed": seed, "head_draw": head_seed,
            "min_routing_gap": gap, "min_argmax_margin": margin,
            "max_abs_logit": float(np.abs(prefill).max()),
            "max_abs_decode_vs_prefill": float(np.abs(decode - prefill).max()),
            "f32_gguf_vs_original": err,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "notes": f"tiny random {family} -> llama.cpp convert_hf_to_gguf.py (f32, `{arch}`) -> "
                     f"llama-quantize {ftype}; logits: gguf-py's dequantisation of model.gguf as a "
                     "float32 checkpoint, transformers on the CPU",
        }, f, indent=1)
    print(f"{name}: {os.path.getsize(path)} bytes, types {counts}, routing gap {gap:.4f}, "
          f"margin {margin:.4f}, decode vs prefill {np.abs(decode - prefill).max():.2e}")
    shutil.rmtree(work, ignore_errors=True)
    if gap < 1e-3 or margin < 2e-3:
        print(f"{name}: seed {seed} is not decisive enough once quantised, trying the next")
        shutil.rmtree(out, ignore_errors=True)
        return seed, False
    return seed, True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree")
    ap.add_argument("--quantize", help="llama-quantize binary (default LLAMA_CPP/build/bin/llama-quantize)")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures"))
    ap.add_argument("--family", action="append", choices=list(FAMILIES),
                    help="family to make (repeatable; default all)")
    a = ap.parse_args()
    a.quantize = a.quantize or os.path.join(a.llama_cpp, "build", "bin", "llama-quantize")
    sys.path.insert(0, os.path.join(a.llama_cpp, "gguf-py"))
    torch.set_num_threads(8)
    from tokenizers import Tokenizer
    tokens = Tokenizer.from_file(os.path.join(TOKENIZER_FROM, "tokenizer.json")).encode(
        TEXT, add_special_tokens=False).ids
    failed = []
    for family in a.family or list(FAMILIES):
        try:
            seed = 0
            for _ in range(8):
                seed, done = make(family, a, tokens, seed)
                if done:
                    break
                seed += 1
            else:
                raise RuntimeError("no decisive model in 8 tries")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - report every family
            import traceback
            traceback.print_exc()
            failed.append(f"{family}: {e}")
    if failed:
        sys.exit("failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
