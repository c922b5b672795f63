#!/usr/bin/env python3
"""Each model family's tool-call format through `sluice serve`, with the official `openai` client.

    python tests/server/tool_formats_client.py --base-url URL --api-key KEY --cases CASES.json

CASES.json lists `{"format", "token", "name", "arguments", "id"?, "reasoning"?}`: `token` is a
vocabulary entry whose text is one whole tool-call block in that format (added to a synthetic
model's tokenizer by crates/sluice-cli/tests/server.rs). The request offers a get_weather tool and
`logit_bias` +100 on that token with `max_tokens` 1, so the model writes exactly that block; the
server must return it as `tool_calls` with that name and arguments (and the model's own id where
the format has one, and the reasoning written before the call where the case says), in a whole
response and in streamed deltas.

Two more kinds of case: `{"format", "token", "reasoning", "content"}`, an answer (no tools
offered) that must come back as that `reasoning_content` and `content`; and `{"format", "token",
"eos": true}`, a token that must end the generation at once (gpt-oss's `<|return|>` and
`<|call|>`, end-of-sequence ids in its generation_config.json) with nothing returned. Exits
non-zero on the first mismatch.
"""
import argparse
import json
import sys

from openai import BadRequestError, OpenAI

# The demo model's weather tool (this script's folder is on the import path).
from openai_client import WEATHER_TOOL


def reasoning_of(message):
    """`reasoning_content` (not a field of the client's types; they keep extra fields)."""
    return getattr(message, "reasoning_content", None) or ""


def streamed(client, kwargs):
    """The streamed deltas of one request, concatenated: (reasoning, content, tool calls as
    [id, name, arguments], finish_reason)."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        reasoning += reasoning_of(delta)
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id:
                calls.append([tc.id, "", ""])
            calls[-1][1] += tc.function.name or ""
            calls[-1][2] += tc.function.arguments or ""
    return reasoning, content, calls, finish


def check_text(client, case):
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        logit_bias={str(case["token"]): 100},
        max_tokens=1,
        temperature=0,
        reasoning_effort="high",
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    got = (reasoning_of(whole.message), whole.message.content, whole.message.tool_calls)
    assert got == (case["reasoning"], case["content"], None), (case["format"], whole)
    assert whole.finish_reason == "length", (case["format"], whole.finish_reason)
    reasoning, content, calls, finish = streamed(client, kwargs)
    assert (reasoning, content, calls) == (case["reasoning"], case["content"], []), (case["format"], reasoning, content, calls)
    assert finish == "length", (case["format"], finish)
    try:
        client.chat.completions.create(**dict(kwargs, reasoning_effort="extreme"))
    except BadRequestError as e:
        assert "reasoning_effort" in str(e), e
    else:
        raise AssertionError("reasoning_effort \"extreme\" was accepted")


def check_eos(client, case):
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        logit_bias={str(case["token"]): 100},
        max_tokens=4,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", (case["format"], choice)
    assert whole.usage.completion_tokens == 0, (case["format"], whole.usage)
    assert not choice.message.content and not choice.message.tool_calls, (case["format"], choice)
    reasoning, content, calls, finish = streamed(client, kwargs)
    assert (reasoning, content, calls, finish) == ("", "", [], "stop"), (case["format"], reasoning, content, calls, finish)


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
    if "reasoning" in case:
        assert reasoning_of(whole) == case["reasoning"], (case["format"], whole)
    reasoning, content, calls, _ = streamed(client, kwargs)
    assert len(calls) == 1, (case["format"], calls)
    [[call_id, name, args]] = calls
    assert (name, json.loads(args)) == (case["name"], case["arguments"]), (case["format"], name, args)
    assert not content.strip(), (case["format"], content)
    if case.get("id"):
        assert call_id == case["id"], (case["format"], call_id)
    if "reasoning" in case:
        assert reasoning == case["reasoning"], (case["format"], reasoning)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--cases", required=True)
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    cases = json.load(open(a.cases))
    for case in cases:
        if "name" in case:
            check(client, case)
        elif case.get("eos"):
            check_eos(client, case)
        else:
            check_text(client, case)
        print(f"ok   {case['format']}")
    print(f"{len(cases)} formats passed")


if __name__ == "__main__":
    sys.exit(main())
