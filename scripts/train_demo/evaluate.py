#!/usr/bin/env python3
"""Evaluates the exported demo model (the 4-bit weights as shipped) with sluice, whose logits
match mlx-lm's on this model to ~1e-6 (scripts/check_synth_mlx.py); mlx-lm itself is too slow
here (its CPU prefill through the Gated DeltaNet layers takes about a minute per 512 tokens):

- perplexity on models/demo/eval/heldout_text.jsonl (non-overlapping 512-token windows over the
  documents joined with <|endoftext|>, as in training), overall and per source;
- tool-call rate on models/demo/eval/weather_prompts.jsonl: greedy generation with the chat
  template and the tools of each prompt; a prompt passes when the output holds a
  <tool_call>...</tool_call> whose JSON parses, names get_weather, and whose `location` equals
  the expected city (case-insensitive; "City, Country" also accepted) and, when the prompt asks
  for a unit, whose `unit` is that unit;
- a few sample generations.

    .venv/bin/python scripts/train_demo/evaluate.py models/demo --sluice target/release/sluice \
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess


def check_tool_call(text: str, expected: dict) -> tuple[bool, str]:
    m = re.search(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    if not m:
        return False, "no <tool_call>...</tool_call>"
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        return False, f"bad JSON: {e}"
    if not isinstance(call, dict) or call.get("name") != expected["name"]:
        return False, f"name {call.get('name') if isinstance(call, dict) else None!r}"
    args = call.get("arguments")
    if not isinstance(args, dict):
        return False, "arguments not an object"
    loc = str(args.get("location", "")).strip().lower()
    want = expected["location"].lower()
    if loc != want and loc.split(",")[0].strip() != want:
        return False, f"location {args.get('location')!r}, expected {expected['location']!r}"
    if expected.get("unit") and args.get("unit") != expected["unit"]:
        return False, f"unit {args.get('unit')!r}, expected {expected['unit']!r}"
    return True, "ok"


def sluice_generate(sluice, model, prompt, n):
    out = subprocess.run([sluice, "generate", "--model", model, "--prompt", prompt, "-n", str(n),
                          "--temperature", "0", "--repetition-penalty", "1"],
                         capture_output=True, text=True, check=True)
    return out.stdout


def sluice_logits(sluice, model, ids, tmp):
    f = os.path.join(tmp, "l.npy")
    subprocess.run([sluice, "logits", "--model", model, "--tokens", ",".join(map(str, ids)),
                    "--mode", "prefill", "--out", f], capture_output=True, check=True)
    import numpy as np
    return np.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--json")
    ap.add_argument("--window", type=int, default=512)
    a = ap.parse_args()

    import tempfile
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    ev = os.path.join(a.model, "eval")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    res = {"engine": "sluice (greedy, f32 compute on the 4-bit weights)", "perplexity": {}}

    docs = [json.loads(l) for l in open(os.path.join(ev, "heldout_text.jsonl"))]
    by_src: dict[str, list[int]] = {}
    chars: dict[str, int] = {}
    for d in docs:
        src = d["source"].split(":")[0]
        by_src.setdefault(src, []).extend(tok.encode(d["text"], add_special_tokens=False) + [eot])
        chars[src] = chars.get(src, 0) + len(d["text"])
    tot_nll, tot_n = 0.0, 0
    W = a.window
    with tempfile.TemporaryDirectory() as tmp:
        for src, ids in by_src.items():
            nll, n = 0.0, 0
            for i in range(0, len(ids) - 1, W):
                x = ids[i:i + W + 1]
                if len(x) < 2:
                    continue
                lg = sluice_logits(a.sluice, a.model, x[:-1], tmp).astype(np.float64)
                m = lg.max(-1, keepdims=True)
                lp = lg - (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))
                nll -= lp[np.arange(len(x) - 1), x[1:]].sum()
                n += len(x) - 1
            res["perplexity"][src] = {"tokens": n, "loss": nll / n, "ppl": math.exp(nll / n),
                                      "bits_per_char": nll / chars[src] / math.log(2)}
            tot_nll += nll
            tot_n += n
    res["perplexity"]["all"] = {"tokens": tot_n, "loss": tot_nll / tot_n,
                                "ppl": math.exp(tot_nll / tot_n),
                                "bits_per_char": tot_nll / sum(chars.values()) / math.log(2)}
    print(json.dumps(res["perplexity"], indent=1))

    prompts = [json.loads(l) for l in open(os.path.join(ev, "weather_prompts.jsonl"))]
    ok, rows = 0, []
    for e in prompts:
        p = tok.apply_chat_template(e["messages"], tools=e["tools"], add_generation_prompt=True,
                                    tokenize=False)
        out = sluice_generate(a.sluice, a.model, p, 64)
        good, why = check_tool_call(out, e["expected"])
        ok += good
        rows.append({"prompt": e["messages"][0]["content"], "held_out_phrasing":
                     e["phrasing_held_out"], "output": out, "ok": good, "why": why})
        if not good:
            print("FAIL", e["messages"][0]["content"], "->", repr(out), why)
    res["tool_call_rate"] = ok / len(prompts)
    res["tool_calls"] = rows
    print(f"tool-call rate: {ok}/{len(prompts)} = {ok / len(prompts):.3f}")

    samples = {}
    for p in ["Once upon a time", "It is a truth universally acknowledged",
              "The economy of Norway"]:
        samples[p] = p + sluice_generate(a.sluice, a.model, p, 60)
    tools = prompts[0]["tools"]
    for q, t in [("Hello! Who are you?", None), ("Tell me a story about a fox.", None),
                 ("What is the capital of Kenya?", None), ("What is 17 times 23?", tools),
                 ("Who wrote Pride and Prejudice?", tools), ("Thanks, goodbye!", None)]:
        p = tok.apply_chat_template([{"role": "user", "content": q}], tools=t,
                                    add_generation_prompt=True, tokenize=False)
        samples[("tools: " if t else "chat: ") + q] = sluice_generate(a.sluice, a.model, p, 100)
    res["samples"] = samples
    for k, v in samples.items():
        print(f"--- {k}\n{v}")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
