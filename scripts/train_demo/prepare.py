#!/usr/bin/env python3
"""Builds everything the training run needs from the registry packages (sources.py) and the
seeded dialogue generator (dialogues.py):

    work/tokenizer/      tokenizer.json, tokenizer_config.json (with chat_template),
                         generation_config.json
    work/data/train.npz  token arrays: `prose` (uint16 stream, documents separated by
                         <|endoftext|>), `stories` (same), `dialogues` ([N, 513] uint16 rows of
                         packed conversations, bit 15 set on tokens that carry loss, i.e. the
                         assistant turns), `heldout` (uint16 stream of the held-out prose)
    models/demo/eval/    weather_prompts.jsonl (held-out tool-call prompts + tool definitions),
                         heldout_text.jsonl (held-out prose, for perplexity)

    python prepare.py [--work work] [--dialogues 100000] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

import numpy as np
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import dialogues as dg  # noqa: E402
import sources  # noqa: E402

VOCAB = 8192
SEQ = 512
SPECIAL = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
           ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
           ("</tool_response>", False)]
# Qwen2's split pattern with one change: a letter run never takes a leading space
# (`[^\r\n\s\p{L}\p{N}]?` instead of `[^\r\n\p{L}\p{N}]?`), so a word is the same tokens after a
# space (in the user's message) and after a quote (in the tool call's JSON). With the Qwen pattern
# " Marseille" and "Marseille" split differently and the small model could not copy names it had
# not seen into the arguments reliably. Costs about a quarter more tokens per text.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\s\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = open(os.path.join(HERE, "chat_template.jinja")).read().rstrip("\n")


def compile_template():
    """The same jinja2 environment transformers' apply_chat_template uses."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    return _compile_jinja_template(CHAT_TEMPLATE)


def render(tpl, messages, tools, add_generation_prompt=False):
    return tpl.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


# ---------------------------------------------------------------- text split

