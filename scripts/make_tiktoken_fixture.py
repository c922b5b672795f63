#!/usr/bin/env python3
"""Writes the Kimi-style tiktoken fixture of sluice-engine's tests/tiktoken.rs.

A small byte-level BPE is trained here on a built-in multilingual text (English prose, code,
Chinese, Japanese, Korean, Cyrillic, Greek, digits, emoji), written as a `tiktoken.model` (one
line per token: base64 of its bytes, a space, its rank) with a `tokenizer_config.json` shaped
like Kimi K2's (`added_tokens_decoder` naming some of the 256 special ids after the ranks, at
Kimi K2's offsets; the others stay unnamed, as Kimi's reserved tokens). Then every case text is
encoded by tiktoken itself, set up exactly as moonshotai's `tokenization_kimi.py`
(`TikTokenTokenizer`) sets it up:

    special_tokens = {added_tokens_decoder.get(i, f"<|reserved_token_{i}|>"): i
                      for i in range(n_ranks, n_ranks + 256)}
    tiktoken.Encoding(name, pat_str=KIMI_PAT_STR, mergeable_ranks=..., special_tokens=...)

and its `encode(text)`: the text cut into 400,000-character chunks, each cut where a run of
whitespace or of non-whitespace would exceed 25,000 characters, each piece encoded with
`allowed_special="all"`.

Output (default crates/sluice-engine/tests/data/tiktoken/): `tiktoken.model`,
`tokenizer_config.json`, `cases.json` (a list of {"name", "text" or "repeat": [[s, n], ...],
"ids" or "ids_runs": [[[id, ...], count], ...]: the ids in blocks, each repeated count times}).

    python3 -m venv /tmp/tk && /tmp/tk/bin/pip install tiktoken
    /tmp/tk/bin/python scripts/make_tiktoken_fixture.py

Deterministic: the same tiktoken version writes the same files (made with tiktoken 0.14.0).
"""

import argparse
import base64
import collections
import json
import pathlib
import random

import regex  # a dependency of tiktoken
import tiktoken

# tokenization_kimi.py's TikTokenTokenizer.pat_str (Kimi K2), verbatim.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

# Kimi K2's named special tokens, by offset from the first special id (163584 in Kimi K2).
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
# Offsets written explicitly with their reserved name (as Kimi K2's config lists them).
EXPLICIT_RESERVED = [5, 8, 16]

CORPUS = """
The quick brown fox jumps over the lazy dog. It's what they're saying, and we've heard
that you'll find it isn't as simple as I'd thought; I'm sure he's right. THE QUICK BROWN FOX
JUMPS OVER THE LAZY DOG, IT'S WHAT THEY'RE SAYING. Hello, world! Hello world. hello there.
In the beginning the Universe was created. This has made a lot of people very angry and been
widely regarded as a bad move. The model streams its experts from the disk while the dense
weights stay resident in memory; tokens arrive one at a time, and the tokenizer turns them
back into text. Numbers: 1, 12, 123, 1234, 12345, 123456, 3.14159, 2024-06-01, 10:30, $99.99,
100%, 1,000,000 and 0x1F. Version 2.5.1 was released on 2025-07-11.

def encode(self, text: str) -> list[int]:
    ids = []
    for piece in self.pattern.findall(text):
        if piece in self.ranks:
            ids.append(self.ranks[piece])
        else:
            ids.extend(self.merge(piece))
    return ids

fn main() {
    let xs: Vec<u32> = (0..10).map(|x| x * x).collect();
    println!("{:?}", xs);
}

        deeply indented line
                more deeply indented line
\t\ttabs\tand\ttabs
aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
================================================================
----------------------------------------------------------------
道可道，非常道；名可名，非常名。无名天地之始，有名万物之母。故常无欲，以观其妙；常有欲，以观其徼。
此两者同出而异名，同谓之玄。玄之又玄，众妙之门。
我们今天去北京大学学习中文。你好，世界！这是一个测试。人工智能模型正在生成文本。
中华人民共和国成立于一九四九年。今天天气很好，我们去公园散步吧。
日本語のテキストです。ひらがなとカタカナと漢字。東京は日本の首都です。
한국어 텍스트입니다. 안녕하세요, 세계!
Привет, мир! Это тестовый текст на русском языке.
Γειά σου κόσμε! Ελληνικά γράμματα.
Emoji: 😀 😀😀 👍🏽 🇫🇷 👨‍👩‍👧 ❤️ ✨🚀
café naïve résumé über Straße façade coöperate
"""


