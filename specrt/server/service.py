"""The service behind the HTTP routes: admission, the engine thread, each request's ticket.

One engine thread owns the generator and runs a continuous batch (runtime/batching.py): up to
`max_batch` requests generate together, joining and leaving between steps; more wait, at most
`max_queue` of them (beyond that a 503 with Retry-After). Each request is a `Ticket`: the engine
thread puts its pieces there; between steps it checks every ticket's cancel flag and age. The
HTTP layer cancels a ticket as soon as it sees the client disconnect (streamed or not), and a
stop sequence or the per-request time limit (`request_timeout`: a 504) ends it the same way: its
slot and cache row are free for the next request within one step. Nothing waits for the garbage
collector to close an abandoned generation, and no lock is held across an HTTP write.

Every request's outcome is counted once, where it is decided (a refused body in `parse`, a full
server in `submit`, the rest on the engine thread), in the metrics that /metrics and /stats read.
"""

import asyncio
import dataclasses
import queue
import threading
import time
from typing import Iterator

import numpy as np

from specrt.errors import PromptError, SpecrtError
from specrt.runtime.batching import BatchEngine, Request, decoder_of
from specrt.runtime.prefix_cache import PrefixCache
from specrt.runtime.target import GenerationResult, Target
from specrt.runtime.tokenizer import IncrementalDetokenizer
from specrt.server.limits import ServerLimits
from specrt.server.metrics import ServerMetrics
from specrt.server.protocol import (
    Job,
    Piece,
    RequestError,
    Served,
    SseWriter,
    completion_response,
    internal_error,
    models_list,
    outcome_of,
    parse_request,
    request_id,
    result_extras,
)

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
        self.running = 0  # its choices still generating (engine thread only)
        self.cancelled_choice = False  # one of them ended cancelled

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


WINDOW = 4  # tokens of context a token's text is decoded after (logprobs)


class _Reply:
    """One request's text on its way out: tokens become text (incremental detokenizing), text
    that could be the start of a stop sequence is held back, and the time to first token and
    between tokens go to the metrics."""

    def __init__(self, service: "CompletionService", ticket: Ticket, index: int = 0):
        self.ticket, self.service, self.index = ticket, service, index
        self.detok = IncrementalDetokenizer(service.gen.tokenizer)
        self.text, self.sent, self.count = "", 0, 0
        self.stop = ticket.job.stop
        self.hold = max((len(x) for x in self.stop), default=1) - 1  # text that may start a stop sequence
        self.last_out: float | None = None  # when the previous tokens came out
        self.logprobs: list | None = [] if ticket.job.logprobs is not None else None  # not yet sent
        self.window: list[int] = []  # the last tokens, the context each token's text is read in

    def push(self, tokens: list[int], logprobs: list | None = None) -> bool:
        """New tokens of a step (and their TokenLogprobs when the request asked): send what is
        safe to send; True when a stop sequence appeared (the text is cut before it). Every
        token counted has its logprobs entry, the end-of-sequence token's included (it adds no
        text: its entry's token is ""), and a stop sequence ends both at the token that
        completed it: a step's tokens after it are neither counted nor reported (as vLLM)."""
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
        scores = logprobs if self.logprobs is not None else None
        for i, t in enumerate(tokens):
            self.count += 1
            if scores:
                self.logprobs.append(self._render(scores[i], t in eos))
            if t in eos:
                continue
            self.text += self.detok.push(t)
            cut = self._stop_at()
            if cut >= 0:
                self.text = self.text[:cut]
                return True
        safe = len(self.text) - self.hold if self.stop else len(self.text)
        if safe > self.sent:
            self.ticket.put(Piece(self.text[self.sent : safe], logprobs=self._take_logprobs(), index=self.index))
            self.sent = safe
        return False

    def _stop_at(self) -> int:
        """Where the first stop sequence begins in the text not yet sent (and the held back
        text before it); -1: none."""
        start = max(0, self.sent - self.hold)
        return min((i for i in (self.text.find(x, start) for x in self.stop) if i >= 0), default=-1)

    def _render(self, lp, end: bool = False) -> tuple:
        """A TokenLogprob as the protocol shows it, each token as the text it adds after the
        answer's previous tokens (decoded alone, a word-level or SentencePiece token would lose
        its leading space), so the tokens' texts concatenate to the answer; `end`: the token is
        the end of sequence, which adds none."""
        decode = self.service.gen.tokenizer.decode
        before = decode(self.window)

        def text(t: int) -> str:
            return decode([*self.window, t])[len(before) :]

        out = "" if end else text(lp.token), lp.logprob, tuple((text(t), x) for t, x in lp.top)
        self.window = [*self.window, lp.token][-WINDOW:]
        return out

    def _take_logprobs(self) -> list | None:
        out = self.logprobs
        if out is not None:
            self.logprobs = []
        return out

    def last(self, finish: str, result: GenerationResult | None) -> Piece:
        """The last piece: the rest of the text, why it ended, the token counts."""
        prompt = len(self.ticket.job.prompt_ids)
        return Piece(self.text[self.sent :], finish, prompt, self.count, result, self._take_logprobs(), self.index)


