#!/usr/bin/env python3
"""Each model family's tool-call format through `sluice serve`, with the official `openai` client.

    python tests/server/tool_formats_client.py --base-url URL --api-key KEY --cases CASES.json

CASES.json lists `{"format", "token", "name", "arguments", "id"?}`: `token` is a vocabulary entry
whose text is one whole tool-call block in that format (added to a synthetic model's tokenizer by
crates/sluice-cli/tests/server.rs). The request offers a get_weather tool and `logit_bias` +100 on
that token with `max_tokens` 1, so the model writes exactly that block; the server must return it
as `tool_calls` with that name and arguments (and the model's own id where the format has one),
in a whole response and in streamed deltas. Exits non-zero on the first mismatch.
"""
import argparse
import json
import sys

from openai import OpenAI

# The demo model's weather tool (this script's folder is on the import path).
from openai_client import WEATHER_TOOL


def check(client, case):
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        logit_bias={str(case["token"]): 100},
        max_tokens=1,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message
    calls = whole.tool_calls or []
    assert len(calls) == 1, (case["format"], whole)
    got = calls[0]
    assert got.function.name == case["name"], (case["format"], got)
    assert json.loads(got.function.arguments) == case["arguments"], (case["format"], got)
    assert not (whole.content or "").strip(), (case["format"], whole.content)
    if case.get("id"):
        assert got.id == case["id"], (case["format"], got.id)
    name, args, ids, content = "", "", [], ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            ids += [tc.id] if tc.id else []
            name += tc.function.name or ""
            args += tc.function.arguments or ""
    assert (name, json.loads(args)) == (case["name"], case["arguments"]), (case["format"], name, args)
    assert not content.strip() and len(ids) == 1, (case["format"], content, ids)
    if case.get("id"):
        assert ids[0] == case["id"], (case["format"], ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--cases", required=True)
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    cases = json.load(open(a.cases))
    for case in cases:
        check(client, case)
        print(f"ok   {case['format']}")
    print(f"{len(cases)} formats passed")


if __name__ == "__main__":
    sys.exit(main())
