"""Speculative decoding: prefill, then repeat { propose → verify in one target step → accept →
commit KV }.

    spec = SpeculativeDecoder(Generator.from_engine(...), make_proposer("suffix"), AutoPolicy())
    result = spec.generate("Rewrite this code ...", max_new_tokens=256)
    print(result.text, result.metrics.summary())

One target step verifies the draft of every row of a static batch: row b feeds [root, draft
nodes...] at positions length_b + depth with the tree's ancestor mask; rows accept different
numbers of tokens. Commit: the KV of the root and the accepted path is kept (for a chain that is
a length change; for a tree the path's slots are compacted behind the root), the rest is rolled
back. Greedy output equals plain greedy decoding, sampled output follows the target exactly
(see verification.py).
"""

from __future__ import annotations

import time
import warnings
from typing import Generator as Generator_

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.generator import GenerationResult, Generator, run_to_end, stream_text
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel, FixedPolicy
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.verification import DraftTree, accept_greedy, accept_sampling


def batch_variance_warning(backend) -> str | None:
    """A warning when the backend's logits for a position depend on how many positions a step
    computes (measured when its engine was built): then verification can disagree with plain
    decoding on near ties, and speculative output is not guaranteed to equal plain output."""
    from specrt.engines.ort import BATCH_VARIANCE_LIMIT

    measured = getattr(backend, "batch_invariance", None)
    if not measured or measured["relative"] <= BATCH_VARIANCE_LIMIT:
        return None
    return (
        f"this engine's logits change by up to {measured['relative']:.1%} of their range between one-position and multi-position "
        f"steps (int8 activations?), so speculative output may differ from plain output; for exact speculative decoding "
        f"use a float32 engine or a weight-only one (build-engines --quantize int4, not an -a8 scheme)."
    )


def make_policy(num_draft: int | str, max_draft: int = 16):
    """`num_draft`: an int (fixed N, 0 = plain decoding) or "auto"."""
    if num_draft == "auto":
        return AutoPolicy(max_draft=max_draft)
    try:
        n = int(num_draft)
    except (TypeError, ValueError):
        raise SpecrtError(f"num_draft must be a number >= 0 or 'auto', got {num_draft!r}") from None
    if n < 0:
        raise SpecrtError(f"num_draft must be >= 0, got {n}")
    return FixedPolicy(n)


