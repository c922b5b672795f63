#!/usr/bin/env bash
# The GPU checks a change to the CUDA backend must pass, on a machine without Rust (the lent GPU
# machine), from the bundle scripts/cuda/device_bundle.sh makes. From the repository root there:
#   bash scripts/cuda/device_check.sh [.device/bundle.tar.xz]
# Runs the backend conformance suite, the reference-logit suite and the fast-prefill suite on CUDA
# device 0, then the demo model's greedy text with the exact kernels on the CPU and the GPU (two
# prompts, and with experts streamed through a 4 MiB cache), which must be identical. Prints one
# line per check and exits non-zero if any failed.
set -uo pipefail
bundle="${1:-.device/bundle.tar.xz}"
[ -f "$bundle" ] || { echo "error: no bundle at $bundle (make it with scripts/cuda/device_bundle.sh)" >&2; exit 2; }
[ -f models/demo/config.json ] || { echo "error: run this from the repository root" >&2; exit 2; }
bin="$(mktemp -d)"
trap 'rm -rf "$bin"' EXIT
tar -xJf "$bundle" -C "$bin"
export SLUICE_REPO="$PWD"
failed=0
suite() { # name: the test binary; prints cargo's summary line
    local out
    out=$("$bin/$1" --ignored 2>&1)
    local summary; summary=$(grep -E "^test result" <<<"$out" | tail -1)
    if grep -q "^test result: ok" <<<"$summary"; then
        echo "$1: $summary"
    else
        echo "$1: FAILED"; grep -E -A1 "panicked" <<<"$out" | head -6; failed=1
    fi
}
suite conformance
suite reference_logits
suite fast_prefill
same() { # label, generate arguments...
    local label=$1; shift
    local cpu cuda
    # The CPU's exact kernels: its default fast ones quantize activations, and their greedy
    # text may part from the exact computation after a few tokens.
    cpu=$("$bin/sluice" generate --device cpu --kernels exact "$@" 2>/dev/null)
    # The GPU's exact kernels too: its default fast prefill quantizes activations (tested
    # against the exact path by the fast_prefill suite).
    cuda=$("$bin/sluice" generate --device cuda --kernels exact "$@" 2>/dev/null)
    if [ -n "$cpu" ] && [ "$cpu" = "$cuda" ]; then
        echo "demo greedy, $label: cpu == cuda"
    else
        printf 'demo greedy, %s: DIFFERS\n  cpu:  %s\n  cuda: %s\n' "$label" "$cpu" "$cuda"; failed=1
    fi
}
same "short prompt" --prompt "Once upon a time" -n 48 --temperature 0
same "long prompt" --prompt "The river flows past the old mill and the miller's daughter walks to" -n 48 --temperature 0
same "experts streamed (4 MiB cache)" --prompt "Once upon a time" -n 48 --temperature 0 --expert-cache 4MiB
exit $failed
