"""OpenAI's protocol, with no engine: a request body becomes a checked `Job`, a run's pieces
become a response body or server-sent events, and every refusal is a `RequestError` in OpenAI's
error format (HTTP status, type, param, code) that names the field and the fix.

    served = Served(model_id, limits, tokenizer, max_context)
    job = parse_request(raw_bytes, chat=True, served=served)          # or RequestError
    body = completion_response(job, pieces, model_id)                  # non-streamed
    writer = SseWriter(job, request_id(job), model_id)                 # streamed: head, piece, tail

Which request fields are taken, refused or ignored is fields.py's table. Each refusal's outcome
in the metrics (`outcome_of`) follows from its status.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Callable, Iterator

from specrt.errors import SpecrtError
from specrt.runtime.grammar import Grammar
from specrt.runtime.logprobs import MAX_TOP
from specrt.runtime.sampling import SamplingParams
from specrt.server.fields import refused_field
from specrt.server.limits import ServerLimits
from specrt.server.structured import FIELD, response_format

if TYPE_CHECKING:
    from specrt.runtime.target import GenerationResult

# a request's outcome, as the metrics count it (metrics.py), by the status it ended with
OUTCOMES = ("ok", "invalid", "cancelled", "refused", "timed_out", "error")
_BY_STATUS = {200: "ok", 499: "cancelled", 503: "refused", 504: "timed_out"}


def outcome_of(status: int) -> str:
    """ok, cancelled (499: the client left), refused (503: busy), timed_out (504), error (any
    other 5xx) or invalid (any other 4xx: the request itself was wrong)."""
    return _BY_STATUS.get(status, "error" if status >= 500 else "invalid")


class RequestError(SpecrtError):
    """A request the server refuses; carries the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


CLIENT_CLOSED = RequestError("client closed the request", status=499, code="client_closed_request")


