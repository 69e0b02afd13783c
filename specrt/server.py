"""An OpenAI-compatible HTTP server over a generator (plain or speculative).

    specrt serve --artifacts artifacts/SmolLM2-135M-Instruct --draft suffix
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both
with `stream: true` as server-sent events ending in `data: [DONE]`), GET /metrics (Prometheus's
text format: server_metrics.py), GET /stats (the same counters as JSON).

Two layers: `CompletionService` parses and checks a request body (every problem is a 400 in
OpenAI's error format naming the field and the fix; a body over the size limit is a 413, an
unknown model a 404, a full queue a 503) and runs it as a stream of text pieces with stop
sequences applied; `create_app` is the thin FastAPI layer.

One engine thread owns the generator and runs a continuous batch (runtime/batching.py): up to
`max_batch` requests generate together, joining and leaving between steps; more wait, at most
`max_queue` of them (beyond that a 503 with Retry-After). Each request is a `Ticket`: the engine
thread puts its pieces there; between steps it checks every ticket's cancel flag and age. The
HTTP layer cancels a ticket as soon as it sees the client disconnect (streamed or not), and a
stop sequence or the per-request time limit (`request_timeout`: a 504) ends it the same way: its
slot and cache row are free for the next request within one step. Nothing waits for the garbage
collector to close an abandoned generation, and no lock is held across an HTTP write.

fastapi / uvicorn are imported only by `create_app` / `serve` (the `server` extra).
"""

import asyncio
import dataclasses
import json
import math
import os
import queue
import threading
import time
import uuid
from typing import AsyncIterator, Iterator

from specrt.errors import PromptError, SpecrtError
from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.generator import GenerationResult, Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder
from specrt.runtime.tokenizer import IncrementalDetokenizer
from specrt.server_fields import refused_field
from specrt.server_limits import ServerLimits
from specrt.server_metrics import ServerMetrics


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


@dataclasses.dataclass
class Job:
    """A checked request."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


@dataclasses.dataclass
class Piece:
    text: str
    finish_reason: str | None = None  # set on the last piece
    prompt_tokens: int = 0
    completion_tokens: int = 0
    result: GenerationResult | None = None


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


_END = object()  # the engine thread's last item on a ticket


class Ticket:
    """One request between the HTTP layer and the engine thread.

    The engine thread `put`s pieces (and, on failure, the exception) and finally `_END`; the
    consumer reads them synchronously (`__iter__`) or, given an event loop, asynchronously
    (`next_async`). `cancel()` may come from any thread: the engine thread stops the generation
    at its next step and frees the cache; a ticket still in the queue is never started."""

    def __init__(self, job: "Job", loop: asyncio.AbstractEventLoop | None = None):
        self.job = job
        self.received = time.perf_counter()  # time to first token counts from here
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._loop = loop
        self._ready = asyncio.Event() if loop is not None else None
        self.done = threading.Event()  # set after the engine thread let go of the ticket

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def put(self, item) -> None:
        self._items.put(item)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is closed: nobody will read this ticket any more
                self.cancel()

    @staticmethod
    def _take(item):
        """A piece or _END; the engine thread's exception is raised here, in the consumer."""
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator["Piece"]:
        try:
            while (item := self._take(self._items.get())) is not _END:
                yield item
        finally:
            self.cancel()  # a consumer that stops reading ends the generation

    async def next_async(self) -> "Piece":
        """The next piece; StopAsyncIteration after the last one."""
        while True:
            try:
                item = self._take(self._items.get_nowait())
            except queue.Empty:
                await self._ready.wait()
                self._ready.clear()
                continue
            if item is _END:
                raise StopAsyncIteration
            return item


