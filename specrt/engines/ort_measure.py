"""What an ORT engine's build measures on the session it optimized, written into its manifest:

    step_cuts(session, config, flavour)         the positions no step may span: where the
                                                engine's attention adds in another order once a
                                                step ends past them (schema/step_cuts.py)
    batch_invariance(session, config, flavour)  how a position's logits move with the shape of
                                                the step that computes them (exactness of
                                                speculation), and which step shapes agree bitwise
                                                under the cuts
    step_costs(session, config, flavour)        milliseconds per step by positions at batch 1
                                                (the speculative cost model's priors)

The session is called as the runtime calls it (engines/ sits below the runtime, so this is
written against the step graph's I/O directly): the past is a preallocated buffer of fixed
capacity whose unused slots the attention mask hides, and each step's KV is written into it (the
portable graph returns it and it is copied in; the fused graph writes it in place). A row's
step may be padded past its tokens (`run(..., q=...)`): the padding is computed, then left
uncommitted, as the runtime's step floor does (runtime/session.py).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from specrt.engines.profiles import EngineShapes
from specrt.schema import step_cuts as cut_rule
from specrt.schema.step_io import LOGITS, STEP_FLOOR, STEP_INPUTS, StepIO, attention_mask

COST_POSITIONS = (1, 2, 3, 5, 9, 17)  # the step sizes step_costs times
COST_REPEATS = 5  # timed steps per size (after one untimed), the median kept
# how far step_cuts probes: past four periods of the cuts ORT 1.32 gives heads of 256 on two
# threads (63, 319, 575, 831), so that a period is seen three times over
CUT_PROBE = 1100
CUT_CONFIRM = 4200  # and checks the period's continuation at its last cut below this


def _runner(session, cfg, flavour: str, capacity: int, batch: int = 1):
    """(fresh, run): `fresh()` an empty cache of `capacity` positions for `batch` rows,
    `run(rows, cache, q)` one step over each row's tokens after its committed length, padded to
    q positions (default: the longest row's); it commits each row's own tokens and returns the
    logits (B, Q, V). A cache's last item is its committed lengths (B,)."""
    if flavour == "fused":
        return _fused_runner(session, cfg, capacity, batch)
    io = StepIO(cfg.num_hidden_layers)
    shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)

    def fresh():
        past = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(cfg.num_hidden_layers)]
        return past, np.zeros(batch, np.int64)

    def run(rows, cache, q=None):
        past, lengths = cache
        ids, positions, Q = _step_ids(rows, lengths, q)
        feeds = dict(
            zip(
                STEP_INPUTS,
                (
                    ids,
                    positions,
                    attention_mask(lengths, capacity, Q),
                    np.tile(np.arange(Q, dtype=np.int64), (batch, 1)),
                ),
            )
        )
        for i, kv in enumerate(past):
            feeds.update(zip(io.past(i), kv))
        out = session.run([LOGITS, *io.present_names], feeds)
        for i, (k, v) in enumerate(past):
            for b, row in enumerate(rows):
                P, n = lengths[b], len(row)
                k[b, :, P : P + n], v[b, :, P : P + n] = out[1 + 2 * i][b, :, :n], out[2 + 2 * i][b, :, :n]
        lengths += [len(r) for r in rows]
        return out[0]

    return fresh, run


def _step_ids(rows, lengths, q):
    """(input ids, position ids, Q) of a step over `rows`, padded to q positions."""
    Q = max(q or 0, *(len(r) for r in rows))
    ids = np.zeros((len(rows), Q), np.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
    return ids, lengths[:, None] + np.arange(Q, dtype=np.int64)[None], Q


def _fused_runner(session, cfg, capacity: int, batch: int):
    from specrt.engines.ort_inplace import InPlaceRunner
    from specrt.schema.step_io import fused_inputs

    runner = InPlaceRunner(session, cfg.num_hidden_layers)
    buffers = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)  # (L, B, Hkv, C, D)

    def fresh():
        return np.zeros(buffers, np.float32), np.zeros(buffers, np.float32), np.zeros(batch, np.int64)

    def run(rows, cache, q=None):
        keys, values, lengths = cache
        ids, positions, Q = _step_ids(rows, lengths, q)
        feeds = {
            "input_ids": ids,
            "position_ids": positions,
            "logits_index": np.tile(np.arange(Q, dtype=np.int64), (batch, 1)),
            **fused_inputs(lengths, attention_mask(lengths, capacity, Q)),
        }
        logits, _ = runner.run(feeds, keys, values)
        lengths += [len(r) for r in rows]
        return logits

    return fresh, run


