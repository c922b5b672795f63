#!/usr/bin/env python3
"""Trains a multi-token-prediction (MTP) layer for the bundled demo model (models/demo), the way
Qwen3.5's MTP is built: shared (frozen) embedding table and output head, two pre-fc RMSNorms, an
`fc` [H, 2H] over concat(embedding, hidden), one full-attention MoE decoder layer and a final
RMSNorm (the forward pass sluice's `--speculate mtp` runs; see the docstring of `MTP`).

The main model stays frozen exactly as shipped: models/demo's mlx affine 4-bit / 8-bit weights
are dequantised (w = scale * q + bias per group of 64 input columns) into a transformers
Qwen3_5MoeForCausalLM. Only the MTP trains, on train.npz's streams (train.py's mix), with two
losses of equal weight: step 1 (row p: main hidden at p + token p+1 -> token p+2) and the chained
step 2 (row p+1: step 1's output g + token p+2 -> token p+3), which is how sluice drafts k tokens.

    python train_mtp.py --data work/data/train.npz --out OUT [--seconds 240] [--batch 64]
    python train_mtp.py --check-load              # CPU: dequantised logits vs the mlx reference
    python train_mtp.py --eval-only --out OUT     # evaluate the MTP found in --model (exported)

Writes to OUT: `mtp.safetensors` (bf16, official names `mtp.fc.weight`, `mtp.pre_fc_norm_*`,
`mtp.norm.weight`, `mtp.layers.0.*` in transformers' names, zero-centred norms, fused
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]), `log_mtp.json` (loss curve,
accuracies before / after training and after a simulated 4-bit quantisation).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import train as T  # noqa: E402  (Batches, make_config, per_layer_aux, SEQ)

GROUP = 64
# RMSNorms that the mlx layout stores as 1 + w (mlx-lm's qwen3_5 sanitize; not linear_attn.norm,
# a gated RMSNorm with a plain weight). The MTP's own norms are the same kind.
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                 ".k_norm.weight")
MTP_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def is_shifted_norm(name: str) -> bool:
    return (name.endswith(NORM_SUFFIXES) or name in MTP_NORMS
            or name in ("language_model.model.norm.weight", "model.norm.weight"))


# ---------------------------------------------------------------- loading models/demo

def read_mlx_dir(model_dir):
    from safetensors import safe_open
    idx = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(idx["weight_map"].values())):
        with safe_open(os.path.join(model_dir, f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    assert set(out) == set(idx["weight_map"]), "index and shards disagree"
    return out


def dequantize(wq, scales, biases, bits, group=GROUP):
    """mlx affine: wq uint32 [..., n] packs 32 / bits values per word, lowest bits first;
    w[..., g * group + j] = scales[..., g] * q + biases[..., g]."""
    per = 32 // bits
    w64 = wq.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    q = ((w64[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*wq.shape[:-1], -1)
    G = scales.shape[-1]
    assert q.shape[-1] == G * group, (wq.shape, scales.shape, bits)
    q = q.reshape(*q.shape[:-1], G, group).float()
    w = scales.float()[..., None] * q + biases.float()[..., None]
    return w.reshape(*w.shape[:-2], G * group)


def mlx_to_hf(model_dir):
    """models/demo (mlx layout) -> float32 state dict in transformers' names: `model.*`,
    `lm_head.weight` and, if the checkpoint has one, `mtp.*` (official names, zero-centred)."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    qcfg = cfg.get("quantization", {})
    raw = read_mlx_dir(model_dir)
    sd = {}
    for name, t in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and base + ".scales" in raw:
            bits = qcfg.get(base, {}).get("bits", qcfg["bits"])
            gs = qcfg.get(base, {}).get("group_size", qcfg["group_size"])
            assert gs == GROUP
            # cross-check bits against the shapes
            assert t.shape[-1] * 32 // bits == raw[base + ".scales"].shape[-1] * gs, name
            w = dequantize(t, raw[base + ".scales"], raw[base + ".biases"], bits)
        else:
            w = t.float()
        if is_shifted_norm(name):
            w = w - 1.0
        if "conv1d.weight" in name:  # mlx [C, K, 1] -> HF [C, 1, K]
            w = w.transpose(1, 2).contiguous()
        if name.startswith("language_model.model."):
            hf = "model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            hf = "lm_head." + name[len("language_model.lm_head."):]
        elif name.startswith("mtp."):
            hf = name
        else:
            raise ValueError(f"unexpected tensor {name}")
        sd[hf] = w
    # switch_mlp (stacked [E, out, in]) -> fused experts
    for k in [k for k in sd if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
        p = k[: -len(".switch_mlp.gate_proj.weight")]
        gate = sd.pop(k)
        up = sd.pop(p + ".switch_mlp.up_proj.weight")
        sd[p + ".experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        sd[p + ".experts.down_proj"] = sd.pop(p + ".switch_mlp.down_proj.weight")
    return cfg, sd


def build_main(model_dir, device, experts_impl=None):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig  # noqa: F401
    cfg, sd = mlx_to_hf(model_dir)
    text = cfg["text_config"]
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    interval = text.get("full_attention_interval",
                        text["layer_types"].index("full_attention") + 1)
    config = T.make_config({}, gen, interval, "demo")
    # make_config must reproduce the shipped text config
    mine = config.to_dict()
    for k, v in text.items():
        if k in ("transformers_version", "full_attention_interval", "mtp_num_hidden_layers"):
            continue
        if k == "rope_parameters":
            assert mine[k]["rope_theta"] == v["rope_theta"]
            assert mine[k]["partial_rotary_factor"] == v["partial_rotary_factor"]
            continue
        assert mine.get(k) == v, (k, mine.get(k), v)
    kw = {"attn_implementation": "sdpa"}
    if experts_impl:
        kw["experts_implementation"] = experts_impl
    model = AutoModelForCausalLM.from_config(config, **kw)
    main_sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(main_sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model = model.float().to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mtp_sd = {k[len("mtp."):]: v for k, v in sd.items() if k.startswith("mtp.")}
    return model, config, mtp_sd


def check_load(model, ref_dir):
    ref = json.load(open(os.path.join(ref_dir, "reference.json")))
    want = np.load(os.path.join(ref_dir, "logits_prefill.npy"))
    dev = next(model.parameters()).device
    with torch.no_grad():
        got = model(input_ids=torch.tensor([ref["tokens"]], device=dev)).logits[0].float().cpu().numpy()
    diff = np.abs(got - want)
    res = {"tokens": len(ref["tokens"]),
           "max_abs_diff": float(diff.max()),
           "max_abs_ref": float(np.abs(want).max()),
           "max_rel": float(diff.max() / np.abs(want).max()),
           "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).mean())}
    print("load check vs tests/fixtures/demo-reference/logits_prefill.npy:", res, flush=True)
    return res


# ---------------------------------------------------------------- the MTP module

class MTP(nn.Module):
    """Qwen3.5's MTP layer (official names under `mtp.`), for a row at position p:
        e = pre_fc_norm_embedding(embed(token p+1)); h = pre_fc_norm_hidden(hidden p)
        x = fc(cat([e, h])); x = layers[0](x, rotary position p); g = norm(x); logits = lm_head(g)
    hidden p = the main model's final hidden state after its final norm (or, chained, the previous
    row's g). layers[0] is transformers' own Qwen3_5MoeDecoderLayer (full attention, MoE)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)
        cfg = copy.deepcopy(config)
        cfg.layer_types = ["full_attention"]
        cfg.num_hidden_layers = 1
        H, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(cfg, 0)])
        self.norm = Qwen3_5MoeRMSNorm(H, eps=eps)

    def rows(self, emb, hidden):
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb),
                                  self.pre_fc_norm_hidden(hidden)], -1))

    def forward(self, x, position_embeddings, mask):
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
        return self.norm(x)


def init_mtp(mtp, model, fc_init="hidden"):
    """The decoder layer from the main model's last full-attention layer, mtp.norm from its final
    norm, pre-fc norms = identity (zero-centred 0), fc passing the hidden half through."""
    types = model.config.layer_types
    last_full = max(i for i, t in enumerate(types) if t == "full_attention")
    src = model.model.layers[last_full].state_dict()
    mtp.layers[0].load_state_dict(src, strict=True)
    with torch.no_grad():
        mtp.norm.weight.copy_(model.model.norm.weight)
        mtp.pre_fc_norm_embedding.weight.zero_()
        mtp.pre_fc_norm_hidden.weight.zero_()
        H = model.config.hidden_size
        eye = torch.eye(H, device=mtp.fc.weight.device)
        if fc_init == "hidden":
            mtp.fc.weight.zero_()
            mtp.fc.weight[:, H:] = eye
        elif fc_init == "sum":
            mtp.fc.weight[:, :H] = 0.5 * eye
            mtp.fc.weight[:, H:] = 0.5 * eye
        else:
            nn.init.normal_(mtp.fc.weight, std=0.02)
    return last_full


def mtp_state_dict(mtp, dtype=torch.bfloat16):
    return {"mtp." + k: v.detach().to(dtype).cpu().contiguous() for k, v in mtp.state_dict().items()}


def affine_round(w, bits, group=GROUP):
    """mx.quantize's affine scheme (mlx ops.cpp affine_quantize) on a bf16-rounded weight,
    dequantised again: scale and bias per group of 64 input columns, stored bf16."""
    n_bins = 2 ** bits - 1
    g = w.to(torch.bfloat16).float().reshape(*w.shape[:-1], -1, group)
    w_max, w_min = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scales = ((w_max - w_min) / n_bins).clamp_min(1e-7)
    scales = torch.where(mask, scales, -scales)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / torch.where(q0 != 0, q0, torch.ones_like(q0)), scales)
    biases = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    q = torch.clamp(torch.round((g - biases) / scales), 0, n_bins)
    scales, biases = scales.to(torch.bfloat16).float(), biases.to(torch.bfloat16).float()
    return (scales * q + biases).reshape(w.shape)


def fake_quant_(mtp, bits=4, gate_bits=8):
    """Rounds the MTP like export_mtp.py stores it (affine g64; mlp.gate and shared_expert_gate
    8-bit; the norms as bf16 1 + w), to see what the exported layer accepts."""
    with torch.no_grad():
        for n, p in mtp.named_parameters():
            if p.ndim < 2:  # all of the MTP's vectors are zero-centred RMSNorm weights
                p.copy_((p.to(torch.bfloat16).float() + 1.0).to(torch.bfloat16).float() - 1.0)
                continue
            b = gate_bits if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else bits
            p.copy_(affine_round(p, b))


# ---------------------------------------------------------------- the two steps

class Runner:
    def __init__(self, model, mtp, eot, device):
        self.model, self.mtp, self.eot, self.dev = model, mtp, eot, device
        self.amp = device.type == "cuda"
        self._masks = {}

    def autocast(self):
        return torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp)

    def pos_emb(self, x, pos):
        B = x.shape[0]
        p = pos.to(self.dev)[None, None, :].expand(3, B, -1)
        return self.model.model.rotary_emb(x, p)

    def masks(self, T1):
        if T1 not in self._masks:
            T2 = T1 - 1
            c1 = torch.ones(T1, T1, dtype=torch.bool).tril()
            m = torch.zeros(T1 + T2, T1 + T2, dtype=torch.bool)
            m[:T1, :T1] = c1
            # chained row i (position i+1): the step-1 rows at positions 0..i, and itself
            m[T1:, :T2] = torch.ones(T2, T2, dtype=torch.bool).tril()
            m[T1:, T1:] = torch.eye(T2, dtype=torch.bool)
            self._masks[T1] = (c1[None, None].to(self.dev), m[None, None].to(self.dev))
        return self._masks[T1]

    @torch.no_grad()
    def main_hidden(self, ids):
        with self.autocast():
            return self.model.model(input_ids=ids[:, :-1]).last_hidden_state

    def forward(self, ids, h, want_main=False):
        """ids [B, L] token ids (flags stripped); h [B, L-1, H] main hidden of ids[:, :-1].
        Returns logits of step 1 (rows p = 0..L-3 -> token p+2) and of the chained step 2
        (rows p = 0..L-4, at position p+1 -> token p+3), and the router logits of the MTP's MoE."""
        B, L = ids.shape
        T1, T2 = L - 2, L - 3
        emb = self.model.model.embed_tokens
        head = self.model.lm_head
        c1, m2 = self.masks(T1)
        router = []
        hook = self.mtp.layers[0].mlp.gate.register_forward_hook(
            lambda m, i, o: router.append(o[0]))
        try:
            with self.autocast():
                x1 = self.mtp.rows(emb(ids[:, 1:T1 + 1]), h[:, :T1].to(emb.weight.dtype))
                pos1 = torch.arange(T1)
                g1 = self.mtp(x1, self.pos_emb(x1, pos1), c1)
                x2 = self.mtp.rows(emb(ids[:, 2:T2 + 2]), g1[:, :T2])
                X = torch.cat([x1, x2], 1)
                P = torch.cat([pos1, torch.arange(1, T2 + 1)])
                g2 = self.mtp(X, self.pos_emb(X, P), m2)[:, T1:]
                l1, l2 = head(g1), head(g2)
        finally:
            hook.remove()
        return l1, l2, router

    def targets(self, ids):
        B, L = ids.shape
        T1, T2 = L - 2, L - 3
        t1, t2 = ids[:, 2:T1 + 2], ids[:, 3:T2 + 3]
        # padding at the end of packed dialogue rows: <|endoftext|> after <|endoftext|>
        v1 = ~((t1 == self.eot) & (ids[:, 1:T1 + 1] == self.eot))
        v2 = ~((t2 == self.eot) & (ids[:, 2:T2 + 2] == self.eot))
        return t1, t2, v1, v2


def masked_ce(logits, tgt, valid):
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                         reduction="none")
    v = valid.reshape(-1).float()
    return (ce * v).sum() / v.sum().clamp_min(1)


@torch.no_grad()
def evaluate(run, rows, bs):
    """Top-1 accuracy vs the text (acc) and agreement with the frozen main model's greedy token
    (agree = what a greedy verifier accepts), step 1 and chained step 2; `both` = steps 1 and 2
    both agree (a 2-token greedy draft fully accepted). For dialogues also on assistant tokens."""
    run.mtp.eval()
    keys = ["acc1", "acc2", "agree1", "agree2", "both", "main_acc"]
    tot = {s: {k: 0.0 for k in keys + ["n1", "n2"]} for s in ("all", "assistant")}
    ce1 = ce2 = 0.0
    for i in range(0, rows.shape[0], bs):
        r = rows[i:i + bs].to(run.dev)
        ids = r & 0x3FFF
        flag = (r >> 15).bool()
        h = run.main_hidden(ids)
        with run.autocast():
            main_pred = run.model.lm_head(h).argmax(-1)  # [B, L-1]: main's token for p+1
        l1, l2, _ = run.forward(ids, h)
        t1, t2, v1, v2 = run.targets(ids)
        T1, T2 = t1.shape[1], t2.shape[1]
        ce1 += masked_ce(l1, t1, v1).item() * v1.sum().item()
        ce2 += masked_ce(l2, t2, v2).item() * v2.sum().item()
        p1, p2 = l1.argmax(-1), l2.argmax(-1)
        m1, m2 = main_pred[:, 1:T1 + 1], main_pred[:, 2:T2 + 2]  # main's greedy for p+2, p+3
        stats1 = {"acc1": p1 == t1, "agree1": p1 == m1, "main_acc": m1 == t1}
        stats2 = {"acc2": p2 == t2, "agree2": p2 == m2, "both": (p2 == m2) & (p1[:, :T2] == m1[:, :T2])}
        for s, sel1, sel2 in (("all", v1, v2), ("assistant", v1 & flag[:, 2:T1 + 2],
                                                v2 & flag[:, 3:T2 + 3])):
            tot[s]["n1"] += sel1.sum().item()
            tot[s]["n2"] += sel2.sum().item()
            for k, v in stats1.items():
                tot[s][k] += (v & sel1).sum().item()
            for k, v in stats2.items():
                tot[s][k] += (v & sel2).sum().item()
    out = {}
    for s, d in tot.items():
        if d["n1"] == 0 or (s == "assistant" and d["n1"] == tot["all"]["n1"]):
            continue  # (held-out prose: every token is flagged)
        out[s] = {k: round(d[k] / (d["n1"] if k in ("acc1", "agree1", "main_acc") else d["n2"]), 4)
                  for k in keys}
        out[s]["tokens"] = int(d["n1"])
    n1 = tot["all"]["n1"]
    out["ce1"], out["ce2"] = round(ce1 / n1, 4), round(ce2 / tot["all"]["n2"], 4)
    run.mtp.train()
    return out


def eval_sets(run, data, n_rows, bs):
    prose = torch.stack([data.heldout[i * T.SEQ:i * T.SEQ + T.SEQ + 1]
                         for i in range(min(n_rows, (data.heldout.numel() - 1) // T.SEQ))])
    return {"heldout_prose": evaluate(run, prose | 0x8000, bs),
            "heldout_dialogues": evaluate(run, data.dia_val[:n_rows], bs)}


def sample_rows(data, B):
    """train.py's Batches.next mix, but the raw rows (bit 15 = assistant token)."""
    nd = int(round(B * data.p[0]))
    ns = int(round(B * data.p[1]))
    npr = B - nd - ns
    rows = [data.dia[torch.randint(0, data.dia.shape[0], (nd,), generator=data.g)]]
    for stream, n in ((data.stories, ns), (data.prose, npr)):
        rows.append(data._windows(stream, n, data.g) | 0x8000)
    return torch.cat(rows)


def print_eval(tag, ev):
    for s, d in ev.items():
        a = d["all"]
        line = (f"[{tag}] {s}: acc1 {a['acc1']:.3f} acc2 {a['acc2']:.3f} | agree1 {a['agree1']:.3f} "
                f"agree2 {a['agree2']:.3f} both {a['both']:.3f} | main_acc {a['main_acc']:.3f} | "
                f"ce1 {d['ce1']:.3f} ce2 {d['ce2']:.3f}")
        if "assistant" in d:
            b = d["assistant"]
            line += f" | assistant: agree1 {b['agree1']:.3f} agree2 {b['agree2']:.3f} both {b['both']:.3f}"
        print(line, flush=True)


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "demo"))
    ap.add_argument("--data", default=os.path.join(HERE, "work", "data", "train.npz"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--ref", default=os.path.join(ROOT, "tests", "fixtures", "demo-reference"))
    ap.add_argument("--check-load", action="store_true", help="only the load check")
    ap.add_argument("--eval-only", action="store_true",
                    help="evaluate the MTP that --model holds (e.g. after export_mtp.py)")
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--max-steps", type=int, default=None, help="(smoke runs) stop here")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--p-dialog", type=float, default=0.75)
    ap.add_argument("--p-story", type=float, default=0.05)
    ap.add_argument("--fc-init", default="hidden", choices=["hidden", "sum", "random"])
    ap.add_argument("--aux-coef", type=float, default=None, help="default: the config's 0.02")
    ap.add_argument("--eval-rows", type=int, default=64, help="held-out rows per set")
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--experts-impl", default=None,
                    help="transformers experts implementation (default: grouped_mm on CUDA)")
    a = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(a.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    impl = a.experts_impl or ("grouped_mm" if dev.type == "cuda" else None)

    import transformers
    model, config, mtp_sd = build_main(a.model, dev, impl)
    print(f"main model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
          f"dequantised from {a.model}; transformers {transformers.__version__}, torch "
          f"{torch.__version__}, {dev}, experts impl {model.config._experts_implementation}, "
          f"attn {model.config._attn_implementation} ({time.time() - t_start:.1f} s)", flush=True)
    log = {"args": vars(a)}
    if os.path.exists(os.path.join(a.ref, "logits_prefill.npy")):
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        log["load_check"] = check_load(model, a.ref)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
    else:
        print(f"no {a.ref}/logits_prefill.npy: load check skipped", flush=True)
    if a.check_load:
        return

    eot = json.load(open(os.path.join(a.model, "generation_config.json")))["eos_token_id"][1]
    data = T.Batches(a.data, a.seed, a.p_dialog, a.p_story)
    mtp = MTP(config).to(dev)
    run = Runner(model, mtp, eot, dev)

    if a.eval_only:
        assert mtp_sd, f"{a.model} has no mtp.* tensors"
        mtp.load_state_dict(mtp_sd, strict=True)
        ev = eval_sets(run, data, a.eval_rows, a.eval_batch)
        print_eval("exported", ev)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            json.dump({"exported": ev, **log}, open(os.path.join(a.out, "eval_exported.json"), "w"), indent=1)
        return

    assert a.out, "--out is required for training"
    os.makedirs(a.out, exist_ok=True)
    src_layer = init_mtp(mtp, model, a.fc_init)
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"MTP: {n_mtp / 1e6:.3f} M params, layer from main layer {src_layer}, fc init {a.fc_init}",
          flush=True)
    log.update(n_mtp_params=n_mtp, init_from_layer=src_layer, steps=[], evals=[])
    t0 = time.time()
    log["before"] = eval_sets(run, data, a.eval_rows, a.eval_batch)
    print_eval("before", log["before"])
    print(f"(eval {time.time() - t0:.1f} s)", flush=True)

    decay, no_decay = [], []
    for n, p in mtp.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    aux_coef = config.router_aux_loss_coef if a.aux_coef is None else a.aux_coef
    total_steps = a.max_steps
    budget = a.seconds

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        Tt = total_steps or 10**9
        prog = min(1.0, (step - a.warmup) / max(1, Tt - a.warmup))
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    mtp.train()
    step, tokens, t_meas = 0, 0, None
    t_train0 = time.time()
    while True:
        if step == 10:
            sync()
            t_meas = time.time()
        if step == 40 and total_steps is None:
            sync()
            per = (time.time() - t_meas) / 30
            spent = time.time() - t_train0
            total_steps = max(40 + int((budget - spent) / (per * 1.04)), a.warmup + 50)
            print(f"step time {per * 1000:.0f} ms -> total steps {total_steps}", flush=True)
        if total_steps is not None and step >= total_steps:
            break
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step)
        ids = (sample_rows(data, a.batch) & 0x3FFF).to(dev, non_blocking=True)
        h = run.main_hidden(ids)
        l1, l2, router = run.forward(ids, h)
        t1, t2, v1, v2 = run.targets(ids)
        ce1, ce2 = masked_ce(l1, t1, v1), masked_ce(l2, t2, v2)
        aux = T.per_layer_aux(router, config.num_experts, config.num_experts_per_tok)
        loss = ce1 + ce2 + aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        tokens += ids.numel()
        if step % 25 == 0 or (a.max_steps and a.max_steps <= 50):
            rec = {"step": step, "t": round(time.time() - t_train0, 1), "lr": round(lr_at(step), 6),
                   "ce1": round(ce1.item(), 4), "ce2": round(ce2.item(), 4),
                   "aux": round(aux.item(), 4), "grad_norm": round(gn.item(), 3)}
            log["steps"].append(rec)
            print(rec, flush=True)
        if step > 0 and step % a.eval_every == 0:
            ev = eval_sets(run, data, min(a.eval_rows, 32), a.eval_batch)
            print_eval(f"step {step}", ev)
            ev["step"] = step
            log["evals"].append(ev)
        step += 1
    sync()
    train_time = time.time() - t_train0
    log.update(train_seconds=round(train_time, 1), train_steps=step, train_tokens=tokens)
    print(f"trained {step} steps, {tokens / 1e6:.1f} M tokens in {train_time:.0f} s", flush=True)

    log["after"] = eval_sets(run, data, a.eval_rows, a.eval_batch)
    print_eval("after", log["after"])
    sd = mtp_state_dict(mtp)
    from safetensors.torch import save_file
    save_file(sd, os.path.join(a.out, "mtp.safetensors"), metadata={"format": "pt"})
    fake_quant_(mtp)
    log["after_4bit_sim"] = eval_sets(run, data, a.eval_rows, a.eval_batch)
    print_eval("after, 4-bit sim", log["after_4bit_sim"])
    log["tensors"] = {k: list(v.shape) for k, v in sd.items()}
    log["total_seconds"] = round(time.time() - t_start, 1)
    json.dump(log, open(os.path.join(a.out, "log_mtp.json"), "w"), indent=1)
    size = os.path.getsize(os.path.join(a.out, "mtp.safetensors"))
    print(f"wrote {a.out}/mtp.safetensors ({len(sd)} tensors, {size / 2**20:.1f} MiB), "
          f"log_mtp.json; total {log['total_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
