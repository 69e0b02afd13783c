"""Which step shapes give a position bitwise the same logits, on any backend, through a session.

    measure(backend)                     the same 17 tokens after a 57-token prefix (crossing slot
                                         64, where one ORT attention kernel changes), computed in
                                         one multi-position step and in the other shapes the
                                         runtime takes (the dict an ORT engine's manifest holds)
    measure(backend, floors=(2, 8, 16))  also with other step floors: where two positions per
                                         row are not enough (a GPU library that picks its kernel
                                         by the product's row count), the floor that is

An ORT engine's build measures this against the step graph directly (engines/ort_measure.py);
this one runs any backend (PyTorch on the CPU or a GPU, TensorRT) the way the runtime does,
through `StepSession.forward`, so it also covers what the session adds (padding, the cache).
"""

from __future__ import annotations

import numpy as np

from specrt.runtime.backends.base import StepBackend
from specrt.runtime.session import StepSession

BESIDE = 3  # the other row of a batch verifies this many tokens per step
WIDER = 512  # the other capacity: this many slots more (past a pooled cache's 256-slot bucket)


def measure(backend: StepBackend, prefix: int = 57, steps: int = 17, rules: tuple = (), seed: int = 0) -> dict:
    """How a position's logits depend on the shape of the step that computes them: `steps`
    tokens after a `prefix`, as one multi-position step (verification) and as

        unpadded   one token per step (plain decoding without the step floor)
        padded     one token per step, padded as the session pads it (the floor)
        split      two multi-position steps (a draft verified in two parts)
        batch      a padded step beside another row verifying BESIDE tokens (continuous batching)
        capacity   the multi-position step over a cache of WIDER more slots

    Returns the manifest's fields (max_abs_diff, relative, padded_relative, argmax_agreement,
    positions, bitwise per shape) under the session's rule (the backend's floor and step
    multiple), and for each (floor, multiple) of `rules` the same four shapes' bitwise verdicts
    and their largest difference under that rule, keyed "floor F, multiple M". Relative
    differences are over the multi-position step's logits range."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, backend.config.vocab_size, 2 * (prefix + steps)).tolist()
    mine, other = ids[: prefix + steps], ids[prefix + steps :]
    room = prefix + 2 * steps

    def run(rule, batch, capacity, chunks):
        """Logits of `mine` after the prefix, computed in `chunks` (lists of offsets) per step."""
        session = StepSession(backend, exact="bitwise")
        session.floor, session.multiple = rule
        cache = session.new_cache(batch, capacity)
        try:
            session.prefill(cache, [mine[:prefix], other[:prefix]][:batch])
            out = []
            for i, (a, b) in enumerate(chunks):
                beside = other[prefix + BESIDE * i : prefix + BESIDE * (i + 1)]
                if batch > 1 and len(beside) < BESIDE:
                    break
                rows = [mine[prefix + a : prefix + b], beside][:batch]
                out.append(np.array(session.forward(cache, rows).logits[0, : b - a], dtype=np.float32))
            return np.concatenate(out)
        finally:
            session.release(cache)

    half = steps // 2
    whole, split, single = [(0, steps)], [(0, half), (half, steps)], [(i, i + 1) for i in range(steps)]

    def shapes(rule):
        multi = run(rule, 1, room, whole)
        got = {
            "padded": run(rule, 1, room, single),
            "split": run(rule, 1, room, split),
            "batch": run(rule, 2, room, single),
            "capacity": run(rule, 1, room + WIDER, whole),
        }
        diff = max(float(np.abs(g - multi[: len(g)]).max()) for g in got.values())
        return multi, got, {k: bool(np.array_equal(g, multi[: len(g)])) for k, g in got.items()}, diff

    own = (max(backend.caps.floor, 1), backend.caps.step_multiple)
    multi, got, bitwise, _ = shapes(own)
    span = max(float(np.ptp(multi)), 1e-12)
    unpadded = run((1, 1), 1, room, single)
    diff = float(np.abs(unpadded - multi).max())
    result = {
        "max_abs_diff": diff,
        "relative": diff / span,
        "padded_relative": float(np.abs(got["padded"] - multi).max()) / span,
        "argmax_agreement": float((unpadded.argmax(-1) == multi.argmax(-1)).mean()),
        "positions": steps,
        "bitwise": bitwise,
    }
    if rules:
        result["rules"] = {}
        for f, m in rules:
            _, _, verdicts, worst = shapes((int(f), int(m)))
            result["rules"][f"floor {f}, multiple {m}"] = {"bitwise": verdicts, "relative": worst / span}
    return result
