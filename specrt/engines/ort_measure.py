"""What an ORT engine's build measures on the session it optimized, written into its manifest:

    batch_invariance(session, config, flavour)  how a position's logits move between one- and
                                                multi-position steps (exactness of speculation)
    step_costs(session, config, flavour)        milliseconds per step by positions at batch 1
                                                (the speculative cost model's priors)

The session is called as the runtime calls it (engines/ sits below the runtime, so this is
written against the step graph's I/O directly): the past is a preallocated buffer of fixed
capacity whose unused slots the attention mask hides, and each step's KV is written into it (the
portable graph returns it and it is copied in; the fused graph writes it in place).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from specrt.engines.profiles import EngineShapes
from specrt.export.step_io import LOGITS, STEP_INPUTS, StepIO, attention_mask

COST_POSITIONS = (1, 2, 3, 5, 9, 17)  # the step sizes step_costs times
COST_REPEATS = 5  # timed steps per size (after one untimed), the median kept


def _runner(session, cfg, flavour: str, capacity: int):
    """(fresh, run): `fresh()` an empty cache of `capacity` positions, `run(tokens, cache)` one
    step over `tokens` after the cache's committed length (it appends them); returns their
    logits (Q, V). A cache's last item is its committed length, [n]."""
    if flavour == "fused":
        return _fused_runner(session, cfg, capacity)
    io = StepIO(cfg.num_hidden_layers)
    shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)

    def fresh():
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(cfg.num_hidden_layers)], [0]

    def run(tokens, cache):
        past, length = cache
        P, Q = length[0], len(tokens)
        mask = attention_mask([P], capacity, Q)
        feeds = dict(
            zip(
                STEP_INPUTS,
                (
                    np.array([tokens], np.int64),
                    np.arange(P, P + Q, dtype=np.int64)[None],
                    mask,
                    np.arange(Q, dtype=np.int64)[None],
                ),
            )
        )
        for i, kv in enumerate(past):
            feeds.update(zip(io.past(i), kv))
        out = session.run([LOGITS, *io.present_names], feeds)
        for i, (k, v) in enumerate(past):
            k[:, :, P : P + Q], v[:, :, P : P + Q] = out[1 + 2 * i], out[2 + 2 * i]
        length[0] += Q
        return out[0][0]

    return fresh, run


def _fused_runner(session, cfg, capacity: int):
    from specrt.engines.ort_inplace import InPlaceRunner
    from specrt.export.step_io import fused_inputs

    runner = InPlaceRunner(session, cfg.num_hidden_layers)
    buffers = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, capacity, cfg.head_dim)  # (L, B, Hkv, C, D)

    def fresh():
        return np.zeros(buffers, np.float32), np.zeros(buffers, np.float32), [0]

    def run(tokens, cache):
        keys, values, length = cache
        P, Q = length[0], len(tokens)
        feeds = {
            "input_ids": np.array([tokens], np.int64),
            "position_ids": np.arange(P, P + Q, dtype=np.int64)[None],
            "logits_index": np.arange(Q, dtype=np.int64)[None],
            **fused_inputs(np.array([P]), attention_mask([P], capacity, Q)),
        }
        logits, _ = runner.run(feeds, keys, values)
        length[0] += Q
        return logits[0]

    return fresh, run


def batch_invariance(
    session, config: dict, flavour: str = "portable", prefix: int = 12, steps: int = EngineShapes.max_verify
) -> dict:
    """How much a position's logits depend on how many positions one step computes: the same
    tokens fed one per step and as one multi-position step (as speculative verification does).
    Exact speculative decoding needs this to be at float rounding level (~1e-6 of the logits'
    range); kernels that switch arithmetic with the number of rows (int8 activations) are not.
    (Measured with an exactly sized past instead of the runtime's preallocated one,
    int8-activation engines show no difference at all, while the runtime sees ~2 % of the
    logits' range.) `steps` must reach the largest verification step: ORT's int8 Q/DQ kernels
    gave identical logits for 6 positions and moved them by 5 % of their range at 17."""
    from specrt.export.config import ModelConfig

    cfg = ModelConfig.from_dict(config)
    # the fused graph writes a step's positions in place: room for the steps and their slack
    fresh, run = _runner(session, cfg, flavour, prefix + (2 * steps if flavour == "fused" else steps))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, prefix + steps).tolist()
    one, many = fresh(), fresh()
    run(ids[:prefix], one)
    run(ids[:prefix], many)
    single = np.stack([run([t], one)[0] for t in ids[prefix:]])
    multi = run(ids[prefix:], many)
    diff = float(np.abs(single - multi).max())
    return {
        "max_abs_diff": diff,
        "relative": diff / max(float(np.ptp(multi)), 1e-12),
        "argmax_agreement": float((single.argmax(-1) == multi.argmax(-1)).mean()),
        "positions": steps,
    }


def step_costs(session, config: dict, flavour: str = "portable", prefix: int = 128) -> dict[str, float]:
    """Milliseconds per step at batch 1 after `prefix` committed positions, by the positions the
    step computes (COST_POSITIONS, keys as strings: JSON), the median of COST_REPEATS steps
    each, sizes interleaved so that a slow moment of the machine hits them alike. The cost of a
    verification step relative to a one-position step is what decides whether drafting pays
    (on this CPU: float32 ~1.06x at 2 positions, the 4-bit gguf engine ~2.3x), and the cost
    model starts from it instead of a guess."""
    from specrt.export.config import ModelConfig

    cfg = ModelConfig.from_dict(config)
    top = max(COST_POSITIONS)
    fresh, run = _runner(session, cfg, flavour, prefix + 2 * top)
    cache = fresh()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prefix + top).tolist()  # any vocabulary size
    run(ids[:prefix], cache)
    times: dict[int, list[float]] = {q: [] for q in COST_POSITIONS}
    for r in range(COST_REPEATS + 1):
        for q in COST_POSITIONS:
            t = time.perf_counter()
            run(ids[prefix : prefix + q], cache)
            if r:  # the first round warms each shape up
                times[q].append(time.perf_counter() - t)
            cache[-1][0] = prefix  # roll back: every step sees the same past
    return {str(q): round(statistics.median(ts) * 1e3, 3) for q, ts in times.items()}
