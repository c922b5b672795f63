#!/usr/bin/env python3
"""Reference fixture for the multi-token-prediction (MTP) layer of Qwen3.5-MoE, with transformers'
own layer code as the reference. Needs torch and transformers; runs on the CPU in float32.

    python scripts/make_fixtures_mtp.py [--out tests/fixtures]

Writes `qwen3_5_moe-mtp/`:
- the tiny text-only Qwen3.5-MoE of make_fixtures_transformers.py (`config_qwen3_5()`, the same
  seeds and conditioning, so the same weights as `qwen3_5_moe-transformers`), saved by
  `save_pretrained` in bf16 as one `model.safetensors`, `config.json` with
  `"mtp_num_hidden_layers": 1`, its `logits_prefill.npy` / `logits_decode.npy` / `reference.json`
  as the other transformers fixtures;
- `mtp.safetensors`: random (seeded) bf16 MTP weights under the official names at the checkpoint
  root (`mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
  `mtp.norm.weight`, `mtp.layers.0.*`), listed in `model.safetensors.index.json`. The decoder
  layer is transformers' `Qwen3_5MoeDecoderLayer` built as a full-attention layer (gated attention
  + the MoE block), and its tensors are written by transformers' own `save_pretrained` (so in
  exactly the layout of the main layers: per-expert `experts.N.{gate,up,down}_proj.weight`);
- the reference (float32, from the saved bf16 values): `main_hidden.npy` [n, H] (the main model's
  hidden states after its final norm), `mtp_logits.npy` [n-1, V] / `mtp_hidden.npy` [n-1, H] (row
  p = (main_hidden[p], tokens[p+1]) at position p, one causal pass; row p predicts token p+2),
  `mtp_chained_logits.npy` [1, V] (row (mtp_hidden[n-2], argmax mtp_logits[n-2]) at position n-1),
  `mtp.json`.
mtp.json's note defines the MTP forward pass (as vLLM's qwen3_5_mtp.py runs it).
"""
import argparse, copy, json, os, shutil, sys, tempfile
import numpy as np
import torch
from torch import nn
import transformers
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures_transformers import TOKENIZER_FILES, TOKENIZER_FROM, config_qwen3_5, init_, routing_gap  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the river runs to the sea."
MTP_SEED0 = 5000
MIN_MARGIN = 0.05
MIN_GAP = 2e-3


class MTP(nn.Module):
    """The MTP module with the official names (under `mtp.`): transformers' own classes."""

    def __init__(self, cfg, layer_cls, norm_cls):
        super().__init__()
        self.config = cfg  # init_ reads model_type (zero-centred norms)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer_cls(cfg, 0)])
        self.norm = norm_cls(h, eps=cfg.rms_norm_eps)


def causal_mask(t, past=0):
    """Additive float mask [1, 1, t, past + t]: query i (position past + i) sees keys 0..past + i."""
    m = torch.full((t, past + t), torch.finfo(torch.float32).min)
    m = torch.triu(m, diagonal=past + 1)
    return m[None, None]


class Rope:
    """cos/sin for positions 0..n-1 from the model's own rotary module, checked against what the
    model passes its layers."""

    def __init__(self, model, n, captured):
        rot = model.model.rotary_emb
        x = torch.zeros(1, n, model.config.hidden_size)
        pe = None
        for pos in (torch.arange(n).view(1, 1, -1).expand(3, 1, -1), torch.arange(n)[None]):
            try:
                pe = rot(x, pos)
                if pe[0].shape == captured[0].shape:
                    break
            except Exception as e:  # noqa: BLE001
                print("rotary call with position ids", tuple(pos.shape), "failed:", repr(e)[:200])
                pe = None
        if pe is None:
            print("using the position embeddings captured from the main model's layer 3")
            pe = captured
        self.diff = max((a - b).abs().max().item() for a, b in zip(pe, captured))
        print("rotary (own call) vs captured from the model's forward:", self.diff)
        self.cos, self.sin = pe

    def at(self, start, t):
        return self.cos[:, start:start + t], self.sin[:, start:start + t]


