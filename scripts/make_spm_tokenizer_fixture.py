#!/usr/bin/env python3
"""A SentencePiece tokenizer fixture (Llama/Mistral/Mixtral's kind) for the GGUF tokenizer tests.

    python scripts/make_spm_tokenizer_fixture.py --llama-cpp DIR [--out tests/fixtures/spm-tokenizer]

Needs sentencepiece, transformers 4.x (no torch; transformers 5 no longer converts a bare
SentencePiece model), tokenizers, numpy, protobuf, and a llama.cpp tree for its gguf-py. Writes:
- `tokenizer.model`: a SentencePiece BPE model trained here on the repository's README with
  Llama's settings (byte fallback, digits split, a dummy prefix, whitespace kept as is;
  `<unk>`, `<s>`, `</s>` at ids 0-2), deterministic on one thread;
- `tokenizer.json`, `tokenizer_config.json`: the original tokenizer as transformers converts the
  model (`LlamaTokenizerFast`, legacy, as Mixtral's published tokenizer.json is);
- `vocab.gguf`: a vocabulary-only GGUF written as llama.cpp's converter writes a SentencePiece
  vocabulary (`TextModel._set_vocab_sentencepiece` / `_create_vocab_sentencepiece`: tokens,
  scores, types from the model, `tokenizer.ggml.model` "llama", pre "default", and gguf-py's
  `SpecialVocab` for the special ids and add_bos);
- `expected.json`: mixed texts with the ids SentencePiece itself gives (with the BOS llama.cpp
  adds) and those of tokenizer.json.
"""
import argparse, json, os, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TEXTS = [
    "Hello world",
    " leading space and  two  spaces, trailing ",
    "def f(x):\n    return x * 2  # code\n\tTabs\r\n",
    "Numbers 1234567 and 3.14159, dates 2026-11-27.",
    "日本語のテキストと中文，한국어",
    "Emoji: 😀🚀 and accents: café, naïve, Ωμέγα",
    "<s>special</s> inside text [INST] not special [/INST]",
    "",
    " ",
    "\n\n\n",
    "The quick brown fox jumps over the lazy dog while the river runs to the sea.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "spm-tokenizer"))
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(a.llama_cpp, "gguf-py"))
    import gguf
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    os.makedirs(a.out, exist_ok=True)
    corpus = open(os.path.join(HERE, "..", "README.md"), encoding="utf-8").read()
    with tempfile.TemporaryDirectory() as work:
        text = os.path.join(work, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write(corpus)
        prefix = os.path.join(work, "sp")
        spm.SentencePieceTrainer.train(
            input=text, model_prefix=prefix, model_type="bpe", vocab_size=1000,
            byte_fallback=True, split_digits=True, add_dummy_prefix=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity",
            allow_whitespace_only_pieces=True, character_coverage=0.9995, num_threads=1,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
        model = open(prefix + ".model", "rb").read()
    path = os.path.join(a.out, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model)

    hf = LlamaTokenizerFast(vocab_file=path, legacy=True, add_prefix_space=True, add_bos_token=True,
                            add_eos_token=False)
    hf.save_pretrained(a.out)
    for extra in ("special_tokens_map.json", "tokenizer.model.bak"):
        if os.path.exists(os.path.join(a.out, extra)):
            os.remove(os.path.join(a.out, extra))

    # llama.cpp's _create_vocab_sentencepiece (no added_tokens.json; tokenizer_config.json's
    # added_tokens_decoder only restates <unk>, <s>, </s>, which stay as the model types them).
    sp = spm.SentencePieceProcessor()
    sp.LoadFromFile(path)
    class T:  # llama.cpp's SentencePieceTokenTypes
        NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i).encode("utf-8"))
        scores.append(sp.GetScore(i))
        types.append(T.UNKNOWN if sp.IsUnknown(i) else T.CONTROL if sp.IsControl(i)
                     else T.UNUSED if sp.IsUnused(i) else T.BYTE if sp.IsByte(i) else T.NORMAL)
    w = gguf.GGUFWriter(os.path.join(a.out, "vocab.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(a.out, n_vocab=len(tokens)).add_to_gguf(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    cases = []
    for t in TEXTS:
        ids_sp = [1] + sp.encode(t)  # llama.cpp adds BOS (add_bos_token)
        ids_hf = hf(t)["input_ids"]
        cases.append({"text": t, "sentencepiece": ids_sp, "tokenizer_json": ids_hf})
        flag = "" if ids_sp == ids_hf else "   <- differ"
        print(f"{t[:40]!r}: {len(ids_sp)} ids{flag}")
    with open(os.path.join(a.out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"cases": cases, "sentencepiece": spm.__version__,
                   "notes": "ids with BOS; special-token text ('<s>') inside a text is "
                            "encoded as the special token by tokenizer.json and llama.cpp, "
                            "as text by SentencePiece"}, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