@dataclasses.dataclass(kw_only=True)
class Job:
    """A checked request (made by keyword: thirteen fields, several of one type)."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    max_draft: int | None = None  # the request's own cap on draft tokens a step (0: none); None: the server's
    speculation: dict | None = None  # what the request runs with: {"draft", "num_draft"}, echoed under "specrt"
    logprobs: int | None = None  # alternatives per token when the request asks for logprobs; None: it does not
    echo: str = ""  # completions' echo: the prompt, sent before the completion
    n: int = 1  # answers (choices), each a row of the batch with its own random stream
    grammar: Grammar | None = None  # structured output (response_format): every answer follows it
    # the server's per-request acceptance report ("summary", "detailed"; ServerLimits.spec_decode_metrics)
    acceptance: str | None = None


@dataclasses.dataclass
class Piece:
    text: str
    finish_reason: str | None = None  # set on the last piece
    prompt_tokens: int = 0
    completion_tokens: int = 0
    result: GenerationResult | None = None
    # per token of `text` when the request asks: (token text, logprob, ((alternative, logprob), ...))
    logprobs: list | None = None
    index: int = 0  # the choice it belongs to (n > 1)


@dataclasses.dataclass(frozen=True)
class Served:
    """What a request is checked against: the model's name, the limits, the tokenizer (encode,
    apply_chat_template) and the context length."""

    model_id: str
    limits: ServerLimits
    tokenizer: object
    max_context: int
    draft: str = "none"  # the server's draft method ("none": plain decoding)
    max_draft: int = 0  # the most draft tokens its steps verify
    num_draft: int | str = 0  # its speculation length: N, or "auto" (the cost model's)
    # compiles a request's grammar for the served target (a SpecrtError when it cannot); None: unchecked
    compile: Callable | None = None


def _number(body: dict, name: str, lo: float, hi: float, default, integer: bool = False, lo_open: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind):
        raise RequestError(
            f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}", param=name
        )
    if not math.isfinite(v):  # Python's JSON reader takes NaN and Infinity; every comparison with NaN is False
        raise RequestError(f"'{name}' must be a finite number, got {v}", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=name)
    return v


def too_large(size: int | str, limit: int, over: bool = False) -> RequestError:
    """The 413 of a body of `size` bytes (`over`: at least that many, still arriving)."""
    said = f"over {limit}" if over else f"{size}"
    return RequestError(
        f"request body is {said} bytes; this server takes at most {limit}", status=413, code="request_too_large"
    )


def parse_request(raw: bytes, chat: bool, served: Served) -> Job:
    """The checked job of a request body, or the RequestError that says what is wrong."""
    limits = served.limits
    if len(raw) > limits.max_body_bytes:
        raise too_large(len(raw), limits.max_body_bytes)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise RequestError("request body nests JSON too deeply; send a flat JSON object") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.model_id:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {served.model_id!r} (GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )
    refused = refused_field(body, chat)  # a field not implemented is a 400 naming it, never ignored
    if refused is not None:
        raise RequestError(refused[1], param=refused[0])
    prompt_ids = _chat_prompt(body, served.tokenizer) if chat else _text_prompt(body, served.tokenizer)
    limit = limits.max_tokens
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, 1, limit, limit, integer=True)
    room = served.max_context - len(prompt_ids)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens and the context holds {served.max_context}; shorten it",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 0.0, 2.0, 1.0),  # OpenAI's default; 0 is greedy
            top_p=_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
            top_k=_number(body, "top_k", 0, 1 << 20, 0, integer=True),
            seed=_number(body, "seed", 0, (1 << 63) - 1, None, integer=True),
        )
    except RequestError:
        raise
    except SpecrtError as e:  # a check of SamplingParams' own that the ranges above missed
        raise RequestError(str(e)) from None
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > limits.max_stop:
        raise RequestError(
            f"'stop' must be a non-empty string or a list of up to {limits.max_stop} non-empty strings", param="stop"
        )
    stream = _flag(body, "stream") or False
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    max_draft, speculation = _speculation(body.get("speculation"), served)
    include_usage = bool(opts.get("include_usage", False))
    logprobs = _logprobs(body, chat)
    echo = _flag(body, "echo")
    if echo and logprobs is not None:  # OpenAI's answer would score every prompt token: a prefill's logits
        raise RequestError("'echo' with 'logprobs' is not supported here; ask for one of them", param="echo")
    prompt_text = _text_prompt(body, served.tokenizer, text=True) if echo else ""
    n = _number(body, "n", 1, 1 << 20, 1, integer=True)
    if n > limits.max_batch:
        raise RequestError(
            f"'n' = {n}: this server generates at most {limits.max_batch} answers at once (--max-batch); ask for fewer",
            param="n",
        )
    try:
        grammar = response_format(body.get(FIELD))
        if grammar is not None and served.compile is not None:  # now, not as a failed answer later
            served.compile(grammar)
    except SpecrtError as e:
        raise RequestError(f"'{FIELD}': {e}", param=FIELD) from None
    return Job(
        chat=chat,
        prompt_ids=prompt_ids,
        max_tokens=min(max_tokens, room),
        sampling=sampling,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        max_draft=max_draft,
        speculation=speculation,
        logprobs=logprobs,
        echo=prompt_text,
        n=n,
        grammar=grammar,
        acceptance=None if limits.spec_decode_metrics == "none" else limits.spec_decode_metrics,
    )


def _flag(body: dict, name: str) -> bool | None:
    """A true/false field (None when absent or null)."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {json.dumps(v)[:40]}", param=name)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants with its tokens' logprobs (None: no
    logprobs): chat's `logprobs` true and `top_logprobs` 0-MAX_TOP, completions' `logprobs` 0-5."""
    if not chat:
        return _number(body, "logprobs", 0, 5, None, integer=True)
    wanted = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", 0, MAX_TOP, None, integer=True)
    if top is not None and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _speculation(spec, served: Served) -> tuple[int | None, dict]:
    """specrt's `speculation` field: (the request's cap on draft tokens a step, None for the
    server's; what it runs with). The draft is the server's (one proposer serves every request)
    or "none"; num_draft caps the tokens a step verifies for this request, "auto" leaves the
    server's policy alone."""
    server = {"draft": served.draft, "num_draft": served.num_draft}
    if spec is None:
        return None, server
    if not isinstance(spec, dict):
        raise RequestError(
            '\'speculation\' must be an object such as {"draft": "none"} or {"num_draft": 4}', param="speculation"
        )
    for key in spec:
        if key not in ("draft", "num_draft"):
            raise RequestError(
                f"'speculation.{key}' is not a speculation setting; it takes 'draft' and 'num_draft'",
                param=f"speculation.{key}",
            )
    draft = spec.get("draft", served.draft)
    if draft not in ("none", served.draft):
        raise RequestError(
            f"'speculation.draft' = {json.dumps(draft)[:40]}: this server drafts with {served.draft!r}; give "
            f"{served.draft!r} or 'none' (the draft method is chosen when the server starts: specrt serve --draft)",
            param="speculation.draft",
        )
    num = spec.get("num_draft", "auto")
    if num != "auto" and (isinstance(num, bool) or not isinstance(num, int) or not 0 <= num <= served.max_draft):
        most = f"an integer in [0, {served.max_draft}]" if served.max_draft else "0 (the server runs without a draft)"
        raise RequestError(
            f"'speculation.num_draft' must be 'auto' or {most}, got {json.dumps(num)[:40]}",
            param="speculation.num_draft",
        )
    if draft == "none" or num == 0 or served.max_draft == 0:
        return 0, {"draft": "none", "num_draft": 0}
    if num == "auto":
        return None, server
    return num, {"draft": draft, "num_draft": num}


