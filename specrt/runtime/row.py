"""A request and its row: what one request asks for, and everything that is its own while it holds
a slot of the batch.

    rid = engine.submit(Request(prompt_ids, max_new_tokens=128, sampling=SamplingParams(seed=1)))
    row = engine.slots[b]           # a Row: its request, random generator, grammar state, prefill
    row.sampling, row.cap, row.top_logprobs, row.metrics

A row owns its progress: the tokens it produced (`out`, appended by `emit` alone, up to EOS or its
budget), why it ended and whether it has. A new per-request feature is a field of `Request` (and,
where it keeps state while the row runs, a field of `Row`) and the lines that use it: the batching
engine (runtime/batching.py) and the decoder (runtime/speculative.py) hand rows over whole, so
neither copies a request's settings or progress into containers of their own. What one row does
in one step is its `RowStep` (runtime/row_step.py); the one view of the rows the batch keeps is
the cache's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrt.runtime.acceptance_report import RequestAcceptance
from specrt.runtime.grammar import Grammar, Matcher
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    rng: np.random.Generator | None = None  # its random generator (default: one from sampling.seed)
    # the most draft tokens a step verifies for it (0: it never drafts); None: the decoder's
    max_draft: int | None = None
    # log probabilities of its tokens (runtime/logprobs.py), with this many alternatives each; None: none
    logprobs: int | None = None
    grammar: Grammar | None = None  # structured output: its output follows this grammar (runtime/grammar.py)
    # its drafts' acceptance reported with its result, "summary" or "detailed" (runtime/acceptance_report.py)
    acceptance: str | None = None


@dataclasses.dataclass
class Row:
    """A request in a slot of the batch, from its submission to its end."""

    rid: int
    request: Request
    budget: int  # tokens it may produce (its max_new_tokens, bounded by the context)
    rng: np.random.Generator  # its own draws: a row samples the same numbers whatever else runs
    matcher: Matcher | None = None  # its grammar's state, when it has one
    prefilled: int = 0  # prompt tokens in the cache so far
    looked_up: bool = False  # its prompt was looked up in the prefix cache
    prefill_seconds: float = 0.0
    steps: list[float] = dataclasses.field(default_factory=list)  # the decode steps it was in (seconds)
    # the target's features the draft has not seen yet: the prompt's by chunk, then each step's
    # root and accepted nodes (kept only when something reads features)
    features: list[np.ndarray] = dataclasses.field(default_factory=list)
    metrics: SpecMetrics | None = None  # its drafts' acceptance while it generates (None: plain decoding)
    acceptance: RequestAcceptance | None = None  # the same, as its request asked it reported (None: not asked)
    out: list[int] = dataclasses.field(default_factory=list)  # the tokens it produced
    reason: str = "length"  # why it ended: "length" (its budget) until EOS makes it "stop"
    done: bool = False  # it hit EOS or its budget

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def generating(self) -> bool:
        """Its prompt is in the cache: it takes part in the decode steps."""
        return self.prefilled == len(self.prompt)

    @property
    def running(self) -> bool:
        """It takes part in the decode steps: its prompt is in and it has not finished."""
        return self.generating and not self.done

    @property
    def left(self) -> int:
        """Tokens it may still produce."""
        return self.budget - len(self.out)

    @property
    def cap(self) -> int | None:
        """The most draft tokens a step verifies for it (its request's max_draft), None: the decoder's."""
        return None if self.request.max_draft is None else max(0, self.request.max_draft)

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives per token when it asked for log probabilities, else None."""
        return self.request.logprobs

    def emit(self, tokens, eos_ids: frozenset) -> list[int]:
        """Append tokens up to EOS or the budget (the one place a row's tokens grow); returns what
        was appended."""
        taken = []
        for t in tokens:
            t = int(t)
            self.out.append(t)
            taken.append(t)
            if t in eos_ids:
                self.done, self.reason = True, "stop"
                break
            if len(self.out) >= self.budget:
                self.done = True
                break
        return taken

    def take_features(self) -> np.ndarray:
        """The features the draft has not seen yet, handed over once."""
        got = np.concatenate(self.features)
        self.features = []
        return got