def mtp_rows(mtp, model, rope, hidden, toks, start=0, cache=None, mask=True):
    """Rows (hidden[i], toks[i]) at positions start.. : (logits [t, V], g [t, H])."""
    t = hidden.shape[0]
    e = mtp.pre_fc_norm_embedding(model.model.embed_tokens(toks))
    h = mtp.pre_fc_norm_hidden(hidden)
    x = mtp.fc(torch.cat([e, h], -1))[None]
    am = causal_mask(t, start) if mask else None
    out = mtp.layers[0](x, position_embeddings=rope.at(start, t), attention_mask=am,
                        position_ids=torch.arange(start, start + t)[None], past_key_values=cache)
    if isinstance(out, tuple):
        out = out[0]
    g = mtp.norm(out)[0]
    return model.lm_head(g), g


def margins(logits):
    top2 = torch.topk(logits, 2, -1).values
    return top2[:, 0] - top2[:, 1]


def gate_gaps(mtp, fn):
    """Smallest top-k vs top-(k+1) router probability gap in the MTP MoE during fn()."""
    k = mtp.config.num_experts_per_tok
    gaps = []

    def hook(m, inp, _out):
        x = inp[0].float().reshape(-1, m.weight.shape[1])
        p = torch.softmax(x @ m.weight.float().T, -1)
        top = torch.topk(p, k + 1, -1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    hd = mtp.layers[0].mlp.gate.register_forward_hook(hook)
    try:
        r = fn()
    finally:
        hd.remove()
    return min(gaps), r


def new_cache(cfg):
    from transformers import DynamicCache
    try:
        return DynamicCache()
    except Exception:  # noqa: BLE001
        return DynamicCache(config=cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures"))
    a = ap.parse_args()
    torch.set_num_threads(8)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(TOKENIZER_FROM, "tokenizer.json"))
    tokens = tok.encode(TEXT, add_special_tokens=False).ids
    n = len(tokens)
    ids = torch.tensor([tokens])
    out = os.path.join(a.out, "qwen3_5_moe-mtp")

    # --- The main model: exactly make_fixtures_transformers.make("qwen3_5_moe") ---------------
    for seed in range(400):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config_qwen3_5()).float().eval()
        init_(model, seed)
        model = model.to(torch.bfloat16).float()
        gap = routing_gap(model, ids)
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
        if margin > 0.01 * scale:
            break
    else:
        sys.exit("no output head gave clear argmaxes")
    print(f"main: seed {seed}, head draw {head_seed}: routing gap {gap:.4f}, margin {margin:.4f}, max|logit| {scale:.2f}")

    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="200MB")
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), out)
    print("save_pretrained wrote:", sorted(os.listdir(out)))

    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = ref.config
    full = cfg.layer_types.index("full_attention")
    # What the model passes its full-attention layer: for the rotary check and a replay of the layer.
    cap = {}

    def pre(m, args, kwargs):
        cap["x"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        cap["pe"] = tuple(t.detach().clone() for t in kwargs["position_embeddings"])

    def post(m, args, kwargs, o):
        cap["y"] = (o[0] if isinstance(o, tuple) else o).detach().clone()

    layer3 = ref.model.layers[full]
    h1 = layer3.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = layer3.register_forward_hook(post, with_kwargs=True)
    with torch.no_grad():
        main_hidden = ref.model(ids, use_cache=False).last_hidden_state[0]
    h1.remove(); h2.remove()
    with torch.no_grad():
        prefill = ref(ids).logits[0].numpy().astype(np.float32)
        head_check = float(np.abs(ref.lm_head(main_hidden).numpy() - prefill).max())
        past, rows = None, []
        for t in tokens:
            o = ref(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            rows.append(o.logits[0, -1].numpy())
        decode = np.stack(rows).astype(np.float32)
    print("lm_head(main_hidden) vs prefill logits:", head_check)
    old = os.path.join(HERE, "..", "tests", "fixtures", "qwen3_5_moe-transformers", "logits_prefill.npy")
    vs_old = float(np.abs(np.load(old) - prefill).max()) if os.path.exists(old) else None
    print("prefill vs qwen3_5_moe-transformers/logits_prefill.npy:", vs_old)

    rope = Rope(ref, n, cap["pe"])
    with torch.no_grad():
        replay = layer3(cap["x"], position_embeddings=rope.at(0, n), attention_mask=causal_mask(n),
                        position_ids=torch.arange(n)[None], past_key_values=None)
        replay = replay[0] if isinstance(replay, tuple) else replay
    replay_diff = (replay - cap["y"]).abs().max().item()
    print("main layer 3 replayed with our mask / rotary vs inside the model:", replay_diff)
    assert replay_diff < 1e-4, replay_diff

    # --- MTP weights ----------------------------------------------------------------------------
    d = cfg.to_dict()
    d["layer_types"] = ["full_attention"]
    d["num_hidden_layers"] = 1
    cfg_mtp = type(cfg).from_dict(d)
    cfg_mtp._attn_implementation = "eager"
    if getattr(cfg, "_experts_implementation", None) is not None:  # as the main model dispatches
        cfg_mtp._experts_implementation = cfg._experts_implementation
    print("experts implementation:", getattr(cfg, "_experts_implementation", None))
    layer_cls, norm_cls = type(layer3), type(ref.model.norm)
    print("classes:", layer_cls.__module__, layer_cls.__name__, norm_cls.__name__)
    hid = main_hidden[: n - 1]
    nxt = ids[0, 1:]

    def run_all(mtp):
        lg, gg = mtp_rows(mtp, ref, rope, hid, nxt)
        dtok = int(lg[-1].argmax())
        lg2, gg2 = mtp_rows(mtp, ref, rope, torch.cat([hid, gg[-1:]]),
                            torch.cat([nxt, torch.tensor([dtok])]))
        return lg, gg, dtok, lg2, gg2

    for mtp_seed in range(MTP_SEED0, MTP_SEED0 + 2000):
        torch.manual_seed(mtp_seed)
        mtp = MTP(cfg_mtp, layer_cls, norm_cls).float().eval()
        init_(mtp, mtp_seed)
        mtp = mtp.to(torch.bfloat16).float()
        with torch.no_grad():
            mgap, (lg, gg, dtok, lg2, gg2) = gate_gaps(mtp, lambda: run_all(mtp))
        mmargin = margins(lg2).min().item()  # the n-1 rows and the chained row
        if mtp_seed < MTP_SEED0 + 5:
            print(f"mtp seed {mtp_seed}: routing gap {mgap:.5f}, margin {mmargin:.4f}")
        if mgap > MIN_GAP and mmargin > MIN_MARGIN:
            break
    else:
        sys.exit("no MTP seed gave decisive routing and argmaxes")
    print(f"mtp seed {mtp_seed}: routing gap {mgap:.5f}, margin {mmargin:.4f}")
    names_mem = sorted(mtp.state_dict())
    print("MTP module state_dict (in memory):",
          [(k, tuple(v.shape)) for k, v in mtp.state_dict().items()])

    # The decoder layer written by transformers' own save_pretrained, as the main layer `full`.
    with tempfile.TemporaryDirectory() as tmp:
        twin = copy.deepcopy(ref)
        twin.model.layers[full].load_state_dict(mtp.layers[0].state_dict())
        twin.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True, max_shard_size="200MB")
        from safetensors.torch import load_file
        disk = {}
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".safetensors"):
                disk.update(load_file(os.path.join(tmp, f)))
    pfx = f"model.layers.{full}."
    tensors = {"mtp.layers.0." + k[len(pfx):]: v.contiguous() for k, v in disk.items() if k.startswith(pfx)}
    for k in ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"):
        tensors["mtp." + k] = mtp.state_dict()[k].to(torch.bfloat16).contiguous()
    from safetensors.torch import save_file, load_file, safe_open
    save_file(tensors, os.path.join(out, "mtp.safetensors"), metadata={"format": "pt"})

    # The index: the main file(s) and the mtp shard.
    idx_path = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        index = json.load(open(idx_path))
    else:
        wm = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors") and f != "mtp.safetensors":
                with safe_open(os.path.join(out, f), "pt") as sf:
                    wm.update({k: f for k in sf.keys()})
        index = {"metadata": {}, "weight_map": wm}
    main_names = sorted(index["weight_map"])
    index["weight_map"].update({k: "mtp.safetensors" for k in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    total = 0
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(out, f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                total += t.numel() * t.element_size()
    index.setdefault("metadata", {})["total_size"] = total
    with open(idx_path, "w") as f:
        json.dump(index, f, indent=2)
    conf_path = os.path.join(out, "config.json")
    conf = json.load(open(conf_path))
    conf["mtp_num_hidden_layers"] = 1
    with open(conf_path, "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)

    # Names: the mtp layer's must be the main full-attention layer's, with the same shapes/dtypes.
    main3 = {}
    with safe_open(os.path.join(out, index["weight_map"][pfx + "input_layernorm.weight"]), "pt") as sf:
        for k in sf.keys():
            if k.startswith(pfx):
                t = sf.get_tensor(k)
                main3[k[len(pfx):]] = (tuple(t.shape), str(t.dtype))
    mtp3 = {k[len("mtp.layers.0."):]: (tuple(v.shape), str(v.dtype)) for k, v in tensors.items()
            if k.startswith("mtp.layers.0.")}
    assert main3 == mtp3, (sorted(set(main3) ^ set(mtp3)), main3, mtp3)
    print("mtp.layers.0.* names/shapes/dtypes == model.layers.%d.*: %d tensors" % (full, len(mtp3)))

    # Read the MTP back from the file (per-expert tensors re-fused as transformers keeps them) and
    # check it is the model in memory: the reference below uses the file's values.
    filed = load_file(os.path.join(out, "mtp.safetensors"))
    sd = {}
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    ex = "layers.0.mlp.experts."
    for k, v in filed.items():
        k = k[len("mtp."):]
        if k.startswith(ex) and k[len(ex):].split(".")[0].isdigit():
            continue
        sd[k] = v.float()
    if ex + "gate_up_proj" not in sd:
        sd[ex + "gate_up_proj"] = torch.stack([torch.cat([
            filed[f"mtp.{ex}{e}.gate_proj.weight"], filed[f"mtp.{ex}{e}.up_proj.weight"]]) for e in range(E)]).float()
        sd[ex + "down_proj"] = torch.stack([filed[f"mtp.{ex}{e}.down_proj.weight"] for e in range(E)]).float()
    back = MTP(cfg_mtp, layer_cls, norm_cls).float().eval()
    back.load_state_dict(sd, strict=True)
    for k, v in mtp.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    print("mtp.safetensors read back (gate rows first, then up) == the MTP in memory")
    mtp = back

    # --- The reference ----------------------------------------------------------------------------
    with torch.no_grad():
        mgap, (lg, gg, dtok, lg2, gg2) = gate_gaps(mtp, lambda: run_all(mtp))
        # Causality: a prefix pass equals the first rows of the full pass.
        prefix_diff = 0.0
        for m in (1, 5, 17, n - 1):
            lm, gm = mtp_rows(mtp, ref, rope, hid[:m], nxt[:m])
            prefix_diff = max(prefix_diff, (lm - lg2[:m]).abs().max().item(), (gm - gg2[:m]).abs().max().item())
        # Rows one at a time through a DynamicCache (the MTP layer's own kv cache), chained row too.
        cache = new_cache(cfg_mtp)
        hs, ts = torch.cat([hid, gg[-1:]]), torch.cat([nxt, torch.tensor([dtok])])
        one = []
        for r in range(n):
            l1, g1 = mtp_rows(mtp, ref, rope, hs[r:r + 1], ts[r:r + 1], start=r, cache=cache, mask=False)
            one.append(l1)
        one = torch.cat(one)
    one_diff = (one - lg2).abs().max().item()
    chained_vs_pass = (lg2[: n - 1] - lg).abs().max().item()
    print(f"prefix passes vs the full pass: {prefix_diff:.3g}; one at a time (DynamicCache) vs one pass: "
          f"{one_diff:.3g}; first n-1 rows of the n-row pass vs the (n-1)-row pass: {chained_vs_pass:.3g}")
    assert one_diff < 1e-4 and prefix_diff < 1e-4
    mtp_logits = lg.numpy().astype(np.float32)
    mm = margins(lg2)

    # A normal reference fixture too: transformers reads the directory with the mtp shard in it.
    try:
        again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            reload_diff = float(np.abs(again(ids).logits[0].numpy() - prefill).max())
        print("reloaded with mtp.safetensors in the index vs prefill:", reload_diff)
    except Exception as e:  # noqa: BLE001
        reload_diff = "failed: " + repr(e)[:300]
        print("transformers could not read the directory back:", reload_diff)

    np.save(os.path.join(out, "logits_prefill.npy"), prefill)
    np.save(os.path.join(out, "logits_decode.npy"), decode)
    np.save(os.path.join(out, "main_hidden.npy"), main_hidden.numpy().astype(np.float32))
    np.save(os.path.join(out, "mtp_logits.npy"), mtp_logits)
    np.save(os.path.join(out, "mtp_hidden.npy"), gg.numpy().astype(np.float32))
    np.save(os.path.join(out, "mtp_chained_logits.npy"), lg2[n - 1:].numpy().astype(np.float32))
    versions = {"torch_version": torch.__version__, "transformers_version": transformers.__version__}
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({
            "text": TEXT, "tokens": tokens, "seed": seed, "head_draw": head_seed, **versions,
            "min_routing_gap": gap, "min_argmax_margin": margin, "max_abs_logit": scale,
            "max_abs_decode_vs_prefill": float(np.abs(decode - prefill).max()),
            "notes": f"tiny random {type(model).__name__} saved by transformers save_pretrained in bf16 "
                     "(the qwen3_5_moe-transformers model, one file); logits from the saved files reloaded "
                     "in float32 on the CPU, eager attention. MTP: see mtp.json",
        }, f, indent=1)
    with open(os.path.join(out, "mtp.json"), "w") as f:
        json.dump({
            "tokens": tokens, "n": n, "chained_token": dtok, "chained_position": n - 1,
            "seed": seed, "head_draw": head_seed, "mtp_seed": mtp_seed, **versions,
            "mtp_max_abs_logit": float(lg2.abs().max()),
            "mtp_min_argmax_margin": float(mm.min()),
            "mtp_chained_argmax_margin": float(mm[-1]),
            "mtp_min_routing_gap": mgap,
            "mtp_argmax": [int(i) for i in lg.argmax(-1)],
            "chained_argmax": int(lg2[-1].argmax()),
            "max_abs_one_at_a_time_vs_one_pass": one_diff,
            "max_abs_prefix_pass_vs_full_pass": prefix_diff,
            "max_abs_main_layer_replay": replay_diff,
            "max_abs_rotary_own_vs_model": rope.diff,
            "max_abs_prefill_vs_qwen3_5_moe_transformers": vs_old,
            "max_abs_reload_with_mtp_vs_prefill": reload_diff,
            "mtp_tensors": {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in sorted(tensors.items())},
            "note": (
                "MTP = Qwen3.5/Qwen3-Next multi-token prediction. Weights (mtp.safetensors, bf16, seeded random, "
                "init_ of make_fixtures_transformers.py: zero-centred norms 0 + N(0, 0.1), matrices N(0, 1/fan_in)): "
                "mtp.fc.weight [H, 2H]; mtp.pre_fc_norm_embedding/pre_fc_norm_hidden/norm: Qwen3_5MoeRMSNorm "
                "(x/rms * (1 + w), eps rms_norm_eps); mtp.layers.0: transformers' Qwen3_5MoeDecoderLayer built as a "
                "full-attention layer (gated attention + MoE block with shared expert), its tensors written by "
                "save_pretrained exactly as the main layer %d's (per-expert experts.N.{gate,up,down}_proj.weight). "
                "Embedding and lm_head are the main model's. Row r at position p: e = pre_fc_norm_embedding(embed(tok_r)), "
                "h = pre_fc_norm_hidden(hidden_r), x = fc(cat([e, h])), x = layer(x, rotary position p, causal over the "
                "MTP layer's own kv of rows 0..p), g = norm(x), logits = lm_head(g). main_hidden.npy [n, H]: the main "
                "model's last_hidden_state (after model.norm). mtp_logits.npy / mtp_hidden.npy [n-1, .]: rows p = 0..n-2 "
                "with (main_hidden[p], tokens[p+1]) at positions 0..n-2 in one causal pass (eager attention, float32, "
                "CPU, weights as saved); row p predicts token p+2; mtp_hidden = g. mtp_chained_logits.npy [1, V]: the "
                "row (mtp_hidden[n-2], chained_token = argmax mtp_logits[n-2]) at position n-1 after the n-1 rows. "
                "Checked: rows one at a time through a DynamicCache and prefix passes equal the one pass; the main "
                "full-attention layer replayed with the same mask/rotary equals the model's forward." % full),
        }, f, indent=1)
    sizes = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    print("files:", sizes, "total", sum(sizes.values()))
    print("mtp tensors:", json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in sorted(tensors.items())}))
    print("main names of layer %d:" % full, [k for k in main_names if k.startswith(pfx)][:6], "...")
    print("in-memory MTP names:", names_mem)


if __name__ == "__main__":
    main()
