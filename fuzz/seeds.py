#!/usr/bin/env python3
"""Writes each fuzz target's seed corpus into fuzz/corpus/TARGET/ from the repository's fixtures
and a few hand-written cases (the corpus lives in the repo as this script; libFuzzer adds what
it finds beside the seeds). Run from anywhere; existing seeds are rewritten, found inputs kept."""

import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = ROOT / "tests/fixtures"
CORPUS = ROOT / "fuzz/corpus"


def seed(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def main():
    # safetensors: small files of each layout sluice reads.
    seed("safetensors", "f32", safetensors([("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))]))
    seed("safetensors", "mixed", safetensors([
        ("a.weight", "U32", [2, 1], struct.pack("<2I", 7, 9)),
        ("a.scales", "BF16", [2, 1], b"\x80\x3f\x00\x40"),
        ("a.biases", "F16", [2, 1], b"\x00\x3c\x00\xc0"),
        ("e", "F32", [0], b""),
    ], metadata={"format": "mlx"}))

    # model_dir: config.json \0 tokenizer_config.json \0 generation_config.json.
    q = FIX / "qwen3_5_moe-q4"
    files = [(q / n).read_bytes() for n in ("config.json", "tokenizer_config.json", "generation_config.json")]
    seed("model_dir", "all", b"\0".join(files))
    seed("model_dir", "config", files[0])
    for fam in ("qwen3_moe-q4", "gpt_oss-q4", "mixtral-q4", "deepseek_v3-q4", "glm4_moe-q4"):
        seed("model_dir", fam, (FIX / fam / "config.json").read_bytes())

    # manifest: a packed directory's experts.json (one layer, two experts) and variations.
    layer = {"layer": 0, "prefix": "model.layers.0.mlp.experts", "experts": 2, "offset": 0,
             "stride": 4096, "checksums": ["0" * 16, "1" * 16]}
    seed("manifest", "tiny", json.dumps({"format": "sluice-experts", "version": 1, "layers": [layer]}))
    packed = ROOT / "target/fuzz-seeds/demo-packed/experts.json"
    if packed.exists():
        seed("manifest", "demo", packed.read_bytes())

    # gguf: the fixtures' files.
    for d in sorted(FIX.glob("*gguf*")):
        for f in d.glob("*.gguf"):
            seed("gguf", d.name, f.read_bytes())

    # tokenizer: the fixtures' tokenizer.json files.
    for fam in ("qwen3_5_moe-q4", "gpt_oss-q4", "deepseek_v3-q4", "mixtral-q4"):
        seed("tokenizer", fam, (FIX / fam / "tokenizer.json").read_bytes())

    # tiktoken: tiktoken.model \0 tokenizer_config.json.
    t = ROOT / "crates/sluice-engine/tests/data/tiktoken"
    seed("tiktoken", "kimi", (t / "tiktoken.model").read_bytes() + b"\0" + (t / "tokenizer_config.json").read_bytes())
    seed("tiktoken", "model-only", (t / "tiktoken.model").read_bytes())

    # chat_template: every template in the repo, one with extra kwargs.
    for f in sorted((ROOT / "crates/sluice-engine/tests/data").glob("*.jinja")):
        seed("chat_template", f.stem, f.read_bytes())
    seed("chat_template", "gpt_oss", (ROOT / "tests/server/gpt_oss_chat_template.jinja").read_bytes())
    qt = json.loads((q / "tokenizer_config.json").read_text())["chat_template"]
    seed("chat_template", "qwen35-thinking-off", qt.encode() + b"\0" + b'{"enable_thinking": false}')

    # request_body: endpoint byte (0 chat, 1 completions), then the body.
    chat = [
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9, "seed": 3},
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "21C"}],
         "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object",
                    "properties": {"city": {"type": "string"}}}}}], "tool_choice": "auto"},
        {"messages": [{"role": "user", "content": "x"}], "stop": ["\n", "a"], "logit_bias": {"5": -100},
         "presence_penalty": 1.5, "frequency_penalty": -0.5, "top_k": 5, "min_p": 0.1,
         "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"},
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "n": 2},
    ]
    for i, b in enumerate(chat):
        seed("request_body", f"chat{i}", b"\0" + json.dumps(b).encode())
    comp = [
        {"prompt": "Once upon a time", "max_tokens": 2, "echo": True},
        {"prompt": ["one"], "stream": True, "ignore_eos": True},
        {"prompt": [1, 2, 3], "stop": "x", "temperature": 0},
        {"prompt": "x", "suffix": "y"},
    ]
    for i, b in enumerate(comp):
        seed("request_body", f"completion{i}", b"\1" + json.dumps(b).encode())

    # output_parser: flags byte, seed byte, model output.
    texts = [
        "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 1, \"s\": \"x\"}}\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=b>\ntrue\n</parameter>\n</function>\n</tool_call>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"n\": 2}<|tool_call_end|><|tool_calls_section_end|>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"n\": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"n\":1}<|call|>",
        "Stop here\n\nnot this </ nor this",
    ]
    for i, t in enumerate(texts):
        flags = 2 | 4 | 32 | (8 if "<|channel|>" in t else 0) | (16 if "Stop" in t else 0)
        seed("output_parser", f"text{i}", bytes([flags, i * 37 % 256]) + t.encode())


if __name__ == "__main__":
    main()
