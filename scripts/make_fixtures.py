#!/usr/bin/env python3
"""Generate the qwen3_moe reference fixtures for sluice (tests/fixtures/).

Every fixture is a complete, tiny Hugging Face-style model directory
(config.json, safetensors, tokenizer files, generation_config.json) plus the
reference logits that mlx-lm computes for it:

    logits_decode.npy    float32 [T, vocab]: tokens fed one at a time through the KV cache
    logits_prefill.npy   float32 [T, vocab]: all tokens in one forward call
    reference.json       tokens, versions, decode-vs-prefill difference, notes

The mlx-layout fixtures are produced by mlx-lm's own `convert()` (the code
behind `mlx_lm.convert` / `mlx_lm convert -q`) from a random bf16/f16
checkpoint in the official Hugging Face layout, so config.json (including
the `quantization` block) and the tensor layout are exactly what mlx-lm
writes.  The reference logits are computed by loading the saved directory
back with mlx-lm's loader and casting every floating parameter (weights,
norms, quantization scales/biases) to float32, which is exact.

Usage:
    python -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt
    .venv/bin/python scripts/make_fixtures.py

The script is deterministic: running it again rewrites identical files.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

import mlx_lm  # noqa: E402
import importlib  # noqa: E402

mlx_convert = importlib.import_module("mlx_lm.convert")
from mlx_lm.models import qwen3_moe  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load as mlx_load, load_model as mlx_load_model  # noqa: E402

from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
import tokenizers  # noqa: E402

try:
    from importlib.metadata import version as _pkg_version
except ImportError:  # pragma: no cover
    _pkg_version = None

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures"

# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

VOCAB_SIZE = 500
SPECIAL_TOKENS = [
    # (content, special) -- as in Qwen3's tokenizer, the chat-control tokens are
    # "special" (skipped by decode(skip_special_tokens=True)); the think/tool
    # tags are added tokens that are NOT special, so they survive decoding.
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
]
BPE_VOCAB = VOCAB_SIZE - len(SPECIAL_TOKENS)  # 256 byte symbols + merges

# The pre-tokenizer split pattern of Qwen2/Qwen2.5/Qwen3 tokenizer.json.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML template in the style of Qwen3's (system/user/assistant/tool messages,
# `tools`, `add_generation_prompt`, `enable_thinking`, reasoning_content).
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string "
    "and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') "
    "+ '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

_WORDS = """
the a an of to in on at by for with from over under into onto about after before
and or but so yet because while when where which who whom whose that this these those
i you he she it we they me him her us them my your his its our their mine yours
is are was were be been being have has had do does did can could will would shall
should may might must not no yes very more most less least many much some any each
every all both few several other another such only own same than too also just now
then here there today tomorrow yesterday always never often sometimes soon again
time year day night morning evening week month people person man woman child children
world life hand part place case point group number way thing story river mountain
city town road house garden tree forest field stone water fire wind rain snow sun
moon star sky sea ship boat train bridge market school teacher student book page
letter word question answer idea reason problem system model token weight layer
expert router cache memory engine server request response message user assistant
tool function call result value error test file data table list name code line
good new first last long great little old big high different small large next early
young important public bad able quiet bright dark warm cold heavy light quick slow
happy strange simple clear careful gentle brave clever calm green blue red golden
go come make take see know think look want give use find tell ask work seem feel try
leave call keep let begin help show hear play run move live believe bring happen
write provide sit stand lose pay meet include continue set learn change lead understand
watch follow stop create speak read allow add spend grow open walk win offer remember
love consider appear buy wait serve die send expect build stay fall cut reach kill
remain suggest raise pass sell require report decide pull carry break explain hope
""".split()

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Peggy", "Victor", "Walter"]


def make_corpus(seed: int = 20240601, n_sentences: int = 6000) -> list[str]:
    """Deterministic English-like text with some chat/JSON/code flavour."""
    rng = random.Random(seed)
    # Zipf-ish word frequencies so BPE learns a natural-looking vocabulary.
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(_WORDS))]
    lines = []
    for i in range(n_sentences):
        kind = rng.random()
        n = rng.randint(4, 16)
        words = rng.choices(_WORDS, weights=weights, k=n)
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
        s = " ".join(words)
        s = s[0].upper() + s[1:]
        if rng.random() < 0.15:
            k = rng.randrange(1, len(words))
            s = " ".join(words[:k]) + ", " + " ".join(words[k:])
            s = s[0].upper() + s[1:]
        s += rng.choice([".", ".", ".", "?", "!", "..."])
        if kind < 0.08:
            s = f"user\n{s}\nassistant\n"
        elif kind < 0.12:
            key = rng.choice(["name", "arguments", "city", "query", "value", "unit"])
            s = f'{{"{key}": "{" ".join(words[:3])}", "count": {rng.randint(0, 99)}}}'
        elif kind < 0.14:
            s = f"def {words[0]}_{words[-1]}(x):\n    return x + {rng.randint(1, 9)}\n"
        lines.append(s)
    return lines


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(make_corpus(), trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=False) != BPE_VOCAB:
        raise RuntimeError(
            f"BPE trained {tok.get_vocab_size(with_added_tokens=False)} tokens, wanted {BPE_VOCAB}"
        )
    for content, special in SPECIAL_TOKENS:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                       special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError("unexpected vocab size after adding special tokens")
    return tok


def tokenizer_json_text(tok: Tokenizer) -> str:
    # Round-trip through json for stable, pretty output.
    return json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {}
    for content, special in SPECIAL_TOKENS:
        added[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, _ in SPECIAL_TOKENS if c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(tok: Tokenizer) -> dict:
    return {
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "do_sample": True,
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": "4.51.0",
    }


def write_json(path: Path, obj, compact_lists: bool = False) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    if compact_lists:
        # Put lists of plain numbers on one line (token ids, histograms).
        text = re.sub(
            r"\[\s*(-?[0-9.eE+-]+(?:,\s*-?[0-9.eE+-]+)*)\s*\]",
            lambda mo: "[" + ", ".join(x.strip() for x in mo.group(1).split(",")) + "]",
            text,
        )
    path.write_text(text + "\n")


# --------------------------------------------------------------------------
# Fixture specifications
# --------------------------------------------------------------------------


@dataclass
class Spec:
    name: str
    layout: str  # "mlx" (via mlx_lm convert) or "hf" (written here, official layout)
    dtype: str  # torch_dtype of the checkpoint: "bfloat16" | "float16"
    seed: int
    text: str
    head_dim: int = 32
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    rope_theta: float = 1e6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    mlp_only_layers: list = field(default_factory=list)
    decoder_sparse_step: int = 1
    quant_bits: int | None = None
    quant_group: int | None = None
    hf_shards: int = 1
    description: str = ""


COMMON = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    num_experts=8,
    intermediate_size=192,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
)
# Re-draws until the draw is well conditioned: body seeds spec.seed, spec.seed+1, ...
# (routing decisive, residual stream balanced), then for an accepted body, head seeds
# seed*1000, seed*1000+1, ... (logit range and argmax margins).
MAX_ATTEMPTS = 200
MAX_HEAD_ATTEMPTS = 200
MIN_TOKENS, MAX_TOKENS = 20, 32  # each fixture's text encodes to this many tokens

SPECS = [
    Spec(
        name="qwen3_moe-bf16",
        layout="mlx",
        dtype="bfloat16",
        seed=1000,
        text="<|im_start|>user\nWhere does the river go at night, and why?<|im_end|>\n<|im_start|>assistant\n",
        head_dim=32,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        rope_theta=1e6,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        description="mlx-community layout (switch_mlp stacked experts), bf16 weights, "
        "top-2 of 8, norm_topk_prob=true, untied lm_head, rope_theta=1e6.",
    ),
    Spec(
        name="qwen3_moe-q4",
        layout="mlx",
        dtype="bfloat16",
        seed=2000,
        text="Alice asked why the old bridge was so quiet in 1999.",
        head_dim=48,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        rope_theta=10000.0,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        quant_bits=4,
        quant_group=64,
        description="mlx_lm convert -q: 4-bit affine, group 64, bf16 scales/biases; router "
        "mlp.gate 8-bit g64 (mlx-lm's qwen3_moe quant_predicate); embeddings and lm_head "
        "quantized; head_dim=48 != hidden/heads (q_proj out 192); top-3 of 8; rope_theta=1e4.",
    ),
    Spec(
        name="qwen3_moe-q8",
        layout="mlx",
        dtype="bfloat16",
        seed=3000,
        text='<tool_call>\n{"name": "add", "arguments": {"x": 2}}\n</tool_call><|im_end|>',
        head_dim=32,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        rope_theta=1e6,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        quant_bits=8,
        quant_group=32,
        description="mlx_lm convert -q --q-bits 8 --q-group-size 32, bf16 scales/biases; "
        "norm_topk_prob=false; tie_word_embeddings=true (no lm_head tensor: logits use the "
        "quantized embedding as a linear layer).",
    ),
    Spec(
        name="qwen3_moe-q4g128",
        layout="mlx",
        dtype="float16",
        seed=4000,
        text="<think>\nThe user wants the weather.\n</think>\n\nIt will rain today.<|im_end|>",
        head_dim=32,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        rope_theta=1e6,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        quant_bits=4,
        quant_group=128,
        description="mlx_lm convert -q --q-group-size 128 with float16 model dtype "
        "(f16 scales/biases); moe_intermediate_size=128.",
    ),
    Spec(
        name="qwen3_moe-hf",
        layout="hf",
        dtype="bfloat16",
        seed=5000,
        text="<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n",
        head_dim=48,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        rope_theta=10000.0,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        hf_shards=2,
        description="official Hugging Face layout (per-expert mlp.experts.E.*_proj, router "
        "mlp.gate), bf16, two safetensors shards + index; mlp_only_layers=[1] (layer 1 is a "
        "dense SwiGLU MLP of intermediate_size=192); head_dim=48; rope_theta=1e4.",
    ),
]


def hf_config(spec: Spec, tok: Tokenizer) -> dict:
    """config.json as the official Qwen3 MoE checkpoints ship it (transformers 4.51 style)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "decoder_sparse_step": spec.decoder_sparse_step,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": COMMON["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": COMMON["intermediate_size"],
        "max_position_embeddings": COMMON["max_position_embeddings"],
        "max_window_layers": COMMON["num_hidden_layers"],
        "mlp_only_layers": list(spec.mlp_only_layers),
        "model_type": "qwen3_moe",
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "num_attention_heads": COMMON["num_attention_heads"],
        "num_experts": COMMON["num_experts"],
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": COMMON["num_hidden_layers"],
        "num_key_value_heads": COMMON["num_key_value_heads"],
        "output_router_logits": False,
        "rms_norm_eps": COMMON["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": float(spec.rope_theta),
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def is_moe_layer(spec: Spec, i: int) -> bool:
    # Same rule as transformers' Qwen3MoeDecoderLayer and mlx-lm's qwen3_moe.
    return (i not in spec.mlp_only_layers) and (
        COMMON["num_experts"] > 0 and (i + 1) % spec.decoder_sparse_step == 0
    )


# --------------------------------------------------------------------------
# Random weights (official HF layout, float32 numpy; cast on save)
# --------------------------------------------------------------------------

# Init scales, tuned so that every sub-layer contributes a comparable update to
# the residual stream (update/stream RMS ~0.6-2), the stream is small like a real
# model's (RMS 0.02 -> ~0.075, so rms_norm_eps matters at the 1e-2 level),
# attention scores are moderately sharp (q/k norm weights 0.8-2.2), router logits
# have std ~2 (decisive routing), and logits have std ~1 with log-normal per-token
# row norms (sigma ROW_SCALE_SIGMA) in the output embedding.
EMBED_STD = 0.02
ROW_SCALE_SIGMA = 0.5
ATTN_OUT_GAIN = 0.02
MLP_OUT_GAIN = 0.03
ROUTER_GAIN = 2.0
LOGIT_GAIN = 1.0


def make_weights(spec: Spec, seed: int, head_seed: int) -> dict[str, np.ndarray]:
    """Random weights. `seed` draws the body (embeddings, layers); `head_seed` draws the
    output head (final norm, and lm_head when untied), which does not affect routing, so
    routing and logit conditioning can be searched for one after the other."""
    rng = np.random.default_rng(seed)
    H = COMMON["hidden_size"]
    nh, nkv, hd = COMMON["num_attention_heads"], COMMON["num_key_value_heads"], spec.head_dim
    E, I_moe, I_dense = COMMON["num_experts"], spec.moe_intermediate_size, COMMON["intermediate_size"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    def row_scales():
        # Log-normal per-token row norms (as in real output embeddings): heavier-tailed
        # logits, so the argmax is separated from the runner-up at every position.
        s = np.exp(rng.standard_normal((VOCAB_SIZE, 1)) * ROW_SCALE_SIGMA)
        return (s / np.sqrt(np.mean(s * s))).astype(np.float32)

    w = {}
    w["model.embed_tokens.weight"] = normal((VOCAB_SIZE, H), EMBED_STD)
    if spec.tie_word_embeddings:
        w["model.embed_tokens.weight"] *= row_scales()
    for i in range(COMMON["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        w[f"{p}.self_attn.q_proj.weight"] = normal((nh * hd, H), H**-0.5)
        w[f"{p}.self_attn.k_proj.weight"] = normal((nkv * hd, H), H**-0.5)
        w[f"{p}.self_attn.v_proj.weight"] = normal((nkv * hd, H), H**-0.5)
        w[f"{p}.self_attn.o_proj.weight"] = normal((H, nh * hd), ATTN_OUT_GAIN * (nh * hd) ** -0.5 * 2)
        w[f"{p}.self_attn.q_norm.weight"] = uniform((hd,), 0.8, 2.2)
        w[f"{p}.self_attn.k_norm.weight"] = uniform((hd,), 0.8, 2.2)
        w[f"{p}.post_attention_layernorm.weight"] = uniform((H,), 0.6, 1.4)
        if is_moe_layer(spec, i):
            w[f"{p}.mlp.gate.weight"] = normal((E, H), ROUTER_GAIN * H**-0.5)
            for e in range(E):
                q = f"{p}.mlp.experts.{e}"
                w[f"{q}.gate_proj.weight"] = normal((I_moe, H), H**-0.5)
                w[f"{q}.up_proj.weight"] = normal((I_moe, H), H**-0.5)
                w[f"{q}.down_proj.weight"] = normal((H, I_moe), MLP_OUT_GAIN * I_moe**-0.5 * 2)
        else:
            w[f"{p}.mlp.gate_proj.weight"] = normal((I_dense, H), H**-0.5)
            w[f"{p}.mlp.up_proj.weight"] = normal((I_dense, H), H**-0.5)
            w[f"{p}.mlp.down_proj.weight"] = normal((H, I_dense), MLP_OUT_GAIN * I_dense**-0.5 * 2)
    rng = np.random.default_rng(head_seed)
    if spec.tie_word_embeddings:
        # logits = E . norm(h): scale the final norm so that logits have std ~LOGIT_GAIN.
        w["model.norm.weight"] = uniform((H,), 0.6, 1.4) * (LOGIT_GAIN / (EMBED_STD * H**0.5))
    else:
        w["model.norm.weight"] = uniform((H,), 0.6, 1.4)
        w["lm_head.weight"] = normal((VOCAB_SIZE, H), LOGIT_GAIN * H**-0.5) * row_scales()
    return w


def save_hf_checkpoint(spec: Spec, weights: dict, out: Path, tok: Tokenizer, nshards: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dt = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[spec.dtype]
    arrays = {k: mx.array(v).astype(dt) for k, v in weights.items()}
    names = list(arrays)  # natural (model) order
    total = sum(a.nbytes for a in arrays.values())
    if nshards == 1:
        mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "pt"})
    else:
        # Split in model order at equal byte budgets (a layer may straddle shards,
        # as in real checkpoints).
        shards, cur, acc = [[] for _ in range(nshards)], 0, 0
        for k in names:
            if acc >= total * (cur + 1) / nshards and cur < nshards - 1:
                cur += 1
            shards[cur].append(k)
            acc += arrays[k].nbytes
        weight_map = {}
        for s, keys in enumerate(shards):
            fname = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
            mx.save_safetensors(str(out / fname), {k: arrays[k] for k in keys},
                                metadata={"format": "pt"})
            for k in keys:
                weight_map[k] = fname
        index = {"metadata": {"total_size": int(total)},
                 "weight_map": dict(sorted(weight_map.items()))}
        write_json(out / "model.safetensors.index.json", index)
    write_json(out / "config.json", hf_config(spec, tok))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_tokenizer_files(dst: Path, tok_files: dict[str, str]) -> None:
    for name, text in tok_files.items():
        (dst / name).write_text(text)


def build_fixture_dir(spec: Spec, seed: int, head_seed: int, dst: Path, tok: Tokenizer,
                      tok_files: dict) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    weights = make_weights(spec, seed, head_seed)
    if spec.layout == "hf":
        save_hf_checkpoint(spec, weights, dst, tok, spec.hf_shards)
        write_tokenizer_files(dst, tok_files)
        return
    with tempfile.TemporaryDirectory(prefix="sluice-src-") as tmp:
        src = Path(tmp) / "hf"
        save_hf_checkpoint(spec, weights, src, tok, 1)
        write_tokenizer_files(src, tok_files)
        kwargs = dict(hf_path=str(src), mlx_path=str(dst), dtype=spec.dtype)
        if spec.quant_bits is not None:
            kwargs.update(quantize=True, q_bits=spec.quant_bits, q_group_size=spec.quant_group)
        # This is exactly `mlx_lm convert --hf-path src --mlx-path dst [-q ...]`.
        with contextlib.redirect_stdout(io.StringIO()):
            mlx_convert.convert(**kwargs)
    # convert() also saves the tokenizer through transformers' save_pretrained and
    # writes a model card; replace those with the shared canonical tokenizer files.
    keep = {"config.json", "model.safetensors.index.json"}
    for f in dst.iterdir():
        if f.name not in keep and not (f.name.startswith("model") and f.suffix == ".safetensors"):
            f.unlink()
    write_tokenizer_files(dst, tok_files)


# --------------------------------------------------------------------------
# Reference computation with mlx-lm
# --------------------------------------------------------------------------

_ROUTER_LOG: list | None = None
_orig_moe_call = qwen3_moe.Qwen3MoeSparseMoeBlock.__call__


def _logging_moe_call(self, x):
    if _ROUTER_LOG is not None:
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        _ROUTER_LOG.append((getattr(self, "_fixture_layer", -1), np.array(probs.astype(mx.float32))))
    return _orig_moe_call(self, x)


qwen3_moe.Qwen3MoeSparseMoeBlock.__call__ = _logging_moe_call


def cast_f32(model: nn.Module) -> None:
    def f(p):
        return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(f, model.parameters()))
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, qwen3_moe.Qwen3MoeSparseMoeBlock):
            layer.mlp._fixture_layer = i


def prefill_logits(model, tokens) -> np.ndarray:
    out = model(mx.array([tokens], dtype=mx.int32))
    return np.array(out[0].astype(mx.float32))


def decode_logits(model, tokens) -> np.ndarray:
    cache = make_prompt_cache(model)
    rows = []
    for t in tokens:
        out = model(mx.array([[t]], dtype=mx.int32), cache=cache)
        mx.eval(out)
        rows.append(np.array(out[0, -1].astype(mx.float32)))
    return np.stack(rows)


def residual_stats(model, tokens):
    """RMS of the residual stream after each layer, and each layer's update ratio."""
    h = model.model.embed_tokens(mx.array([tokens], dtype=mx.int32))
    rms = [float(mx.sqrt(mx.mean(h * h)))]
    ratios = []
    for layer in model.model.layers:
        h2 = layer(h, "causal", None)
        upd = h2 - h
        ratios.append(float(mx.sqrt(mx.mean(upd * upd)) / mx.sqrt(mx.mean(h * h))))
        h = h2
        rms.append(float(mx.sqrt(mx.mean(h * h))))
    return rms, ratios


def router_analysis(log, k: int):
    """Minimum gap between the k-th and (k+1)-th router probability, and per-layer usage."""
    min_gap = float("inf")
    usage: dict[int, np.ndarray] = {}
    for layer, probs in log:
        p = probs.reshape(-1, probs.shape[-1])
        s = -np.sort(-p, axis=-1)
        gap = float(np.min(s[:, k - 1] - s[:, k]))
        min_gap = min(min_gap, gap)
        top = np.argsort(-p, axis=-1)[:, :k]
        u = usage.setdefault(layer, np.zeros(p.shape[-1], dtype=np.int64))
        u += np.bincount(top.reshape(-1), minlength=p.shape[-1])
    return min_gap, usage


def margins(logits: np.ndarray) -> np.ndarray:
    s = -np.sort(-logits, axis=-1)
    return s[:, 0] - s[:, 1]


def load_f32(path: Path, model_config=None):
    model, _ = mlx_load_model(path, model_config=model_config)
    cast_f32(model)
    return model


def evaluate(spec: Spec, path: Path, tok: Tokenizer):
    global _ROUTER_LOG
    model, hf_tok = mlx_load(str(path))
    ids = tok.encode(spec.text).ids
    ids_hf = hf_tok.encode(spec.text)
    if ids != ids_hf:
        raise RuntimeError(f"tokenizers vs transformers encode mismatch: {ids} vs {ids_hf}")
    if not (MIN_TOKENS <= len(ids) <= MAX_TOKENS):
        raise RuntimeError(f"text of {spec.name} encodes to {len(ids)} tokens")
    tokens = ids
    cast_f32(model)
    for _, p in tree_flatten(model.parameters()):
        assert p.dtype in (mx.float32, mx.uint32), p.dtype

    _ROUTER_LOG = []
    pre = prefill_logits(model, tokens)
    pre_log = _ROUTER_LOG
    _ROUTER_LOG = []
    dec = decode_logits(model, tokens)
    dec_log = _ROUTER_LOG
    _ROUTER_LOG = None

    k = spec.num_experts_per_tok
    gap_pre, usage = router_analysis(pre_log, k)
    gap_dec, _ = router_analysis(dec_log, k)
    rms, ratios = residual_stats(model, tokens)
    m = dict(
        tokens=tokens,
        prefill=pre,
        decode=dec,
        max_abs_logit=float(np.max(np.abs(pre))),
        logit_std=float(np.std(pre)),
        min_margin=float(min(margins(pre).min(), margins(dec).min())),
        min_gap=float(min(gap_pre, gap_dec)),
        usage={int(l): u.tolist() for l, u in sorted(usage.items())},
        dec_vs_pre=float(np.max(np.abs(dec - pre))),
        rms=rms,
        ratios=ratios,
        argmax=[int(a) for a in pre.argmax(-1)],
    )
    return m


def well_conditioned(m) -> tuple[list[str], list[str]]:
    """(problems of the body draw, problems of the head draw)."""
    body, head = [], []
    mx_abs = m["max_abs_logit"]
    if not (2.0 <= mx_abs <= 12.0):
        head.append(f"max|logit|={mx_abs:.3f} outside [2, 12]")
    if m["min_margin"] <= 0.01 * mx_abs:
        head.append(f"argmax margin {m['min_margin']:.4g} <= 1% of max|logit|")
    if m["min_gap"] is not None and m["min_gap"] <= 1e-3:
        body.append(f"routing gap {m['min_gap']:.3g} <= 1e-3")
    for l, u in m["usage"].items():
        if sum(1 for c in u if c > 0) < 5:
            body.append(f"layer {l} uses fewer than 5 experts: {u}")
    for r in m["ratios"]:
        if not (0.2 <= r <= 5.0):
            body.append(f"residual update ratio {r:.3f} outside [0.2, 5]")
    if m["dec_vs_pre"] > 1e-4 * mx_abs:
        body.append(f"decode vs prefill differ by {m['dec_vs_pre']:.3g}")
    return body, head


# --------------------------------------------------------------------------
# Sensitivity checks (printed only)
# --------------------------------------------------------------------------


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def sensitivity(spec: Spec, path: Path, tokens, ref: np.ndarray) -> list[tuple[str, float]]:
    global _ROUTER_LOG
    _ROUTER_LOG = None
    out = []
    cfg_perturb = [
        ("rope_theta x2", {"rope_theta": spec.rope_theta * 2}),
        ("rope_theta 1e6<->1e4", {"rope_theta": 1e4 if spec.rope_theta != 1e4 else 1e6}),
        ("rms_norm_eps x10 (1e-5)", {"rms_norm_eps": 1e-5}),
        ("rms_norm_eps /10 (1e-7)", {"rms_norm_eps": 1e-7}),
        ("norm_topk_prob flipped", {"norm_topk_prob": not spec.norm_topk_prob}),
        ("num_experts_per_tok +1", {"num_experts_per_tok": spec.num_experts_per_tok + 1}),
    ]
    for label, over in cfg_perturb:
        model = load_f32(path, over)
        out.append((label, _rel(prefill_logits(model, tokens), ref)))

    # Module-level perturbations of the loaded model.
    def patched(label, fn):
        model = load_f32(path)
        fn(model)
        out.append((label, _rel(prefill_logits(model, tokens), ref)))

    def trad_rope(model):
        for layer in model.model.layers:
            a = layer.self_attn
            a.rope = nn.RoPE(spec.head_dim, traditional=True, base=spec.rope_theta)

    def no_qk_norm(model):
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_norm.weight = mx.ones_like(a.q_norm.weight)
            a.k_norm.weight = mx.ones_like(a.k_norm.weight)

    def wrong_scale(model):
        for layer in model.model.layers:
            layer.self_attn.scale = (COMMON["hidden_size"] // COMMON["num_attention_heads"]) ** -0.5

    patched("RoPE traditional (interleaved pairs)", trad_rope)
    patched("q_norm/k_norm weights ignored", no_qk_norm)
    if spec.head_dim != COMMON["hidden_size"] // COMMON["num_attention_heads"]:
        patched("attn scale 1/sqrt(hidden/heads)", wrong_scale)

    # GQA head mapping: q head h uses kv head h % n_kv (tile) instead of h // (n_q/n_kv).
    orig_sdpa = qwen3_moe.scaled_dot_product_attention

    def tiled_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        rep = queries.shape[1] // keys.shape[1]
        keys = mx.tile(keys, (1, rep, 1, 1))
        values = mx.tile(values, (1, rep, 1, 1))
        return orig_sdpa(queries, keys, values, cache=None, scale=scale, mask=mask)

    qwen3_moe.scaled_dot_product_attention = tiled_sdpa
    try:
        model = load_f32(path)
        out.append(("GQA kv-head mapping h % n_kv", _rel(prefill_logits(model, tokens), ref)))
    finally:
        qwen3_moe.scaled_dot_product_attention = orig_sdpa

    # SwiGLU operand order swapped: silu(up) * gate.
    from mlx_lm.models import switch_layers

    orig_act = switch_layers.SwiGLU.__call__
    orig_mlp = qwen3_moe.MLP.__call__
    switch_layers.SwiGLU.__call__ = lambda self, x, gate: nn.silu(x) * gate
    qwen3_moe.MLP.__call__ = lambda self, x: self.down_proj(nn.silu(self.up_proj(x)) * self.gate_proj(x))
    try:
        model = load_f32(path)
        out.append(("SwiGLU silu(up)*gate", _rel(prefill_logits(model, tokens), ref)))
    finally:
        switch_layers.SwiGLU.__call__ = orig_act
        qwen3_moe.MLP.__call__ = orig_mlp
    return out


# --------------------------------------------------------------------------
# Packing check (documents the on-disk affine format for the Rust side)
# --------------------------------------------------------------------------


def check_packing(path: Path, config: dict) -> str | None:
    q = config.get("quantization")
    if not q:
        return None
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    checked = 0
    for name in sorted(weights):
        if not name.endswith(".scales"):
            continue
        base = name[: -len(".scales")]
        per = q.get(base, {})
        bits = per.get("bits", q["bits"])
        gs = per.get("group_size", q["group_size"])
        wq = np.array(weights[base + ".weight"])
        scales = np.array(weights[name].astype(mx.float32))
        biases = np.array(weights[base + ".biases"].astype(mx.float32))
        # Unpack: little-endian within each uint32, element j in bits [bits*j, bits*(j+1)).
        per_word = 32 // bits
        shifts = (np.arange(per_word, dtype=np.uint32) * bits)
        vals = (wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        vals = vals.reshape(*wq.shape[:-1], wq.shape[-1] * per_word).astype(np.float32)
        g = vals.reshape(*vals.shape[:-1], -1, gs)
        deq = (g * scales[..., None] + biases[..., None]).reshape(vals.shape)
        ref = np.array(
            mx.dequantize(weights[base + ".weight"], weights[name].astype(mx.float32),
                          weights[base + ".biases"].astype(mx.float32), gs, bits)
        )
        if not np.array_equal(deq, ref):
            raise RuntimeError(f"packing check failed for {base}")
        checked += 1
    return f"{checked} quantized tensors unpack exactly as w = q*scale + bias (LSB-first)"


# --------------------------------------------------------------------------
# Independent float64 numpy forward pass (documents the math; cross-checks mlx-lm)
# --------------------------------------------------------------------------


def load_dequantized_f64(path: Path, config: dict) -> dict[str, np.ndarray]:
    """All tensors of the directory as float64, affine-quantized ones dequantized."""
    raw = {}
    for f in sorted(path.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    q = config.get("quantization") or {}
    out = {}
    for name, arr in raw.items():
        if name.endswith(".scales") or name.endswith(".biases"):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in raw:
            per = q.get(base, {}) if isinstance(q.get(base), dict) else {}
            gs = per.get("group_size", q["group_size"])
            scales = np.array(raw[f"{base}.scales"].astype(mx.float32)).astype(np.float64)
            biases = np.array(raw[f"{base}.biases"].astype(mx.float32)).astype(np.float64)
            wq = np.array(arr)
            in_dims = scales.shape[-1] * gs
            bits = wq.shape[-1] * 32 // in_dims
            assert bits == per.get("bits", q["bits"]), (name, bits)
            per_word = 32 // bits
            shifts = np.arange(per_word, dtype=np.uint32) * bits
            vals = ((wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.float64)
            vals = vals.reshape(*wq.shape[:-1], in_dims // gs, gs)
            out[name] = (vals * scales[..., None] + biases[..., None]).reshape(*wq.shape[:-1], in_dims)
        else:
            out[name] = np.array(arr.astype(mx.float32)).astype(np.float64)
    return out


def numpy_forward(path: Path, tokens: list[int]) -> np.ndarray:
    """Qwen3-MoE forward in float64 numpy, written from the math (not from mlx ops)."""
    c = json.loads((path / "config.json").read_text())
    w = load_dequantized_f64(path, c)
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, theta, k = c["rms_norm_eps"], c["rope_theta"], c["num_experts_per_tok"]
    T = len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def rope(x):  # x [T, heads, hd]; "rotate half" (GPT-NeoX) pairing: (i, i + hd/2)
        half = hd // 2
        inv = theta ** (-np.arange(0, half, dtype=np.float64) * 2.0 / hd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    h = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x = rms(h, w[f"{p}.input_layernorm.weight"])
        qh = (x @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, nh, hd)
        kh = (x @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
        vh = (x @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        qh = rope(rms(qh, w[f"{p}.self_attn.q_norm.weight"]))
        kh = rope(rms(kh, w[f"{p}.self_attn.k_norm.weight"]))
        rep = nh // nkv
        att = np.zeros((T, nh, hd))
        causal = np.tril(np.ones((T, T), dtype=bool))
        for hh in range(nh):
            kv = hh // rep  # q heads [kv*rep, (kv+1)*rep) share kv head kv
            sc = (qh[:, hh] @ kh[:, kv].T) / np.sqrt(hd)
            sc = np.where(causal, sc, -np.inf)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ vh[:, kv]
        h = h + att.reshape(T, nh * hd) @ w[f"{p}.self_attn.o_proj.weight"].T
        x = rms(h, w[f"{p}.post_attention_layernorm.weight"])
        if f"{p}.mlp.gate.weight" in w:
            logits = x @ w[f"{p}.mlp.gate.weight"].T
            pr = np.exp(logits - logits.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            y = np.zeros_like(h)
            for t in range(T):
                top = np.argsort(-pr[t])[:k]
                sc = pr[t, top]
                if c["norm_topk_prob"]:
                    sc = sc / sc.sum()
                for e, s_ in zip(top, sc):
                    if f"{p}.mlp.switch_mlp.gate_proj.weight" in w:  # mlx layout [E, out, in]
                        g_ = w[f"{p}.mlp.switch_mlp.gate_proj.weight"][e]
                        u_ = w[f"{p}.mlp.switch_mlp.up_proj.weight"][e]
                        d_ = w[f"{p}.mlp.switch_mlp.down_proj.weight"][e]
                    else:  # official HF layout
                        g_ = w[f"{p}.mlp.experts.{e}.gate_proj.weight"]
                        u_ = w[f"{p}.mlp.experts.{e}.up_proj.weight"]
                        d_ = w[f"{p}.mlp.experts.{e}.down_proj.weight"]
                    y[t] += s_ * (d_ @ (silu(g_ @ x[t]) * (u_ @ x[t])))
        else:
            y = (silu(x @ w[f"{p}.mlp.gate_proj.weight"].T) * (x @ w[f"{p}.mlp.up_proj.weight"].T)) \
                @ w[f"{p}.mlp.down_proj.weight"].T
        h = h + y
    h = rms(h, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def versions() -> dict:
    v = {"mlx": mx.__version__, "mlx_lm": getattr(mlx_lm, "__version__", None),
         "tokenizers": tokenizers.__version__, "numpy": np.__version__}
    if _pkg_version is not None:
        for pkg in ("mlx", "mlx-lm", "transformers", "safetensors"):
            with contextlib.suppress(Exception):
                v[pkg.replace("-", "_")] = _pkg_version(pkg)
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", help="fixture names to (re)build")
    ap.add_argument("--no-sensitivity", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true", help="print rejected draws")
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    mx.set_default_device(mx.cpu)  # the reference is the CPU float32 path
    ver = versions()
    print(f"versions: {json.dumps(ver)}")

    tok = train_tokenizer()
    tok_files = {
        "tokenizer.json": tokenizer_json_text(tok),
        "tokenizer_config.json": json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False) + "\n",
        "generation_config.json": json.dumps(generation_config(tok), indent=2) + "\n",
    }
    print(f"tokenizer: vocab {tok.get_vocab_size()} (BPE {BPE_VOCAB} + {len(SPECIAL_TOKENS)} added); "
          + ", ".join(f"{c}={tok.token_to_id(c)}" for c, _ in SPECIAL_TOKENS))

    summary = []
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        dst = out / spec.name
        found = False
        for attempt in range(MAX_ATTEMPTS):
            seed = spec.seed + attempt
            for h in range(MAX_HEAD_ATTEMPTS):
                head_seed = seed * 1000 + h
                build_fixture_dir(spec, seed, head_seed, dst, tok, tok_files)
                m = evaluate(spec, dst, tok)
                bad_body, bad_head = well_conditioned(m)
                if not bad_body and not bad_head:
                    found = True
                    break
                if args.verbose:
                    print(f"[{spec.name}] seeds {seed}/{head_seed} rejected: "
                          + "; ".join(bad_body + bad_head))
                if bad_body:
                    break  # re-draw the body
            if found:
                break
        if not found:
            raise RuntimeError(f"{spec.name}: no well-conditioned draw found")

        config = json.loads((dst / "config.json").read_text())
        pack = check_packing(dst, config)
        np_logits = numpy_forward(dst, m["tokens"])
        np_rel = float(np.max(np.abs(np_logits - m["prefill"])) / m["max_abs_logit"])
        if np_rel > 1e-4:
            raise RuntimeError(f"{spec.name}: numpy float64 forward disagrees with mlx-lm: {np_rel:.3g}")
        np.save(dst / "logits_decode.npy", m["decode"].astype("<f4"))
        np.save(dst / "logits_prefill.npy", m["prefill"].astype("<f4"))
        notes = (
            f"{spec.description} Weights drawn with numpy default_rng(seed={seed}) (output head: "
            f"default_rng({head_seed})) in float32, "
            f"then cast to {spec.dtype}"
            + (" and converted by mlx_lm.convert" if spec.layout == "mlx" else "")
            + ". tokens = tokenizer.json encode(text) (no BOS; special tokens in the text are "
            "matched as added tokens). Reference logits: "
            "mlx_lm.load(dir), every floating parameter (weights, norms, quantization scales/biases) "
            "cast to float32, then (decode) one token per call through mlx_lm's KVCache, "
            "(prefill) all tokens in a single call with a causal mask. Shape [T, vocab], float32 "
            "little-endian. Tolerance meant: max|ours - ref| <= 1e-3 * max|ref|."
        )
        ref = {
            "fixture": spec.name,
            "text": spec.text,
            "tokens": m["tokens"],
            "num_tokens": len(m["tokens"]),
            "vocab_size": VOCAB_SIZE,
            "seed": seed,
            "head_seed": head_seed,
            "mlx_version": ver["mlx"],
            "mlx_lm_version": ver["mlx_lm"],
            "tokenizers_version": ver["tokenizers"],
            "max_abs_logit": m["max_abs_logit"],
            "min_argmax_margin": m["min_margin"],
            "min_routing_gap": m["min_gap"],
            "max_abs_decode_vs_prefill": m["dec_vs_pre"],
            "max_rel_numpy_f64_vs_prefill": np_rel,
            "argmax_prefill": m["argmax"],
            "expert_usage_prefill": {str(k): v for k, v in m["usage"].items()},
            "residual_rms_per_layer": [round(x, 6) for x in m["rms"]],
            "notes": notes,
        }
        write_json(dst / "reference.json", ref, compact_lists=True)

        print(f"\n== {spec.name} (seed {seed}, head seed {head_seed}) ==")
        print(f"  tokens ({len(m['tokens'])}): {m['tokens']}")
        print(f"  max|logit| {m['max_abs_logit']:.4f}  logit std {m['logit_std']:.4f}  "
              f"min margin {m['min_margin']:.4f}  min routing gap {m['min_gap']:.4f}  "
              f"decode-vs-prefill {m['dec_vs_pre']:.3g}")
        print("  residual RMS (embed, after each layer): "
              + ", ".join(f"{x:.4g}" for x in m["rms"])
              + "; layer update/stream ratios: " + ", ".join(f"{x:.3f}" for x in m["ratios"]))
        for l, u in m["usage"].items():
            print(f"  layer {l} expert usage (top-{spec.num_experts_per_tok} picks over "
                  f"{len(m['tokens'])} tokens): {u}")
        if pack:
            print(f"  packing: {pack}")
        print(f"  independent numpy float64 forward vs mlx-lm prefill: max|diff|/max|ref| = {np_rel:.3g}")
        if not args.no_sensitivity:
            print("  sensitivity (max|d logits| / max|ref|, must be >> 1e-3):")
            for label, r in sensitivity(spec, dst, m["tokens"], m["prefill"]):
                flag = "" if r > 1e-2 else "   (< 10x the 1e-3 tolerance)"
                print(f"    {label:40s} {r:.4f}{flag}")

        files = sorted(f for f in dst.iterdir() if f.is_file())
        nbytes = sum(f.stat().st_size for f in files)
        summary.append((spec.name, len(files), nbytes, m["max_abs_logit"], m["min_margin"],
                        m["min_gap"], m["dec_vs_pre"], np_rel))

    print("\nSummary")
    hdr = f"{'fixture':18s} {'files':>5s} {'bytes':>9s} {'max|logit|':>10s} {'min margin':>10s} " \
          f"{'min gap':>9s} {'dec-vs-pre':>10s} {'np64 rel':>9s}"
    print(hdr)
    print("-" * len(hdr))
    for name, nf, nb, ml, mm, mg, dp, nr in summary:
        print(f"{name:18s} {nf:5d} {nb:9d} {ml:10.4f} {mm:10.4f} {mg:9.4f} {dp:10.2e} {nr:9.2e}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"total bytes under {out}: {total}")
    digest = hashlib.sha256()
    for f in sorted(out.rglob("*")):
        if f.is_file() and f.name != "README.md":
            digest.update(str(f.relative_to(out)).encode())
            digest.update(f.read_bytes())
    print(f"sha256 of all fixture files (README excluded): {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
