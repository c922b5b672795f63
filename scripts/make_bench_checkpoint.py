#!/usr/bin/env python3
"""Writes a random Qwen3-MoE checkpoint of real shapes in the mlx-community 4-bit layout, for speed
measurements (not correctness: see make_fixtures.py for that). Needs only numpy.

    python scripts/make_bench_checkpoint.py OUT_DIR [--layers 48] [--bits 4]

Shapes are Qwen3-30B-A3B's (hidden 2048, 32/4 heads of 128, 128 experts, top-8, expert FFN 768,
vocab 151936); --layers trims the depth to make a mid-size model. Quantised weights are uniform
random codes with scale/bias chosen so each weight has mean 0 and std ~ 1/sqrt(fan_in); router
gates are 8-bit as mlx-lm writes them. The tokenizer files are copied from the test fixtures (their
500 tokens fit inside the model's vocabulary).
"""
import argparse, json, os, shutil, struct, sys
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "tests", "fixtures", "qwen3_moe-q4")


def bf16(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    return (a.view(np.uint32) >> 16).astype(np.uint16)


def quantized(rng, shape, bits, group, gain=1.0):
    """(weight u32, scales bf16, biases bf16) for a random matrix of logical `shape`."""
    *lead, out, inp = shape
    levels = 2**bits
    words = rng.integers(0, 2**32, size=(*lead, out, inp * bits // 32), dtype=np.uint32)
    std_q = np.sqrt((levels**2 - 1) / 12.0)
    s = gain / (std_q * np.sqrt(inp))
    scales = np.full((*lead, out, inp // group), s, dtype=np.float32)
    scales *= rng.uniform(0.8, 1.2, size=scales.shape).astype(np.float32)
    biases = -scales * (levels - 1) / 2.0
    return words, bf16(scales), bf16(biases)


class Writer:
    """Streams tensors into one safetensors file (header first, so sizes are planned up front)."""

    def __init__(self, path, plan):
        self.f = open(path, "wb")
        header, off = {"__metadata__": {"format": "mlx"}}, 0
        for name, dtype, shape, nbytes in plan:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
        text = json.dumps(header, separators=(",", ":"))
        text += " " * ((8 - len(text) % 8) % 8)
        self.f.write(struct.pack("<Q", len(text)) + text.encode())
        self.order = [p[0] for p in plan]
        self.i = 0

    def put(self, name, arr):
        assert self.order[self.i] == name, (self.order[self.i], name)
        self.i += 1
        self.f.write(np.ascontiguousarray(arr).tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"error: {a.out} exists; remove it or choose another path")
    H, NH, KV, HD, E, K, I, V = 2048, 32, 4, 128, 128, 8, 768, 151936
    rng = np.random.default_rng(a.seed)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": H, "num_hidden_layers": a.layers, "num_attention_heads": NH,
        "num_key_value_heads": KV, "head_dim": HD, "num_experts": E, "num_experts_per_tok": K,
        "moe_intermediate_size": I, "intermediate_size": 6144, "vocab_size": V,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
        "quantization": {"group_size": a.group, "bits": a.bits, "mode": "affine"},
    }
    for l in range(a.layers):
        cfg["quantization"][f"model.layers.{l}.mlp.gate"] = {"group_size": 64, "bits": 8}
    cfg["quantization_config"] = cfg["quantization"]

    mats = [("model.embed_tokens", (V, H), a.bits, a.group)]
    for l in range(a.layers):
        p = f"model.layers.{l}"
        mats += [(f"{p}.self_attn.q_proj", (NH * HD, H), a.bits, a.group),
                 (f"{p}.self_attn.k_proj", (KV * HD, H), a.bits, a.group),
                 (f"{p}.self_attn.v_proj", (KV * HD, H), a.bits, a.group),
                 (f"{p}.self_attn.o_proj", (H, NH * HD), a.bits, a.group),
                 (f"{p}.mlp.gate", (E, H), 8, 64),
                 (f"{p}.mlp.switch_mlp.gate_proj", (E, I, H), a.bits, a.group),
                 (f"{p}.mlp.switch_mlp.up_proj", (E, I, H), a.bits, a.group),
                 (f"{p}.mlp.switch_mlp.down_proj", (E, H, I), a.bits, a.group)]
    mats.append(("lm_head", (V, H), a.bits, a.group))
    vecs = [("model.norm.weight", H)]
    for l in range(a.layers):
        p = f"model.layers.{l}"
        vecs += [(f"{p}.input_layernorm.weight", H), (f"{p}.post_attention_layernorm.weight", H),
                 (f"{p}.self_attn.q_norm.weight", HD), (f"{p}.self_attn.k_norm.weight", HD)]

    plan = []
    for name, shape, bits, group in mats:
        *lead, o, i = shape
        n = int(np.prod(lead)) * o if lead else o
        plan += [(f"{name}.weight", "U32", (*lead, o, i * bits // 32), n * i * bits // 8),
                 (f"{name}.scales", "BF16", (*lead, o, i // group), n * i // group * 2),
                 (f"{name}.biases", "BF16", (*lead, o, i // group), n * i // group * 2)]
    plan += [(name, "BF16", (n,), n * 2) for name, n in vecs]
    total = sum(p[3] for p in plan)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(a.out)) or ".").free
    if total > free * 0.95:
        sys.exit(f"error: need {total / 1e9:.1f} GB, only {free / 1e9:.1f} GB free")
    tmp = a.out + ".partial"
    os.makedirs(tmp, exist_ok=True)
    w = Writer(os.path.join(tmp, "model.safetensors"), plan)
    done = 0
    for name, shape, bits, group in mats:
        # A stronger router spreads its softmax, so routing is decisive as in trained models.
        gain = 8.0 if name.endswith("mlp.gate") else 1.0
        q, s, b = quantized(rng, shape, bits, group, gain)
        w.put(f"{name}.weight", q); w.put(f"{name}.scales", s); w.put(f"{name}.biases", b)
        done += q.nbytes + s.nbytes + b.nbytes
        print(f"\r{done / 1e9:6.2f} / {total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)
    for name, n in vecs:
        w.put(name, bf16(np.ones(n, dtype=np.float32)))
    w.f.close()
    print(file=sys.stderr)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for fn in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(os.path.join(FIXTURE, fn), tmp)
    os.rename(tmp, a.out)
    print(f"wrote {a.out} ({total / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
