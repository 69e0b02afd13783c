"""The GPU check's correctness blocks; each returns (verdict, details) and can fail.

accuracy   logits against the CPU float32 reference (same cache state) at prefill and Q = 1, 5, 17
graphs     capture counts exactly as expected for the shapes run (a prefill chunk short enough
           to be captured is not), replays equal to eager steps, and a first generation that
           captures while a second captures nothing
syncs      host syncs of one graph decode step (torch's sync debug mode): exactly the one that
           reads the tokens back
greedy     greedy sequences against the CPU reference's, at batch 1 (eager, graphs) and batch 3
generation greedy speculative output == plain, a continuous batch == each prompt alone

A greedy sequence that differs from another is a FAIL unless it first differs where the top-1 /
top-2 margin is a near tie: under twice the largest logit difference measured between the two
computations (the backend against the reference in `greedy`; the backend's one-position steps
against its multi-position steps in `generation`), where rounding decides and not a bug.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch
from gpu_exact import device_model

from specrt.runtime.backends import TorchBackend
from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.session import StepSession
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

# a backend's largest logit difference from float64 may be this many times the CPU's own in the
# same dtype (two float32 computations that add in other orders differ by a few times each one's
# rounding; TF32's 10-bit inputs by about 2^13 times it)
ACCURACY_FACTOR = 8
QS = (1, 5, 17)
NEAR_TIE_FLOOR = 1e-6  # the least near-tie cutoff (two bitwise-equal computations measure 0)
# the largest logit difference that counts as rounding between two float32 computations of one
# model (measured on a GPU: 4.6e-5 against the CPU; TF32 about 1e-3)
NEAR_TIE_CAP = 1e-2
# what torch's sync debug mode says on each synchronizing call (c10/cuda: warn_or_error_on_sync)
SYNC_WARNING = "synchronizing CUDA operation"


def distinct_requests(prompts: list[list[int]], n: int) -> list[list[int]]:
    """n requests from the prompts taken in turn, each later round one token shorter at the
    front (no two alike)."""
    return [prompts[i % len(prompts)][i // len(prompts) :] for i in range(n)]


def ok_lines(checks: dict) -> list[str]:
    return [f"{'ok  ' if v else 'FAIL'} {k}" for k, v in checks.items()]


# -- accuracy ---------------------------------------------------------------------------------------


def compare_steps(backend, reference, prompt: list[int]) -> list[dict]:
    """Logits of `backend` against `reference` at prefill (every prompt position) and at Q = 1, 5,
    17 new positions after it, each from the same committed cache."""
    a, b = StepSession(backend), StepSession(reference)
    ca, cb = a.new_cache(1, len(prompt) + 64), b.new_cache(1, len(prompt) + 64)
    rows = [_diff("prefill", a.forward(ca, [prompt]).logits, b.forward(cb, [prompt]).logits)]
    length = int(ca.lengths[0])
    for q in QS:
        new = [(7 * i + 11) % (backend.config.vocab_size - 3) + 3 for i in range(q)]
        rows.append(_diff(f"Q={q}", a.forward(ca, [new]).logits, b.forward(cb, [new]).logits))
        ca.rollback(np.array([length]))
        cb.rollback(np.array([length]))
    a.release(ca)
    return rows


def _diff(where: str, got: np.ndarray, ref: np.ndarray) -> dict:
    got, ref = got[0].astype(np.float64), ref[0].astype(np.float64)  # (positions, V)
    delta = float(np.abs(got - ref).max())
    margin = top_margin(ref)
    decidable = margin > 2 * delta
    agree = got.argmax(-1) == ref.argmax(-1)
    return {
        "where": where,
        "max_abs_diff": delta,
        "min_margin": float(margin.min()),
        "decidable": int(decidable.sum()),
        "positions": int(len(ref)),
        "top1_agree_decidable": int((agree & decidable).sum()),
        "top1_agree_all": int(agree.sum()),
    }


def top_margin(logits: np.ndarray) -> np.ndarray:
    """top-1 minus top-2 logit along the last axis (float64)."""
    top2 = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def accuracy_block(backends: dict, references: dict, exact, ps):
    """backends: {name: (backend, dtype name)}; references: {dtype name: the same model in that
    dtype on the CPU}; exact: the model in float64 on the CPU. Each backend's logits against
    float64 must stay within ACCURACY_FACTOR times the CPU's own difference in its dtype (the
    tolerance is measured here, per dtype: a float32 GPU step that rounds its products' inputs
    to TF32's 10 bits misses it by orders of magnitude), with top-1 equal wherever the float64
    margin is decidable."""
    tolerance = {d: ACCURACY_FACTOR * _largest(compare_steps(r, exact, ps[1])) for d, r in references.items()}
    rows, ok = {}, True
    lines = [f"{'backend':<22}{'step':<9}{'max |d|':>10}{'tolerance':>11}{'min margin':>12}{'top-1 (decidable)':>20}"]
    lines += [
        f"tolerance {d}: {ACCURACY_FACTOR} x the CPU's own {t / ACCURACY_FACTOR:.2e}" for d, t in tolerance.items()
    ]
    for name, (backend, dtype) in backends.items():
        rows[name] = compare_steps(backend, exact, ps[1])
        for r in rows[name]:
            good = r["max_abs_diff"] <= tolerance[dtype] and r["top1_agree_decidable"] == r["decidable"]
            ok &= good
            lines.append(
                f"{name:<22}{r['where']:<9}{r['max_abs_diff']:>10.2e}{tolerance[dtype]:>11.2e}{r['min_margin']:>12.2e}"
                f"{r['top1_agree_decidable']:>11}/{r['decidable']:<8}{'' if good else '  <- FAIL'}"
            )
    return ("PASS" if ok else "FAIL"), {"rows": rows, "lines": lines, "tolerance": tolerance}


def float64_reference(model) -> TorchBackend:
    """The model computed in float64 on the CPU (its cache, as every cache, float32): the traced
    form, whose past is cast to the model's dtype (the in-place form writes into float32 buffers)."""
    return TorchBackend(device_model(model, torch.float64), in_place=False)