class _Reply:
    """One request's text on its way out: tokens become text (incremental detokenizing), text
    that could be the start of a stop sequence is held back, and the time to first token and
    between tokens go to the metrics."""

    def __init__(self, service: "CompletionService", ticket: Ticket):
        self.ticket, self.service = ticket, service
        self.detok = IncrementalDetokenizer(service.gen.tokenizer)
        self.text, self.sent, self.count = "", 0, 0
        self.stop = ticket.job.stop
        self.hold = max((len(x) for x in self.stop), default=1) - 1  # text that may start a stop sequence
        self.last_out: float | None = None  # when the previous tokens came out

    def push(self, tokens: list[int]) -> bool:
        """New tokens of a step: send what is safe to send; True when a stop sequence appeared
        (the text is cut before it)."""
        if not tokens:
            return False
        now, metrics = time.perf_counter(), self.service.metrics
        if self.last_out is None:
            metrics.ttft.observe(now - self.ticket.received)
            if len(tokens) > 1:
                metrics.tokens_out(now - self.ticket.received, len(tokens) - 1)
        else:
            metrics.tokens_out(now - self.last_out, len(tokens))
        self.last_out = now
        eos = self.service.gen.eos_ids
        for t in tokens:
            self.count += 1
            if t not in eos:
                self.text += self.detok.push(t)
        start = max(0, self.sent - self.hold)
        cut = min((i for i in (self.text.find(x, start) for x in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return True
        safe = len(self.text) - self.hold if self.stop else len(self.text)
        if safe > self.sent:
            self.ticket.put(Piece(self.text[self.sent : safe]))
            self.sent = safe
        return False

    def last(self, finish: str, result: GenerationResult | None) -> Piece:
        """The last piece: the rest of the text, why it ended, the token counts."""
        return Piece(self.text[self.sent :], finish, len(self.ticket.job.prompt_ids), self.count, result)


class CompletionService:
    def __init__(self, runner, model_id: str, limits: ServerLimits = ServerLimits()):
        """runner: a Generator or a SpeculativeDecoder over one."""
        self.runner = runner
        self.gen: Generator = runner.gen  # a Generator is its own
        if self.gen.tokenizer is None:
            raise SpecrtError("the server needs a generator with a tokenizer")
        self.model_id = model_id
        self.limits = limits
        self.engine = BatchEngine(runner, max_batch=limits.max_batch, prefill_budget=limits.prefill_budget)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # tickets for the engine thread; None: close
        self._lock = threading.Lock()  # guards the counts below and the worker's start
        self._open = 0  # tickets accepted and not yet closed: what admission counts
        self._inbox_count = 0  # tickets in the inbox
        self._engine_waiting = 0  # tickets the engine holds without a slot (published after each step)
        self._running = 0  # tickets in slots (published after each step)
        self._worker: threading.Thread | None = None
        self._live: dict[int, _Reply] = {}  # engine request id -> its reply (engine thread only)
        self.metrics = ServerMetrics()
        self.draft_method = runner.proposer.name if isinstance(runner, SpeculativeDecoder) else None
        self.stats = {
            "requests": 0,
            "refused": 0,
            "cancelled": 0,
            "timed_out": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "busy_seconds": 0.0,
        }

    @property
    def busy(self) -> bool:
        """Some request is generating (or prefilling)."""
        return self._running > 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        """Requests accepted and not yet in a slot."""
        return self._inbox_count + self._engine_waiting

    def close(self) -> None:
        """Stop the engine thread once every accepted request is done (queued ones are run first)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._inbox.put(None)
            worker.join()

    # -- parsing --------------------------------------------------------------------------------

    def parse(self, raw: bytes, chat: bool) -> Job:
        if len(raw) > self.limits.max_body_bytes:
            raise RequestError(
                f"request body is {len(raw)} bytes; this server takes at most {self.limits.max_body_bytes}",
                status=413,
                code="request_too_large",
            )
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON ({e}); send a JSON object") from None
        except RecursionError:
            raise RequestError("request body nests JSON too deeply; send a flat JSON object") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise RequestError(
                f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )
        refused = refused_field(body, chat)  # a field not implemented is a 400 naming it, never ignored
        if refused is not None:
            raise RequestError(refused[1], param=refused[0])
        prompt_ids = self._chat_prompt(body) if chat else self._text_prompt(body)
        limit = self.limits.max_tokens
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, 1, limit, limit, integer=True)
        room = self.gen.max_context - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens and the context holds {self.gen.max_context}; shorten it",
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
        if (
            not isinstance(stop, list)
            or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > self.limits.max_stop
        ):
            raise RequestError(
                f"'stop' must be a non-empty string or a list of up to {self.limits.max_stop} non-empty strings",
                param="stop",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be true or false", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        return Job(
            chat, prompt_ids, min(max_tokens, room), sampling, stop, stream, bool(opts.get("include_usage", False))
        )

    def _chat_prompt(self, body: dict) -> list[int]:
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
        tok = self.gen.tokenizer
        return tok.encode(tok.apply_chat_template(clean, add_generation_prompt=True))

    def _text_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("'prompt' must be a non-empty string", param="prompt")
        return self.gen.tokenizer.encode(prompt)

    # -- running --------------------------------------------------------------------------------

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop | None = None) -> Ticket:
        """Hand a request to the engine thread; its pieces arrive on the returned ticket. The
        server holds `max_batch` requests in slots and `max_queue` more waiting: every request
        accepted and not yet answered counts, whether the engine thread has taken it yet or not
        (a burst into an idle server fills the slots first), and one more gets a 503."""
        ticket = Ticket(job, loop)
        limits = self.limits
        with self._lock:
            if self._open >= limits.max_batch + limits.max_queue:
                self.stats["refused"] += 1
                self.metrics.requests.labels("refused").inc()
                raise RequestError(
                    f"the server is busy ({limits.max_batch} requests generating, {self._open - limits.max_batch} "
                    "waiting); retry later",
                    status=503,
                    code="server_busy",
                    kind="server_error",
                    headers={"Retry-After": "1"},
                )
            self._open += 1
            self._inbox_count += 1
            self.metrics.queue_depth.set(self.waiting)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="specrt-engine", daemon=True)
                self._worker.start()
        self._inbox.put(ticket)
        return ticket

    def run(self, job: Job) -> Iterator[Piece]:
        """Text pieces as they are produced, the last one with finish_reason and token counts.
        Closing the iterator (or leaving it unread) cancels the generation."""
        return iter(self.submit(job))

    # -- the engine thread ----------------------------------------------------------------------

    def _work(self) -> None:
        """The engine thread: takes tickets into the batch, steps it, hands out the pieces, ends
        cancelled and overdue requests; until `close` and every accepted request is done."""
        closing = False
        while True:
            closing = self._take_tickets(block=not self._live and not closing) or closing
            if closing and not self._live:
                return
            self._end_cancelled()
            if not self._live:
                continue
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as e:  # a failed step fails the requests in it; the server goes on
                error = RequestError(f"generation failed: {type(e).__name__}: {e}", status=500, kind="server_error")
                for rid in list(self._live):
                    self.engine.cancel(rid)  # their slots are free again
                    self._end(rid, error=error)
                continue
            finally:
                self._publish()
                self.stats["busy_seconds"] += time.perf_counter() - t0
            self.metrics.batch_size.set(int(self.engine.rows.active.sum()))
            for ev in events:
                reply = self._live.get(ev.rid)
                if reply is None:
                    continue
                stopped = reply.push(ev.tokens)
                if stopped or ev.result is not None:
                    if stopped:
                        self.engine.cancel(ev.rid)
                    self._end(ev.rid, "stop" if stopped else ev.result.finish_reason, ev.result)

    def _take_tickets(self, block: bool) -> bool:
        """Move tickets from the inbox into the engine; True once `close` was asked."""
        closing = False
        while True:
            try:
                ticket = self._inbox.get(block=block)
            except queue.Empty:
                break
            block = False
            if ticket is None:
                closing = True
                continue
            with self._lock:
                self._inbox_count -= 1
            if ticket.cancelled:  # the client left before its request started
                self.stats["cancelled"] += 1
                self.metrics.requests.labels("cancelled").inc()
                self._close_ticket(ticket)
                continue
            job = ticket.job
            try:
                rid = self.engine.submit(Request(job.prompt_ids, job.max_tokens, job.sampling))
            except PromptError as e:
                self.metrics.requests.labels("refused").inc()
                self._close_ticket(ticket, RequestError(str(e), code="context_length_exceeded"))
                continue
            self.stats["requests"] += 1
            self._live[rid] = _Reply(self, ticket)
        self._publish()
        return closing

    def _end_cancelled(self) -> None:
        """End the requests whose client left and those past the time limit."""
        now = time.perf_counter()
        for rid, reply in list(self._live.items()):
            if reply.ticket.cancelled:
                self.engine.cancel(rid)
                self._end(rid, "cancelled")
            elif now - reply.ticket.received > self.limits.request_timeout:
                self.engine.cancel(rid)
                self.stats["timed_out"] += 1
                limit = self.limits.request_timeout
                self._end(
                    rid,
                    error=RequestError(
                        f"the request ran past the server's time limit of {limit:g} s; ask for fewer tokens "
                        "(max_tokens) or retry when the server is less busy",
                        status=504,
                        code="timeout",
                        kind="server_error",
                    ),
                )
        self._publish()

    def _end(self, rid: int, finish: str = "error", result: GenerationResult | None = None, error=None) -> None:
        """A request is over: its last piece (or its error) goes out and its ticket closes."""
        reply = self._live.pop(rid)
        job = reply.ticket.job
        self.stats["prompt_tokens"] += len(job.prompt_ids)
        self.stats["completion_tokens"] += reply.count
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.completion_tokens.inc(reply.count)
        if error is not None:
            self.metrics.requests.labels("error").inc()
            self._close_ticket(reply.ticket, error)
            return
        if finish == "cancelled":
            self.stats["cancelled"] += 1
        self.metrics.requests.labels("cancelled" if finish == "cancelled" else "ok").inc()
        m = result.metrics if result is not None else None
        if m is not None and self.draft_method is not None:
            self.metrics.speculation(self.draft_method, m.drafted_tokens, m.accepted_tokens, m.steps)
        reply.ticket.put(reply.last(finish, result))
        self._close_ticket(reply.ticket)

    def _close_ticket(self, ticket: Ticket, error: Exception | None = None) -> None:
        """The ticket's last item; its place counts for admission no more."""
        if error is not None:
            ticket.put(error)
        ticket.put(_END)
        with self._lock:
            self._open -= 1
        ticket.done.set()

    def _publish(self) -> None:
        with self._lock:
            self._engine_waiting = len(self.engine.waiting)
            self._running = self.engine.running
            self.metrics.queue_depth.set(self.waiting)

    # -- OpenAI response shapes -----------------------------------------------------------------

    def response(self, job: Job, pieces: Iterator[Piece]) -> dict:
        text, last = "", None
        for p in pieces:
            text += p.text
            last = p
        rid, created = self._id(job), int(time.time())
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if job.chat else {"text": text})
        out = {
            "id": rid,
            "object": "chat.completion" if job.chat else "text_completion",
            "created": created,
            "model": self.model_id,
            "choices": [choice],
            "usage": self._usage(last),
        }
        if last.result is not None:
            out["specrt"] = self._extras(last.result)
        return out

    def events(self, job: Job) -> "SseWriter":
        """Server-sent events for a streamed answer: one chunk per piece, then the finish chunk,
        usage if asked, [DONE]."""
        return SseWriter(job, self._id(job), self.model_id)

    def _id(self, job: Job) -> str:
        return ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]

    @staticmethod
    def _usage(last: Piece) -> dict:
        return {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
        }

    def _extras(self, result: GenerationResult) -> dict:
        extra = {
            "backend": self.gen.backend.description,
            "prefill_ms": round(result.prefill_seconds * 1e3, 1),
            "decode_tokens_per_second": round(result.decode_tokens_per_second, 2)
            if result.generated_tokens > 1
            else None,
        }
        m = result.metrics
        if m is not None:
            extra.update(
                {
                    "mean_accepted_length": round(m.mean_accepted_length, 3),
                    "acceptance_rate": round(m.acceptance_rate, 3),
                }
            )
        return extra

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "specrt"}],
        }


