"""Continuous batching: requests join and leave a running batch between steps.

    engine = BatchEngine(Generator.from_engine(...), max_batch=8)      # or a SpeculativeDecoder
    rid = engine.submit(Request(prompt_ids, max_new_tokens=128, sampling=SamplingParams(seed=1)))
    while not engine.idle:
        for event in engine.step():    # new tokens per request; `result` once it finished
            ...
    engine.cancel(rid)                 # a gone client: its slot is free at once

This is the one generation loop: plain decoding is speculation with N = 0 (the step verifies
the root alone), and a static batch (`generate_ids`, `stream`, `generate`) is this engine with
every request arriving at step 0.

The batch has `max_batch` slots, each a row of one shared KV cache. Every `step`:

    admit    waiting requests take free slots (lowest first), in arrival order
    prefill  newcomers' prompts run on their own row of the cache (`KVCache.rows`: a view, no
             copy), in chunks: while other rows are decoding at most `prefill_budget` prompt
             tokens per step, so a long prompt delays the running rows' next token by a chunk,
             not by the whole prompt; with no row decoding, whole prompts at once. The last
             chunk's logits give the row's first token. Row by row also when nothing decodes
             (a static batch): one batched prefill pads every row to the longest prompt, and
             on this CPU four ragged chat/code/JSON prompts prefilled together made the
             4-client closed loop 27 % slower (bench_batch.py), and a static batch of 8 of
             them (1,212 tokens, the longest 315) prefilled in 4.5 s row by row against 9.4 s
             batched.
    decode   one step over the rows that are generating (SpeculativeDecoder.step: propose,
             verify, accept, commit), with the cost model choosing each row's draft length for
             this batch (policy.AutoPolicy.plan); with no draft, the root alone
    finish   a row that hit EOS or its budget leaves; its slot, its cache row and its draft
             state are free for the next request at once, as are a cancelled request's.

A request's row (runtime/row.py `Row`: its request, random generator, grammar state, prefill
progress, metrics) is made at `submit` and handed to the decoder whole: the decoder's `join`
makes the first token as a step like every other (runtime/speculative.py). Step observers
(`StepObserver`: training/features.py's recorder of the target's features) watch the rows join,
every step and the rows leave, without drafting.

Why a prompt chunk runs on its own row rather than inside the decode step (as GPU servers
pack them): the step graph is dense, [B, Q] positions, so a 64-token chunk in the same step
would pad every decoding row to 64 positions; on its own row it costs only its own tokens.

Each row keeps its own sampling settings and random generator (seeded from its request), so a
request's output does not depend on what else is in the batch: greedy output equals its output
alone, bitwise with the step floor on an engine whose build measured it (runtime/session.py;
else within the engine's measured bound), and sampled
output with a seed draws the same numbers as alone. The cache's capacity follows the longest
request in the batch (a step attends over the whole capacity, so it is not simply the context
limit): it grows when a longer request joins and shrinks when the long ones have left.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Protocol

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.grammar import NAMES
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.prefix_cache import PrefixCache
from specrt.runtime.row import Request, Row
from specrt.runtime.target import GenerationResult, Target

__all__ = ["BatchEngine", "Decoder", "Event", "Request", "StepObserver", "decoder_of"]

CAPACITY_STEP = 64  # cache capacities are multiples of this (fewer reallocations)


class Decoder(Protocol):
    """What the engine steps with (runtime/speculative.py's SpeculativeDecoder): the target, the
    draft's demands, and the verbs of a row's life: join (which makes its first token), step,
    leave. The rows and the cache are the engine's: it hands each verb the rows (with their slots)
    and the cache view they run on; the decoder's state is its own, kept between the verbs."""

    gen: Target
    policy: object  # its max_draft: the most draft nodes one step verifies; its setting: N or "auto"

    @property
    def needs_features(self) -> bool: ...

    def new_state(self, batch: int, features: bool = False): ...

    def join(self, state, slot: int, row: Row, out, features=None): ...

    def step(self, state, cache: KVCache, rows: list[tuple[int, Row]]): ...

    def leave(self, state, slot: int, row: Row) -> None: ...

    def finish(self, state): ...


def decoder_of(runner) -> Decoder:
    """The decoder a runner steps with: a SpeculativeDecoder is one; a Generator (plain decoding)
    has one, its `decoder`."""
    return getattr(runner, "decoder", runner)


class StepObserver(Protocol):
    """What watches the engine's rows and steps without drafting (training/features.py's
    recorder): a row joined (`features`: every prompt position's, when `needs_features`), a decode
    step ran (its record: rows, trees, verdicts, and the target's output with its features), a
    row left with its tokens."""

    needs_features: bool

    def joined(self, b: int, row: Row, features) -> None: ...

    def stepped(self, record) -> None: ...

    def left(self, b: int, row: Row, tokens: list[int]) -> None: ...


@dataclasses.dataclass
class Event:
    """What one step did for one request: its new tokens; `result` once it finished."""

    rid: int
    tokens: list[int]
    result: GenerationResult | None = None
    logprobs: list | None = None  # per token a TokenLogprob, when its request asked (Request.logprobs)
    # why the request ended without a result (its grammar failed mid-answer: Matcher.error)
    error: str | None = None


class BatchEngine:
    def __init__(
        self,
        runner,
        max_batch: int = 8,
        prefill_budget: int = 64,
        max_waiting: int | None = None,
        prefix_cache: PrefixCache | None = None,
        observers: tuple[StepObserver, ...] = (),
    ):
        """runner: a SpeculativeDecoder, or a Generator (plain decoding: the engine steps with its
        `decoder`). max_batch: slots (requests generating at once); prefill_budget: prompt tokens
        per step while rows decode; max_waiting: requests that may wait for a slot (`submit`
        refuses more; None: no limit); prefix_cache: a pool of earlier prompts' KV blocks
        (runtime/prefix_cache.py; refused with a draft that reads the target's features: a cached
        prompt has none); observers: StepObservers."""
        if max_batch < 1 or prefill_budget < 1:
            raise SpecrtError(f"max_batch and prefill_budget must be >= 1, got {max_batch} and {prefill_budget}")
        self.decoder = decoder_of(runner)
        self.gen: Target = self.decoder.gen
        self.session = self.gen.session
        most = self.session.caps.max_batch
        if most is not None and max_batch > most:
            raise SpecrtError(
                f"no profile of this engine holds batch {max_batch}: it steps at most {most} rows at once; use "
                f"--max-batch {most} or less (a static batch: at most {most} prompts), or rebuild the engine with a "
                "larger --max-batch"
            )
        self.max_batch, self.prefill_budget, self.max_waiting = max_batch, prefill_budget, max_waiting
        if prefix_cache is not None and self.decoder.needs_features:
            raise SpecrtError(
                f"a prefix cache cannot serve draft {self.decoder.proposer.name!r}: it reads the target's features, "
                "which cached prompts do not keep; leave out the prefix cache (serve: --prefix-cache-mb 0) or use a "
                "draft without weights"
            )
        self.prefix = prefix_cache
        self.observers = tuple(observers)
        self.features = self.decoder.needs_features or any(o.needs_features for o in self.observers)
        # a step appends the root and at most max_draft nodes after a row's committed tokens (a
        # guess at the floor's position where nothing was drafted: SpeculativeDecoder.guess)
        self.headroom = max(self.decoder.policy.max_draft, self.session.floor - 1)
        self.waiting: collections.deque[Row] = collections.deque()
        self.slots: list[Row | None] = [None] * max_batch
        self.state = self.decoder.new_state(max_batch, self.features)  # the decoder's, between its verbs
        self.cache: KVCache | None = None
        self._next_rid = 0
        self.steps = 0  # decode steps taken

    # -- the queue ------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.waiting and not any(self.slots)

    @property
    def running(self) -> int:
        """Requests in slots (prefilling or generating)."""
        return sum(s is not None for s in self.slots)

    def decoding(self) -> list[tuple[int, Row]]:
        """The rows (with their slots) that take part in the decode steps: prompt in, not finished."""
        return [(b, s) for b, s in enumerate(self.slots) if s is not None and s.running]

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. The prompt is checked and its grammar compiled here
        (PromptError or SpecrtError names the problem); a full waiting line is a SpecrtError."""
        budget = int(self.gen.budgets([request.prompt], request.max_new_tokens)[0])
        matcher = None if request.grammar is None else self.gen.vocabulary().matcher(request.grammar)
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise SpecrtError(f"{len(self.waiting)} requests already wait for a slot; retry later")
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        rng = request.rng if request.rng is not None else np.random.default_rng(request.sampling.seed)
        self.waiting.append(Row(rid, request, budget, rng, matcher))
        return rid

    def cancel(self, rid: int) -> bool:
        """End a request now (waiting or running); its slot is free for the next. False if unknown."""
        for s in self.waiting:
            if s.rid == rid:
                self.waiting.remove(s)
                return True
        for b, s in enumerate(self.slots):
            if s is not None and s.rid == rid:
                self._free(b)
                return True
        return False

    def close(self) -> None:
        """End every request and give the cache back (a pooled one may be handed out again)."""
        self.waiting.clear()
        for b, s in enumerate(self.slots):
            if s is not None:
                self._free(b)
        if self.cache is not None:
            self.session.release(self.cache)
            self.cache = None

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Admit, prefill (a chunk while others decode), one decode step, finish; the events of
        every request that produced tokens or finished."""
        events: list[Event] = []
        self.admit()
        self._prefill(events)
        rows = self.decoding()
        if rows:
            self._decode(rows, events)
        return events

    def admit(self) -> None:
        """Waiting requests take free slots, and the cache fits the batch."""
        while self.waiting and None in self.slots:
            b = self.slots.index(None)
            self.slots[b] = self.waiting.popleft()
        self._fit_cache()

    def _need(self, s: Row) -> int:
        return len(s.prompt) + s.budget + self.headroom

    def _fit_cache(self) -> None:
        """Capacity for the longest request in the batch: grown when one needs more, shrunk when
        the batch needs under a quarter of it (rows' committed entries are copied over)."""
        need = max((self._need(s) for s in self.slots if s is not None), default=0)
        have = 0 if self.cache is None else self.cache.capacity
        if need == 0 or have >= need > have // 4:
            return
        old, capacity = self.cache, -(-need // CAPACITY_STEP) * CAPACITY_STEP
        most = self.session.caps.max_cache  # an engine's largest past: round up to it, not past it
        capacity = max(need, min(capacity, most)) if most else capacity
        if self.session.capacity_for(capacity) == have:  # what a shrink would give (pooled caches)
            return
        self.cache = self.session.new_cache(self.max_batch, capacity)
        if old is not None:
            for b, s in enumerate(self.slots):
                n = int(old.lengths[b])
                if s is not None and n:
                    self.cache.keys[:, b, :, :n] = old.keys[:, b, :, :n]
                    self.cache.values[:, b, :, :n] = old.values[:, b, :, :n]
            self.cache.lengths[:] = old.lengths
            self.session.release(old)

    def _prefill(self, events: list[Event]) -> None:
        """Newcomers one row at a time: while rows decode at most prefill_budget prompt tokens,
        else every newcomer's whole prompt (a batched prefill of ragged prompts pads each row to
        the longest: measured slower, see the module docstring)."""
        budget = self.prefill_budget if self.decoding() else None
        for b, s in enumerate(self.slots):
            if s is None or s.generating:
                continue
            if not s.looked_up and self.prefix is not None:  # once, as its prefill begins
                t0 = time.perf_counter()
                s.prefilled = self.prefix.lookup(s.prompt, self.cache, b)
                s.prefill_seconds += time.perf_counter() - t0
                s.looked_up = True
            while not s.generating and (budget is None or budget > 0):
                size = self.session.prefill_chunk if budget is None else min(budget, self.session.prefill_chunk)
                chunk = s.prompt[s.prefilled : s.prefilled + size]
                t0 = time.perf_counter()
                out = self.session.forward(self.cache.rows(b, b + 1), [chunk], last_only=True, hidden=self.features)
                s.prefilled += len(chunk)
                if budget is not None:
                    budget -= len(chunk)
                if self.features:
                    s.features.append(out.hidden_states[0, : len(chunk)])
                s.prefill_seconds += time.perf_counter() - t0
                if s.generating:
                    self._start(b, out, events)
            if budget is not None and budget <= 0:
                return

    def _start(self, b: int, out, events: list[Event]) -> None:
        """Row b's prompt is in (`out`: its last prefill step): it joins the decoder, which makes
        its first token."""
        s = self.slots[b]
        features = np.concatenate(s.features) if self.features else None
        s.features = []
        if self.prefix is not None:  # the prompt's blocks, for later requests that start with them
            self.prefix.insert(s.prompt, self.cache, b)
        for o in self.observers:
            o.joined(b, s, features)
        record = self.decoder.join(self.state, b, s, out, features)
        self._events(record, events)

    def _decode(self, rows: list[tuple[int, Row]], events: list[Event]) -> None:
        view = self.cache.rows(0, rows[-1][0] + 1)  # the rows in use: free slots past them cost nothing
        t0 = time.perf_counter()
        record = self.decoder.step(self.state, view, rows)
        seconds = time.perf_counter() - t0
        self.steps += 1
        for o in self.observers:
            o.stepped(record)
        for _, s in rows:
            s.steps.append(seconds)
        self._events(record, events)

    def _events(self, record, events: list[Event]) -> None:
        """Each row's event of a step (its first token's included): its tokens, its result once it
        finished, or the error its grammar met."""
        for r in record.rows:
            s = r.row
            if s.matcher is not None and s.matcher.error is not None:
                events.append(self._fail(r.slot))
                continue
            events.append(Event(s.rid, r.new_tokens, logprobs=r.logprobs))
            if s.done:
                events[-1].result = self._finish(r.slot)

    def _fail(self, b: int) -> Event:
        """Row b's grammar failed mid-answer: the request ends with the error, its slot is free."""
        s = self.slots[b]
        kind = NAMES[s.request.grammar.kind]
        event = Event(s.rid, [], error=f"the {kind} could not be followed to the end of the answer: {s.matcher.error}")
        self._free(b)
        return event

    def _finish(self, b: int) -> GenerationResult:
        s = self.slots[b]
        result = GenerationResult(
            len(s.prompt),
            s.out,
            s.reason,
            s.prefill_seconds,
            float(sum(s.steps)),
            s.steps,
            metrics=s.metrics,
            acceptance=None if s.acceptance is None else s.acceptance.to_dict(),
        )
        if self.prefix is not None:  # the prompt and the answer: what the chat's next turn starts with
            self.prefix.insert(s.prompt + s.out, self.cache, b)
        self._free(b)
        return result

    def _free(self, b: int) -> None:
        s, self.slots[b] = self.slots[b], None
        if s.generating:  # it joined the decoder
            self.decoder.leave(self.state, b, s)
            for o in self.observers:
                o.left(b, s, s.out)
        if self.cache is not None:
            self.cache.lengths[b] = 0

    # -- conveniences ---------------------------------------------------------------------------

    def run(self, requests: list[Request], arrivals: list[int] | None = None) -> list[GenerationResult]:
        """Run requests to the end; request i is submitted before step arrivals[i] (default: all
        at once). Returns their results in order (tests and benchmarks)."""
        arrivals = arrivals or [0] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        ids: dict[int, int] = {}
        results: dict[int, GenerationResult] = {}
        step = 0
        while len(results) < len(requests):
            while order and arrivals[order[0]] <= step:
                i = order.pop(0)
                ids[self.submit(requests[i])] = i
            for e in self.step():
                if e.error is not None:
                    raise SpecrtError(e.error)
                if e.result is not None:
                    results[ids[e.rid]] = e.result
            step += 1
        return [results[i] for i in range(len(requests))]
