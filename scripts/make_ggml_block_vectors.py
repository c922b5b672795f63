#!/usr/bin/env python3
"""Test vectors for sluice-format's port of ggml's dequantisers (src/ggml_quants.rs): random
blocks of each ggml type and their values as gguf-py's numpy dequantisers compute them, an
implementation independent of ggml's C (and of the Rust port).

    target/tmp/gguf-venv/bin/python scripts/make_ggml_block_vectors.py

Needs gguf==0.19.0 and numpy (2.4.6 was used). Writes
crates/sluice-format/tests/data/ggml_blocks/<TYPE>.bin: the raw blocks, then their values as
little-endian f32 (so blocks = file size / (block bytes + 4 * block values)). Quant bytes are
random; the f16 fields (d, dmin / m) are random finite values, often specials (signed zeros,
subnormals, +-65504). Deterministic: a fixed seed through splitmix64, no numpy randomness.
"""
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "sluice-format",
                   "tests", "data", "ggml_blocks")

# Type, byte offsets of its f16 fields, blocks to write.
TYPES = [
    ("Q4_0", [0], 16), ("Q4_1", [0, 2], 16), ("Q5_0", [0], 16), ("Q5_1", [0, 2], 16),
    ("Q8_0", [0], 16), ("Q2_K", [80, 82], 6), ("Q3_K", [108], 6), ("Q4_K", [0, 2], 6),
    ("Q5_K", [0, 2], 6), ("Q6_K", [208], 6), ("F16", [], 256), ("BF16", [], 256),
    ("IQ4_NL", [0], 16), ("IQ4_XS", [0], 6), ("MXFP4", [], 16),
]
SPECIAL = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xB800]
M64 = (1 << 64) - 1


class Rng:
    """splitmix64."""

    def __init__(self, seed):
        self.s = seed

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def finite(self, exp_mask):
        """Random 16 bits whose exponent field (exp_mask) is not all ones."""
        while True:
            b = self.next() & 0xFFFF
            if b & exp_mask != exp_mask:
                return b

    def f16(self):
        r = self.next()
        return SPECIAL[(r >> 8) % len(SPECIAL)] if r % 4 == 0 else self.finite(0x7C00)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = Rng(20240611)
    total = 0
    for name, fields, blocks in TYPES:
        qtype = T[name]
        be, bb = GGML_QUANT_SIZES[qtype]
        if name == "F16":
            raw = b"".join(rng.finite(0x7C00).to_bytes(2, "little") for _ in range(blocks))
        elif name == "BF16":
            raw = b"".join(rng.finite(0x7F80).to_bytes(2, "little") for _ in range(blocks))
        else:
            raw = bytearray(rng.next() & 0xFF for _ in range(blocks * bb))
            for b in range(blocks):
                for at in fields:
                    raw[b * bb + at:b * bb + at + 2] = rng.f16().to_bytes(2, "little")
                if name == "MXFP4":
                    # E8M0 scale 2^(e - 128): the extremes, else below where 12 * 2^(e - 128)
                    # overflows f32.
                    raw[b * bb] = [0, 1, 2, 250][b] if b < 4 else rng.next() % 251
            raw = bytes(raw)
        data = np.frombuffer(raw, dtype=np.uint8).reshape(blocks, bb)
        values = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(-1)
        assert values.size == blocks * be and values.dtype == np.float32, name
        out = raw + values.astype("<f4").tobytes()
        with open(os.path.join(OUT, f"{name}.bin"), "wb") as f:
            f.write(out)
        total += len(out)
        print(f"{name}: {blocks} blocks, {len(out)} bytes")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