def _largest(rows: list[dict]) -> float:
    return max(r["max_abs_diff"] for r in rows)


# -- graphs -----------------------------------------------------------------------------------------

EXPECTED_CAPTURES = [0, 1, 2, 3]


def graphs_block(make_graphs, make_eager, ps):
    """Replays against eager steps on identical inputs, with the captures counted after each stage:
    none yet; Q = 1 captured (then replayed); Q = 5 captured (then Q = 1 replayed again); another
    cache's Q = 1 captured. Exactly EXPECTED_CAPTURES: a replay that recaptures counts. Then two
    generations with graphs: the second captures nothing."""
    g, e = make_graphs(), make_eager()
    sg, se = StepSession(g), StepSession(e)
    # a prefill chunk short enough to be captured by its size (Q <= max_graph_q): run eagerly
    # because it is a prefill (logits at its last position only), which the first count checks
    prompt = ps[0][: min(24, g.max_graph_q)]
    cg, ce = sg.new_cache(1, 128), se.new_cache(1, 128)
    sg.forward(cg, [prompt], last_only=True)
    se.forward(ce, [prompt], last_only=True)
    length = len(prompt)

    def step(session, cache, tokens):
        out = session.forward(cache, [tokens]).logits
        cache.rollback(np.array([length]))
        return out

    one, five = [11], [12, 13, 14, 15, 16]
    eager1, eager5 = step(se, ce, one), step(se, ce, five)
    checks, counts = {}, [g.captures]
    checks["first capture == eager"] = _close(step(sg, cg, one), eager1)
    checks["replay == eager"] = _close(step(sg, cg, one), eager1)
    counts.append(g.captures)
    checks["other shape captured == eager"] = _close(step(sg, cg, five), eager5)
    checks["replay after another shape == eager"] = _close(step(sg, cg, one), eager1)
    counts.append(g.captures)
    sg.release(cg)
    other = sg.new_cache(1, 512)  # other buffers: their graph is captured anew
    sg.forward(other, [prompt], last_only=True)
    checks["another cache == eager"] = _close(sg.forward(other, [one]).logits, eager1)
    counts.append(g.captures)
    sg.release(other)
    checks[f"captures after each stage == {EXPECTED_CAPTURES}"] = counts == EXPECTED_CAPTURES
    gen = Generator(g)
    gen.eos_ids = frozenset()

    def generation():  # a fresh suffix draft each time (it learns from outputs): the same shapes
        SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)).generate_ids(ps[:2], 24)

    generation()
    first = g.captures
    generation()
    checks["a first generation captures"] = first > counts[-1]  # else the next check proves nothing
    checks["a second generation captures nothing"] = g.captures == first
    lines = ok_lines(checks) + [
        f"captures after each stage: {counts}; generations: {first - counts[-1]} then {g.captures - first}"
    ]
    verdict = "PASS" if all(checks.values()) else "FAIL"
    return verdict, {"checks": checks, "capture_counts": counts, "lines": lines}


def _close(a: np.ndarray, b: np.ndarray, tol: float = 1e-3) -> bool:
    return bool(np.abs(a.astype(np.float64) - b.astype(np.float64)).max() < tol)


