#!/usr/bin/env python3
"""Soak test: many clients against `sluice serve` for a set time, every reply checked.

N client threads (loopback only) send requests one after another until --duration runs out (or
--max-requests in all): chat completions and completions, streaming and not, prompts of random
length, random max_tokens, and a share of streams cancelled part way (the socket closed after a
random number of chunks). Every reply that is not cancelled is checked:
  - HTTP 200 and well-formed JSON (or SSE: `data:` lines of JSON, then `data: [DONE]`);
  - exactly one finish_reason ("stop" or "length"), text for every content chunk;
  - usage: prompt_tokens > 0, completion_tokens <= max_tokens, total = prompt + completion, and
    finish_reason "length" exactly when completion_tokens == max_tokens (or the context ended).
After each cancellation the next request on that client must still succeed. Every --sample
seconds the server's resident memory (VmRSS) and open file descriptors are read from /proc; after
--warmup seconds the figures must stay flat: the largest value of the last quarter within --flat
(5%) of the largest of the first quarter after warm-up (descriptors: plus the clients' sockets).

With --sluice and --model it starts the server itself (more arguments with --server-arg) and
stops it with SIGTERM at the end (it must exit 0). Exits 1 on any error, malformed or lost reply,
or growth. The summary goes to stdout as a Markdown table; --json writes every sample too.

    bench/soak.py --sluice target/release/sluice --model models/demo --clients 8 --duration 1800
    bench/soak.py --base-url http://127.0.0.1:8080 --pid 1234 --duration 600
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

from serve_load import percentile  # bench/ is on the path: this script lives there

WORDS = (
    "the river ran past the old mill where a cat slept in the sun and children counted boats "
    "while the baker sang about bread salt and rain in a small town at the edge of a forest "
    "code like fn main() { println!(\"hi\"); } and numbers 3.14159 2718 and 東京 café 🙂"
).split()


class Problem(Exception):
    """A reply that broke the contract (not a transport failure we caused ourselves)."""


def check_usage(usage, max_tokens, finish, context_ended=False):
    if not isinstance(usage, dict):
        raise Problem(f"no usage: {usage!r}")
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if not all(isinstance(x, int) for x in (p, c, t)):
        raise Problem(f"usage fields not integers: {usage}")
    if p <= 0 or c < 0 or t != p + c:
        raise Problem(f"usage inconsistent: {usage}")
    if c > max_tokens:
        raise Problem(f"{c} completion tokens for max_tokens {max_tokens}")
    if finish not in ("stop", "length"):
        raise Problem(f"finish_reason {finish!r}")
    if finish == "length" and c != max_tokens and not context_ended:
        raise Problem(f"finish_reason length after {c} of {max_tokens} tokens")


class Client:
    def __init__(self, base, headers, rng, args):
        u = urllib.parse.urlparse(base)
        self.host, self.port = u.hostname, u.port
        self.headers = {"Content-Type": "application/json", **headers}
        self.rng = rng
        self.args = args

    def prompt(self):
        n = self.rng.randint(1, self.args.max_prompt_words)
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def request(self):
        """One random request; returns (kind, tokens, seconds)."""
        rng = self.rng
        chat = rng.random() < 0.5
        stream = rng.random() < 0.7
        cancel = stream and rng.random() < self.args.cancel_share
        max_tokens = rng.randint(1, self.args.max_tokens)
        body = {"model": "any", "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0]),
                "seed": rng.randint(0, 1 << 30)}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt()}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = self.prompt()
            path = "/v1/completions"
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        start = time.perf_counter()
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.args.timeout)
        try:
            c.request("POST", path, json.dumps(body), self.headers)
            r = c.getresponse()
            if r.status != 200:
                raise Problem(f"HTTP {r.status} on {path}: {r.read()[:300]!r}")
            if not stream:
                tokens = self.check_whole(r, chat, max_tokens)
                kind = "whole"
            elif cancel:
                tokens = self.read_then_cancel(c, r)
                kind = "cancelled"
            else:
                tokens = self.check_stream(r, chat, max_tokens)
                kind = "stream"
        finally:
            c.close()
        return kind, tokens, time.perf_counter() - start

    def check_whole(self, r, chat, max_tokens):
        raw = r.read()
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise Problem(f"malformed JSON ({e}): {raw[:200]!r}")
        choices = doc.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise Problem(f"choices: {choices!r}")
        ch = choices[0]
        text = ch["message"].get("content") if chat else ch.get("text")
        if chat and text is None and not ch["message"].get("tool_calls"):
            text = ""
        if not isinstance(text, str):
            raise Problem(f"no text in {ch!r}")
        check_usage(doc.get("usage"), max_tokens, ch.get("finish_reason"))
        return doc["usage"]["completion_tokens"]

    def events(self, r):
        """The SSE data payloads of a streamed reply, ending at [DONE] (a Problem without it)."""
        for raw in r:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line or line.startswith(":"):
                continue  # a blank separator, or a comment (the server's keep-alive)
            if not line.startswith("data: "):
                raise Problem(f"not an SSE data line: {line[:200]!r}")
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            try:
                yield json.loads(data)
            except ValueError as e:
                raise Problem(f"malformed chunk ({e}): {data[:200]!r}")
        raise Problem("stream ended without [DONE]")

    def check_stream(self, r, chat, max_tokens):
        finishes, usage, pieces = [], None, 0
        for chunk in self.events(r):
            if "error" in chunk:
                raise Problem(f"error in stream: {chunk['error']}")
            if chunk.get("usage"):
                if usage is not None:
                    raise Problem("usage sent twice")
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                delta = ch.get("delta", {}) if chat else ch
                if delta.get("content") or delta.get("text") or delta.get("reasoning_content"):
                    pieces += 1
                if ch.get("finish_reason"):
                    finishes.append(ch["finish_reason"])
        if len(finishes) != 1:
            raise Problem(f"finish reasons {finishes}")
        check_usage(usage, max_tokens, finishes[0])
        if pieces > usage["completion_tokens"]:
            raise Problem(f"{pieces} content chunks for {usage['completion_tokens']} tokens")
        return usage["completion_tokens"]

    def read_then_cancel(self, c, r):
        stop_after = self.rng.randint(0, 8)
        seen = 0
        for raw in r:
            if raw.startswith(b"data: "):
                seen += 1
                if seen > stop_after:
                    break
        # Close abruptly (RST where the OS allows), as a client that goes away would.
        try:
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except (OSError, AttributeError):
            pass
        return 0


def proc_figures(pid):
    """(RSS bytes, open fds) of process `pid`, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds


def start_server(sluice, model, extra):
    cmd = [sluice, "serve", "--model", model, "--port", "0"] + extra
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        sys.stderr.write("[server] " + line)
        if "at http://" in line:
            addr = line.split("at http://")[1].split()[0].split("/")[0]

            def drain():
                for rest in proc.stderr:
                    if "error" in rest.lower() or "panic" in rest.lower():
                        sys.stderr.write("[server] " + rest)
            threading.Thread(target=drain, daemon=True).start()
            return proc, f"http://{addr}"
    raise SystemExit(f"the server did not start: {' '.join(cmd)}")


def flat(samples, warmup):
    """(largest of the first quarter after warm-up, largest of the last quarter), or None."""
    after = [v for t, v in samples if t >= warmup]
    if len(after) < 8:
        return None
    q = len(after) // 4
    return max(after[:q]), max(after[-q:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server on loopback (default: start one with --sluice/--model)")
    ap.add_argument("--pid", type=int, help="the running server's process id, for its RSS and fds")
    ap.add_argument("--sluice", help="the sluice binary to start")
    ap.add_argument("--model", help="model for the started server")
    ap.add_argument("--server-arg", action="append", default=[], help="more arguments for the started server")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=1800, help="seconds (default 1800)")
    ap.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many in all")
    ap.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens drawn")
    ap.add_argument("--max-prompt-words", type=int, default=400, help="longest prompt drawn, in words")
    ap.add_argument("--cancel-share", type=float, default=0.15, help="share of streams cancelled")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    ap.add_argument("--sample", type=float, default=5, help="seconds between RSS/fd samples")
    ap.add_argument("--warmup", type=float, help="seconds before RSS/fds must be flat (default: a fifth)")
    ap.add_argument("--flat", type=float, default=0.05, help="growth allowed after warm-up (0.05: 5%%)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--api-key")
    ap.add_argument("--json", help="write the samples and counts here")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else args.duration / 5

    proc, pid = None, args.pid
    if args.base_url:
        base = args.base_url.rstrip("/").removesuffix("/v1")
        host = urllib.parse.urlparse(base).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            ap.error("the soak test runs on loopback only")
    elif args.sluice and args.model:
        proc, base = start_server(args.sluice, args.model, args.server_arg)
        pid = proc.pid
    else:
        ap.error("give --base-url (and --pid), or --sluice and --model")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    lock = threading.Lock()
    counts = {"whole": 0, "stream": 0, "cancelled": 0, "tokens": 0, "requests": 0}
    problems, latencies, samples_rss, samples_fd = [], [], [], []
    t0 = time.perf_counter()
    deadline = t0 + args.duration
    stop = threading.Event()

    def client(i):
        c = Client(base, headers, random.Random(args.seed * 1000 + i), args)
        while not stop.is_set() and time.perf_counter() < deadline:
            with lock:
                if counts["requests"] >= args.max_requests:
                    return
                counts["requests"] += 1
            try:
                kind, tokens, secs = c.request()
                with lock:
                    counts[kind] += 1
                    counts["tokens"] += tokens
                    latencies.append(secs)
            except Exception as e:  # a Problem, or the transport failing under us
                with lock:
                    problems.append(f"client {i}: {e!r}"[:400])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            if pid:
                try:
                    rss, fds = proc_figures(pid)
                except OSError as e:
                    problems.append(f"server process gone: {e}")
                    stop.set()
                    break
                now = time.perf_counter() - t0
                samples_rss.append((now, rss))
                samples_fd.append((now, fds))
            if proc and proc.poll() is not None:
                problems.append(f"server exited with {proc.returncode} during the soak")
                stop.set()
                break
            time.sleep(args.sample)
    except KeyboardInterrupt:
        stop.set()
    for t in threads:
        t.join(timeout=args.timeout)
    wall = time.perf_counter() - t0

    # The server must still answer, then stop cleanly.
    try:
        Client(base, headers, random.Random(0), args).request()
    except Exception as e:
        problems.append(f"after the soak: {e!r}")
    exit_code = None
    if proc:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = "hung"
        if exit_code != 0:
            problems.append(f"server exit after SIGTERM: {exit_code}")

    rss, fd = flat(samples_rss, warmup), flat(samples_fd, warmup)
    grew = []
    if rss and rss[1] > rss[0] * (1 + args.flat):
        grew.append("RSS")
    # Descriptors: the clients' sockets come and go on top of the server's own.
    if fd and fd[1] > fd[0] * (1 + args.flat) + args.clients:
        grew.append("fds")
    mb = [v / 2**20 for _, v in samples_rss]
    fds = [v for _, v in samples_fd]
    print("| seconds | clients | requests | whole | streamed | cancelled | gen tokens | latency p50 / p99 s "
          "| errors | RSS MiB min / max (last/first quarter) | fds min / max (ratio) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rss_txt = f"{min(mb):.0f} / {max(mb):.0f} ({rss[1] / rss[0]:.3f})" if rss else "-"
    fd_txt = f"{min(fds)} / {max(fds)} ({fd[1] / fd[0]:.3f})" if fd else "-"
    print(f"| {wall:.0f} | {args.clients} | {counts['whole'] + counts['stream'] + counts['cancelled']} "
          f"| {counts['whole']} | {counts['stream']} | {counts['cancelled']} | {counts['tokens']} "
          f"| {percentile(latencies, 50):.2f} / {percentile(latencies, 99):.2f} | {len(problems)} "
          f"| {rss_txt} | {fd_txt} |")
    for p in problems[:10]:
        print(f"    {p}", file=sys.stderr)
    for g in grew:
        print(f"    {g} grew more than {args.flat:.0%} after warm-up", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "problems": problems, "rss": samples_rss, "fds": samples_fd,
                       "wall": wall, "server_exit": exit_code}, f)
    sys.exit(1 if problems or grew else 0)


if __name__ == "__main__":
    main()