def choices(job: Job) -> list[Request]:
    """The engine requests of a job: one per choice (`n`), each with its own random stream: the
    first with the request's seed (so n = 1 is the request alone), choice i with a seed drawn
    from (seed, i); unseeded, each from fresh entropy."""
    out = []
    for i in range(job.n):
        sampling = job.sampling
        if i and sampling.seed is not None:
            seed = int(np.random.SeedSequence([sampling.seed, i]).generate_state(1, np.uint64)[0] >> 1)
            sampling = dataclasses.replace(sampling, seed=seed)
        out.append(
            Request(
                job.prompt_ids,
                job.max_tokens,
                sampling,
                max_draft=job.max_draft,
                logprobs=job.logprobs,
                grammar=job.grammar,
                acceptance=job.acceptance if job.n == 1 else None,
            )
        )
    return out


class CompletionService:
    def __init__(self, runner, model_id: str, limits: ServerLimits = ServerLimits()):
        """runner: a Generator or a SpeculativeDecoder over one (the engine steps with its `decoder`)."""
        self.runner = runner
        decoder = decoder_of(runner)
        self.gen: Target = decoder.gen
        if self.gen.tokenizer is None:
            raise SpecrtError("the server needs a generator with a tokenizer")
        self.model_id = model_id
        self.limits = limits
        self.served = Served(
            model_id,
            limits,
            self.gen.tokenizer,
            self.gen.max_context,
            decoder.proposer.name,
            decoder.policy.max_draft,
            decoder.policy.setting,
            lambda grammar: self.gen.vocabulary().matcher(grammar),
        )
        # a draft that reads the target's features needs every prompt position's: no cached prompts
        features = limits.prefix_cache_mb and decoder.needs_features
        self.prefix_cache = (
            PrefixCache(limits.prefix_cache_mb << 20) if limits.prefix_cache_mb and not features else None
        )
        self.notes = [
            f"prefix cache off: draft {decoder.proposer.name!r} reads the target's features, which cached prompts "
            "do not keep"
        ] if features else []  # fmt: skip
        self.engine = BatchEngine(
            runner, max_batch=limits.max_batch, prefill_budget=limits.prefill_budget, prefix_cache=self.prefix_cache
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # tickets for the engine thread; None: close
        self._lock = threading.Lock()  # guards the counts below and the worker's start
        self._open = 0  # tickets accepted and not yet closed: what admission counts
        self._inbox_count = 0  # tickets in the inbox
        self._engine_waiting = 0  # tickets the engine holds without a slot (published after each step)
        self._running = 0  # tickets in slots (published after each step)
        self._worker: threading.Thread | None = None
        self._live: dict[int, _Reply] = {}  # engine request id -> its reply (engine thread only)
        self.metrics = ServerMetrics()
        if self.engine.prefix is not None:
            self.metrics.watch_prefix_cache(self.engine.prefix)

    @property
    def busy(self) -> bool:
        """Some request is generating (or prefilling)."""
        return self._running > 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        """Requests accepted that no free slot takes: the queue (at most max_queue). Those in the
        inbox or the engine's list that a free slot will take at the next step do not wait (they
        were counted, and the gauge read more than the queue holds)."""
        free = self.limits.max_batch - self._running  # slots no request holds
        return max(0, self._inbox_count + self._engine_waiting - free)

    def close(self) -> None:
        """Stop the engine thread once every accepted request is done (queued ones are run first)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._inbox.put(None)
            worker.join()

    # -- parsing --------------------------------------------------------------------------------

    def parse(self, raw: bytes, chat: bool) -> Job:
        """The checked job of a request body (protocol.py); a refusal is counted, then raised."""
        try:
            return parse_request(raw, chat, self.served)
        except RequestError as e:
            self.count(outcome_of(e.status))
            raise

    def count(self, outcome: str) -> None:
        """A request ended so (protocol.OUTCOMES); /metrics and /stats both read this count."""
        self.metrics.requests.labels(outcome).inc()

    @property
    def stats(self) -> dict:
        """GET /stats: the metrics' counters as JSON."""
        return self.metrics.counts()

    def response(self, job: Job, pieces: Iterator[Piece]) -> dict:
        return completion_response(job, pieces, self.model_id, self.extras)

    def events(self, job: Job) -> SseWriter:
        """Server-sent events for a streamed answer: one chunk per piece, then the finish chunk,
        usage if asked, [DONE]."""
        return SseWriter(job, request_id(job), self.model_id)

    def extras(self, result: GenerationResult) -> dict:
        return result_extras(result, self.gen.backend.description)

    def models(self) -> dict:
        return models_list(self.model_id)

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
                self.count("refused")
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
                error = internal_error(f"generation failed: {type(e).__name__}: {e}")
                for rid in list(self._live):
                    self.engine.cancel(rid)  # their slots are free again
                    self._end(rid, error=error)
                continue
            finally:
                self._publish()
                self.metrics.busy_seconds.inc(time.perf_counter() - t0)
            self.metrics.batch_size.set(len(self.engine.decoding()))
            for ev in events:
                reply = self._live.get(ev.rid)
                if reply is None:
                    continue
                if ev.error is not None:  # its grammar failed mid-answer (runtime/grammar.py): the engine freed it
                    self._end(ev.rid, error=RequestError(f"'response_format': {ev.error}", param="response_format"))
                    continue
                stopped = reply.push(ev.tokens, ev.logprobs)
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
                self.count("cancelled")
                self._close_ticket(ticket)
                continue
            job = ticket.job
            try:
                rids = [self.engine.submit(request) for request in choices(job)]
            except PromptError as e:  # the first choice's: the others were not submitted
                self.count("invalid")
                self._close_ticket(ticket, RequestError(str(e), code="context_length_exceeded"))
                continue
            self.metrics.started.inc()
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            ticket.running = len(rids)
            for i, rid in enumerate(rids):
                self._live[rid] = _Reply(self, ticket, i)
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
        """A choice is over: its last piece goes out, and once every choice of the request is,
        its ticket closes. An error ends the request: its other choices stop at once, and the
        error is its last item."""
        reply = self._live.pop(rid, None)
        if reply is None:  # a choice its request's error already ended
            return
        ticket = reply.ticket
        self.metrics.completion_tokens.inc(reply.count)
        if error is not None:
            for other, sibling in list(self._live.items()):
                if sibling.ticket is ticket:
                    self.engine.cancel(other)
                    self.metrics.completion_tokens.inc(self._live.pop(other).count)
            self.count(outcome_of(error.status))
            self._close_ticket(ticket, error)
            return
        m = result.metrics if result is not None else None
        if m is not None:
            self.metrics.speculation(self.served.draft, m.drafted_tokens, m.accepted_tokens, m.steps)
        ticket.put(reply.last(finish, result))
        ticket.cancelled_choice = ticket.cancelled_choice or finish == "cancelled"
        ticket.running -= 1
        if ticket.running == 0:
            self.count("cancelled" if ticket.cancelled_choice else "ok")
            self._close_ticket(ticket)

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
            live = self._live
            self._engine_waiting = len({id(live[s.rid].ticket) for s in self.engine.waiting if s.rid in live})
            self._running = self.engine.running
            self.metrics.queue_depth.set(self.waiting)