# -- host syncs -------------------------------------------------------------------------------------

# the host syncs each kind of step needs: reading back what its caller reads (greedy: the tokens;
# sampled: the logits; a feature step: the features and the tokens), and nothing else
EXPECTED_SYNCS = {"decode": 1, "verification": 1, "sampled": 1, "features": 2}
HOST_READS = ("cpu", "item", "tolist")  # the torch.Tensor methods that read a tensor to the host


def count_syncs(fn) -> tuple[int, list[str]]:
    """(host syncs while `fn` runs, where). On a GPU torch's sync debug mode warns on every
    synchronizing CUDA call. Without CUDA (the CPU mode) the host reads a GPU step would sync on
    are counted instead: calls of HOST_READS, plus warnings raised by an emulation."""
    cuda = torch.cuda.is_available()
    where: list[str] = []
    saved = {}
    if not cuda:
        for name in HOST_READS:
            saved[name] = real = getattr(torch.Tensor, name)

            def read(self, *a, _real=real, _name=name, **kw):
                caller = sys._getframe(1)
                where.append(f"{caller.f_code.co_filename}:{caller.f_lineno} (Tensor.{_name})")
                return _real(self, *a, **kw)

            setattr(torch.Tensor, name, read)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            for name, real in saved.items():
                setattr(torch.Tensor, name, real)
    where += [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]
    return len(where), where


def syncs_block(make_backend, ps):
    """Each kind of step the runtime takes (EXPECTED_SYNCS), run twice first (through its CUDA
    graph where the backend has graphs: captured, then replayed), then once with its syncs
    counted: exactly the expected count (0 would mean the audit saw nothing)."""
    backend = make_backend()
    session = StepSession(backend)
    cache = session.new_cache(1, 128)
    session.forward(cache, [ps[0][:32]], last_only=True)
    base = cache.lengths.copy()
    kinds = {
        "decode": lambda: session.forward(cache, [[13]], want_logits=False),
        "verification": lambda: session.forward(cache, [[13, 14, 15, 16, 17]], want_logits=False),
        "sampled": lambda: session.forward(cache, [[13]]),
        "features": lambda: session.forward(cache, [[13]], hidden=True, want_logits=False),
    }
    counts, where, lines = {}, {}, []
    for kind, step in kinds.items():
        for _ in range(2):  # captured, replayed: warm
            step()
            cache.rollback(base)
        counts[kind], where[kind] = count_syncs(step)
        cache.rollback(base)
        expected = EXPECTED_SYNCS[kind]
        ok = counts[kind] == expected
        lines.append(f"{'ok  ' if ok else 'FAIL'} {kind}: {counts[kind]} host sync(s) (expected {expected})")
        lines += [f"     sync at {w}" for w in where[kind]]
    session.release(cache)
    verdict = "PASS" if counts == EXPECTED_SYNCS else "FAIL"
    return verdict, {"syncs": counts, "expected": EXPECTED_SYNCS, "where": where, "lines": lines}


# -- greedy sequences against the CPU ---------------------------------------------------------------


def greedy_block(reference, make_backend, ps, runs, tokens: int = 48):
    """Each run (name, graphs, batch) generates `tokens` greedy tokens per prompt; each sequence
    must equal the CPU reference's. At a mismatch: its first index and the reference's top-1 /
    top-2 margin there; under the run's near-tie cutoff (twice the largest logit difference of its
    backend against the reference, measured on the first prompt) a near tie, else FAIL."""
    ref_gen = Generator(reference)
    ref_gen.eos_ids = frozenset()
    expected = [ref_gen.generate_ids([p], tokens)[0].token_ids for p in ps]
    ok, results, lines = True, {}, []
    for name, graphs, batch in runs:
        gen = Generator(make_backend(graphs))
        gen.eos_ids = frozenset()
        cutoff = near_tie(max(r["max_abs_diff"] for r in compare_steps(make_backend(graphs), reference, ps[0][:32])))
        if batch == 1:
            got = [gen.generate_ids([p], tokens)[0].token_ids for p in ps]
        else:
            got = [r.token_ids for r in gen.generate_ids(ps[:batch], tokens)]
        rows = []
        for i, (g, r) in enumerate(zip(got, expected)):
            row = mismatch(reference, ps[i], g, r, cutoff)
            ok &= row["verdict"] != "FAIL"
            rows.append(row)
            lines.append(f"{row['verdict']:<9} {name}, prompt {i}: {row['note']}")
        results[name] = rows
    return ("PASS" if ok else "FAIL"), {"runs": results, "tokens": tokens, "lines": lines}