class SpeculativeDecoder:
    def __init__(self, generator: Generator, proposer, policy=None):
        self.gen = generator
        self.proposer = proposer
        self.policy = policy if policy is not None else AutoPolicy()
        self.exactness_warning = batch_variance_warning(generator.backend)
        if self.exactness_warning:
            warnings.warn(self.exactness_warning, stacklevel=2)

    @property
    def eos_ids(self):
        return self.gen.eos_ids

    def iter_generate(
        self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams()
    ) -> Generator_[list[list[int]], None, list[GenerationResult]]:
        """Yields, after every step, the new tokens of each row (possibly none); returns one
        GenerationResult per row, each carrying the batch's SpecMetrics."""
        # room for the longest output plus one unverified draft
        st = self.gen.start(prompts, max_new_tokens, sampling, headroom=self.policy.max_draft + 1)
        try:
            return (yield from self._steps(st, prompts, sampling))
        finally:
            self.gen.release(st.cache)

    def _steps(self, st, prompts, sampling):
        gen = self.gen
        B = len(prompts)
        max_draft = self.policy.max_draft
        cache, rng, budget = st.cache, st.rng, st.budget
        cost = CostModel(max(max_draft, 1))
        metrics = SpecMetrics()
        for b, p in enumerate(prompts):
            self.proposer.begin(b, p)

        out: list[list[int]] = [[] for _ in range(B)]
        reason = ["length"] * B
        active = np.ones(B, dtype=bool)
        step_times: list[float] = []
        drafted_per_step: list[float] = []

        def emit(b: int, tokens: list[int]) -> list[int]:
            """Append tokens to row b up to EOS or its budget; returns what was appended."""
            taken = []
            for t in tokens:
                out[b].append(t)
                taken.append(t)
                if t in self.eos_ids:
                    active[b], reason[b] = False, "stop"
                    break
                if len(out[b]) >= budget[b]:
                    active[b] = False
                    break
            return taken

        yield [emit(b, [int(st.first[b])]) for b in range(B)]
        while active.any():
            rows = np.flatnonzero(active)
            td = time.perf_counter()
            n_draft = self.policy.num_draft(cost, len(rows))
            trees: dict[int, DraftTree] = {}
            depths: dict[int, np.ndarray] = {}
            for b in rows:
                tree = self.proposer.propose(int(b), prompts[b] + out[b], n_draft) if n_draft > 0 else DraftTree.empty()
                trees[b] = tree.truncate(n_draft)
                depths[b] = trees[b].depths()
            draft_s = time.perf_counter() - td

            ts = time.perf_counter()
            start = cache.lengths.copy()  # the root of row b goes to slot start[b]
            feed = [[out[b][-1], *trees[b].tokens.tolist()] if active[b] else [] for b in range(B)]
            shapes = [(np.concatenate([[0], depths[b]]), trees[b].ancestor_mask()) if active[b] else None for b in range(B)]
            step = gen.forward_tokens(cache, feed, shapes)
            new_tokens: list[list[int]] = [[] for _ in range(B)]
            for b in rows:
                tree = trees[b]
                logits = step.logits[b, : len(tree) + 1]
                if sampling.greedy:
                    verdict = accept_greedy(tree, logits.argmax(axis=-1))
                else:
                    verdict = accept_sampling(tree, probs_from_logits(logits, sampling), rng)
                cache.keep(int(b), int(start[b]) + 1, [int(start[b]) + 1 + i for i in verdict.accepted])
                depth = int(depths[b].max()) if len(tree) else 0
                metrics.observe_draft(len(tree), len(verdict.accepted), depth)
                if len(tree):
                    cost.observe_acceptance(depth, len(verdict.accepted))
                new_tokens[b] = emit(int(b), verdict.tokens(tree))
            step_s = time.perf_counter() - ts
            cost.observe_step(sum(len(f) for f in feed), len(rows), step_s, draft_s)
            drafted_per_step.append(sum(len(trees[b]) for b in rows) / len(rows))
            metrics.step_seconds += step_s
            metrics.draft_seconds += draft_s
            step_times.append(step_s + draft_s)
            yield new_tokens

        for b in range(B):
            self.proposer.end(b, out[b])
        fitted = cost.cost(B)
        if fitted is not None and metrics.steps:
            metrics.alpha, metrics.beta, metrics.draft_ratio = fitted.alpha, fitted.beta, fitted.draft_ratio
            metrics.decode_step_seconds = fitted.decode
            # the cost model's speedup for the drafts this run made: tokens per step / mean step cost
            metrics.predicted_speedup = metrics.mean_accepted_length / float(fitted.relative(np.array(drafted_per_step)).mean())
        decode_s = float(sum(step_times))
        results = []
        for b in range(B):
            r = GenerationResult(int(st.lens[b]), out[b], reason[b], st.prefill_seconds, decode_s, step_times)
            r.metrics = metrics
            results.append(r)
        return results

    def generate_ids(self, prompts, max_new_tokens=128, sampling=SamplingParams()) -> list[GenerationResult]:
        return run_to_end(self.iter_generate(prompts, max_new_tokens, sampling))

    def stream(self, prompt: str, max_new_tokens=128, sampling=SamplingParams(), chat=True, system=None):
        """Yield text pieces; returns (StopIteration.value) the GenerationResult with metrics."""
        return stream_text(self.gen, self.iter_generate([self.gen.encode_prompt(prompt, chat, system)], max_new_tokens, sampling))

    def generate(self, prompt: str, max_new_tokens=128, sampling=SamplingParams(), chat=True, system=None) -> GenerationResult:
        ids = self.gen.encode_prompt(prompt, chat, system)
        result = self.generate_ids([ids], max_new_tokens, sampling)[0]
        result.text = self.gen.decode(result.token_ids)
        return result