def _keeping(run, cuts):
    """`run` that splits each step at the cuts as the runtime's session does (schema/step_cuts.py)
    and returns the logits of the whole step."""
    if not cuts:
        return run

    def split(rows, cache, q=None):
        steps = cut_rule.pieces(cache[-1], [len(r) for r in rows], cuts, STEP_FLOOR)
        outs = [run([r[a:b] for r, (a, b) in zip(rows, step)], cache, q) for step in steps]
        return cut_rule.joined(steps, outs, max(q or 0, *(len(r) for r in rows)))

    return split


def _one_a_step(run, cache, ids: list[int], a: int, b: int) -> list[np.ndarray]:
    """The logits of positions [a, b) computed one a step (padded to the floor: the plain
    decoding shape, the canonical bits), from the cache rolled back to a."""
    cache[-1][:] = a
    return [run([ids[p : p + 1]], cache, STEP_FLOOR)[0, 0].copy() for p in range(a, b)]


def step_cuts(session, config: dict, flavour: str = "portable", top: int = CUT_PROBE, width: int = 17) -> dict:
    """The positions no step may span (schema/step_cuts.py), probed on the engine's own session
    over its first `top` positions (at most its context): each window of `width` positions
    computed as one step and again one position a step (the plain decoding shape, the
    canonical bits); where a window disagrees, every neighbouring pair of its positions as a
    step of two finds the cut between them (a pair that ends on the cut gives the cut's
    position the bits of the shorter total). {"cuts": [...], "period": the spacing where the
    cuts are three or more and evenly spaced (the runtime continues them past the probe), else
    None, "probed_to": the positions probed}."""
    from specrt.schema.config import ModelConfig

    cfg = ModelConfig.from_dict(config)
    top = max(0, min(top, cfg.max_position_embeddings - width - STEP_FLOOR))
    fresh, run = _runner(session, cfg, flavour, top + 2 * width + STEP_FLOOR)
    cache = fresh()
    lengths = cache[-1]
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, top + width + 1).tolist()

    cuts: list[int] = []
    a = 0
    while a < top:
        lengths[:] = a
        wide = run([ids[a : a + width]], cache)[0].copy()
        canon = _one_a_step(run, cache, ids, a, a + width)
        if not all(np.array_equal(w, c) for w, c in zip(wide, canon)):
            for p in range(a + 1, a + width):
                lengths[:] = p - 1
                pair = run([ids[p - 1 : p + 1]], cache)[0]
                if not (np.array_equal(pair[0], canon[p - 1 - a]) and np.array_equal(pair[1], canon[p - a])):
                    cuts.append(p)
            # the pairs wrote their own bits: the window's canonical ones again
            _one_a_step(run, cache, ids, a, a + width)
        a += width - 1  # the next window starts on this one's last position
    gaps = {b - a for a, b in zip(cuts, cuts[1:])}
    period = gaps.pop() if len(cuts) >= 3 and len(gaps) == 1 else None
    out = {"cuts": cuts, "period": period, "probed_to": top}
    if period:  # the continuation checked far past the probe: the predicted cut is one
        out |= _confirmed(session, cfg, flavour, cuts, period, width)
    return out


