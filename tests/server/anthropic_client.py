#!/usr/bin/env python3
"""Drives a running `sluice serve` with the official `anthropic` Python client: the Messages API
that Claude Code speaks.

    python tests/server/anthropic_client.py --base-url http://127.0.0.1:PORT --api-key KEY

Run by `cargo test` (crates/sluice-cli/tests/server.rs) on the demo model, which answers "What is
the weather in Paris?" with a get_weather call. Prints one line per check; exits non-zero if any
failed.
"""
import argparse
import json
import sys
import time
import traceback

import anthropic
from anthropic import Anthropic

# The demo model's tools (scripts/train_demo/dialogues.py), in Anthropic's shape.
TOOLS = [
    {
        "name": "get_weather",
        "description": "Get the current weather for a location.",
        "input_schema": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The temperature unit"},
            },
            "required": ["location"],
        },
    },
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate, e.g. 2 * (3 + 4)"}
            },
            "required": ["expression"],
        },
    },
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_RESULT = json.dumps({"location": "Paris", "temperature": 18, "unit": "celsius",
                             "condition": "sunny", "humidity": 40, "wind_kph": 12})


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


class Checks:
    def __init__(self, args):
        self.args = args
        self.client = Anthropic(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
        self.model = "sluice"

    def create(self, **kw):
        kw.setdefault("model", self.model)
        # Greedy, so that answers repeat (the current API has no `temperature` of its own; sluice
        # reads it as an extension).
        kw.setdefault("extra_body", {"temperature": 0})
        return self.client.messages.create(**kw)

    def stream(self, **kw):
        """The final message and the raw event types, from the SDK's stream helper."""
        kw.setdefault("model", self.model)
        kw.setdefault("extra_body", {"temperature": 0})
        types = []
        with self.client.messages.stream(**kw) as s:
            for event in s:
                types.append(event.type)
            return s.get_final_message(), types

    def test_message(self):
        r = self.create(max_tokens=12, messages=[{"role": "user", "content": "Tell me a story."}])
        assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_"), r
        assert r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason
        assert r.content and r.content[-1].type == "text" and text_of(r), r.content
        assert 1 <= r.usage.output_tokens <= 12 and r.usage.input_tokens > 5, r.usage
        if r.stop_reason == "max_tokens":
            assert r.usage.output_tokens == 12, r.usage
        self.story = r

    def test_streaming_matches_non_streaming(self):
        final, types = self.stream(max_tokens=12, messages=[{"role": "user", "content": "Tell me a story."}])
        assert text_of(final) == text_of(self.story), (text_of(final), text_of(self.story))
        assert final.stop_reason == self.story.stop_reason, final.stop_reason
        assert final.usage.output_tokens == self.story.usage.output_tokens, final.usage
        raw = [t for t in types if t in ("message_start", "content_block_start", "content_block_delta",
                                         "content_block_stop", "message_delta", "message_stop")]
        assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"], raw
        assert raw.count("content_block_start") == raw.count("content_block_stop") >= 1, raw

    def test_system_prompt(self):
        r = self.create(max_tokens=8, system="You are terse.", messages=[{"role": "user", "content": "Hi"}])
        plain = self.create(max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens > \
            plain.usage.input_tokens + plain.usage.cache_read_input_tokens, (r.usage, plain.usage)

    def tool_round_trip(self, stream):
        kw = dict(max_tokens=60, tools=TOOLS, messages=WEATHER_QUESTION)
        r = self.stream(**kw)[0] if stream else self.create(**kw)
        assert r.stop_reason == "tool_use", (r.stop_reason, r.content)
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather", r.content
        assert uses[0].id.startswith("toolu_"), uses[0].id
        assert uses[0].input.get("location") == "Paris", uses[0].input
        # The assistant turn goes back as it came, with the tool's result.
        messages = WEATHER_QUESTION + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": WEATHER_RESULT}]},
        ]
        answer = self.create(max_tokens=60, tools=TOOLS, messages=messages)
        assert answer.stop_reason in ("end_turn", "max_tokens"), answer
        assert not [b for b in answer.content if b.type == "tool_use"], answer.content
        assert text_of(answer), answer.content
        if self.args.expect_tool_use:
            assert "18" in text_of(answer), text_of(answer)
        return text_of(answer)

    def test_tool_use_round_trip(self):
        print(f"    answer after the tool result: {self.tool_round_trip(stream=False)!r}")

    def test_tool_use_round_trip_streamed(self):
        self.tool_round_trip(stream=True)

    def test_tool_choice_none_gives_text(self):
        r = self.create(max_tokens=30, tools=TOOLS, tool_choice={"type": "none"}, messages=WEATHER_QUESTION)
        assert r.stop_reason != "tool_use" and not [b for b in r.content if b.type == "tool_use"], r.content

    def test_stop_sequences(self):
        text = text_of(self.story)
        words = [w for w in text.split() if len(w) >= 3]
        if not words:
            raise AssertionError(f"the story has no word to stop at: {text!r}")
        stop = words[min(1, len(words) - 1)]
        for stream in (False, True):
            kw = dict(max_tokens=12, messages=[{"role": "user", "content": "Tell me a story."}],
                      stop_sequences=["never-in-the-text", stop])
            r = self.stream(**kw)[0] if stream else self.create(**kw)
            assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop, (r.stop_reason, r.stop_sequence)
            assert text_of(r) == text[:text.index(stop)], (text_of(r), text, stop)

    def test_thinking_switch_is_accepted(self):
        for kind in ("enabled", "disabled"):
            thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
            r = self.create(max_tokens=8, thinking=thinking, messages=[{"role": "user", "content": "Hi"}])
            assert r.type == "message", r

    def test_count_tokens(self):
        n = self.client.messages.count_tokens(model=self.model, messages=WEATHER_QUESTION, tools=TOOLS)
        r = self.create(max_tokens=1, tools=TOOLS, messages=WEATHER_QUESTION)
        assert n.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens, (n, r.usage)

    def expect_error(self, cls, status, fn, *words):
        try:
            fn()
        except cls as e:
            assert e.status_code == status, (e.status_code, e)
            body = e.body
            assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
            for w in words:
                assert w in body["error"]["message"], (w, body)
            return
        raise AssertionError(f"expected {cls.__name__}")

    def test_errors(self):
        q = WEATHER_QUESTION
        self.expect_error(anthropic.BadRequestError, 400,
                          lambda: self.client.messages.create(model=self.model, messages=q, max_tokens=0),
                          "max_tokens")
        self.expect_error(anthropic.BadRequestError, 400, lambda: self.create(max_tokens=5, messages=[]),
                          "messages")
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        self.expect_error(anthropic.BadRequestError, 400,
                          lambda: self.create(max_tokens=5, messages=[{"role": "user", "content": [image]}]),
                          "image")
        self.expect_error(anthropic.BadRequestError, 400,
                          lambda: self.create(max_tokens=5, messages=q, tools=TOOLS,
                                              tool_choice={"type": "tool", "name": "nope"}),
                          "nope")
        wrong = Anthropic(base_url=self.args.base_url, api_key="wrong", max_retries=0)
        self.expect_error(anthropic.AuthenticationError, 401,
                          lambda: wrong.messages.create(model=self.model, max_tokens=5, messages=q),
                          "API key")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the server's root, without /v1")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--expect-tool-use", action="store_true", help="the answer after a tool result must quote it")
    args = ap.parse_args()
    checks = Checks(args)
    names = [n for n in dir(Checks) if n.startswith("test_")]
    names.sort(key=lambda n: getattr(Checks, n).__code__.co_firstlineno)
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            getattr(checks, name)()
            print(f"ok   {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
    print(f"{len(names) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