def train(text: str, vocab_size: int) -> dict[bytes, int]:
    """Byte-level BPE training on the pieces of the Kimi pattern: ranks 0..255 are the bytes,
    each further rank the most frequent adjacent pair of the previous step."""
    ranks = {bytes([i]): i for i in range(256)}
    # The regex module needs V1 for the `&&` class intersections.
    pieces = regex.findall("(?V1)" + KIMI_PAT_STR, text)
    counts = collections.Counter(pieces)
    words = [([bytes([b]) for b in p.encode()], c) for p, c in sorted(counts.items())]
    while len(ranks) < vocab_size:
        stats = collections.Counter()
        for w, c in words:
            for a, b in zip(w, w[1:]):
                stats[a, b] += c
        if not stats:
            break
        (a, b), _ = max(stats.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in ranks:
            ranks[a + b] = len(ranks)
        for w, _ in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i : i + 2] = [a + b]
                i += 1
    return ranks


def kimi_split(s: str, max_len: int):
    """TikTokenTokenizer._split_whitespaces_or_nonwhitespaces."""
    current_slice_len = 0
    current_slice_is_space = s[0].isspace() if len(s) > 0 else False
    slice_start = 0
    for i in range(len(s)):
        is_now_space = s[i].isspace()
        if current_slice_is_space ^ is_now_space:
            current_slice_len = 1
            current_slice_is_space = is_now_space
        else:
            current_slice_len += 1
            if current_slice_len > max_len:
                yield s[slice_start:i]
                slice_start = i
                current_slice_len = 1
    yield s[slice_start:]


