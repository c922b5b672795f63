#!/usr/bin/env python3
"""Trains the demo qwen3_5_moe text model with PyTorch + transformers (Qwen3_5MoeTextConfig /
AutoModelForCausalLM, as scripts/make_fixtures_transformers.py builds its qwen3_5_moe fixture) on
the arrays prepare.py wrote. Needs a CUDA GPU (it was run on an H100).

    python train.py --data work/data/train.npz --tokenizer work/tokenizer --out OUT \
        [--seconds 390] [--batch 96] [--lr 2e-3] [--smoke]

The cosine schedule is sized from the measured step time so that training takes --seconds.
Writes to OUT: `weights.*` (the bf16 state dict, losslessly packed into <= 15 MB parts: see
pack_state_dict; export.py unpacks it), `config.json`, `log.json`
(losses, timing, routing shares, held-out perplexity, tool-call rate, samples), and
`ref_logits.npz` (float32 logits of the trained bf16 model for a few token sequences).
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ = 512


# `--size draft`: the demo's draft model (models/demo-draft, `--speculate draft`): the same
# architecture and tokenizer, 2 layers instead of 8 and 8 small experts instead of 32.
SIZES = {
    "demo": dict(layers=8, experts=32, top_k=4, shared=256),
    "draft": dict(layers=2, experts=8, top_k=2, shared=128),
}


def make_config(tok_cfg, gen_cfg, interval=4, size="demo"):
    from transformers import Qwen3_5MoeTextConfig
    eot, im_end = gen_cfg["eos_token_id"][1], gen_cfg["eos_token_id"][0]
    z = SIZES[size]
    interval = min(interval, z["layers"])
    return Qwen3_5MoeTextConfig(
        vocab_size=8192, hidden_size=256, num_hidden_layers=z["layers"],
        layer_types=(["linear_attention"] * (interval - 1) + ["full_attention"])
        * (z["layers"] // interval),
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=z["experts"], num_experts_per_tok=z["top_k"], moe_intermediate_size=128,
        shared_expert_intermediate_size=z["shared"], norm_topk_prob=True,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        router_aux_loss_coef=0.02, output_router_logits=False,
        initializer_range=0.02, eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=None,
    )


# ---------------------------------------------------------------- data

class Batches:
    def __init__(self, path, seed, p_dialog=0.35, p_story=0.07):
        d = np.load(path)
        self.prose = torch.from_numpy(d["prose"].astype(np.int64))
        self.stories = torch.from_numpy(d["stories"].astype(np.int64))
        dia = d["dialogues"].astype(np.int64)
        self.dia_val = torch.from_numpy(dia[-256:])
        self.dia = torch.from_numpy(dia[:-256])
        self.heldout = torch.from_numpy(d["heldout"].astype(np.int64))
        self.g = torch.Generator().manual_seed(seed)
        self.p = (p_dialog, p_story)

    @staticmethod
    def _windows(stream, n, g):
        starts = torch.randint(0, stream.numel() - SEQ - 1, (n,), generator=g)
        idx = starts[:, None] + torch.arange(SEQ + 1)[None]
        return stream[idx]

    @staticmethod
    def split(rows):
        """rows [B, SEQ+1] with bit 15 = loss flag, bit 14 = tool-call token -> inputs, labels
        (-100 where no loss), and the tool-call flag of each label."""
        ids = rows & 0x3FFF
        flag = (rows >> 15).bool()
        call = ((rows >> 14) & 1).bool()
        x = ids[:, :-1]
        y = ids[:, 1:].clone()
        y[~flag[:, 1:]] = -100
        return x, y, call[:, 1:]

    def next(self, B):
        nd = int(round(B * self.p[0]))
        ns = int(round(B * self.p[1]))
        npr = B - nd - ns
        rows = [self.dia[torch.randint(0, self.dia.shape[0], (nd,), generator=self.g)]]
        for stream, n in ((self.stories, ns), (self.prose, npr)):
            rows.append(self._windows(stream, n, self.g) | 0x8000)
        return self.split(torch.cat(rows))

    def heldout_windows(self, max_windows=64):
        n = min(max_windows, (self.heldout.numel() - 1) // SEQ)
        rows = torch.stack([self.heldout[i * SEQ:i * SEQ + SEQ + 1] for i in range(n)])
        return self.split(rows | 0x8000)


def per_layer_aux(router_logits, E, k):
    """Switch-style load-balancing loss per MoE layer, averaged over layers (1.0 when balanced).
    transformers' load_balancing_loss_func pools all layers before the product, which lets single
    layers starve experts while the pooled counts look balanced."""
    tot = 0.0
    for lg in router_logits:
        p = torch.softmax(lg.float().reshape(-1, E), -1)
        top = torch.topk(p, k, -1).indices.reshape(-1)
        f = torch.zeros(E, device=p.device).scatter_add_(0, top, torch.ones_like(top, dtype=torch.float32))
        f = f / top.numel()
        tot = tot + E * (f * p.mean(0)).sum()
    return tot / len(router_logits)


# ---------------------------------------------------------------- packing for the trip back

def pack_state_dict(sd, out, part_bytes=15 * 2**20):
    """bf16/f32 tensors -> byte planes (the high byte of bf16 = sign + exponent compresses well),
    xz-compressed, split into parts of <= part_bytes. Lossless."""
    names, meta, hi, lo, f32 = sorted(sd), [], [], [], []
    for n in names:
        t = sd[n].detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            u = t.view(torch.int16).numpy().view(np.uint16).ravel()
            hi.append((u >> 8).astype(np.uint8))
            lo.append((u & 0xFF).astype(np.uint8))
            meta.append({"name": n, "dtype": "bfloat16", "shape": list(t.shape)})
        else:
            f32.append(t.float().numpy().ravel())
            meta.append({"name": n, "dtype": "float32", "shape": list(t.shape)})
    # Record the three stream lengths so unpack can split them.
    h = lzma.compress(np.concatenate(hi).tobytes(), preset=6)
    l_ = lzma.compress(np.concatenate(lo).tobytes(), preset=1)
    f = lzma.compress(np.concatenate(f32).astype(np.float32).tobytes() if f32 else b"", preset=6)
    blob = h + l_ + f
    parts = []
    for i in range(0, len(blob), part_bytes):
        p = f"weights.part{len(parts)}"
        open(os.path.join(out, p), "wb").write(blob[i:i + part_bytes])
        parts.append(p)
    json.dump({"tensors": meta, "streams": [len(h), len(l_), len(f)], "parts": parts},
              open(os.path.join(out, "weights.json"), "w"))
    return len(blob)


# ---------------------------------------------------------------- eval helpers

@torch.no_grad()
def eval_loss(model, x, y, bs=16):
    tot, n = 0.0, 0
    for i in range(0, x.shape[0], bs):
        xb, yb = x[i:i + bs].cuda(), y[i:i + bs].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=xb).logits
        l = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yb.reshape(-1),
                            ignore_index=-100, reduction="sum")
        tot += l.item()
        n += (yb != -100).sum().item()
    return tot / max(n, 1)


@torch.no_grad()
def routing_shares(model, x):
    counts = []
    hooks = []
    k = model.config.num_experts_per_tok

    def hook(m, inp, out):
        idx = [o for o in out if torch.is_tensor(o) and not o.is_floating_point()][0]
        counts.append(torch.bincount(idx.reshape(-1), minlength=model.config.num_experts).cpu())

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    per_layer = None
    for i in range(0, x.shape[0], 16):
        counts.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=x[i:i + 16].cuda())
        c = torch.stack(counts)
        per_layer = c if per_layer is None else per_layer + c
    for h in hooks:
        h.remove()
    share = per_layer.float() / per_layer.sum(1, keepdim=True)
    return share.numpy()


@torch.no_grad()
def greedy(model, ids, max_new, stop_ids):
    out = model.generate(torch.tensor([ids]).cuda(), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=stop_ids, pad_token_id=stop_ids[-1])
    return out[0, len(ids):].tolist()


def tool_call_eval(model, tok, prompts, stop_ids):
    sys.path.insert(0, HERE)
    from evaluate import check_tool_call  # noqa
    ok, rows = 0, []
    for e in prompts:
        ids = tok.apply_chat_template(e["messages"], tools=e["tools"], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        gen = greedy(model, list(ids), 64, stop_ids)
        text = tok.decode(gen, skip_special_tokens=False)
        good, why = check_tool_call(text, e["expected"])
        ok += good
        rows.append({"prompt": e["messages"][0]["content"], "output": text, "ok": good, "why": why})
    return ok / len(prompts), rows


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--eval-dir", default=os.path.join(HERE, "..", "..", "models", "demo", "eval"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=390)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts-impl", default="grouped_mm")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--p-dialog", type=float, default=0.75)
    ap.add_argument("--full-attention-interval", type=int, default=2, choices=[2, 4])
    ap.add_argument("--call-weight", type=float, default=5.0,
                    help="loss weight of tool-call tokens (1 = plain cross-entropy)")
    ap.add_argument("--p-story", type=float, default=0.05)
    ap.add_argument("--tool-prompts", type=int, default=10,
                    help="held-out weather prompts to try here (evaluate.py runs all of them)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--size", default="demo", choices=sorted(SIZES),
                    help="demo: models/demo; draft: its draft model (models/demo-draft)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.smoke:
        a.warmup = 20
    t_start = time.time()
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    gen_cfg = json.load(open(os.path.join(a.tokenizer, "generation_config.json")))
    tok_cfg = json.load(open(os.path.join(a.tokenizer, "tokenizer_config.json")))
    config = make_config(tok_cfg, gen_cfg, a.full_attention_interval, a.size)
    kw = {"experts_implementation": a.experts_impl} if a.experts_impl else {}
    try:
        model = AutoModelForCausalLM.from_config(config, **kw)
    except Exception as e:  # older/newer transformers without the switch
        print("experts implementation switch failed:", e)
        model = AutoModelForCausalLM.from_config(config)
    model = model.float().cuda()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n_params / 1e6:.2f} M parameters; transformers "
          f"{transformers.__version__}, torch {torch.__version__}, "
          f"experts impl {getattr(model.config, '_experts_implementation', None)}", flush=True)

    data = Batches(a.data, a.seed, a.p_dialog, a.p_story)
    hx, hy, _ = data.heldout_windows()
    dvx, dvy, _ = data.split(data.dia_val)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed_tokens" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    total_steps = None
    budget = 25 if a.smoke else a.seconds

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        T = total_steps or 10**9
        prog = min(1.0, (step - a.warmup) / max(1, T - a.warmup))
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    log = {"args": vars(a), "n_params": n_params, "steps": [], "evals": []}
    model.train()
    step, tokens = 0, 0
    t0 = None
    while True:
        if step == 10:
            torch.cuda.synchronize()
            t0 = time.time()
        if step == 40 and total_steps is None:
            torch.cuda.synchronize()
            per = (time.time() - t0) / 30
            spent = time.time() - t_train0
            total_steps = 40 + int((budget - spent) / (per * 1.04))
            total_steps = max(total_steps, a.warmup + 50)
            print(f"step time {per * 1000:.0f} ms -> total steps {total_steps} "
                  f"({total_steps * a.batch * SEQ / 1e6:.1f} M tokens)", flush=True)
        if step == 0:
            t_train0 = time.time()
        if total_steps is not None and step >= total_steps:
            break
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step)
        x, y, call = data.next(a.batch)
        x, y, call = x.cuda(non_blocking=True), y.cuda(non_blocking=True), call.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x, output_router_logits=True)
            tok_ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                     y.reshape(-1), ignore_index=-100, reduction="none")
            valid = (y.reshape(-1) != -100).float()
            w = valid * (1 + (a.call_weight - 1) * call.reshape(-1).float())
            ce = (tok_ce * valid).sum() / valid.sum()
            wce = (tok_ce * w).sum() / w.sum()
            aux = per_layer_aux(out.router_logits, config.num_experts,
                                config.num_experts_per_tok)
            loss = wce + config.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()
        if step % 25 == 0:
            rec = {"step": step, "t": round(time.time() - t_train0, 1), "lr": lr_at(step),
                   "ce": round(ce.item(), 4), "aux": round(aux.item(), 4),
                   "grad_norm": round(gn.item(), 3)}
            log["steps"].append(rec)
            print(rec, flush=True)
        if step > 0 and step % a.eval_every == 0 or (a.smoke and step == 30):
            model.eval()
            ev = {"step": step, "heldout_prose_loss": eval_loss(model, hx, hy),
                  "val_dialogue_loss": eval_loss(model, dvx[:64], dvy[:64])}
            model.train()
            log["evals"].append(ev)
            print(ev, flush=True)
        step += 1
    torch.cuda.synchronize()
    train_time = time.time() - t_train0
    log.update(train_seconds=round(train_time, 1), train_steps=step, train_tokens=tokens,
               tokens_per_second=round(tokens / train_time))
    print(f"trained {step} steps, {tokens / 1e6:.1f} M tokens in {train_time:.0f} s", flush=True)

    # ---- final evaluation of the bf16 model
    a_log = {n: p.detach().float().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    model = model.to(torch.bfloat16).eval()
    hl = eval_loss(model, *data.heldout_windows(10**6)[:2])
    dl = eval_loss(model, dvx, dvy)
    log["final"] = {"heldout_prose_loss": hl, "heldout_prose_ppl": math.exp(hl),
                    "val_dialogue_loss": dl, "last_train_ce": log["steps"][-1]["ce"]}
    print(log["final"], flush=True)
    share = routing_shares(model, torch.cat([hx[:32], dvx[:32]]))
    log["expert_share"] = share.round(4).tolist()
    print("expert share per layer: min %.4f max %.4f (uniform %.4f)" % (
        share.min(), share.max(), 1 / share.shape[1]), flush=True)

    stop = gen_cfg["eos_token_id"]
    prompts = [json.loads(l) for l in open(os.path.join(a.eval_dir, "weather_prompts.jsonl"))]
    prompts = prompts[:3] if a.smoke else prompts[:a.tool_prompts]
    rate, rows = tool_call_eval(model, tok, prompts, stop)
    log["tool_call_rate_bf16"] = rate
    log["tool_call_rows"] = rows
    print(f"tool-call rate (bf16, transformers greedy): {rate:.3f}", flush=True)
    samples = {}
    for p in ["Once upon a time", "It is a truth universally acknowledged", "The capital of"]:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        samples[p] = tok.decode(ids + greedy(model, ids, 60, stop))
    for q in ["Hello! Who are you?", "Tell me a story about a fox.", "What is the capital of Kenya?"]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        samples["chat: " + q] = tok.decode(greedy(model, list(ids), 80, stop))
    log["samples"] = samples
    for k, v in samples.items():
        print(f"--- {k}\n{v}", flush=True)

    # ---- reference logits (of exactly the weights shipped back) + weights
    sd = model.state_dict()
    sd.update(a_log)  # float32, as in the official checkpoints (mlx-lm keeps it float32)
    ref = {}
    g = torch.Generator().manual_seed(0)
    ref["random_ids"] = torch.randint(0, 8192, (24,), generator=g)
    ref["text_ids"] = torch.tensor(tok("Once upon a time there was a little fox who lived in the"
                                       " woods.", add_special_tokens=False)["input_ids"])
    chat = tok.apply_chat_template(prompts[0]["messages"], tools=prompts[0]["tools"],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(chat, "input_ids"):
        chat = chat["input_ids"]
    ref["chat_ids"] = torch.tensor(list(chat))
    ref32 = AutoModelForCausalLM.from_config(config).float().eval()
    ref32.load_state_dict({k: v.float() for k, v in sd.items()})
    arrays = {}
    for k, ids in ref.items():
        with torch.no_grad():
            arrays[k] = ids.numpy()
            arrays[k + "_logits"] = ref32(input_ids=ids[None]).logits[0].float().numpy()
    np.savez_compressed(os.path.join(a.out, "ref_logits.npz"), **arrays)
    packed = pack_state_dict(sd, a.out)
    config.output_router_logits = False
    config.save_pretrained(a.out)
    # (the tokenizer stays in --tokenizer: at most 8 files come back from the GPU machine)
    log["packed_bytes"] = packed
    log["total_seconds"] = round(time.time() - t_start, 1)
    json.dump(log, open(os.path.join(a.out, "log.json"), "w"), indent=1)
    print(f"packed weights {packed / 2**20:.1f} MiB; total {log['total_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
