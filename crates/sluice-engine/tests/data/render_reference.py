#!/usr/bin/env python3
"""Reference renderer for chat templates, used to cross-check `chat.rs` by hand.

Renders a Hugging Face chat template with Python's jinja2 set up the way transformers'
`apply_chat_template` does (trim_blocks, lstrip_blocks, loopcontrols, its own `tojson`,
`raise_exception`, `strftime_now`), after the same tool-call normalisation as `chat.rs`
(JSON-string `arguments` parsed into objects, as vLLM does, unless a probe call renders only as
JSON text, as in DeepSeek's templates: then object `arguments` are written as compact JSON).

    python3 render_reference.py TEMPLATE.jinja CASES.json

CASES.json is a list of {"messages": [...], "tools": [...]|null, "add_generation_prompt": bool,
"extra": {...}}; prints a JSON list of the rendered strings (or {"error": msg}).
Needs only `pip install jinja2`; not run by the test suite.
"""
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def normalize(messages, object_arguments=True):
    if not object_arguments:
        for m in messages:
            for call in m.get("tool_calls") or []:
                target = call["function"] if isinstance(call.get("function"), dict) else call
                if isinstance(target.get("arguments"), dict):
                    target["arguments"] = json.dumps(target["arguments"], ensure_ascii=False,
                                                     separators=(",", ":"))
        return messages
    for m in messages:
        for call in m.get("tool_calls") or []:
            target = call["function"] if isinstance(call.get("function"), dict) else call
            args = target.get("arguments")
            if isinstance(args, str):
                if not args.strip():
                    target["arguments"] = {}
                else:
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        continue
                    if isinstance(parsed, dict):
                        target["arguments"] = parsed
    return messages


def main():
    source = open(sys.argv[1], encoding="utf-8").read()
    cases = json.load(open(sys.argv[2], encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)

    def renders(arguments):
        call = {"id": "call_probe", "type": "function",
                "function": {"name": "probe_tool", "arguments": arguments}}
        messages = [{"role": "user", "content": "Probe."},
                    {"role": "assistant", "content": None, "tool_calls": [call]}]
        try:
            return "argument_needle" in template.render(messages=messages, tools=None,
                                                        add_generation_prompt=False)
        except Exception:
            return False

    needle = {"argument_needle": "probe"}
    object_arguments = renders(needle) or not renders(json.dumps(needle, separators=(",", ":")))
    out = []
    for case in cases:
        kwargs = dict(case.get("extra") or {})
        try:
            out.append(template.render(messages=normalize(case["messages"], object_arguments),
                                       tools=case.get("tools"),
                                       add_generation_prompt=case.get("add_generation_prompt", False),
                                       **kwargs))
        except jinja2.exceptions.TemplateError as e:
            out.append({"error": str(e)})
    print(json.dumps(out, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
