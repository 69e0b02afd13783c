"""Speculative decoding metrics.

Conventions (as vLLM counts them):
    acceptance rate       accepted draft tokens / drafted tokens
    mean accepted length  tokens emitted per verification step, the bonus/recovered token
                          and accepted guesses included: (accepted + guesses accepted + steps) /
                          steps; plain decoding has 1.0 without guesses
    guesses               a one-token guess a step's floor position carries where nothing was
                          drafted (SpeculativeDecoder.guess): counted apart from the drafts, so
                          the acceptance rate is the draft method's
    per-position rate     of the steps whose draft reached depth i, the fraction whose accepted
                          path reached depth i
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecMetrics:
    steps: int = 0  # verification steps (target forward passes after prefill)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at_depth: list[int] = dataclasses.field(default_factory=list)
    accepted_at_depth: list[int] = dataclasses.field(default_factory=list)
    step_seconds: float = 0.0  # target steps
    draft_seconds: float = 0.0  # proposers
    alpha: float | None = None  # measured marginal cost of one verified position / decode step
    beta: float | None = None  # measured fixed extra cost of a verification step / decode step
    draft_ratio: float | None = None  # measured T_draft / T_decode
    decode_step_seconds: float | None = None  # measured (fitted) cost of a plain decode step
    predicted_speedup: float | None = None  # cost model with the measured numbers
    forced_tokens: int = 0  # drafted tokens a request's grammar forced (runtime/grammar.py)
    forced_accepted: int = 0
    guessed_tokens: int = 0  # steps whose only node was the floor's guess (SpeculativeDecoder.guess)
    guessed_accepted: int = 0

    def observe_draft(self, num_draft: int, num_accepted: int, max_depth: int = 0) -> None:
        """One verified draft: its size, how many were accepted, how deep the draft went."""
        self.steps += 1
        self.drafted_tokens += num_draft
        self.accepted_tokens += num_accepted
        depth = max(max_depth, num_accepted)
        for lst in (self.drafted_at_depth, self.accepted_at_depth):
            lst.extend([0] * (depth - len(lst)))
        for i in range(depth):
            self.drafted_at_depth[i] += 1
        for i in range(num_accepted):
            self.accepted_at_depth[i] += 1

    def observe_forced(self, drafted: int, accepted: int) -> None:
        """Of one verified draft, the first `drafted` tokens were forced by the grammar."""
        self.forced_tokens += drafted
        self.forced_accepted += min(drafted, accepted)

    def observe_guess(self, accepted: int) -> None:
        """One verified step whose only node was a guess at the floor's position."""
        self.steps += 1
        self.guessed_tokens += 1
        self.guessed_accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.guessed_accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_depth, self.drafted_at_depth)]

    @property
    def measured_speedup(self) -> float | None:
        """Emitted tokens per second of steps + drafting, over 1 / (fitted plain decode step)."""
        spent = self.step_seconds + self.draft_seconds
        if not self.decode_step_seconds or not spent or not self.steps:
            return None
        return (self.accepted_tokens + self.guessed_accepted + self.steps) / spent * self.decode_step_seconds

    def summary(self) -> str:
        pos = " ".join(f"{r:.2f}" for r in self.per_position_acceptance[:8])
        parts = [
            f"steps {self.steps}",
            f"acceptance {self.acceptance_rate:.2f}",
            f"mean accepted length {self.mean_accepted_length:.2f}",
            f"per position [{pos}]",
        ]
        if self.guessed_tokens:
            parts.append(f"guesses {self.guessed_accepted}/{self.guessed_tokens}")
        if self.alpha is not None:
            parts.append(f"alpha {self.alpha:.3f} beta {self.beta:.3f}")
        if self.predicted_speedup is not None and self.measured_speedup is not None:
            parts.append(f"speedup predicted {self.predicted_speedup:.2f}x / measured {self.measured_speedup:.2f}x")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            per_position_acceptance=self.per_position_acceptance,
            measured_speedup=self.measured_speedup,
        )
        return d