def _confirmed(session, cfg, flavour: str, cuts: list[int], period: int, width: int) -> dict:
    """{"confirmed_at": the last cut the period predicts below CUT_CONFIRM (and the context),
    "confirmed": whether a step of two positions ending on it gives the cut's position the
    other bits and a window before it agrees}; the period is dropped where it does not."""
    far = cut_rule.expand(cuts, period, min(CUT_CONFIRM, cfg.max_position_embeddings - width - STEP_FLOOR))[-1]
    if far <= cuts[-1]:
        return {}
    start = far - width + 2  # a window of width positions ending just before the cut
    fresh, run = _runner(session, cfg, flavour, far + 2 * width + STEP_FLOOR)
    cache = fresh()
    lengths = cache[-1]
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, far + width).tolist()
    keep = _keeping(run, cut_rule.expand(cuts, period, far))
    for a in range(0, start, 256):
        keep([ids[a : min(a + 256, start)]], cache)
    wide = run([ids[start:far]], cache)[0].copy()
    canon = _one_a_step(run, cache, ids, start, far + 1)
    lengths[:] = far - 1
    pair = run([ids[far - 1 : far + 1]], cache)[0]
    agrees = all(np.array_equal(w, c) for w, c in zip(wide, canon))
    confirmed = agrees and not np.array_equal(pair[1], canon[-1])
    return {"confirmed_at": int(far), "confirmed": bool(confirmed), "period": period if confirmed else None}


# the steps measured start here: they cross slot 64, where ORT 1.32's GroupQueryAttention with
# heads of 256 (Gemma 3) gives a position other bits depending on where its step started (a
# prefix of 12 never saw it: Gemma's engines recorded bitwise, and speculative output differed
# from plain on 2 of 24 prompts of 256 tokens)
SHAPES_PREFIX = 57


def min_context(steps: int = EngineShapes.max_verify) -> int:
    """The shortest context an engine is measured in: one prefix position, then `steps` at once
    and the step floor's padding after the last of them."""
    return 1 + steps + STEP_FLOOR


def within_context(cfg, prefix: int, steps: int) -> int:
    """The prefix a measurement of `steps` positions after it starts from, moved down where the
    model's context ends first: what is measured is what the runtime serves, every position a
    step computes (its padding included) inside the model's context. A context too short for
    any is refused before the build (engines/build.py)."""
    return max(1, min(prefix, cfg.max_position_embeddings - steps - STEP_FLOOR))


