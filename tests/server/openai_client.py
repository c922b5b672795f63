#!/usr/bin/env python3
"""Drives a running `sluice serve` with the official `openai` Python client (and raw HTTP for
what the client cannot send: broken JSON, huge bodies, a client that hangs up).

    python tests/server/openai_client.py --base-url http://127.0.0.1:PORT/v1 --api-key KEY

Run by `cargo test` (crates/sluice-cli/tests/server.rs), which installs the client into a venv,
starts the server on the demo model and calls this. Needs a model that answers
"What is the weather in Paris?" with a get_weather tool call (the demo model does). Exits non-zero
on the first failed check; prints one line per check and the timings it measured.
"""
import argparse
import http.client
import json
import socket
import sys
import threading
import time
import traceback
import urllib.parse

import openai
from openai import OpenAI

# The tools the demo model was trained with (scripts/train_demo/dialogues.py): a model this small
# calls the tools it knows, described the way it learned them.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The temperature unit"},
            },
            "required": ["location"],
        },
    },
}
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate, e.g. 2 * (3 + 4)"}
            },
            "required": ["expression"],
        },
    },
}
TOOLS = [WEATHER_TOOL, CALC_TOOL]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class Response:
    def __init__(self, status, text):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def http_request(url, method="GET", body=None, headers=None, timeout=10.0):
    """Plain HTTP with the standard library (for what the openai client cannot send). A timeout
    raises TimeoutError after closing the connection, as a client that gives up does."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, u.path, body=body, headers=hdrs)
        r = conn.getresponse()
        return Response(r.status, r.read().decode("utf-8", "replace"))
    except (socket.timeout, TimeoutError) as e:
        raise TimeoutError(str(e)) from e
    finally:
        conn.close()


class Checks:
    def __init__(self, args):
        self.args = args
        self.client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
        self.root = args.base_url.rsplit("/v1", 1)[0]
        self.model = None
        self.headers = {"Authorization": f"Bearer {args.api_key}"}

    def chat(self, **kw):
        kw.setdefault("model", self.model)
        kw.setdefault("temperature", 0)
        return self.client.chat.completions.create(**kw)

    def metric(self, name):
        text = http_request(f"{self.root}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"sluice_{name} "):
                return float(line.split()[1])
        raise AssertionError(f"metric sluice_{name} missing from /metrics:\n{text}")

    # --- the checks, in order -------------------------------------------------------------

    def test_health_and_models(self):
        r = http_request(f"{self.root}/health")
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        models = self.client.models.list().data
        assert len(models) == 1, models
        self.model = models[0].id
        assert self.client.models.retrieve(self.model).id == self.model

    def test_non_streaming(self):
        r = self.chat(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12)
        c = r.choices[0]
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-"), r
        assert c.message.role == "assistant" and isinstance(c.message.content, str), c
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        u = r.usage
        assert 1 <= u.completion_tokens <= 12, u
        assert u.prompt_tokens > 5 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u
        if c.finish_reason == "length":
            assert u.completion_tokens == 12, u
        self.story = (c.message.content, c.finish_reason, u.completion_tokens)

    def test_streaming_matches_non_streaming(self):
        stream = self.chat(
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finishes, usage, roles = "", [], None, []
        for chunk in stream:
            assert chunk.object == "chat.completion.chunk", chunk
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == [], chunk
                continue
            d = chunk.choices[0].delta
            if d.role:
                roles.append(d.role)
            text += d.content or ""
            if chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
        content, finish, completion_tokens = self.story
        assert roles == ["assistant"], roles
        assert text == content, (text, content)
        assert finishes == [finish], finishes
        assert usage is not None and usage.completion_tokens == completion_tokens, usage

    def test_completions(self):
        r = self.client.completions.create(
            model=self.model, prompt="Once upon a time", max_tokens=8, temperature=0
        )
        assert r.object == "text_completion", r
        assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens >= 3, r.usage
        streamed = "".join(
            c.choices[0].text
            for c in self.client.completions.create(
                model=self.model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == r.choices[0].text, (streamed, r.choices[0].text)

    def test_stop_sequences(self):
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        full = self.chat(messages=messages, max_tokens=40).choices[0].message.content
        # A stop string from the middle of the greedy answer: the answer must end right before it.
        words = [w for w in full.split() if len(w) >= 3]
        assert len(words) >= 3, f"answer too short to pick a stop word from: {full!r}"
        stop = words[len(words) // 2]
        expected = full[: full.index(stop)]
        r = self.chat(messages=messages, max_tokens=40, stop=[stop, "\u2603never"])
        assert r.choices[0].message.content == expected, (r.choices[0].message.content, expected, stop)
        assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
        streamed, finish = "", None
        for chunk in self.chat(messages=messages, max_tokens=40, stop=stop, stream=True):
            if chunk.choices:
                streamed += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert streamed == expected and finish == "stop", (streamed, expected, finish)

    def test_sampling_parameters(self):
        kw = dict(
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=10,
            temperature=0.8,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            seed=7,
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
        )
        a = self.chat(**kw).choices[0].message.content
        b = self.chat(**kw).choices[0].message.content
        assert a == b, f"same seed, different text: {a!r} vs {b!r}"
        r = self.chat(messages=kw["messages"], max_completion_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length", r

    def tool_call_request(self, stream):
        kw = dict(messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=60)
        if not stream:
            r = self.chat(**kw)
            m = r.choices[0].message
            return r.choices[0].finish_reason, m.content, [
                (c.id, c.type, c.function.name, c.function.arguments) for c in (m.tool_calls or [])
            ]
        calls, content, finish = {}, "", None
        for chunk in self.chat(stream=True, **kw):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "type": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                c["type"] = tc.type or c["type"]
                if tc.function:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
        assert sorted(calls) == list(range(len(calls))), calls
        return finish, content or None, [
            (c["id"], c["type"], c["name"], c["arguments"]) for _, c in sorted(calls.items())
        ]

    def tool_round_trip(self, stream):
        finish, content, calls = self.tool_call_request(stream)
        assert finish == "tool_calls", (finish, content, calls)
        assert len(calls) >= 1, calls
        call_id, kind, name, arguments = calls[0]
        assert call_id.startswith("call_") and kind == "function", calls
        assert name == "get_weather", calls
        args = json.loads(arguments)
        assert args["location"] == "Paris", args
        # The tool's answer goes back through the template; the model answers in text.
        messages = WEATHER_QUESTION + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(
                {"location": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny", "humidity": 40, "wind_kph": 12})},
        ]
        r = self.chat(messages=messages, tools=TOOLS, max_tokens=60)
        m = r.choices[0].message
        assert r.choices[0].finish_reason in ("stop", "length"), r
        assert m.tool_calls in (None, []) and m.content, m
        # ... and a trained model uses it (the tool result's temperature shows up in the answer).
        if self.args.expect_tool_use:
            assert "18" in m.content, m.content
        # The tool result must have been in the prompt: it is longer than the question's.
        return r.usage.prompt_tokens, m.content

    def test_tool_call_round_trip(self):
        tokens, answer = self.tool_round_trip(stream=False)
        print(f"    answer after the tool result: {answer!r}")

    def test_tool_call_round_trip_streamed(self):
        self.tool_round_trip(stream=True)

    def test_tool_choice_none_gives_text(self):
        r = self.chat(messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="none", max_tokens=30)
        assert not r.choices[0].message.tool_calls, r
        assert r.choices[0].finish_reason != "tool_calls", r

    # --- the Responses API ---------------------------------------------------------------

    def respond(self, **kw):
        kw.setdefault("model", self.model)
        kw.setdefault("temperature", 0)
        return self.client.responses.create(**kw)

    def respond_streamed(self, **kw):
        """The final response and the event types, from the SDK's stream helper."""
        kw.setdefault("model", self.model)
        kw.setdefault("temperature", 0)
        with self.client.responses.stream(**kw) as s:
            events = list(s)
        # The helper's get_final_response wants `response.completed`; a response cut by
        # max_output_tokens ends with `response.incomplete` instead, as OpenAI's does.
        last = events[-1]
        assert last.type in ("response.completed", "response.incomplete"), [e.type for e in events]
        return last.response, [e.type for e in events]

    def test_responses_text(self):
        r = self.respond(input="Tell me a story.", max_output_tokens=12)
        assert r.object == "response" and r.id.startswith("resp_"), r
        # The same conversation as the chat completion's story: the same greedy answer.
        story, finish, tokens = self.story
        assert r.output_text == story, (r.output_text, story)
        assert r.usage.output_tokens == tokens, r.usage
        if finish == "length":
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
        else:
            assert r.status == "completed" and r.incomplete_details is None, r
        streamed, types = self.respond_streamed(input="Tell me a story.", max_output_tokens=12)
        assert streamed.output_text == story and streamed.status == r.status, streamed
        assert types[:2] == ["response.created", "response.in_progress"], types
        assert "response.output_text.delta" in types, types
        assert types[-1] in ("response.completed", "response.incomplete"), types

    def responses_tool_round_trip(self, stream):
        tools = [dict(type="function", **t["function"]) for t in TOOLS]
        kw = dict(input=WEATHER_QUESTION, tools=tools, max_output_tokens=60)
        r = self.respond_streamed(**kw)[0] if stream else self.respond(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_weather", r.output
        assert calls[0].call_id.startswith("call_"), calls[0]
        assert json.loads(calls[0].arguments)["location"] == "Paris", calls[0].arguments
        follow = WEATHER_QUESTION + [o.model_dump(exclude_none=True) for o in r.output] + [
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps(
                {"location": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny",
                 "humidity": 40, "wind_kph": 12})},
        ]
        answer = self.respond(input=follow, tools=tools, max_output_tokens=60)
        assert not [o for o in answer.output if o.type == "function_call"], answer.output
        assert answer.output_text, answer.output
        if self.args.expect_tool_use:
            assert "18" in answer.output_text, answer.output_text

    def test_responses_tool_round_trip(self):
        self.responses_tool_round_trip(stream=False)

    def test_responses_tool_round_trip_streamed(self):
        self.responses_tool_round_trip(stream=True)

    def test_responses_errors(self):
        self.expect_error(400, lambda: self.respond(input="Hi", previous_response_id="resp_1"),
                          "previous_response_id")
        image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
        self.expect_error(400, lambda: self.respond(input=[image]), "input_image")
        self.expect_error(400, lambda: self.respond(input="Hi", tools=[{"type": "web_search"}]),
                          "web_search")

    def test_prompt_cache(self):
        system = {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}
        first = [system, {"role": "user", "content": "Tell me about the river."}]
        r1 = self.chat(messages=first, max_tokens=30)
        answer = r1.choices[0].message.content
        second = first + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And the mountains?"},
        ]
        t_cached, r2 = self.ttft(second)
        cached = r2.prompt_tokens_details.cached_tokens
        assert cached >= r1.usage.prompt_tokens, (cached, r1.usage)
        assert cached < r2.prompt_tokens, r2
        # The same length of prompt with nothing to reuse (the first token differs).
        fresh = [{"role": "system", "content": "you are a helpful assistant. Answer in one sentence."}] + second[1:]
        t_fresh, r3 = self.ttft(fresh)
        print(
            f"    time to first token: {t_cached * 1e3:.0f} ms with {cached} of {r2.prompt_tokens} prompt tokens "
            f"cached, {t_fresh * 1e3:.0f} ms with {r3.prompt_tokens_details.cached_tokens} of {r3.prompt_tokens} "
            f"(ratio {t_fresh / max(t_cached, 1e-9):.1f}x)"
        )

    def ttft(self, messages):
        start = time.perf_counter()
        first, usage = None, None
        for chunk in self.chat(messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            elif first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                first = time.perf_counter() - start
        return first, usage

    def wait_for(self, what, cond, timeout=20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def test_cancel_by_disconnect(self):
        cancelled = self.metric("requests_cancelled_total")
        generated = self.metric("generated_tokens_total")
        limit = 3000
        stream = self.chat(
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=limit,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(stream):
            if i >= 3:
                break
        stream.close()
        self.wait_for("the streamed generation to be cancelled", lambda: self.metric("requests_cancelled_total") > cancelled)
        produced = self.metric("generated_tokens_total") - generated
        assert produced < limit / 2, f"{produced} tokens generated after the client left"
        # A non-streaming client that gives up: its generation stops too.
        cancelled = self.metric("requests_cancelled_total")
        try:
            http_request(
                f"{self.args.base_url}/chat/completions",
                "POST",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": limit, "ignore_eos": True},
                self.headers,
                timeout=1.0,
            )
            raise AssertionError(f"a {limit}-token answer came back within 1 s: the test cannot observe a cancel")
        except TimeoutError:
            pass
        self.wait_for("the non-streamed generation to be cancelled", lambda: self.metric("requests_cancelled_total") > cancelled)
        # The model is free again at once.
        start = time.perf_counter()
        r = self.chat(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        print(f"    next request answered in {(time.perf_counter() - start) * 1e3:.0f} ms")

    def expect_error(self, status, fn, *words):
        try:
            fn()
        except openai.APIStatusError as e:
            assert e.status_code == status, (e.status_code, e.response.text)
            body = e.response.json()
            message = body["error"]["message"]
            for w in words:
                assert w in message, (w, message)
            return body["error"]
        raise AssertionError(f"expected HTTP {status}")

    def test_errors(self):
        chat = self.chat
        q = [{"role": "user", "content": "Hi"}]
        e = self.expect_error(400, lambda: chat(messages=q, temperature="hot"), "temperature")
        assert e["param"] == "temperature" and e["type"] == "invalid_request_error", e
        self.expect_error(400, lambda: chat(messages="not a list"), "messages")
        self.expect_error(400, lambda: chat(messages=[{"role": "wizard", "content": "x"}]), "role")
        self.expect_error(400, lambda: chat(messages=q, temperature=-1), "temperature")
        self.expect_error(400, lambda: chat(messages=q, n=2), "n must be 1")
        self.expect_error(400, lambda: chat(messages=q, stop=[""]), "stop")
        self.expect_error(400, lambda: chat(messages=q, tools=[{"type": "retrieval"}]), "tools")
        ctx = self.client.models.retrieve(self.model).model_extra["max_model_len"]
        long = [{"role": "user", "content": "word " * (ctx + 10)}]
        e = self.expect_error(400, lambda: chat(messages=long), "context")
        assert e["code"] == "context_length_exceeded", e
        # Raw HTTP: broken JSON, wrong JSON shape, a body over the limit, unknown routes.
        url = f"{self.args.base_url}/chat/completions"
        r = http_request(url, "POST", b'{"messages": [', self.headers)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
        r = http_request(url, "POST", b"[1, 2]", self.headers)
        assert r.status_code == 400 and "error" in r.json(), r.text
        r = http_request(url, "POST", b"x" * (17 << 20), self.headers, timeout=30)
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"], (r.status_code, r.text[:200])
        r = http_request(f"{self.root}/v1/nope", headers=self.headers)
        assert r.status_code == 404 and "error" in r.json(), r.text
        # API key.
        bad = OpenAI(base_url=self.args.base_url, api_key="wrong-key", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("a wrong API key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and "API key" in e.response.json()["error"]["message"]
        r = http_request(url, "POST", {"messages": q})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], r.text
        # The server is still healthy, and counted the failures.
        assert self.metric("requests_failed_total") >= 10
        assert chat(messages=q, max_tokens=1).choices[0].finish_reason in ("stop", "length")

    def test_heldout_weather_prompts(self):
        """Weather questions the model never saw (cities and phrasings held out of training): at
        least 90% must come back as a valid get_weather call (finish_reason tool_calls, JSON
        arguments with a location). How often the location is the asked city is reported."""
        if not self.args.heldout:
            raise AssertionError("--heldout FILE is required (models/demo/eval/weather_prompts.jsonl)")
        cases = [json.loads(line) for line in open(self.args.heldout, encoding="utf-8") if line.strip()]
        assert len(cases) >= 20, f"only {len(cases)} held-out prompts"
        valid, right, misses = 0, 0, []
        for case in cases:
            r = self.chat(messages=case["messages"], tools=case["tools"], max_tokens=60)
            c = r.choices[0]
            calls = c.message.tool_calls or []
            location = None
            if c.finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == case["expected"]["name"]:
                try:
                    args = json.loads(calls[0].function.arguments)
                    if isinstance(args, dict) and isinstance(args.get("location"), str) and args["location"].strip():
                        location = args["location"]
                except json.JSONDecodeError:
                    pass
            valid += location is not None
            right += location is not None and location.lower() == case["expected"]["location"].lower()
            if location is None:
                misses.append((case["messages"][-1]["content"], c.message.content, [(t.function.name, t.function.arguments) for t in calls]))
        n = len(cases)
        print(f"    valid get_weather calls: {valid}/{n} = {valid / n:.0%}; with the asked city: {right}/{n} = {right / n:.0%}")
        for m in misses[:5]:
            print(f"    not a valid call: {m}")
        assert valid / n >= 0.9, f"{valid / n:.0%} < 90%"

    def test_concurrent_streams(self):
        # Requests of different prompts and lengths, first one at a time, then all at once as
        # streams: the server batches them (they join and leave at different steps), and each
        # stream must be complete and give exactly its greedy answer alone.
        cases = [
            ("Tell me a story.", 24),
            ("What is the weather in Paris?", 10),
            ("Write a poem about the sea.", 32),
            ("Hi", 6),
            ("Count to ten.", 16),
            ("Describe a cat in one sentence.", 20),
        ]
        def messages(prompt):
            return [{"role": "user", "content": prompt}]
        alone = []
        for prompt, n in cases:
            c = self.chat(messages=messages(prompt), max_tokens=n).choices[0]
            alone.append((c.message.content, c.finish_reason))
        steps, rows = self.metric("batch_steps_total"), self.metric("batch_rows_total")
        results = [None] * len(cases)

        def run(i):
            try:
                prompt, n = cases[i]
                stream = self.chat(messages=messages(prompt), max_tokens=n, stream=True)
                text, finishes = "", []
                for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        if chunk.choices[0].finish_reason:
                            finishes.append(chunk.choices[0].finish_reason)
                results[i] = (text, finishes)
            except Exception as e:  # reported below, with the request it belongs to
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for i, ((want, finish), got) in enumerate(zip(alone, results)):
            assert not isinstance(got, Exception) and got is not None, (i, got)
            text, finishes = got
            assert finishes == [finish], (i, finishes, finish)
            assert text == want, (i, text, want)
        steps = self.metric("batch_steps_total") - steps
        rows = self.metric("batch_rows_total") - rows
        print(f"    {len(cases)} concurrent streams: {steps:.0f} steps advanced {rows:.0f} requests ({rows / steps:.2f} per step)")
        assert rows / steps > 1.5, (steps, rows)

    def test_metrics(self):
        text = http_request(f"{self.root}/metrics").text
        for name in ("generated_tokens_total", "queue_depth", "decode_tokens_per_second", "prompt_tokens_cached_total",
                     "requests_running", "batch_steps_total", "batch_rows_total", "time_to_first_token_seconds_total",
                     "request_latency_seconds_total", "requests_timed_total"):
            assert f"sluice_{name} " in text, name
        assert self.metric("generated_tokens_total") > 0 and self.metric("queue_depth") == 0
        if self.args.expect_streaming:
            for name in ("expert_cache_hit_rate", "expert_read_gbps", "expert_read_bytes_total"):
                assert f"sluice_{name} " in text, name
            assert self.metric("expert_read_bytes_total") > 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--expect-streaming", action="store_true", help="experts stream: expert-cache metrics must be there")
    ap.add_argument("--expect-tool-use", action="store_true", help="the answer after a tool result must quote it")
    ap.add_argument("--heldout", help="held-out weather prompts (JSON lines) for the tool-call rate check")
    ap.add_argument("--only", help="run only the checks whose name contains this (debugging)")
    args = ap.parse_args()
    checks = Checks(args)
    names = [n for n in dir(Checks) if n.startswith("test_")]
    names.sort(key=lambda n: getattr(Checks, n).__code__.co_firstlineno)
    names = ["test_health_and_models"] + [n for n in names if n != "test_health_and_models"]
    if args.only:
        names = ["test_health_and_models"] + [n for n in names[1:] if args.only in n]
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
            if name == "test_health_and_models":
                break
    print(f"{len(names) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
