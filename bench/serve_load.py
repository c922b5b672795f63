#!/usr/bin/env python3
"""Concurrent streaming clients against `sluice serve` (or any OpenAI-compatible server).

For each client count (default 1, 2, 4, 8, 16) every client sends --requests streaming
/v1/completions requests one after another (different prompts, --max-tokens each, ignore_eos so
every answer has the same length), over plain HTTP on loopback. Reports aggregate generated
tok/s, time to first token and inter-token latency (p50/p99), errors (must be 0) and whether every
stream was complete and well formed (a role-less text chunk per token, one finish_reason, usage,
then [DONE]). With --sluice and --model it starts the server itself (--parallel as given) and also
reads the expert bytes the server read per generated token from /metrics.

    bench/serve_load.py --sluice target/release/sluice --model models/demo --clients 1,2,4,8,16
    bench/serve_load.py --base-url http://127.0.0.1:8080 --clients 1,8
"""

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "Once upon a time",
    "The weather in Paris today is",
    "Write a short poem about the sea:",
    "The three most important things in life are",
    "In a small village at the edge of the forest",
    "Here is a recipe for bread:",
    "The history of the bridge begins",
    "Dear diary, today I",
]


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metrics(base):
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("sluice_"):
            name, value = line.split()[:2]
            out[name[len("sluice_"):]] = float(value)
    return out


def one_request(base, prompt, max_tokens, headers):
    """Streams one completion; returns (ttft, gaps, tokens, problem or None)."""
    u = urllib.parse.urlparse(base)
    body = json.dumps({
        "model": "any", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    })
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    start = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **headers})
    r = c.getresponse()
    if r.status != 200:
        return None, [], 0, f"HTTP {r.status}: {r.read()[:200]!r}"
    times, finishes, usage, done = [], [], None, False
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                times.append(time.perf_counter())
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    c.close()
    tokens = usage["completion_tokens"] if usage else 0
    problem = None
    if not done or len(finishes) != 1 or usage is None or tokens != max_tokens:
        problem = f"incomplete stream: done={done} finishes={finishes} usage={usage}"
    ttft = times[0] - start if times else None
    gaps = [b - a for a, b in zip(times, times[1:])]
    return ttft, gaps, tokens, problem


def run_level(base, clients, requests, max_tokens, headers):
    ttfts, gaps, problems, tokens = [], [], [], [0]
    lock = threading.Lock()

    def client(i):
        for r in range(requests):
            prompt = PROMPTS[(i * requests + r) % len(PROMPTS)] + f" (#{i}.{r})"
            try:
                t, g, n, p = one_request(base, prompt, max_tokens, headers)
            except Exception as e:  # counted as an error
                t, g, n, p = None, [], 0, repr(e)
            with lock:
                if t is not None:
                    ttfts.append(t)
                gaps.extend(g)
                tokens[0] += n
                if p:
                    problems.append(p)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return tokens[0], wall, ttfts, gaps, problems


def start_server(sluice, model, parallel, extra):
    cmd = [sluice, "serve", "--model", model, "--port", "0"] + extra
    if parallel:
        cmd += ["--parallel", str(parallel)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        sys.stderr.write("[server] " + line)
        if "at http://" in line:
            addr = line.split("at http://")[1].split()[0].split("/")[0]
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, f"http://{addr}"
    raise SystemExit("the server did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server (default: start one with --sluice/--model)")
    ap.add_argument("--sluice", help="the sluice binary to start")
    ap.add_argument("--model", help="model for the started server")
    ap.add_argument("--parallel", type=int, help="--parallel for the started server (default: its own)")
    ap.add_argument("--server-arg", action="append", default=[], help="more arguments for the started server")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key")
    args = ap.parse_args()
    proc = None
    if args.base_url:
        base = args.base_url.rstrip("/").removesuffix("/v1")
    elif args.sluice and args.model:
        proc, base = start_server(args.sluice, args.model, args.parallel, args.server_arg)
    else:
        ap.error("give --base-url, or --sluice and --model")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        one_request(base, "warm up", 4, headers)
        print("| clients | requests | gen tok/s | vs 1 client | TTFT p50 / p99 s | ITL p50 / p99 ms | errors | streams complete | expert MB read / gen token |")
        print("|---|---|---|---|---|---|---|---|---|")
        first = None
        failed = False
        for c in [int(x) for x in args.clients.split(",")]:
            before = metrics(base)
            tokens, wall, ttfts, gaps, problems = run_level(base, c, args.requests, args.max_tokens, headers)
            after = metrics(base)
            rate = tokens / wall
            first = first or rate
            read = after.get("expert_read_bytes_total", 0) - before.get("expert_read_bytes_total", 0)
            per_tok = f"{read / max(tokens, 1) / 1e6:.2f}" if "expert_read_bytes_total" in after else "-"
            n = c * args.requests
            print(f"| {c} | {n} | {rate:.1f} | {rate / first:.2f}x | {percentile(ttfts, 50):.3f} / {percentile(ttfts, 99):.3f} "
                  f"| {percentile(gaps, 50) * 1e3:.1f} / {percentile(gaps, 99) * 1e3:.1f} | {len(problems)} "
                  f"| {n - len(problems)}/{n} | {per_tok} |", flush=True)
            for p in problems[:3]:
                print(f"    {p}", file=sys.stderr)
            failed |= bool(problems)
        sys.exit(1 if failed else 0)
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
