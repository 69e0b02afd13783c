"""One request's acceptance, as vLLM reports it per request (`metrics.speculative_decoding` of a
response; its `--per-request-spec-decode-metrics summary|detailed`), so a client that reads
vLLM's reads ours.

    report = RequestAcceptance(most=16, detailed=False)
    report.observe(drafted=3, accepted=2)          # one verification step of the request
    report.to_dict()   # {"mean_acceptance_length": 3.0, "draft_acceptance_rate": 0.667, ...}

The fields, with vLLM's names and meanings:
    num_spec_steps             verification steps that verified at least one draft token (a step
                               with nothing drafted is left out, as vLLM leaves it out)
    num_draft_tokens           draft tokens verified: the draft's, the step floor's one-token
                               guess and a grammar's forced tokens alike (all are proposed tokens
                               the target checked)
    num_accepted_draft_tokens  of them, accepted (the bonus token excluded)
    num_spec_tokens            the most draft tokens one of its steps may verify (its k)
    mean_acceptance_length     1 + accepted / steps: tokens per verification step, bonus included
    draft_acceptance_rate      accepted / drafted
    acceptance_histogram       index j: steps that accepted exactly j draft tokens (k + 1 entries)
    acceptance_histogram_by_draft_length  per verified draft length n (a string key): the
                               histogram of steps that verified n tokens (n + 1 entries)
    per_step_accepted, per_step_drafted   with `detailed`: each step's, in order
Its storage is bounded by k (the histograms), except for the detailed per-step lists.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestAcceptance:
    most: int  # num_spec_tokens: the most draft tokens one step verifies for the request
    detailed: bool = False  # keep each step's counts too
    by_length: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    per_step_drafted: list[int] = dataclasses.field(default_factory=list)
    per_step_accepted: list[int] = dataclasses.field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        """One verification step of the request: how many draft tokens it verified and accepted."""
        if drafted == 0:
            return
        counts = self.by_length.setdefault(drafted, [0] * (drafted + 1))
        counts[accepted] += 1
        if self.detailed:
            self.per_step_drafted.append(drafted)
            self.per_step_accepted.append(accepted)

    def to_dict(self) -> dict:
        """vLLM's `metrics.speculative_decoding` object for the request."""
        histogram = [0] * (max(self.most, *self.by_length, 0) + 1)
        drafted = accepted = 0
        for n, counts in self.by_length.items():
            for j, steps in enumerate(counts):
                histogram[j] += steps
                drafted += n * steps
                accepted += j * steps
        steps = sum(histogram)
        out = {
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": histogram,
            "acceptance_histogram_by_draft_length": {str(n): c for n, c in sorted(self.by_length.items())},
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": self.most,
        }
        if self.detailed:
            out |= {"per_step_accepted": self.per_step_accepted, "per_step_drafted": self.per_step_drafted}
        return out
