"""Two engines of one model as one backend: one for steps of a single position, one for the rest.

    backend = SplitBackend(single=gguf_backend, multi=float32_backend)

Which engine is fastest depends on how many positions a step computes. On this CPU ONNX
Runtime's 4-bit kernel (the `gguf` engine) makes a one-position step 1.6x faster than float32,
but its steps of 2 to 16 positions slower (they dequantize to float32 first): 26.7 against 21.0
ms at 2 positions, 37.5 against 32.1 at 16 (`specrt calibrate --report`, quant-report-2026-12-01). What counts is
the positions of the whole step, rows times positions per row (the kernel's matrix rows): a
plain step of two rows is as slow there as a two-position step of one (continuous batching of
2-16 clients decoded at 0.74-0.75x float32's throughput when their one-position steps went to
the 4-bit engine, bench_batch.py). So only a step of one row and one position (plain decoding
alone) runs on `single`; speculative verification, prefill and batched steps run on `multi`.

Only engines that compute the same model may be split: the same checkpoint, features and
precision class (`gguf` computes the float32 model within float rounding; its manifest precision
is float32), so a position's logits differ between the two by float rounding, as they do between
a one- and a multi-position step of either; speculative output stays equal to plain output. Both
read and extend the same host KV cache, whichever graph flavour each runs (a fused graph writes
its positions in place, a portable one returns them for the session to append). A split takes
one-position steps as they are (`Capabilities.floor` 1): its output equals plain output up to
near-ties, the engines' measured bound, never bitwise.
"""

from __future__ import annotations

from specrt.errors import SpecrtError
from specrt.runtime.backends.base import Capabilities, StepBackend, StepOutput


class SplitBackend(StepBackend):
    def __init__(self, single: StepBackend, multi: StepBackend):
        a, b = single.caps, multi.caps
        for what, x, y in (
            ("checkpoint", a.checkpoint_hash, b.checkpoint_hash),
            ("precision", a.precision, b.precision),
            ("feature layers", a.hidden_layers, b.hidden_layers),
            ("cache device", a.cache_device, b.cache_device),
        ):
            if x != y:
                raise SpecrtError(
                    f"the two engines compute different models or keep different caches ({what}: {x} and {y}); "
                    "split only engines of one checkpoint that compute the same numbers (e.g. gguf and float32)"
                )
        if single.config != multi.config:
            raise SpecrtError("the two engines are of different model configurations; split engines of one model")
        self.single, self.multi = single, multi
        self.config = multi.config
        self.description = f"{single.description} (1 position) + {multi.description} (more)"
        inv = [c.batch_invariance for c in (a, b) if c.batch_invariance]
        self.caps = Capabilities(
            max_context=_least(a.max_context, b.max_context),
            max_step=b.max_step,
            max_verify=b.max_verify,
            max_cache=_least(a.max_cache, b.max_cache),
            max_batch=_least(a.max_batch, b.max_batch),
            cache_device=b.cache_device,
            batch_invariance=max(inv, key=lambda d: d["relative"]) if len(inv) == 2 else None,
            step_ms=_split_costs(a.step_ms, b.step_ms),
            hidden_layers=b.hidden_layers,
            precision=b.precision,
            checkpoint_hash=b.checkpoint_hash,
            vocab_size=b.vocab_size,
            # either may write the cache in place (a fused graph): a step says which (its present)
            cache_slack=max(a.cache_slack, b.cache_slack),
            floor=1,  # one-position steps are what `single` is for: exact up to near-ties, not bitwise
        )

    def step(
        self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index=None, want_logits=True
    ) -> StepOutput:
        backend = self.single if input_ids.size == 1 else self.multi
        return backend.step(input_ids, position_ids, attention_mask, logits_index, cache, hidden_index, want_logits)


def _least(x, y):
    return y if x is None else x if y is None else min(x, y)


def _split_costs(single: dict | None, multi: dict | None) -> dict | None:
    """The split's step costs: one position on `single`'s engine, more on `multi`'s."""
    if not single or not multi or 1 not in single:
        return None
    return {1: single[1], **{q: ms for q, ms in multi.items() if q > 1}}
