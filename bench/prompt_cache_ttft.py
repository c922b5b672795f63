#!/usr/bin/env python3
"""Time to first token of a second chat turn, with and without the server's prompt cache.

    sluice serve -m MODEL &
    python bench/prompt_cache_ttft.py --base-url http://127.0.0.1:8080/v1 [--system-words 300]

Turn 1 is a long system message and a question; turn 2 resends it with turn 1's answer and a new
question (what every chat client does). Its time to first token is measured once as is (the
server resumes from turn 1's saved state) and once with the first character of the system message
changed (nothing to reuse, same length). Needs the `openai` package (tests/server/requirements.txt).
"""
import argparse
import time

from openai import OpenAI

WORDS = "the river runs past old stone walls and green fields toward a quiet town by the sea".split()


def ttft(client, model, messages, kwargs):
    start = time.perf_counter()
    first, usage = None, None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kwargs,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        elif first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.model_extra.get("reasoning_content") or chunk.choices[0].finish_reason):
            first = time.perf_counter() - start
    return first, usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--thinking", action="store_true", help="leave the template's thinking on")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    kwargs = {} if args.thinking else {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    system = "Background: " + " ".join(WORDS[i % len(WORDS)] for i in range(args.system_words))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Where does the river go?"}]
    r1 = client.chat.completions.create(model=model, messages=turn1, max_tokens=16, temperature=0, **kwargs)
    answer = r1.choices[0].message.content or ""
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    t_cached, u_cached = ttft(client, model, turn2, kwargs)
    fresh = [{"role": "system", "content": "b" + system[1:]}] + turn2[1:]
    t_fresh, u_fresh = ttft(client, model, fresh, kwargs)
    print(f"model {model}: turn 1 prompt {r1.usage.prompt_tokens} tokens")
    print(f"turn 2, resumed: TTFT {t_cached:.2f} s, {u_cached.prompt_tokens_details.cached_tokens} of {u_cached.prompt_tokens} prompt tokens cached")
    print(f"turn 2, fresh:   TTFT {t_fresh:.2f} s, {u_fresh.prompt_tokens_details.cached_tokens} of {u_fresh.prompt_tokens} prompt tokens cached")
    print(f"ratio fresh / resumed: {t_fresh / t_cached:.1f}x")


if __name__ == "__main__":
    main()
