"""An OpenAI-compatible HTTP server over a generator (plain or speculative).

    specrt serve --artifacts artifacts/SmolLM2-135M-Instruct --draft suffix
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both
with `stream: true` as server-sent events ending in `data: [DONE]`), GET /metrics.

Two layers: `CompletionService` parses and checks a request body (every problem is a 400 in
OpenAI's error format naming the field and the fix; a body over the size limit is a 413, an
unknown model a 404, a full queue a 503) and runs it as a stream of text pieces with stop
sequences applied; `create_app` is the thin FastAPI layer. One engine serves one request at a
time (requests queue up to `max_queue`); a client that disconnects mid-stream ends its
generation and frees the engine.

fastapi / uvicorn are imported only by `create_app` / `serve` (the `server` extra).
"""


import dataclasses
import json
import threading
import time
import uuid
from typing import Iterator

from specrt.errors import PromptError, SpecrtError
from specrt.runtime.generator import GenerationResult, Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import IncrementalDetokenizer


class RequestError(SpecrtError):
    """A request the server refuses; carries the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024  # per request; also the default when a request names none
    max_stop: int = 4
    max_queue: int = 8  # requests that may wait while the engine is busy; more get a 503


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
        raise RequestError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=name)
    return v


class CompletionService:
    def __init__(self, runner, model_id: str, limits: ServerLimits = ServerLimits()):
        """runner: a Generator or a SpeculativeDecoder over one."""
        self.runner = runner
        self.gen: Generator = getattr(runner, "gen", runner)
        if self.gen.tokenizer is None:
            raise SpecrtError("the server needs a generator with a tokenizer")
        self.model_id = model_id
        self.limits = limits
        self._engine = threading.Lock()
        self._waiting = 0
        self._count = threading.Lock()
        self.stats = {"requests": 0, "refused": 0, "prompt_tokens": 0, "completion_tokens": 0, "busy_seconds": 0.0}

    # -- parsing --------------------------------------------------------------------------------

    def parse(self, raw: bytes, chat: bool) -> Job:
        if len(raw) > self.limits.max_body_bytes:
            raise RequestError(f"request body is {len(raw)} bytes; this server takes at most {self.limits.max_body_bytes}", status=413, code="request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise RequestError(f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models)", status=404, param="model", code="model_not_found")
        if body.get("n", 1) != 1:
            raise RequestError("only n = 1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name) not in (None, 0, 0.0):
                raise RequestError(f"'{name}' is not supported (only 0)", param=name)
        if body.get("logprobs") not in (None, False) or body.get("echo") not in (None, False):
            raise RequestError("'logprobs' and 'echo' are not supported", param="logprobs")
        prompt_ids = self._chat_prompt(body) if chat else self._text_prompt(body)
        limit = self.limits.max_tokens
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, 1, limit, limit, integer=True)
        room = self.gen.max_context - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens and the context holds {self.gen.max_context}; shorten it",
                param="messages" if chat else "prompt", code="context_length_exceeded",
            )
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 0.0, 2.0, 1.0),  # OpenAI's default; 0 is greedy
            top_p=_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
            top_k=_number(body, "top_k", 0, 1 << 20, 0, integer=True),
            seed=_number(body, "seed", -(1 << 63), (1 << 63) - 1, None, integer=True),
        )
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > self.limits.max_stop:
            raise RequestError(f"'stop' must be a non-empty string or a list of up to {self.limits.max_stop} non-empty strings", param="stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be true or false", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        return Job(chat, prompt_ids, min(max_tokens, room), sampling, stop, stream, bool(opts.get("include_usage", False)))

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise RequestError(f"messages[{i}] must be an object with role 'system', 'user' or 'assistant'", param=f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise RequestError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
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

    def run(self, job: Job) -> Iterator[Piece]:
        """Text pieces as they are produced, the last one with finish_reason and token counts.
        Waits for the engine (503 when too many wait); closing the iterator ends the generation."""
        with self._count:
            if self._engine.locked() and self._waiting >= self.limits.max_queue:
                self.stats["refused"] += 1
                raise RequestError(f"the server is busy ({self._waiting} requests waiting); retry later", status=503, code="server_busy", kind="server_error")
            self._waiting += 1
        try:
            self._engine.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        t0 = time.perf_counter()
        try:
            yield from self._generate(job)
        finally:
            self._engine.release()
            self.stats["busy_seconds"] += time.perf_counter() - t0

    def _generate(self, job: Job) -> Iterator[Piece]:
        gen = self.gen
        try:
            gen.check_prompts([job.prompt_ids])
        except PromptError as e:
            raise RequestError(str(e), code="context_length_exceeded") from None
        self.stats["requests"] += 1
        steps = self.runner.iter_generate([job.prompt_ids], job.max_tokens, job.sampling)
        detok = IncrementalDetokenizer(gen.tokenizer)
        text, sent, count = "", 0, 0
        hold = max((len(s) for s in job.stop), default=1) - 1  # text that may start a stop sequence is held back
        result, finish = None, "length"
        try:
            while True:
                try:
                    new = next(steps)
                except StopIteration as stop:
                    result = stop.value[0]
                    finish = result.finish_reason
                    break
                for t in new[0]:
                    count += 1
                    if t not in gen.eos_ids:
                        text += detok.push(t)
                cut = min((i for i in (text.find(s, max(0, sent - hold)) for s in job.stop) if i >= 0), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                    break
                safe = len(text) - hold if job.stop else len(text)
                if safe > sent:
                    yield Piece(text[sent:safe])
                    sent = safe
        finally:
            steps.close()  # a stop sequence or a gone client: end the generation, free its cache
        self.stats["prompt_tokens"] += len(job.prompt_ids)
        self.stats["completion_tokens"] += count
        yield Piece(text[sent:], finish, len(job.prompt_ids), count, result)

    # -- OpenAI response shapes -----------------------------------------------------------------

    def response(self, job: Job, pieces: Iterator[Piece]) -> dict:
        text, last = "", None
        for p in pieces:
            text += p.text
            last = p
        rid, created = self._id(job), int(time.time())
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if job.chat else {"text": text})
        out = {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": created, "model": self.model_id,
               "choices": [choice], "usage": self._usage(last)}
        if last.result is not None:
            out["specrt"] = self._extras(last.result)
        return out

    def events(self, job: Job, pieces: Iterator[Piece]) -> Iterator[str]:
        """Server-sent events: one chunk per piece, then the finish chunk, usage if asked, [DONE]."""
        rid, created = self._id(job), int(time.time())
        kind = "chat.completion.chunk" if job.chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
            if job.chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": delta_text} if delta_text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": self.model_id, "choices": [choice]}) + "\n\n"

        if job.chat:
            yield chunk(None, None, role=True)
        last = None
        for p in pieces:
            last = p
            if p.text:
                yield chunk(p.text, None)
        yield chunk(None if job.chat else "", last.finish_reason)
        if job.include_usage:
            yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": self.model_id, "choices": [], "usage": self._usage(last)}) + "\n\n"
        yield "data: [DONE]\n\n"

    def _id(self, job: Job) -> str:
        return ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]

    @staticmethod
    def _usage(last: Piece) -> dict:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens, "total_tokens": last.prompt_tokens + last.completion_tokens}

    def _extras(self, result: GenerationResult) -> dict:
        extra = {"backend": self.gen.backend.description, "prefill_ms": round(result.prefill_seconds * 1e3, 1),
                 "decode_tokens_per_second": round(result.decode_tokens_per_second, 2) if result.generated_tokens > 1 else None}
        m = result.metrics
        if m is not None:
            extra.update({"mean_accepted_length": round(m.mean_accepted_length, 3), "acceptance_rate": round(m.acceptance_rate, 3)})
        return extra

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "specrt"}]}


def create_app(service: CompletionService):
    """The FastAPI app: routes map onto the service; RequestError becomes OpenAI's error JSON."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="specrt", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def _refused(request, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def read(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > service.limits.max_body_bytes:
            raise RequestError(f"request body is {declared} bytes; this server takes at most {service.limits.max_body_bytes}", status=413, code="request_too_large")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > service.limits.max_body_bytes:
                raise RequestError(f"request body is over {service.limits.max_body_bytes} bytes", status=413, code="request_too_large")
        return raw

    def respond(job: Job):
        pieces = service.run(job)
        first = next(pieces)  # waits for the engine and prefills; refusals surface here, as a status
        pieces = _chain(first, pieces)
        if job.stream:
            return StreamingResponse(service.events(job, pieces), media_type="text/event-stream")
        return JSONResponse(service.response(job, pieces))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        job = service.parse(await read(request), chat=True)
        return await _in_thread(respond, job)

    @app.post("/v1/completions")
    async def completions(request: Request):
        job = service.parse(await read(request), chat=False)
        return await _in_thread(respond, job)

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_id, "backend": service.gen.backend.description}

    @app.get("/metrics")
    async def metrics():
        return service.stats

    return app


def _chain(first: Piece, rest: Iterator[Piece]) -> Iterator[Piece]:
    try:
        yield first
        yield from rest
    finally:
        rest.close()


async def _in_thread(fn, *args):
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def serve(service: CompletionService, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(create_app(service), host=host, port=port, log_level="info")
