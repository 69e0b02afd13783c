"""The FastAPI app over a CompletionService: routes, OpenAI's error JSON, streaming, disconnects.

    GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with
    `stream: true` as server-sent events ending in `data: [DONE]`), GET /metrics (Prometheus's
    text format: metrics.py), GET /stats (the same counters as JSON)

fastapi / uvicorn are imported only by `create_app` / `serve` (the `server` extra).
"""

import asyncio
import os
from typing import AsyncIterator

from specrt.server.protocol import CLIENT_CLOSED, Piece, RequestError, SseWriter, internal_error, outcome_of, too_large
from specrt.server.service import CompletionService, Ticket


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
        err = internal_error(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    async def read(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > service.limits.max_body_bytes:
            raise too_large(declared, service.limits.max_body_bytes)
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > service.limits.max_body_bytes:
                raise too_large(len(raw), service.limits.max_body_bytes, over=True)
        return raw

    async def respond(request: Request, chat: bool):
        try:
            raw = await read(request)
        except RequestError as e:  # too large: refused before the service saw it
            service.count(outcome_of(e.status))
            raise
        job = await run_in_threadpool(service.parse, raw, chat)  # counts its own refusals
        ticket = service.submit(job, asyncio.get_running_loop())
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, ticket))
        try:
            try:
                first = (
                    await ticket.next_async()
                )  # waits for the engine and prefills; refusals surface here, as a status
            except StopAsyncIteration:  # cancelled while it waited: the client is gone, nobody reads this
                return JSONResponse(CLIENT_CLOSED.body(), status_code=499)
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


def serve(service: CompletionService, sock, log_level: str = "info") -> None:
    """Run the app on a socket from `bind_socket` until interrupted."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level=log_level))
    try:
        server.run(sockets=[sock])
    finally:
        service.close()
