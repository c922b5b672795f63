#!/usr/bin/env python3
"""mlx-lm's fp32 logits for the bundled demo model (models/demo), for the reference-logits test.

    .venv/bin/python scripts/make_demo_reference.py [--model models/demo] [--out tests/fixtures/demo-reference]

Writes reference.json (the tokens: an English sentence and a chat prompt offering the weather
tool), logits_prefill.npy (one call) and logits_decode.npy (one token at a time through the
cache), float32 [tokens, vocab]. Needs mlx[cpu] and mlx-lm (scripts/requirements-fixtures.txt).
The weights are 4-bit; mlx-lm dequantizes them exactly and computes in f32 after the cast below,
so sluice must agree to fp32 rounding.
"""
import argparse, json, sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import decode_logits, prefill_logits  # noqa: E402

TEXT = "The bear walked to the river"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a location.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--out", default="tests/fixtures/demo-reference")
    ap.add_argument("--chat-tail", type=int, default=8, help="last N tokens of the chat prompt to keep")
    a = ap.parse_args()
    model, tok = load(a.model)
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    text = tok.encode(TEXT, add_special_tokens=False)
    chat = tok.apply_chat_template(CHAT, tools=[TOOL], add_generation_prompt=True, tokenize=True)
    tokens = [int(t) for t in text + list(chat)[-a.chat_tail:]]
    prefill = prefill_logits(model, tokens)
    decode = decode_logits(model, tokens)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference.json").write_text(json.dumps({
        "model": a.model, "tokens": tokens, "text": TEXT, "chat_tail_of": CHAT,
        "made_by": "scripts/make_demo_reference.py (mlx-lm, weights dequantized, fp32)",
    }, indent=1) + "\n")
    np.save(out / "logits_prefill.npy", prefill.astype(np.float32))
    np.save(out / "logits_decode.npy", decode.astype(np.float32))
    gap = np.abs(prefill - decode).max() / np.abs(decode).max()
    print(f"{len(tokens)} tokens, vocab {prefill.shape[1]}; mlx prefill vs decode max|diff|/max|ref| {gap:.1e}")


if __name__ == "__main__":
    main()
