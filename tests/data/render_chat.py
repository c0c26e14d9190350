#!/usr/bin/env python3
"""Chat templates rendered by Jinja2 as Hugging Face's apply_chat_template renders them: the
reference kvlab's renderer is held to (a test peer only).

stdin: {"jobs": [{"template": PATH, "variables": {...}}, ...]}
stdout: [{"text": ...} or {"error": ...}, ...], one per job, in order.
"""
import json
import sys
from datetime import datetime

from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2 import nodes


class Generation(Extension):
    """{% generation %}...{% endgeneration %}: its body, as transformers' AssistantTracker."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    env = environment()
    out = []
    compiled = {}
    for job in json.load(sys.stdin)["jobs"]:
        try:
            path = job["template"]
            if path not in compiled:
                with open(path, encoding="utf-8") as f:
                    compiled[path] = env.from_string(f.read())
            out.append({"text": compiled[path].render(**job["variables"])})
        except Exception as e:  # any failure is an answer: kvlab must fail there too
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
