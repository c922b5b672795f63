#!/usr/bin/env bash
# Builds what a run on a machine without Rust needs (the lent GPU machine): the release `sluice`
# binary, the CUDA backend's test binaries and its bench example, stripped, in
# .device/bundle.tar.xz (.device/ is ignored by git). There:
#   mkdir -p /tmp/s && tar -xJf .device/bundle.tar.xz -C /tmp/s
#   SLUICE_REPO=$PWD /tmp/s/conformance --ignored; /tmp/s/sluice bench --device cuda ...
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device
rm -rf "$out/stage" && mkdir -p "$out/stage"
cargo build --release -p sluice-cli
cargo build --release -p sluice-cuda --example gpu_bench
cp target/release/sluice target/release/examples/gpu_bench "$out/stage/"
# The test binaries of sluice-cuda, by name (cargo prints their paths as JSON).
cargo test --release -p sluice-cuda --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"] \
            and m["package_id"].split("#")[0].endswith("sluice-cuda"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
' "$out/stage"
strip "$out"/stage/*
tar -cJf "$out/bundle.tar.xz" -C "$out/stage" .
rm -rf "$out/stage"
ls -la "$out/bundle.tar.xz"