def _chat_prompt(body: dict, tok) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise RequestError(
                f"messages[{i}] must be an object with role 'system', 'user' or 'assistant'", param=f"messages[{i}]"
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        clean.append({"role": m["role"], "content": content})
    if not any(m["content"].strip() for m in clean):
        raise RequestError("every message is empty; give some text", param="messages")
    return tok.encode(tok.apply_chat_template(clean, add_generation_prompt=True))


def _text_prompt(body: dict, tok, text: bool = False) -> list[int] | str:
    """The completions prompt's token ids (`text`: the prompt itself)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("'prompt' must be a non-empty string", param="prompt")
    return prompt if text else tok.encode(prompt, add_special_tokens=True)  # a BOS where the model takes one


# -- response shapes ------------------------------------------------------------------------------


def request_id(job: Job) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(lasts: list[Piece]) -> dict:
    """Token counts of a request from its choices' last pieces: the prompt once, every choice's
    completion."""
    prompt, completion = lasts[0].prompt_tokens, sum(p.completion_tokens for p in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def metrics_body(job: Job, lasts: list[Piece]) -> dict:
    """vLLM's response-level `metrics` with the answer's acceptance (`speculative_decoding`, as
    runtime/acceptance_report.py counts it) when the server reports it; null where the answer
    carries none: for n > 1 (one generation stream's figures, as vLLM's: only an n = 1 request
    asks, service.choices) and with no drafting; nothing when it is off."""
    if job.acceptance is None:
        return {}
    result = lasts[0].result
    return {"metrics": {"speculative_decoding": None if result is None else result.acceptance}}


def completion_response(job: Job, pieces: Iterator[Piece], model_id: str, extras=None) -> dict:
    """The non-streamed answer, a choice per index; `extras(result)`: specrt's own fields
    (backend, speeds; the first choice's)."""
    texts, lasts, entries = [job.echo] * job.n, [None] * job.n, [[] for _ in range(job.n)]
    for p in pieces:
        texts[p.index] += p.text
        lasts[p.index] = p
        entries[p.index] += p.logprobs or []
    choices = []
    for i, (text, last) in enumerate(zip(texts, lasts)):
        choice = {"index": i, "finish_reason": last.finish_reason, "logprobs": logprobs_body(job, entries[i])}
        choice.update({"message": {"role": "assistant", "content": text}} if job.chat else {"text": text})
        choices.append(choice)
    out = {
        "id": request_id(job),
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": choices,
        "usage": usage(lasts),
    } | metrics_body(job, lasts)
    if lasts[0].result is not None and extras is not None:
        out["specrt"] = extras(lasts[0].result) | {"speculation": job.speculation}
    return out


def logprobs_body(job: Job, entries: list, offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` object of a choice (or of a streamed chunk) for these tokens: chat's
    {"content": [{token, logprob, bytes, top_logprobs}]}, completions' {tokens, token_logprobs,
    top_logprobs, text_offset} (`offset`: where the tokens' text starts in the answer)."""
    if job.logprobs is None:
        return None
    if job.chat:

        def one(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        return {"content": [one(t, lp) | {"top_logprobs": [one(a, x) for a, x in top]} for t, lp, top in entries]}
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


def result_extras(result: GenerationResult, backend: str) -> dict:
    """specrt's fields beside OpenAI's: the backend, prefill time, decode speed, acceptance."""
    extra = {
        "backend": backend,
        "prefill_ms": round(result.prefill_seconds * 1e3, 1),
        "decode_tokens_per_second": round(result.decode_tokens_per_second, 2) if result.generated_tokens > 1 else None,
    }
    m = result.metrics
    if m is not None:
        extra["mean_accepted_length"] = round(m.mean_accepted_length, 3)
        extra["acceptance_rate"] = round(m.acceptance_rate, 3)
    return extra


def models_list(model_id: str) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "specrt"}]}


class SseWriter:
    """The text of OpenAI's streamed chunks, piece by piece (`head`, `piece`, `tail`)."""

    def __init__(self, job: Job, rid: str, model_id: str):
        self.job, self.rid, self.model_id = job, rid, model_id
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if job.chat else "text_completion"
        self.lasts: list[Piece | None] = [None] * job.n  # each choice's latest piece
        self.offsets = [0] * job.n  # completions' text_offset of each choice's next token (no echo with logprobs)

    def _event(self, choices: list, **extra) -> str:
        body = {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model_id}
        return "data: " + json.dumps(body | {"choices": choices, **extra}) + "\n\n"

    def _chunk(
        self, delta_text: str | None, finish: str | None, role: bool = False, logprobs=None, index: int = 0
    ) -> str:
        if self.job.chat:
            delta = ({"role": "assistant"} if role else {}) | (
                {"content": delta_text} if delta_text is not None else {}
            )
            return self._event([{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}])
        return self._event([{"index": index, "text": delta_text or "", "finish_reason": finish, "logprobs": logprobs}])

    def _logprobs(self, p: Piece) -> dict | None:
        if not p.logprobs:
            return None
        out = logprobs_body(self.job, p.logprobs, self.offsets[p.index])
        self.offsets[p.index] += sum(len(t) for t, _, _ in p.logprobs)
        return out

    def head(self) -> list[str]:
        if self.job.chat:
            return [self._chunk(None, None, role=True, index=i) for i in range(self.job.n)]
        return [self._chunk(self.job.echo, None, index=i) for i in range(self.job.n)] if self.job.echo else []

    def piece(self, p: Piece) -> list[str]:
        self.lasts[p.index] = p
        if not (p.text or p.logprobs):
            return []
        return [self._chunk(p.text, None, logprobs=self._logprobs(p), index=p.index)]

    def tail(self) -> list[str]:
        out = [self._chunk(None if self.job.chat else "", p.finish_reason, index=i) for i, p in enumerate(self.lasts)]
        if self.job.include_usage:
            out.append(self._event([], usage=usage(self.lasts), **metrics_body(self.job, self.lasts)))
        return out + ["data: [DONE]\n\n"]

    def error(self, exc: Exception) -> list[str]:
        """A failure after the stream began: OpenAI's error object as the last event."""
        err = exc if isinstance(exc, RequestError) else internal_error(f"generation failed: {exc}")
        return ["data: " + json.dumps(err.body()) + "\n\n", "data: [DONE]\n\n"]


def internal_error(message: str) -> RequestError:
    return RequestError(message, status=500, kind="server_error")