def batch_invariance(
    session,
    config: dict,
    flavour: str = "portable",
    prefix: int = SHAPES_PREFIX,
    steps: int = EngineShapes.max_verify,
    cuts: tuple[int, ...] = (),
) -> dict:
    """How a position's logits depend on the shape of the step that computes them: the same
    `steps` tokens after a `prefix`, computed as one multi-position step (as verification does)
    and as

        unpadded   one token per step (plain decoding without the step floor), alone and
                   beside another row that decodes one token per step too
        padded     one token per step, each step padded to STEP_FLOOR positions (the floor)
        split      two multi-position steps (a draft verified in two parts)
        batch      a padded step beside another row (continuous batching)
        capacity   the multi-position step over a cache of twice the capacity

    The unpadded difference is the bound speculation is exact up to without the floor, the
    padded one the bound with it where the shapes are not bitwise equal (float rounding level on
    float kernels, ~1e-6 of the logits' range; int8 activations amplify it to percents).
    `bitwise` says which shapes give exactly the multi-position step's logits (np.array_equal):
    Some of ORT's CPU kernels compute one row in another order of float operations than two or
    more rows, which agree with each other (its attention did, and the fused graph pads a
    one-position step's attention to two positions; its 4-bit and 8-bit products did not);
    with every shape but the unpadded ones true, plain, speculative and batched generation see
    the same logits under the step floor, and with those too without it (the engine needs no
    floor: Capabilities.floor 1).
    `steps` must reach the largest verification step: ORT's int8 Q/DQ kernels gave identical
    logits for 6 positions and moved them by 5 % of their range at 17."""
    from specrt.schema.config import ModelConfig

    cfg = ModelConfig.from_dict(config)
    prefix = within_context(cfg, prefix, steps)
    # the fused graph writes a step's positions in place: room for the steps and their padding
    room = prefix + (2 * steps if flavour == "fused" else steps)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 2 * (prefix + steps)).tolist()
    mine, other = ids[: prefix + steps], ids[prefix + steps :]

    def started(capacity=room, batch=1):
        fresh, run = _runner(session, cfg, flavour, capacity, batch)
        run = _keeping(run, cuts)  # every step keeps the cuts, as the runtime's do
        cache = fresh()
        run([mine[:prefix], other[:prefix]][:batch], cache)
        return run, cache

    def one_by_one(q=None, batch=1, verifying=3):
        run, cache = started(batch=batch)
        out = []
        for i, t in enumerate(mine[prefix:]):
            beside = other[prefix + verifying * i : prefix + verifying * (i + 1)]  # the other row's tokens
            out.append(run([[t], beside][:batch], cache, q)[0, 0])
            if batch > 1 and len(beside) < verifying:
                break
        return np.stack(out)

    run, cache = started()
    multi = run([mine[prefix:]], cache)[0]
    run, cache = started()
    half = steps // 2
    split = np.concatenate([run([mine[prefix : prefix + half]], cache)[0], run([mine[prefix + half :]], cache)[0]])
    run, cache = started(capacity=2 * room)
    wide = run([mine[prefix:]], cache)[0]
    single, padded, batched = one_by_one(), one_by_one(q=STEP_FLOOR), one_by_one(q=STEP_FLOOR, batch=2)
    decoding = one_by_one(batch=2, verifying=1)  # two rows decoding, one position each
    diff, span = float(np.abs(single - multi).max()), max(float(np.ptp(multi)), 1e-12)
    return {
        "max_abs_diff": diff,
        "relative": diff / span,
        "padded_relative": float(np.abs(padded - multi).max()) / span,  # the bound with the floor
        "argmax_agreement": float((single.argmax(-1) == multi.argmax(-1)).mean()),
        "positions": steps,
        "bitwise": {
            "padded": bool(np.array_equal(padded, multi)),
            "split": bool(np.array_equal(split, multi)),
            "batch": bool(np.array_equal(batched, multi[: len(batched)])),
            "capacity": bool(np.array_equal(wide, multi)),
            # one-position steps as they are, alone and beside another row: with these too, an
            # engine needs no step floor (the fused graph's attention pads them itself)
            "unpadded": bool(np.array_equal(single, multi)),
            "unpadded_batch": bool(np.array_equal(decoding, multi[: len(decoding)])),
        },
    }


def step_costs(session, config: dict, flavour: str = "portable", prefix: int = 128) -> dict[str, float]:
    """Milliseconds per step at batch 1 after `prefix` committed positions, by the positions the
    step computes (COST_POSITIONS, keys as strings: JSON), the median of COST_REPEATS steps
    each, sizes interleaved so that a slow moment of the machine hits them alike. The cost of a
    verification step relative to a one-position step is what decides whether drafting pays
    (on this CPU: float32 ~1.06x at 2 positions, the 4-bit gguf engine ~2.3x), and the cost
    model starts from it instead of a guess."""
    from specrt.schema.config import ModelConfig

    cfg = ModelConfig.from_dict(config)
    top = max(COST_POSITIONS)
    prefix = within_context(cfg, prefix, top)
    fresh, run = _runner(session, cfg, flavour, prefix + 2 * top)
    cache = fresh()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prefix + top).tolist()  # any vocabulary size
    run([ids[:prefix]], cache)
    times: dict[int, list[float]] = {q: [] for q in COST_POSITIONS}
    for r in range(COST_REPEATS + 1):
        for q in COST_POSITIONS:
            t = time.perf_counter()
            run([ids[prefix : prefix + q]], cache)
            if r:  # the first round warms each shape up
                times[q].append(time.perf_counter() - t)
            cache[-1][:] = prefix  # roll back: every step sees the same past
    return {str(q): round(statistics.median(ts) * 1e3, 3) for q, ts in times.items()}


def floor_of(measured: dict | None) -> int:
    """The step floor an engine needs: 1 where its build found every step shape bitwise equal,
    one-position steps included (batch_invariance's `unpadded`), else STEP_FLOOR."""
    shapes = (measured or {}).get("bitwise") or {}
    return 1 if shapes.get("unpadded") and all(shapes.values()) else STEP_FLOOR
