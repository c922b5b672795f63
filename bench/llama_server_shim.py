#!/usr/bin/env python3
"""Starts `sluice serve` from llama-server's command line, so that llama.cpp's own server test
suite (tools/server/tests in the llama.cpp source) can run against sluice: its
`LLAMA_SERVER_BIN_PATH` points here (bench/llama_server_suite.sh does that).

Taken from llama-server's arguments: --host, --port, --alias (the model id), --api-key,
--cors-origins, --parallel, --n-predict (as --max-tokens-limit is not the same thing, it is
ignored). The model is $SLUICE_MODEL (default: the bundled demo model); the sluice binary is
$SLUICE_BIN (default: target/release/sluice). Everything else (the test's own model, sampling
and cache flags) is ignored: the suite's tests that expect llama.cpp's models or features fail,
and bench/llama_server_suite.sh reports why.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TAKES_VALUE = {
    "--port", "--host", "--alias", "--api-key", "--cors-origins", "--parallel", "--temp",
    "--seed", "--model", "--model-url", "--model-draft", "--hf-repo", "--hf-file", "--models-dir",
    "--models-max", "--models-preset", "--batch-size", "--ubatch-size", "--threads",
    "--n-gpu-layers", "--pooling", "--tags", "--ctx-size", "-ctk", "-ctv", "-fa", "--n-predict",
    "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type",
    "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates",
    "--reasoning-format", "--reasoning", "--chat-template", "--chat-template-file", "--mmproj-url",
    "--media-path", "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime",
    "--mcp-servers-config", "--mcp-servers-json", "--draft-max", "--draft-min", "--n-probs",
    "--keep", "--cache-reuse", "--rope-scaling", "--rope-freq-base",
}


def main():
    args = sys.argv[1:]
    opts, i = {}, 0
    while i < len(args):
        a = args[i]
        if a in TAKES_VALUE and i + 1 < len(args):
            opts[a] = args[i + 1]
            i += 2
        else:
            i += 1
    cmd = [
        os.environ.get("SLUICE_BIN", os.path.join(ROOT, "target", "release", "sluice")),
        "serve",
        "--model", os.environ.get("SLUICE_MODEL", os.path.join(ROOT, "models", "demo")),
        "--host", opts.get("--host", "127.0.0.1"),
        "--port", opts.get("--port", "8080"),
    ]
    if "--alias" in opts:
        cmd += ["--served-model-name", opts["--alias"]]
    if "--api-key" in opts:
        cmd += ["--api-key", opts["--api-key"]]
    if "--parallel" in opts:
        cmd += ["--parallel", opts["--parallel"]]
    for origin in opts.get("--cors-origins", "").split(","):
        if origin.strip():
            cmd += ["--cors-origin", origin.strip()]
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