class SseWriter:
    """The text of OpenAI's streamed chunks, piece by piece (`head`, `piece`, `tail`)."""

    def __init__(self, job: Job, rid: str, model_id: str):
        self.job, self.rid, self.model_id = job, rid, model_id
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if job.chat else "text_completion"
        self.last: Piece | None = None

    def _event(self, choices: list, **extra) -> str:
        body = {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": self.model_id,
            "choices": choices,
            **extra,
        }
        return "data: " + json.dumps(body) + "\n\n"

    def _chunk(self, delta_text: str | None, finish: str | None, role: bool = False) -> str:
        if self.job.chat:
            delta = ({"role": "assistant"} if role else {}) | (
                {"content": delta_text} if delta_text is not None else {}
            )
            return self._event([{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])
        return self._event([{"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}])

    def head(self) -> list[str]:
        return [self._chunk(None, None, role=True)] if self.job.chat else []

    def piece(self, p: Piece) -> list[str]:
        self.last = p
        return [self._chunk(p.text, None)] if p.text else []

    def tail(self) -> list[str]:
        out = [self._chunk(None if self.job.chat else "", self.last.finish_reason)]
        if self.job.include_usage:
            out.append(self._event([], usage=CompletionService._usage(self.last)))
        return out + ["data: [DONE]\n\n"]

    def error(self, exc: Exception) -> list[str]:
        """A failure after the stream began: OpenAI's error object as the last event."""
        err = (
            exc
            if isinstance(exc, RequestError)
            else RequestError(f"generation failed: {exc}", status=500, kind="server_error")
        )
        return ["data: " + json.dumps(err.body()) + "\n\n", "data: [DONE]\n\n"]


async def _cancel_on_disconnect(receive, ticket: Ticket) -> None:
    """Cancel the ticket when the client goes away (ASGI's http.disconnect)."""
    while not ticket.done.is_set():
        message = await receive()
        if message["type"] == "http.disconnect":
            ticket.cancel()
            return


def create_app(service: CompletionService):
    """The FastAPI app: routes map onto the service; RequestError becomes OpenAI's error JSON."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    class TicketStream(StreamingResponse):
        """A streamed answer that cancels its ticket however the response ends: finished,
        client gone (Starlette stops the body when it sees http.disconnect), or failed."""

        def __init__(self, ticket: Ticket, content):
            super().__init__(content, media_type="text/event-stream")
            self.ticket = ticket

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.ticket.cancel()

    app = FastAPI(title="specrt", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def _refused(request, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _failed(request, exc: Exception):
        err = RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    async def read(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > service.limits.max_body_bytes:
            raise RequestError(
                f"request body is {declared} bytes; this server takes at most {service.limits.max_body_bytes}",
                status=413,
                code="request_too_large",
            )
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > service.limits.max_body_bytes:
                raise RequestError(
                    f"request body is over {service.limits.max_body_bytes} bytes", status=413, code="request_too_large"
                )
        return raw

    async def respond(request: Request, chat: bool):
        job = await run_in_threadpool(service.parse, await read(request), chat)
        ticket = service.submit(job, asyncio.get_running_loop())
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, ticket))
        try:
            try:
                first = (
                    await ticket.next_async()
                )  # waits for the engine and prefills; refusals surface here, as a status
            except StopAsyncIteration:  # cancelled while it waited: the client is gone, nobody reads this
                return JSONResponse(
                    {
                        "error": {
                            "message": "client closed the request",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "client_closed_request",
                        }
                    },
                    status_code=499,
                )
            if job.stream:
                watcher.cancel()  # from here on Starlette's streaming response watches the client
                return TicketStream(ticket, _sse(service.events(job), ticket, first))
            pieces = [first]
            while True:
                try:
                    pieces.append(await ticket.next_async())
                except StopAsyncIteration:
                    break
            return JSONResponse(service.response(job, iter(pieces)))
        except BaseException:
            ticket.cancel()
            raise
        finally:
            watcher.cancel()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": service.model_id,
            "backend": service.gen.backend.description,
            "busy": service.busy,
            "running": service.running,
            "waiting": service.waiting,
            "pid": os.getpid(),  # which process answered (replicas behind Ray Serve each have their own)
        }

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import Response

        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/stats")
    async def stats():
        return service.stats

    return app


async def _sse(writer: SseWriter, ticket: Ticket, first: Piece) -> AsyncIterator[str]:
    for event in writer.head():
        yield event
    piece = first
    while True:
        for event in writer.piece(piece):
            yield event
        try:
            piece = await ticket.next_async()
        except StopAsyncIteration:
            break
        except Exception as e:
            for event in writer.error(e):
                yield event
            return
    for event in writer.tail():
        yield event


def bind_socket(host: str, port: int):
    """A listening socket on host:port, or a SpecrtError that says what holds the port and what
    to change. Binding before the server starts means "serving on ..." is only said once true."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            holder = _port_holder(port)
            raise SpecrtError(
                f"port {port} on {host} is already in use{f' by {holder}' if holder else ''}; stop that process "
                f"or choose another port with --port"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
            raise SpecrtError(
                f"cannot listen on {host}: no such address on this machine; use --host 127.0.0.1 or 0.0.0.0"
            ) from None
        raise SpecrtError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --host or --port") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _port_holder(port: int) -> str | None:
    """'process NAME (pid N)' listening on `port`, read from /proc (Linux; None elsewhere or when unreadable)."""
    import os
    from pathlib import Path

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                    inodes.add(f[9])
        except (OSError, ValueError, IndexError):
            continue
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    return f"process {name} (pid {pid})"
        except OSError:
            continue
    return None


def serve(service: CompletionService, sock, log_level: str = "info") -> None:
    """Run the app on a socket from `bind_socket` until interrupted."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level=log_level))
    try:
        server.run(sockets=[sock])
    finally:
        service.close()
