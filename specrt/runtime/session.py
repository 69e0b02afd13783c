"""The step session: a backend, its KV caches, and the two kinds of step the runtime takes.

    session = StepSession(backend)
    cache = session.new_cache(batch=2, capacity=512)
    first = session.prefill(cache, prompts, hidden=True)      # last logits (+ every prompt position's features)
    out = session.forward(cache, [[t0, d1, d2], [t1]], trees) # a multi-position step, KV appended
    session.release(cache)

Everything above this module (plain generation, speculative decoding, drafts that run a model of
their own) steps a model through a session. Batches are ragged: every row keeps its own length in
the cache and the attention mask hides everything else, so rows never need padding in the cache.
Hidden states (the features learned drafts read) are computed by every step but copied to the
host only for the positions asked for.

Every step computes at least `floor` positions per row (schema/step_io.py STEP_FLOOR, where the
backend keeps it: `Capabilities.floor`): a one-position step gets one more position, computed and
left uncommitted, so that a position's logits come from the same kernels, bit for bit, whether
plain decoding, a verification step of any size, a split step or a batch computes them. An
engine whose build found one-position steps bitwise too (the fused graphs pad their attention
themselves, and their int8-activation and float32 products give a row the same bits alone)
needs no floor: 1. With
`exact="near-ties"` one-position steps run as they are: faster where a two-row product costs much
more than a one-row one (the level-0 4-bit kernels), and exact only up to the engine's measured
difference between the two.

Where the engine's build found step cuts (schema/step_cuts.py: positions past which its
attention adds in another order, ORT's with heads of 256), no step spans one: `forward` splits
such a step into steps that do not and returns their outputs as the one step's, and `room` says
how far a row's next step may reach (a draft tree, which cannot be split, stops there).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrt.engines.ort import BATCH_VARIANCE_LIMIT
from specrt.errors import SpecrtError
from specrt.runtime.backends.base import Capabilities, StepBackend, StepOutput
from specrt.runtime.kv_cache import KVCache
from specrt.schema import step_cuts
from specrt.schema.config import ModelConfig

CACHE_BUCKET = 256  # pooled caches (CUDA-graph backends) have capacities in multiples of this
CACHE_POOL_SIZE = 4


@dataclasses.dataclass
class Prefilled:
    """What prefill returns: per row the logits after the prompt and, when asked, the features of
    every prompt position."""

    logits: np.ndarray  # (B, V) at each row's last prompt position
    hidden: list[np.ndarray] | None  # per row (prompt length, H*) float32; None when not asked


EXACTNESS = ("bitwise", "near-ties")  # StepSession(exact=...): with the step floor or without


class StepSession:
    def __init__(
        self, backend: StepBackend, max_context: int | None = None, prefill_chunk: int = 512, exact: str = "bitwise"
    ):
        if exact not in EXACTNESS:
            raise SpecrtError(f"exact must be one of {', '.join(EXACTNESS)}, got {exact!r}")
        self.backend = backend
        self.config: ModelConfig = backend.config
        # the smallest of: what was asked, what an engine was built for, what the model supports
        self.max_context = min(
            v for v in (max_context, self.caps.max_context, self.config.max_position_embeddings) if v
        )
        self.prefill_chunk = min(prefill_chunk, self.caps.max_step or prefill_chunk)  # an engine's largest profile
        self._pool: list[KVCache] = []
        # the fewest positions per row a step computes (the module docstring)
        self.exact = exact  # "bitwise": greedy verdicts keep to the tree's leading chain too (speculative.py)
        self.floor = self.caps.floor if exact == "bitwise" else 1
        # and the multiple every step's positions per row are rounded up to (Capabilities.step_multiple)
        self.multiple = self.caps.step_multiple if exact == "bitwise" else 1
        # the positions no step may span (schema/step_cuts.py): where the engine's build found
        # its attention adding in another order past them; none where near-ties are enough
        caps = self.caps
        limit = self.max_context + 1
        self.cuts = step_cuts.expand(caps.step_cuts, caps.cut_period, limit) if exact == "bitwise" else ()
        if self.cuts and self.multiple > 1:
            raise SpecrtError("an engine with step cuts and a step multiple is not supported; rebuild the engine")

    @property
    def caps(self) -> Capabilities:
        return self.backend.caps

    def exactness(self) -> dict:
        """What speculative output is guaranteed to equal plain output up to, on this session:
        {"exact": "bitwise"} when the engine's build found every step shape the session runs
        bitwise equal (engines/ort_measure.py: one-position steps too where the floor is 1);
        else {"exact": "near-ties", "bound": the measured difference of one- (with the floor:
        padded) and multi-position steps, relative to the logits' range};
        "unmeasured" where the backend has no such record (PyTorch, TensorRT)."""
        measured = self.caps.batch_invariance
        if not measured:
            return {"exact": "unmeasured", "floor": self.floor}
        shapes = measured.get("bitwise") or {}
        # under the floor no step has one position: what those shapes give does not matter
        needed = [v for k, v in shapes.items() if self.floor < 2 or not k.startswith("unpadded")]
        if shapes and all(needed) and (self.floor >= 2 or "unpadded" in shapes):
            return {"exact": "bitwise", "floor": self.floor}
        # with the floor, one-position steps are gone: what is left is the padded steps' difference
        bound = measured.get("padded_relative", measured["relative"]) if self.floor >= 2 else measured["relative"]
        return {"exact": "near-ties", "bound": bound, "floor": self.floor, "bitwise": shapes}

    # -- caches ---------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A KV cache of at least `capacity` positions for `batch` rows.

        The capacity is rounded up to a multiple of `caps.cache_align` (TensorRT binds every layer's
        and row's slice in place, and each must start 256-byte aligned).

        Backends that bind cache buffers (`caps.reuse_cache`: CUDA graphs) get caches from a small
        pool, with the capacity rounded up to a multiple of CACHE_BUCKET (but not past
        `caps.max_cache`): a graph is bound to its cache's buffers, so reusing them across
        generations lets each step shape be captured once, not once per generation. A pooled cache
        is handed out again only after `release`."""
        c, caps = self.config, self.caps
        capacity = self.capacity_for(capacity)

        def fresh(capacity: int) -> KVCache:
            shape = (c.num_hidden_layers, batch, c.num_key_value_heads, capacity, c.head_dim)
            return KVCache(*shape, device=caps.cache_device, slack=caps.cache_slack)

        if not caps.reuse_cache:
            return fresh(capacity)
        for cache in self._pool:
            if not cache.in_use and cache.batch == batch and cache.capacity == capacity:
                cache.reset()
                cache.in_use = True
                return cache
        cache = fresh(capacity)
        cache.in_use = True
        idle = [k for k in self._pool if not k.in_use]
        if len(self._pool) >= CACHE_POOL_SIZE and idle:
            self._pool.remove(idle[0])  # the oldest idle one makes room
        if len(self._pool) < CACHE_POOL_SIZE:
            self._pool.append(cache)
        return cache

    def capacity_for(self, capacity: int) -> int:
        """The capacity `new_cache` gives for one asked for (aligned; pooled: bucketed)."""
        caps = self.caps
        capacity = -(-capacity // caps.cache_align) * caps.cache_align
        if not caps.reuse_cache:
            return capacity
        limit = caps.max_cache or capacity + CACHE_BUCKET
        return max(capacity, min(-(-capacity // CACHE_BUCKET) * CACHE_BUCKET, limit))

    def release(self, cache: KVCache) -> None:
        """The generation that used `cache` is over: a pooled cache may be handed out again."""
        cache.in_use = False

    @property
    def pooled_caches(self) -> list[KVCache]:
        return list(self._pool)

    # -- steps ----------------------------------------------------------------------------------

    def room(self, cache: KVCache) -> list[int | None]:
        """Per row, the most positions its next step may compute without crossing a step cut
        (None: no cut ahead): a draft tree must fit (the session cannot split a tree)."""
        if not self.cuts:
            return [None] * cache.batch
        return [step_cuts.room(self.cuts, int(n)) for n in cache.lengths]

    def forward(
        self,
        cache: KVCache,
        tokens: list[list[int]],
        trees: list[tuple[np.ndarray, np.ndarray] | None] | None = None,
        last_only: bool = False,
        hidden: bool = False,
        want_logits: bool = True,
    ) -> StepOutput:
        """One step over new tokens per row (rows may differ in count, even be empty); their KV is
        appended to the cache. Returns the StepOutput (B, Q = longest row, ...; the padding
        the floor adds is computed and dropped): logits at every
        position, or with last_only=True at each row's last token only (B, 1, V); with
        hidden=True also the hidden states of every position (B, Q, H*); with want_logits=False
        (greedy: only the argmax is read, `StepOutput.argmax()`) a device backend copies tokens to
        the host instead of logits.

        trees: per row (depths (n,), mask (n, n)) for tokens that form a tree rather than a
        sequence: position = committed length + depth, and each token sees what its mask allows."""
        if self.cuts:
            counts = [len(t) for t in tokens]
            trees = trees if trees is None else [None if t is None or _is_chain(t) else t for t in trees]
            whole = [b for b, t in enumerate(trees or ()) if t is not None]
            try:
                steps = step_cuts.pieces(cache.lengths, counts, self.cuts, max(self.floor, 2), whole)
            except ValueError as e:
                raise SpecrtError(f"{e}: draft no further than StepSession.room allows") from None
            if len(steps) > 1:
                return self._pieces(cache, tokens, trees, steps, last_only, hidden, want_logits)
        return self._step(cache, tokens, trees, last_only, hidden, want_logits)

    def _pieces(self, cache, tokens, trees, steps, last_only, hidden, want_logits) -> StepOutput:
        """One step computed as several that keep the step cuts (schema/step_cuts.py), their
        outputs put together as the one step's."""
        outs = []
        for step in steps:
            rows = [t[a:b] for t, (a, b) in zip(tokens, step)]
            part = None if trees is None else [t if a < b else None for t, (a, b) in zip(trees, step)]
            outs.append(self._step(cache, rows, part, last_only, hidden, want_logits))
        longest = max(1, *(len(t) for t in tokens))
        # with last_only, a row's last token is in the step that ends its tokens
        ends = [next((k for k, s in enumerate(steps) if s[b][0] < s[b][1] == len(t)), 0) for b, t in enumerate(tokens)]

        def whole(name: str):
            got = [getattr(o, name) for o in outs]
            if got[0] is None:
                return None
            if last_only and name != "hidden_states":
                return np.stack([got[k][b, :1] for b, k in enumerate(ends)])
            return step_cuts.joined(steps, got, longest)

        return StepOutput(whole("logits"), whole("hidden_states"), None, whole("top1"))

    def _step(self, cache, tokens, trees, last_only, hidden, want_logits) -> StepOutput:
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        ids, positions, mask, index, every = self.step_inputs(
            cache, tokens, trees, last_only, self.floor, self.multiple
        )
        out = self.backend.step(ids, positions, mask, index, cache, every if hidden else None, want_logits)
        if out.present is None:  # the backend wrote the positions in place (caps.cache_slack)
            cache.commit(counts)
        else:
            cache.append(out.present, counts)
        longest = max(int(counts.max()), 1)
        if not last_only and ids.shape[1] > longest:  # the padding's outputs are nobody's
            out = dataclasses.replace(
                out,
                logits=None if out.logits is None else out.logits[:, :longest],
                hidden_states=None if out.hidden_states is None else out.hidden_states[:, :longest],
                top1=None if out.top1 is None else out.top1[:, :longest],
            )
        return out

    @staticmethod
    def step_inputs(
        cache: KVCache,
        tokens: list[list[int]],
        trees: list[tuple[np.ndarray, np.ndarray] | None] | None = None,
        last_only: bool = False,
        floor: int = 1,
        multiple: int = 1,
    ) -> tuple[np.ndarray, ...]:
        """What `forward` hands the backend for a step of `tokens` per row: (input ids, position
        ids, attention mask, logits index, every position's index), each (B, Q, ...), Q the
        longest row's count, at least `floor` and rounded up to a multiple of `multiple` (rows
        are padded: token 0 at the next positions, seen by no real position)."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        Q = -(-max(int(counts.max()), floor) // multiple) * multiple
        B = cache.batch
        ids = np.zeros((B, Q), dtype=np.int64)
        offsets = np.broadcast_to(np.arange(Q, dtype=np.int64), (B, Q)).copy()
        new_mask = np.broadcast_to(np.tril(np.ones((Q, Q), dtype=bool)), (B, Q, Q)).copy()
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = t
            if trees is not None and trees[b] is not None:
                depths, mask = trees[b]
                n = len(t)
                offsets[b, :n] = depths
                new_mask[b, :n, :n] = mask
        positions = cache.lengths[:, None] + offsets
        every = np.broadcast_to(np.arange(Q, dtype=np.int64), (B, Q)).copy()
        index = np.maximum(counts - 1, 0)[:, None] if last_only else every
        return ids, positions, cache.attention_mask(Q, new_mask), index, every

    def prefill(self, cache: KVCache, prompts: list[list[int]], hidden: bool = False) -> Prefilled:
        """Run the prompts through the model in chunks of `prefill_chunk`."""
        last = np.zeros((cache.batch, self.config.vocab_size), dtype=np.float32)
        feats: list[list[np.ndarray]] = [[] for _ in prompts]
        start = 0
        while start < max(len(p) for p in prompts):
            chunk = [p[start : start + self.prefill_chunk] for p in prompts]
            out = self.forward(cache, chunk, last_only=True, hidden=hidden)
            for b, c in enumerate(chunk):
                if c:
                    last[b] = out.logits[b, 0]
                    if hidden:
                        feats[b].append(out.hidden_states[b, : len(c)])
            start += self.prefill_chunk
        return Prefilled(last, [np.concatenate(f) for f in feats] if hidden else None)


def _is_chain(tree: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether a row's (depths, mask) is a plain sequence (each token after the one before)."""
    depths, mask = tree
    n = len(depths)
    return bool(np.array_equal(depths, np.arange(n)) and np.array_equal(mask, np.tri(n, dtype=bool)))


def exactness_warning(session) -> str | None:
    """A warning when speculative output may differ from plain output on a near-tie by more than
    float rounding: the engine's logits move between step shapes (int8 activations; measured when
    it was built, StepSession.exactness) and the step floor does not make it bitwise."""
    e = session.exactness()
    if e["exact"] != "near-ties" or e["bound"] <= BATCH_VARIANCE_LIMIT:
        return None
    shapes = e.get("bitwise") or {}
    if shapes and all(shapes.values()):
        fix = "keep the step floor (--exact bitwise, the default), which makes this engine bitwise exact"
    elif shapes:
        fix = (
            "its step shapes are not bitwise equal even with the step floor (an engine built before step cuts were "
            "probed, or a kernel they do not cover: rebuild it to probe again); the PyTorch backend (--backend torch) "
            "is bitwise"
        )
    else:
        fix = "rebuild the engine (its build measures whether the step floor makes it bitwise exact)"
    return (
        f"this engine's logits change by up to {e['bound']:.1%} of their range between steps of different shapes "
        f"(int8 activations?), so speculative output may differ from plain output; {fix}"
    )
