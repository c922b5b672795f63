#!/usr/bin/env python3
"""What reading /stats/stream costs generation, on the server's side: the same long generation
(ignore_eos, greedy) timed with nobody watching and with N clients reading the stream, in
alternating rounds so that drift hits both alike. Standard library only.

    python3 watch_overhead.py --base http://127.0.0.1:8080 [--tokens 2000] [--rounds 6] [--clients 1]

tests/browser/overhead.mjs measures the same with the web page open in Chromium instead.
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse
import urllib.request


def generate(base, tokens):
    body = json.dumps(
        {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        usage = json.load(r)["usage"]
    secs = time.perf_counter() - t
    assert usage["completion_tokens"] == tokens, usage
    return tokens / secs


class Watcher(threading.Thread):
    """Reads /stats/stream and parses every event, until stopped."""

    def __init__(self, base):
        super().__init__(daemon=True)
        u = urllib.parse.urlparse(base)
        self.conn = http.client.HTTPConnection(u.hostname, u.port)
        self.conn.request("GET", "/stats/stream")
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.events = 0
        self.stopping = False

    def run(self):
        try:
            while not self.stopping:
                line = self.response.readline()
                if not line:
                    return
                if line.startswith(b"data: "):
                    json.loads(line[6:])
                    self.events += 1
        except (OSError, ValueError):
            return

    def stop(self):
        self.stopping = True
        self.conn.sock.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clients", type=int, default=1)
    a = p.parse_args()
    base = a.base.rstrip("/")
    generate(base, a.tokens // 4)  # warm-up
    alone, watched = [], []
    for i in range(a.rounds):
        alone.append(generate(base, a.tokens))
        watchers = [Watcher(base) for _ in range(a.clients)]
        for w in watchers:
            w.start()
        watched.append(generate(base, a.tokens))
        for w in watchers:
            w.stop()
        events = sum(w.events for w in watchers)
        print(f"round {i}: alone {alone[-1]:.1f} tok/s, watched {watched[-1]:.1f} tok/s ({events} events read)")
    m0, m1 = statistics.median(alone), statistics.median(watched)
    print(
        f"median over {a.rounds} rounds of {a.tokens} tokens: alone {m0:.1f} tok/s, "
        f"with {a.clients} /stats/stream client(s) {m1:.1f} tok/s, ratio {m1 / m0:.3f}"
    )


if __name__ == "__main__":
    main()
