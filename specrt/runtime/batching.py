"""Continuous batching: requests join and leave a running batch between steps.

    engine = BatchEngine(Generator.from_engine(...), max_batch=8)      # or a SpeculativeDecoder
    rid = engine.submit(Request(prompt_ids, max_new_tokens=128, sampling=SamplingParams(seed=1)))
    while not engine.idle:
        for event in engine.step():    # new tokens per request; `result` once it finished
            ...
    engine.cancel(rid)                 # a gone client: its slot is free at once

The batch has `max_batch` slots, each a row of one shared KV cache. Every `step`:

    admit    waiting requests take free slots (lowest first), in arrival order
    prefill  newcomers' prompts run on their own row of the cache (`KVCache.rows`: a view, no
             copy), in chunks: while other rows are decoding at most `prefill_budget` prompt
             tokens per step, so a long prompt delays the running rows' next token by a chunk,
             not by the whole prompt; with no row decoding, whole prompts at once. The last
             chunk's logits give the row's first token.
    decode   one step over the rows that are generating: plain (one token each) or speculative
             (SpeculativeDecoder.step: propose, verify, accept, commit), with the cost model
             choosing each row's draft length for this batch (policy.AutoPolicy.plan)
    finish   a row that hit EOS or its budget leaves; its slot, its cache row and its draft
             state are free for the next request at once, as are a cancelled request's.

Why a prompt chunk runs on its own row rather than inside the decode step (as GPU servers
pack them): the step graph is dense, [B, Q] positions, so a 64-token chunk in the same step
would pad every decoding row to 64 positions; on its own row it costs only its own tokens.

Each row keeps its own sampling settings and random generator (seeded from its request), so a
request's output does not depend on what else is in the batch: greedy output equals its output
alone (the runtime's batch-invariance check bounds the arithmetic differences), and sampled
output with a seed draws the same numbers as alone. The cache's capacity follows the longest
request in the batch (a step attends over the whole capacity, so it is not simply the context
limit): it grows when a longer request joins and shrinks when the long ones have left.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.generator import GenerationResult, Generator, Rows
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.sampling import SamplingParams, next_tokens
from specrt.runtime.session import Prefilled
from specrt.runtime.speculative import SpecState, SpeculativeDecoder

CAPACITY_STEP = 64  # cache capacities are multiples of this (fewer reallocations)


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()


@dataclasses.dataclass
class Event:
    """What one step did for one request: its new tokens; `result` once it finished."""

    rid: int
    tokens: list[int]
    result: GenerationResult | None = None


@dataclasses.dataclass
class _Slot:
    """A request in a slot of the batch."""

    rid: int
    request: Request
    budget: int  # tokens it may produce (its max_new_tokens, bounded by the context)
    rng: np.random.Generator
    prefilled: int = 0  # prompt tokens in the cache so far
    prefill_seconds: float = 0.0
    steps: list[float] = dataclasses.field(default_factory=list)  # the decode steps it was in
    hidden: list[np.ndarray] = dataclasses.field(default_factory=list)  # prompt features, by chunk
    metrics: SpecMetrics | None = None

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt


class BatchEngine:
    def __init__(
        self,
        runner: Generator | SpeculativeDecoder,
        max_batch: int = 8,
        prefill_budget: int = 64,
        max_waiting: int | None = None,
    ):
        """runner: a Generator (plain decoding) or a SpeculativeDecoder over one; max_batch: slots
        (requests generating at once); prefill_budget: prompt tokens per step while rows decode;
        max_waiting: requests that may wait for a slot (`submit` refuses more; None: no limit)."""
        if max_batch < 1 or prefill_budget < 1:
            raise SpecrtError(f"max_batch and prefill_budget must be >= 1, got {max_batch} and {prefill_budget}")
        self.spec = runner if isinstance(runner, SpeculativeDecoder) else None
        self.gen: Generator = runner.gen
        self.session = self.gen.session
        most = self.session.caps.max_batch
        if most is not None and max_batch > most:
            raise SpecrtError(
                f"this engine steps at most {most} rows at once (its profiles), but max_batch is {max_batch}; use "
                f"--max-batch {most} or less, or rebuild the engine with a larger --max-batch"
            )
        self.max_batch, self.prefill_budget, self.max_waiting = max_batch, prefill_budget, max_waiting
        self.headroom = self.spec.policy.max_draft + 1 if self.spec else 0  # one unverified draft
        self.waiting: collections.deque[_Slot] = collections.deque()
        self.slots: list[_Slot | None] = [None] * max_batch
        self.rows = Rows(np.zeros(max_batch, np.int64), np.zeros(max_batch, np.int64), self.gen.eos_ids)
        self.rows.active[:] = False  # generating (prefill done); a slot may be taken and not active
        self.cache: KVCache | None = None
        self.state: SpecState | None = None
        if self.spec is not None:
            S = max_batch
            self.state = SpecState(
                [[] for _ in range(S)],
                self.rows,
                None,  # set to the view of the rows in use before each step
                [SamplingParams()] * S,
                [np.random.default_rng()] * S,
                self.spec.new_cost_model(),
                pending=[[] for _ in range(S)] if self.spec.proposer.needs_features else None,
            )
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

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. The prompt is checked here (PromptError names the
        problem); a full waiting line is a SpecrtError."""
        budget = int(self.gen.budgets([request.prompt], request.max_new_tokens)[0])
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise SpecrtError(f"{len(self.waiting)} requests already wait for a slot; retry later")
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        self.waiting.append(_Slot(rid, request, budget, np.random.default_rng(request.sampling.seed)))
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

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Admit, prefill (a chunk while others decode), one decode step, finish; the events of
        every request that produced tokens or finished."""
        events: list[Event] = []
        self._admit()
        self._prefill(events)
        if self.rows.active.any():
            self._decode(events)
        return events

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            b = self.slots.index(None)
            self.slots[b] = self.waiting.popleft()
            self.rows.active[b] = False
        self._fit_cache()

    def _need(self, s: _Slot) -> int:
        return len(s.prompt) + s.budget + self.headroom

    def _fit_cache(self) -> None:
        """Capacity for the longest request in the batch: grown when one needs more, shrunk when
        the batch needs under a quarter of it (rows' committed entries are copied over)."""
        need = max((self._need(s) for s in self.slots if s is not None), default=0)
        have = 0 if self.cache is None else self.cache.capacity
        if need == 0 or have >= need > have // 4:
            return
        old, capacity = self.cache, -(-need // CAPACITY_STEP) * CAPACITY_STEP
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
        decoding = self.rows.active.any()
        budget = self.prefill_budget if decoding else None
        for b, s in enumerate(self.slots):
            if s is None or self.rows.active[b] or s.prefilled == len(s.prompt):
                continue
            while s.prefilled < len(s.prompt) and (budget is None or budget > 0):
                size = self.session.prefill_chunk if budget is None else min(budget, self.session.prefill_chunk)
                chunk = s.prompt[s.prefilled : s.prefilled + size]
                t0 = time.perf_counter()
                out = self.session.forward(
                    self.cache.rows(b, b + 1), [chunk], last_only=True, hidden=self._needs_features
                )
                s.prefilled += len(chunk)
                if budget is not None:
                    budget -= len(chunk)
                if self._needs_features:
                    s.hidden.append(out.hidden_states[0, : len(chunk)])
                if s.prefilled == len(s.prompt):
                    self._start(b, s, out.logits[:, 0], events)
                s.prefill_seconds += time.perf_counter() - t0
            if budget is not None and budget <= 0:
                return

    @property
    def _needs_features(self) -> bool:
        return self.spec is not None and self.spec.proposer.needs_features

    def _start(self, b: int, s: _Slot, logits: np.ndarray, events: list[Event]) -> None:
        """The prompt is in: the first token, and the row starts generating."""
        first = next_tokens(logits, s.request.sampling, s.rng)
        self.rows.join(b, len(s.prompt), s.budget)
        if self.spec is not None:
            st = self.state
            st.prompts[b], st.sampling[b], st.rng[b] = s.prompt, s.request.sampling, s.rng
            hidden = [np.concatenate(s.hidden)] if s.hidden else None
            s.hidden = []
            if st.pending is not None:
                st.pending[b] = list(hidden)
            s.metrics = SpecMetrics()
            self.spec.proposer.begin([b], [s.prompt], Prefilled(logits, hidden))
        events.append(Event(s.rid, self.rows.emit(b, [first[0]])))
        if not self.rows.active[b]:
            events[-1].result = self._finish(b)

    def _decode(self, events: list[Event]) -> None:
        rows = [int(b) for b in np.flatnonzero(self.rows.active)]
        view = self.cache.rows(0, rows[-1] + 1)  # the rows in use: free slots past them cost nothing
        t0 = time.perf_counter()
        if self.spec is None:
            new = self._plain_step(view, rows)
        else:
            self.state.cache = view
            record = self.spec.step(self.state)
            new = record.new_tokens
            for b in rows:
                tree, verdict = record.trees[b], record.verdicts[b]
                depth = int(record.depths[b].max()) if len(tree) else 0
                self.slots[b].metrics.observe_draft(len(tree), len(verdict.accepted), depth)
        seconds = time.perf_counter() - t0
        self.steps += 1
        for b in rows:
            s = self.slots[b]
            s.steps.append(seconds)
            events.append(Event(s.rid, new[b]))
            if not self.rows.active[b]:
                events[-1].result = self._finish(b)

    def _plain_step(self, view: KVCache, rows: list[int]) -> list[list[int]]:
        active = self.rows.active[: view.batch].copy()
        last = np.array([self.rows.out[b][-1] if active[b] else 0 for b in range(view.batch)])
        greedy = all(self.slots[b].request.sampling.greedy for b in rows)
        out = self.gen.decode_step(view, last, active, want_logits=not greedy)
        new: list[list[int]] = [[] for _ in range(view.batch)]
        top = out.argmax()[:, 0]  # (B,): on a device backend computed there
        for b in rows:
            s = self.slots[b]
            if s.request.sampling.greedy:
                token = int(top[b])
            else:
                token = next_tokens(out.logits[b : b + 1, 0], s.request.sampling, s.rng)[0]
            new[b] = self.rows.emit(b, [token])
        return new

    def _finish(self, b: int) -> GenerationResult:
        s = self.slots[b]
        result = GenerationResult(
            len(s.prompt),
            self.rows.out[b],
            self.rows.reason[b],
            s.prefill_seconds,
            float(sum(s.steps)),
            s.steps,
            metrics=s.metrics,
        )
        self._free(b)
        return result

    def _free(self, b: int) -> None:
        s, self.slots[b] = self.slots[b], None
        if self.spec is not None and s.metrics is not None:  # it had begun generating
            self.spec.proposer.end([b], [self.rows.out[b]])
            self.state.cost.forget_row(b)
            if self.state.pending is not None:
                self.state.pending[b] = []
        self.rows.active[b] = False
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
                if e.result is not None:
                    results[ids[e.rid]] = e.result
            step += 1
        return [results[i] for i in range(len(requests))]