def near_tie(max_abs_diff: float) -> float:
    """The near-tie cutoff of two computations whose logits differ by up to `max_abs_diff`: a
    margin under twice it can flip (each of the top two may move by it). A difference past
    NEAR_TIE_CAP is no rounding (a wrong kernel moves logits by whole units: its own gap would
    excuse its every mismatch), and NaN is none: both give NaN, no margin is under it, and
    every mismatch is a FAIL."""
    if not max_abs_diff <= NEAR_TIE_CAP:
        return float("nan")
    return max(2 * max_abs_diff, NEAR_TIE_FLOOR)


def mismatch(reference, prompt: list[int], got: list[int], expected: list[int], cutoff: float) -> dict:
    """Where `got` first differs from `reference`'s greedy `expected`, with the reference's margin
    there: under `cutoff` (near_tie) a near tie, else FAIL."""
    if got == expected:
        return {"verdict": "equal", "note": f"{len(got)} tokens equal"}
    i = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    session = StepSession(reference)
    cache = session.new_cache(1, len(prompt) + i + 1)
    logits = session.forward(cache, [prompt + expected[:i]], last_only=True).logits[0, 0]
    margin = float(top_margin(logits))
    verdict = "near tie" if margin < cutoff else "FAIL"
    got_i = got[i] if i < len(got) else None
    note = (
        f"first differs at token {i} (got {got_i}, reference {expected[i]}), reference margin {margin:.2e} "
        f"(near-tie cutoff {cutoff:.1e})"
    )
    return {"verdict": verdict, "index": i, "margin": margin, "cutoff": cutoff, "note": note}


# -- generation -------------------------------------------------------------------------------------


def class_gap(backend, prompt: list[int], q: int = 5) -> float:
    """The largest logit difference between the backend's one-position steps and one step of q
    positions over the same tokens (a decode step against a verification step: kernels may
    compute them in two numeric classes): measured without the step floor, which generation keeps."""
    session = StepSession(backend, exact="near-ties")
    one, many = session.new_cache(1, len(prompt) + q), session.new_cache(1, len(prompt) + q)
    new = [(5 * i + 7) % (backend.config.vocab_size - 3) + 3 for i in range(q)]
    for cache in (one, many):
        session.forward(cache, [prompt], last_only=True)
    single = np.concatenate([session.forward(one, [[t]]).logits[0] for t in new])
    multi = session.forward(many, [new]).logits[0]
    session.release(one)
    session.release(many)
    return float(np.abs(single.astype(np.float64) - multi.astype(np.float64)).max())


def generation_block(make_backend, ps):
    """Greedy speculative == plain on the same backend (a first difference at a near tie of its
    decode and verification steps' numeric classes passes, named), a continuous batch == alone."""
    backend = make_backend()
    gen = Generator(backend)
    gen.eos_ids = frozenset()
    plain = [r.token_ids for r in gen.generate_ids(ps, 64)]
    spec = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4))
    gap = class_gap(backend, ps[0][:32])
    cutoff = near_tie(gap)
    rows = [mismatch(backend, p, s.token_ids, e, cutoff) for p, s, e in zip(ps, spec.generate_ids(ps, 64), plain)]
    checks = {
        f"decode and verification steps differ by rounding only (<= {NEAR_TIE_CAP:.0e})": gap <= NEAR_TIE_CAP,
        "greedy speculative == plain (or a near tie)": all(r["verdict"] != "FAIL" for r in rows),
    }
    alone = [gen.generate_ids([p], 24)[0].token_ids for p in ps]
    # a batch's decode step has a row per request: the multi-row class, as a verification step
    batched = BatchEngine(gen, max_batch=2).run([Request(p, 24) for p in ps], [0, 0, 3])
    brows = [mismatch(backend, p, b.token_ids, a, cutoff) for p, b, a in zip(ps, batched, alone)]
    checks["continuous batch == alone (or a near tie)"] = all(r["verdict"] != "FAIL" for r in brows)
    lines = (
        ok_lines(checks)
        + [f"decode vs verification steps: largest logit difference {gap:.1e}"]
        + [
            f"{r['verdict']:<9} {what}, prompt {i}: {r['note']}"
            for what, rs in (("speculative", rows), ("batched", brows))
            for i, r in enumerate(rs)
        ]
    )
    verdict = "PASS" if all(checks.values()) else "FAIL"
    details = {"checks": checks, "speculative": rows, "batched": brows, "near_tie_cutoff": cutoff, "class_gap": gap}
    return verdict, {**details, "lines": lines}