def kimi_encode(enc: tiktoken.Encoding, text: str) -> list[int]:
    """TikTokenTokenizer.encode(text) (allow_special_tokens=True)."""
    t = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        for substr in kimi_split(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
            t.extend(enc.encode(substr, allowed_special="all"))
    return t


def runs(ids, max_period=8):
    """`ids` as [[block, count], ...]: each block of ids repeated count times, in order."""
    out = []
    i = 0
    while i < len(ids):
        best = (1, 1)  # (period, count)
        for p in range(1, max_period + 1):
            k = 1
            while ids[i + k * p : i + (k + 1) * p] == ids[i : i + p] and i + (k + 1) * p <= len(ids):
                k += 1
            if k >= 2 and k * p > best[0] * best[1]:
                best = (p, k)
        p, k = best
        if k == 1 and out and out[-1][1] == 1:
            out[-1][0].append(ids[i])
        else:
            out.append([ids[i : i + p], k])
        i += p * k
    assert [t for b, k in out for _ in range(k) for t in b] == ids
    return out


def cases(specials: list[str]) -> list[tuple[str, str]]:
    named = [
        ("empty", ""),
        ("ascii", "Hello world"),
        ("ascii_punct", "Hello, world! How are you? (fine) [ok] {yes}"),
        ("contractions", "it's they're we've you'll I'd I'm don't"),
        ("contractions_upper", "IT'S THEY'RE WE'VE YOU'LL I'D I'M DON'T It'S tHeY'Re"),
        ("contraction_alone", "'s 're 've 'll 'd 'm 't ''s"),
        ("contraction_long_s", "its'ſ it'ſ"),
        ("numbers", "1 12 123 1234 12345 123456 1234567"),
        ("numbers_mixed", "3.14159 2024-06-01 $99.99 100% 1,000,000 0x1F v2.5.1 a1b22c333d4444"),
        ("numbers_unicode", "٣٤٥٦ ½ ² Ⅻ ①②③④ 一二三"),
        ("chinese", "我们今天去北京大学学习中文。"),
        ("chinese_punct", "道可道，非常道；名可名，非常名。「你好」《书》"),
        ("chinese_mixed", "GPT模型test测试123数字abc中文"),
        ("chinese_spaces", "你好 世界  你好\n世界"),
        ("japanese", "日本語のテキストです。ひらがなとカタカナ、漢字ー"),
        ("korean", "한국어 텍스트입니다. 안녕하세요!"),
        ("cyrillic_greek", "Привет, мир! Γειά σου κόσμε!"),
        ("accents", "café naïve résumé über Straße façade"),
        ("combining", "e\u0301 a\u0308\u0301 \u0301x n\u0303o"),
        ("emoji", "emoji 😀😀 then 👍🏽 and 🇫🇷 flag 👨‍👩‍👧 ❤️"),
        ("whitespace_runs", "a  b   c    d\t\te \t f"),
        ("trailing_spaces", "end   "),
        ("leading_spaces", "   start"),
        ("only_spaces", "     "),
        ("newlines", "line1\nline2\n\nline3\r\nline4\r\r\n\n"),
        ("newline_indent", "if x:\n    return y\n\n\n        z = 1\n"),
        ("space_before_newline", "a  \n  b \n\n c"),
        ("unicode_spaces", "a\u00a0b\u3000c\u2028d\u2029e\u0085f\u1680g\u2009h\u202fi"),
        ("python_isspace_only", "a\x1cb\x1dc\x1e d\x1f"),
        ("space_punct", "a !b ?? c ... d  ,e\t!f"),
        ("punct_newlines", "end.\n\nNext!\r\n(x)\n"),
        ("code", 'def f(x):\n    return [i * 2 for i in range(x)]  # comment\n'),
        ("json", '{"key": "value", "n": [1, 2, 3], "ok": true}'),
        ("unreachable_token", " supercalifragilistic and supercalifragilistic"),
        ("aaaa", "a" * 100 + " " + "a" * 7),
        ("mixed_case_words", "HTTPServer parseJSON McDonald's iPhone XMLHttpRequest"),
        ("control_chars", "a\x00b\x01c\x7fd\ufffde"),
        ("specials_chat", "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
         "<|im_user|>user<|im_middle|>Hi 你好<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        ("specials_tool", "<think>hm</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>"
         "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"北京\"}"
         "<|tool_call_end|><|tool_calls_section_end|>"),
        ("specials_adjacent", "[BOS][EOS][BOS]x[PAD]"),
        ("special_spaces", "hello  <|im_end|>  world   [EOS]\n"),
        ("reserved_unnamed", f"a{specials[5]}b{specials[100]}c"),
        ("special_partial", "<|im_end| <|im_end <im_end|> [BOS"),
    ]
    rng = random.Random(20250711)
    atoms = (
        list("abcxyzABCXYZ'sdtm") + list("0123456789") + list(" \t\n\r\u00a0\u3000\x1c")
        + list(".,!?;:-()[]{}\"'#/*") + list("中文字汉你好世界学") + list("，。「」、ー")
        + list("ひらカタ한국ПриΓειé") + ["e\u0301", "😀", "👍🏽", "🇫🇷", "\u200d", "\ufe0f"]
        + [" the", " The", "'re", "'S", "123", "    ", "\n\n", " \n", "aaaa"]
        + ["<|im_end|>", "<|im_user|>", "[EOS]", "<think>", specials[42]]
    )
    randoms = [
        (f"random_{i}", "".join(rng.choice(atoms) for _ in range(rng.randint(1, 30))))
        for i in range(400)
    ]
    return named + randoms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = pathlib.Path(__file__).resolve().parent.parent
    ap.add_argument("--out", type=pathlib.Path, default=root / "crates/sluice-engine/tests/data/tiktoken")
    ap.add_argument("--vocab", type=int, default=1200)
    args = ap.parse_args()

    ranks = train(CORPUS, args.vocab)
    # Tokens that no merge reaches: tiktoken uses them only when a whole piece equals one.
    for extra in [b" supercalifragilistic", b"zzzz"]:
        ranks.setdefault(extra, len(ranks))
    n = len(ranks)
    decoder = {n + off: {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
               for off, c in NAMED_SPECIALS.items()}
    for off in EXPLICIT_RESERVED:
        decoder[n + off] = {"content": f"<|reserved_token_{n + off}|>", "lstrip": False,
                            "normalized": False, "rstrip": False, "single_word": False,
                            "special": True}
    mapping = {i: t["content"] for i, t in decoder.items()}
    special_tokens = {mapping.get(i, f"<|reserved_token_{i}|>"): i
                      for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(name="tiktoken.model", pat_str=KIMI_PAT_STR,
                            mergeable_ranks=ranks, special_tokens=special_tokens)
    specials = list(special_tokens)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tiktoken.model", "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    config = {
        "added_tokens_decoder": {str(i): decoder[i] for i in sorted(decoder)},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|start_header_id|>", "<|end_header_id|>", "[EOT]",
                                      "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    rows = []
    for name, text in cases(specials):
        ids = kimi_encode(enc, text)
        assert enc.decode(ids) == text, name
        rows.append({"name": name, "text": text, "ids": ids})
    # Long runs: Kimi's cuts at 25,000 whitespace / non-whitespace characters and at 400,000
    # characters change the ids there.
    for name, repeat in [
        ("long_letters", [["a", 30_000]]),
        ("long_spaces", [[" ", 30_000], ["end", 1]]),
        ("long_newlines_spaces", [["x", 1], [" \n", 13_000]]),
        ("long_han", [["中文", 13_000]]),
        ("long_words", [["word ", 90_000]]),
        ("long_exact_25000", [["b", 25_000], [" ", 25_000], ["c", 25_001]]),
    ]:
        text = "".join(s * k for s, k in repeat)
        ids = kimi_encode(enc, text)
        assert enc.decode(ids) == text, name
        rows.append({"name": name, "repeat": repeat, "ids_runs": runs(ids)})
    with open(out / "cases.json", "w") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
        f.write("\n]\n")
    print(f"{n} ranks, {len(special_tokens)} special ids, {len(rows)} cases -> {out}")


if __name__ == "__main__":
    main()
