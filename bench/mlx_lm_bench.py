#!/usr/bin/env python3
"""Time mlx-lm prompt processing and generation on a checkpoint; print one JSON line.

pp: a prompt of P random token ids is run through generate_step; time to the first generated
    token (prefill + one sampled token) gives pp tok/s = P / t_first.
tg: the next N-1 tokens after the first: tg tok/s = (N-1) / (t_last - t_first). generate_step is
    used directly (no EOS stop), greedy sampling. The prompt cache is fresh every repetition.
mlx's CPU backend picks its own thread count; -t is not applicable.
"""
import argparse
import json
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("-p", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("-n", type=int, default=4, help="generated tokens (default 4, >= 2 for tg)")
    ap.add_argument("-r", type=int, default=1, help="repetitions (default 1)")
    ap.add_argument("--warmup", action="store_true",
                    help="one untimed run first (otherwise the first repetition includes first-use "
                         "costs: weights read from disk/page cache, kernel compilation)")
    ap.add_argument("--scenario", default="mmap")
    ap.add_argument("--available", default=None)
    args = ap.parse_args()
    if args.p < 1 or args.n < 1 or args.r < 1:
        ap.error("-p, -n and -r must be >= 1")

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    model, tok = load(args.model_dir)
    t_load = time.perf_counter() - t0
    print(f"mlx_lm_bench: loaded in {t_load:.1f} s (lazy: weights are read on first use)",
          file=sys.stderr, flush=True)
    vocab = getattr(tok, "vocab_size", None) or 1000
    import random
    rng = random.Random(0)
    pp, tg, ttft = [], [], []
    if args.warmup:
        for i, _ in enumerate(generate_step(mx.array([1] * args.p, dtype=mx.uint32), model,
                                            max_tokens=2, prompt_cache=make_prompt_cache(model))):
            if i >= 1:
                break
        print("mlx_lm_bench: warm-up done", file=sys.stderr, flush=True)
    for rep in range(args.r):
        prompt = mx.array([rng.randrange(min(vocab, 100000)) for _ in range(args.p)], dtype=mx.uint32)
        cache = make_prompt_cache(model)
        times = []
        t_start = time.perf_counter()
        for i, (token, _) in enumerate(generate_step(prompt, model, max_tokens=args.n,
                                                     prompt_cache=cache)):
            times.append(time.perf_counter())
            if i + 1 >= args.n:
                break
        t_first = times[0] - t_start
        ttft.append(t_first)
        pp.append(args.p / t_first)
        if len(times) >= 2:
            tg.append((len(times) - 1) / (times[-1] - times[0]))
        print(f"mlx_lm_bench: rep {rep + 1}/{args.r}: first token after {t_first:.1f} s "
              f"(pp {pp[-1]:.3f} tok/s), tg {tg[-1] if tg else float('nan'):.4f} tok/s",
              file=sys.stderr, flush=True)

    def sd(x):
        return statistics.stdev(x) if len(x) > 1 else 0.0
    res = {"engine": "mlx-lm", "scenario": args.scenario,
           "pp_tok_s": statistics.mean(pp), "pp_sd": sd(pp),
           "tg_tok_s": statistics.mean(tg) if tg else None, "tg_sd": sd(tg) if tg else None,
           "n_prompt": args.p, "n_gen": args.n, "repetitions": args.r,
           "ttft_s": statistics.mean(ttft), "load_s": t_load,
           "warmup": args.warmup, "mlx": mx.__version__, "mlx_lm": getattr(mlx_lm, "__version__", None),
           "available": args.available}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
