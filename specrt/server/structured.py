"""Structured output in a request: OpenAI's `response_format`, read into a grammar
(runtime/grammar.py) that every answer of the request follows, with speculation under it.

    {"type": "text"}                                    no constraint (the default)
    {"type": "json_object"}                             one JSON object (JSON mode)
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}
    {"type": "regex", "regex": "\\d{3}-\\d{4}"}           specrt's extension: the whole answer matches
    {"type": "grammar", "grammar": "start: ..."}        specrt's extension: a Lark grammar (llguidance's)

Taken on both endpoints (OpenAI has it on chat; vLLM takes it on completions too). A schema or
pattern the grammar engine cannot compile is a 400 naming `response_format`, before the request
queues (parse_request compiles it through `Served.compile`; the engine then copies it).
"""

from __future__ import annotations

import json

from specrt.errors import SpecrtError
from specrt.runtime.grammar import Grammar

FIELD = "response_format"
TYPES = ("text", "json_object", "json_schema", "regex", "grammar")


def response_format(fmt) -> Grammar | None:
    """The grammar of a request's `response_format` value (None: free text); a SpecrtError that
    names the problem (the parser answers it with a 400 naming the field)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TYPES:
        raise SpecrtError(f"it must be an object whose type is one of {', '.join(TYPES)}, got {json.dumps(fmt)[:60]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise SpecrtError("'json_schema' must be an object with the JSON schema under 'schema' (and a 'name')")
        return Grammar.json_schema(spec["schema"])
    return Grammar.regex(fmt.get("regex")) if kind == "regex" else Grammar.lark(fmt.get("grammar"))
