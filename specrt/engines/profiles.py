"""Optimization profiles as plain data, converted to TensorRT objects at one edge (trt.py).

A `ProfileSpec` names ranges of batch, new positions Q and past length P; `shapes()` turns it
into (min, opt, max) shapes for every input of the step graph. Two regimes are built by default:
    prefill: Q up to the longest prompt chunk, P up to the context
    verify:  Q from 1 (decode) to max draft tokens + 1 (or the largest tree), P up to the context
The runtime picks the profile whose Q range holds the step (verify first: it is tuned for small Q).
"""

from __future__ import annotations

import dataclasses

from specrt.errors import SpecrtError
from specrt.schema.step_io import STEP_INPUTS, StepIO

# TensorRT requires every bound address to be 256-byte aligned. A KV cache is one buffer
# [L, B, Hkv, C, D] whose layer and row slices are bound in place, at multiples of Hkv * C * D * 4
# bytes: with C a multiple of 64 positions that is a multiple of 256 for any Hkv and D (float32).
CACHE_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Range:
    min: int
    opt: int
    max: int

    def check(self, what: str, lowest: int = 0) -> None:
        if not lowest <= self.min <= self.opt <= self.max:
            raise SpecrtError(
                f"profile range {what} = (min {self.min}, opt {self.opt}, max {self.max}) must satisfy {lowest} <= "
                "min <= opt <= max."
            )

    def __add__(self, other: "Range") -> "Range":
        return Range(self.min + other.min, self.opt + other.opt, self.max + other.max)


def triple(*dims) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes from dimensions that are Ranges or fixed ints."""
    return tuple(tuple(getattr(d, k) if isinstance(d, Range) else d for d in dims) for k in ("min", "opt", "max"))


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    name: str
    batch: Range
    q_len: Range
    past_len: Range

    def validate(self) -> None:
        self.batch.check(f"{self.name}.batch", lowest=1)
        self.q_len.check(f"{self.name}.q_len", lowest=1)
        self.past_len.check(f"{self.name}.past_len", lowest=0)

    def holds(self, batch: int, q_len: int, past_len: int) -> bool:
        return (
            self.batch.min <= batch <= self.batch.max
            and self.q_len.min <= q_len <= self.q_len.max
            and self.past_len.min <= past_len <= self.past_len.max
        )

    def shapes(
        self, num_layers: int, kv_heads: int, head_dim: int
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """{input name: (min shape, opt shape, max shape)} for the step graph's inputs."""
        self.validate()
        b, q, p = self.batch, self.q_len, self.past_len
        kv = q + p
        ids, pos, mask, index = STEP_INPUTS
        out = {
            ids: triple(b, q),
            pos: triple(b, q),
            mask: triple(b, q, kv),
            index: triple(b, Range(1, q.opt, q.max)),  # K in 1..Q: the last position, or all
        }
        for name in StepIO(num_layers).past_names:
            out[name] = triple(b, kv_heads, p, head_dim)
        return out


@dataclasses.dataclass(frozen=True)
class EngineShapes:
    """What the engine must serve; turned into the two default profiles."""

    max_batch: int = 1
    max_context: int = 2048
    max_prefill: int = 512  # longest prompt chunk (the runtime prefills in chunks of this size)
    max_verify: int = 17  # max draft tokens + 1 (or the largest tree + 1)

    def profiles(self) -> list[ProfileSpec]:
        if self.max_verify < 1 or self.max_prefill < 1 or self.max_context < 2 or self.max_batch < 1:
            raise SpecrtError(f"engine shapes must be positive: {self}")
        if self.max_prefill > self.max_context or self.max_verify > self.max_context:
            raise SpecrtError(
                f"max_prefill ({self.max_prefill}) and max_verify ({self.max_verify}) must not exceed max_context "
                f"({self.max_context})."
            )
        batch = Range(1, 1, self.max_batch)
        # the runtime feeds its whole preallocated cache: the context plus room for one draft, up to
        # a multiple of CACHE_ALIGN (the largest cache must still have aligned slices)
        most = -(-(self.max_context + self.max_verify) // CACHE_ALIGN) * CACHE_ALIGN
        past = Range(0, self.max_context // 2, most)
        verify = ProfileSpec("verify", batch, Range(1, min(4, self.max_verify), self.max_verify), past)
        prefill = ProfileSpec("prefill", batch, Range(1, self.max_prefill // 2 or 1, self.max_prefill), past)
        for p in (verify, prefill):
            p.validate()
        return [verify, prefill]