def split_prose(work: str, seed: int):
    """(train docs, held-out docs), each a list of (source, text). Held out: the last 3% of
    paragraphs of each Austen novel, the Book of Ruth (WEB), and 12 Factbook countries."""
    rng = random.Random(seed)
    load = lambda s: json.load(open(os.path.join(work, "prose", f"{s}.json")))
    train, held = [], []
    for name, paras in load("austen").items():
        k = int(len(paras) * 0.97)
        train.append(("austen", "\n\n".join(paras[:k])))
        held.append((f"austen:{name}", "\n\n".join(paras[k:])))
    for name, paras in load("web").items():
        doc = "\n\n".join(paras)
        (held if "Book of Ruth" in " ".join(paras[:3]) else train).append(("web", doc))
    assert any(s == "web" for s, _ in held) or True
    fb = load("factbook")
    keys = sorted(fb)
    held_keys = set(rng.sample(keys, 12))
    for k in keys:
        paras = [fb[k][0]] + [p for t in fb[k][1:] for p in re.split(r"\s*\+\+\s*", t) if p]
        doc = "\n\n".join(paras)
        (held if k in held_keys else train).append(("factbook" if k not in held_keys
                                                    else f"factbook:{fb[k][0]}", doc))
    held = [(s, t) for s, t in held if t]
    webheld = [s for s, _ in held if s == "web"]
    held = [("web:ruth" if s == "web" else s, t) for s, t in held]
    assert webheld, "Book of Ruth not found"
    return train, held


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(texts) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    bpe_vocab = VOCAB - len(SPECIAL)
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size(with_added_tokens=False) == bpe_vocab
    for content, special in SPECIAL:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                       special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([t])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {str(tok.token_to_id(c)): {"content": c, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": s}
             for c, s in SPECIAL}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(tok: Tokenizer) -> dict:
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    return {"bos_token_id": eot, "do_sample": True, "eos_token_id": [im_end, eot],
            "pad_token_id": eot, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


# ---------------------------------------------------------------- token arrays

def encode_stream(tok, docs):
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for enc in tok.encode_batch([t for t in docs], add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return np.array(out, dtype=np.uint16)


def encode_dialogues(tok, texts):
    """Packs rendered conversations into [N, SEQ+1] rows; bit 15 marks tokens with loss
    (inside assistant turns, from after '<|im_start|>assistant\\n' to '<|im_end|>' inclusive),
    bit 14 the tokens of a tool call (from '<tool_call>' to '</tool_call>'), which train.py
    weights more (the arguments must be copied exactly from the user's words)."""
    eot = tok.token_to_id("<|endoftext|>")
    rows, cur, dropped = [], [], 0
    width = SEQ + 1
    head = "<|im_start|>assistant\n"
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        spans, i = [], 0
        while True:
            j = text.find(head, i)
            if j < 0:
                break
            s = j + len(head)
            e = text.index("<|im_end|>", s) + len("<|im_end|>")
            spans.append((s, e))
            i = e
        calls, i = [], 0
        while True:
            j = text.find("<tool_call>", i)
            if j < 0:
                break
            e = text.index("</tool_call>", j) + len("</tool_call>")
            calls.append((j, e))
            i = e
        ids = []
        for t, (a, b) in zip(enc.ids, enc.offsets):
            on = any(s <= a < e for s, e in spans)
            call = on and any(s <= a < e for s, e in calls)
            ids.append(t | (0x8000 if on else 0) | (0x4000 if call else 0))
        if len(ids) > width:
            dropped += 1
            continue
        if len(cur) + len(ids) > width:
            rows.append(cur + [eot] * (width - len(cur)))
            cur = []
        cur += ids
    if cur:
        rows.append(cur + [eot] * (width - len(cur)))
    print(f"dialogues longer than {width} tokens dropped: {dropped} of {len(texts)}")
    return np.array(rows, dtype=np.uint16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=os.path.join(HERE, "work"))
    ap.add_argument("--dialogues", type=int, default=150_000)
    ap.add_argument("--stories", type=int, default=12_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-dir", default=os.path.join(ROOT, "models", "demo", "eval"))
    a = ap.parse_args()

    if not os.path.exists(os.path.join(a.work, "prose", "austen.json")):
        sys.argv = ["sources.py", "--work", a.work]
        sources.main()
    facts = json.load(open(os.path.join(a.work, "factbook_facts.json")))
    train_docs, held_docs = split_prose(a.work, a.seed)

    tpl = compile_template()
    words = sorted({w.capitalize() for _, t in train_docs if _ != "web"
                    for w in re.findall(r"\b[a-z]{4,10}\b", t)})
    convs, cities = dg.train_dialogues(a.seed, a.dialogues, facts, words)
    texts = [render(tpl, m, t) for m, t in convs]
    rng = random.Random(a.seed + 1)
    stories = [dg.story(rng) for _ in range(a.stories)]
    print(f"{len(convs)} dialogues, {len(cities)} real training cities, {len(words)} words, "
          f"{len(stories)} stories")

    # Eval set: held-out cities must not occur in any training dialogue.
    train_blob = "\n".join(texts).lower()
    for c in dg.EVAL_CITIES:
        assert c.lower() not in {x.lower() for x in cities}
        assert f"\"location\": \"{c.lower()}\"" not in train_blob, c
    os.makedirs(a.eval_dir, exist_ok=True)
    with open(os.path.join(a.eval_dir, "weather_prompts.jsonl"), "w") as f:
        for e in dg.eval_weather():
            text = e["messages"][0]["content"]
            assert text.lower() not in train_blob, text
            e["tools"] = dg.EVAL_TOOLS
            f.write(json.dumps(e) + "\n")
    with open(os.path.join(a.eval_dir, "heldout_text.jsonl"), "w") as f:
        for s, t in held_docs:
            f.write(json.dumps({"source": s, "text": t}, ensure_ascii=False) + "\n")

    tok_dir = os.path.join(a.work, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    sample = [t for _, t in train_docs] + texts[:20000] + stories[:2000]
    tok = train_tokenizer(sample)
    with open(os.path.join(tok_dir, "tokenizer.json"), "w") as f:
        f.write(json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n")
    json.dump(tokenizer_config(tok), open(os.path.join(tok_dir, "tokenizer_config.json"), "w"),
              indent=2, ensure_ascii=False)
    json.dump(generation_config(tok), open(os.path.join(tok_dir, "generation_config.json"), "w"),
              indent=2)

    data_dir = os.path.join(a.work, "data")
    os.makedirs(data_dir, exist_ok=True)
    prose = encode_stream(tok, [t for _, t in train_docs])
    story_arr = encode_stream(tok, stories)
    held = encode_stream(tok, [t for _, t in held_docs])
    dia = encode_dialogues(tok, texts)
    np.savez_compressed(os.path.join(data_dir, "train.npz"), prose=prose, stories=story_arr,
                        dialogues=dia, heldout=held)
    n_loss = int((dia >> 15).sum())
    stats = {"prose_tokens": int(prose.size), "story_tokens": int(story_arr.size),
             "dialogue_rows": int(dia.shape[0]), "dialogue_tokens": int(dia.size),
             "dialogue_loss_tokens": n_loss, "heldout_tokens": int(held.size),
             "prose_chars": sum(len(t) for _, t in train_docs),
             "heldout_chars": sum(len(t) for _, t in held_docs),
             "dialogues": len(convs), "stories": len(stories)}
    json.dump(stats, open(os.path.join(data_dir, "stats.json"), "w"), indent=1)
    print(json.dumps(stats, indent=1))
    print("sample dialogue:\n" + texts[0] + "\n---\n" + texts[3])


if __name__ == "__main__":
    main()
