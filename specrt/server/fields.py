"""Which fields of OpenAI's request bodies the server takes: the one table the parser and the
docs (docs/server.md, "OpenAI request fields") follow.

- SUPPORTED: implemented; the parser checks each one's type and range.
- ONLY: implemented at the values listed and refused at any other (`n` = 1, `logit_bias` {},
  `tools` with `tool_choice` "none", ...): the server does what OpenAI means at those values.
- IGNORED: accepted without effect, where OpenAI's meaning asks nothing of a server that
  stores nothing: identifiers and tags (`user`, `metadata`), hints (`prompt_cache_key`).
- Anything else is refused with a 400 naming the field. A field not implemented must not come
  back as a 200 that silently did something else, and an unknown name is usually a typo.
"""

from __future__ import annotations

import json
from typing import Callable

CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)

# name -> endpoints: implemented, each one's type and range checked by the parser
SUPPORTED = {
    "messages": (CHAT,),
    "max_completion_tokens": (CHAT,),
    "prompt": (COMPLETIONS,),
    **dict.fromkeys(("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options"), BOTH),
    "top_k": BOTH,  # not OpenAI's: vLLM's and llama.cpp's extension
    "speculation": BOTH,  # specrt's extension: {"draft": "none" | the server's, "num_draft": N | "auto"}
    "logprobs": BOTH,  # chat: true/false; completions: 0-5 alternatives
    "top_logprobs": (CHAT,),
    "echo": (COMPLETIONS,),  # the prompt before the completion (not with logprobs)
    "n": BOTH,  # answers per request, rows of the batch (at most --max-batch)
    "response_format": BOTH,  # text, json_object, json_schema; specrt's regex and grammar (server/structured.py)
}


def _is(*values) -> Callable[[object, dict], bool]:
    return lambda v, body: any(v == x and type(v) is type(x) or v is x for x in values)


def _number(*values) -> Callable[[object, dict], bool]:
    return lambda v, body: v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v in values)


def _tools(choice: str) -> Callable[[object, dict], bool]:
    """Tools the model may call are not implemented: tools come only with choice "none" (OpenAI:
    the model answers in text)."""
    return lambda v, body: v in (None, []) or body.get(choice) == "none"


def _choice(tools: str) -> Callable[[object, dict], bool]:
    return lambda v, body: v in (None, "none") or v == "auto" and body.get(tools) in (None, [])


# name -> (endpoints, accepts(value, body), the accepted values in words)
ONLY = {
    "best_of": ((COMPLETIONS,), _number(1), "only 1"),
    "presence_penalty": (BOTH, _number(0), "only 0"),
    "frequency_penalty": (BOTH, _number(0), "only 0"),
    "suffix": ((COMPLETIONS,), _is(None, ""), 'only null or ""'),
    "logit_bias": (BOTH, _is(None, {}), "only {} (no bias)"),
    "tools": (
        (CHAT,),
        _tools("tool_choice"),
        'no tools, or tools with tool_choice "none" (tool calls are not implemented)',
    ),
    "tool_choice": ((CHAT,), _choice("tools"), '"none", or "auto" without tools (tool calls are not implemented)'),
    "functions": ((CHAT,), _tools("function_call"), 'none, or functions with function_call "none"'),
    "function_call": ((CHAT,), _choice("functions"), '"none", or "auto" without functions'),
    "modalities": ((CHAT,), _is(None, ["text"]), 'only ["text"]'),
    "store": (BOTH, _is(None, False), "only false (nothing is stored)"),
    "service_tier": (BOTH, _is(None, "auto", "default"), 'only "auto" or "default"'),
}

# accepted at any value and without effect
IGNORED = {
    "user": BOTH,  # an end-user id for abuse monitoring
    "safety_identifier": BOTH,  # its newer name
    "metadata": BOTH,  # tags for stored completions; none are stored
    "prompt_cache_key": BOTH,  # a cache-routing hint
    "parallel_tool_calls": (CHAT,),  # only matters with tools the model may call, which are refused
}


def refused_field(body: dict, chat: bool) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` this server refuses, or None."""
    ep = CHAT if chat else COMPLETIONS
    first = ("tool_choice", "function_call")  # "required" says more than the tools it comes with
    for name in sorted(body, key=lambda n: n not in first):
        value = body[name]
        if ep in SUPPORTED.get(name, ()) or ep in IGNORED.get(name, ()):
            continue
        eps, accepts, words = ONLY.get(name, ((), None, ""))
        if ep not in eps:
            kind = "chat completion" if chat else "completion"
            return name, (
                f"'{name}' is not a {kind} field this server implements; leave it out (docs/server.md lists the "
                'fields taken, under "OpenAI request fields")'
            )
        if not accepts(value, body):
            return name, f"'{name}' = {json.dumps(value)[:40]} is not supported here; it takes {words}"
    return None


def field_table() -> list[tuple[str, str, str]]:
    """(field, endpoints, what the server does with it) for every field it takes: docs/server.md's table."""
    where = {BOTH: "both", (CHAT,): "chat", (COMPLETIONS,): "completions"}
    rows = [(n, where[eps], "supported") for n, eps in SUPPORTED.items()]
    rows += [(n, where[eps], words) for n, (eps, _, words) in ONLY.items()]
    rows += [(n, where[eps], "accepted, ignored") for n, eps in IGNORED.items()]
    return rows
