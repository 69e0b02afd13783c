"""Step cuts (schema/step_cuts.py): the positions no step may span, found by an engine's build
where its attention adds a position's scores in another order once the step ends past them
(ORT 1.32, heads of 256: Gemma 3, on an Intel Xeon; an AMD EPYC's build finds none), and kept
by the session, which splits steps there, and the speculative decoder, which drafts no further.
With them a request's tokens and log probabilities are bitwise the same alone, beside others,
with any draft, a tree, a prefix-cache hit and a chunked prefill, across several cuts (a CPU
without cuts runs the Xeon's, which change no bits there); the rule itself and the session's
putting split steps back together are checked on their own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_exact import answers, spec

from specrt.engines.build import BuildSpec, build_all
from specrt.errors import SpecrtError
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator
from specrt.runtime.prefix_cache import PrefixCache
from specrt.runtime.session import StepSession
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.schema import step_cuts

from self_draft import SelfDraftProposer

pytest.importorskip("transformers")


def keeps_the_rule(lengths, counts, cuts, floor, steps, whole=()):
    """Every row's tokens once, in order; no step spans a cut; whole rows in one step."""
    done = [0] * len(counts)
    for step in steps:
        q = max(floor, *(b - a for a, b in step))
        for row, (a, b) in enumerate(step):
            assert a == done[row] and b >= a
            if b == a:
                continue
            if row in whole:
                assert (a, b) == (0, counts[row])
            s = lengths[row] + a
            c = step_cuts.next_cut(cuts, s)
            if c is not None:
                assert s + (b - a) <= c and s + q <= c + 1, (row, s, a, b, q, c)
            done[row] = b
    assert done == list(counts)


def test_the_rule_splits_steps_at_the_cuts_and_nowhere_else():
    rng = np.random.default_rng(0)
    for _ in range(400):
        cuts = tuple(sorted(set(rng.integers(1, 200, rng.integers(0, 5)).tolist())))
        B = int(rng.integers(1, 5))
        lengths = rng.integers(0, 180, B).tolist()
        counts = rng.integers(0, 40, B).tolist()
        steps = step_cuts.pieces(lengths, counts, cuts)
        keeps_the_rule(lengths, counts, cuts, 2, steps)
        q = max(2, *counts)  # the step's width: every row's total is its length + q
        if not any(s < c and (s + n > c or s + q > c + 1) for s, n in zip(lengths, counts) if n for c in cuts):
            assert len(steps) == 1  # nothing crosses: the step as it is
    # a tree is never split; one that crosses its cut is the caller's error
    lengths, counts = [60, 10], [3, 20]
    keeps_the_rule(lengths, counts, (63,), 2, step_cuts.pieces(lengths, counts, (63,), whole=[0]), whole=[0])
    with pytest.raises(ValueError, match="cross the step cut at 63"):
        step_cuts.pieces([61], [3], (63,), whole=[0])
    assert step_cuts.expand([63, 319, 575], 256, 1200) == (63, 319, 575, 831, 1087)
    assert step_cuts.expand([63], None, 1200) == (63,) and step_cuts.room((63, 319), 100) == 219


def test_split_steps_put_together_are_the_one_step(tiny_artifacts):
    """Cuts forced onto an engine that has none (heads of 16: splitting changes no bits) leave
    every output of a ragged step as it was: logits, features, last positions, a tree row."""
    gen = Generator.from_engine(ArtifactLayout(tiny_artifacts).ort_engine("cpu"))
    rng = np.random.default_rng(1)
    V = gen.config.vocab_size
    prompts = [rng.integers(3, V, n).tolist() for n in (30, 7, 19)]
    tokens = [rng.integers(3, V, n).tolist() for n in (12, 3, 0)]
    depths, mask = np.array([0, 1, 1, 2]), np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    tree = [None, (depths, mask), None]
    tokens[1] = rng.integers(3, V, 4).tolist()

    def run(cuts, **kw):
        session = StepSession(gen.backend)
        session.cuts = cuts
        cache = session.new_cache(3, 128)
        session.prefill(cache, prompts)
        first = session.forward(cache, tokens, tree, **kw)
        return first, cache.lengths.copy()

    for kw in ({"hidden": True}, {"last_only": True, "hidden": True}):
        want, lengths = run((), **kw)
        got, split = run((33, 36, 40), **kw)
        assert np.array_equal(lengths, split)
        for name in ("logits", "hidden_states"):
            w, g = getattr(want, name), getattr(got, name)
            assert g.shape == w.shape and all(np.array_equal(g[b, : max(len(t), 1)], w[b, : max(len(t), 1)])
                                              for b, t in enumerate(tokens) if t), (kw, name)  # fmt: skip
    session = StepSession(gen.backend)
    session.cuts = (9,)
    cache = session.new_cache(3, 128)
    session.prefill(cache, prompts)
    with pytest.raises(SpecrtError, match="cross the step cut at 9.*StepSession.room"):
        session.forward(cache, tokens, tree)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(checkpoint, artifacts) of a tiny random Gemma 3 with heads of 256 (one KV head), its
    float32 and int8-a8 engines built."""
    from test_conformance import checkpoint, reference

    root = tmp_path_factory.mktemp("cuts")
    ref = reference("gemma3", head_dim=256, num_key_value_heads=1, max_position_embeddings=1024)
    ckpt = checkpoint(ref, root / "ckpt")
    for scheme in ("none", "int8-a8"):
        list(build_all(BuildSpec(checkpoint=ckpt, out=root / "art", quantize=scheme, tensorrt="off")))
    return root / "art"


@pytest.mark.parametrize("scheme", [None, "int8-a8"])
def test_gemma_requests_are_bitwise_across_the_cuts(gemma, scheme):
    from specrt.inspection import inspect_artifact

    engine = ArtifactLayout(gemma).ort_engine("cpu", *([scheme] if scheme else []))
    gen = Generator.from_engine(engine)
    assert gen.session.exactness()["exact"] == "bitwise"
    shown = [line for line in inspect_artifact(engine).lines if "step cuts" in line]
    # ORT 1.32 on 2 threads of an Intel Xeon (AVX-512): 63, 319, 575, 831, 1087; of an AMD EPYC
    # (AVX2): none, the products adding alike whatever the step's end
    listed = ", ".join(map(str, gen.backend.caps.step_cuts)) or "none"
    assert shown and f"step cuts   {listed}" in shown[0] and "probed over" in shown[0], shown
    if not gen.backend.caps.step_cuts:
        # the Xeon's cuts put on, so the session's splitting and the drafts' room run on this CPU
        # too (where the kernel has no cut, a split step's bits are the unsplit step's)
        caps = dataclasses.replace(gen.backend.caps, step_cuts=(63, 319, 575), cut_period=256)
        gen.backend.caps = caps
        gen = Generator(gen.backend, gen.tokenizer)
        assert gen.session.cuts[:4] == (63, 319, 575, 831)
    gen.eos_ids = frozenset()
    rng = np.random.default_rng(2)
    base = rng.integers(3, 150, 160).tolist()
    # past slot 64 while decoding; a self-repeating text crossing 319 (copy drafts fire there)
    prompts = [base[:50], (base * 2)[:300], base[100:109]]
    alone = [answers(gen, [p], budget=30)[0] for p in prompts]
    assert answers(gen, prompts, max_batch=3, arrivals=[0, 2, 5], budget=30) == alone
    for draft in ("ngram", "suffix"):
        assert answers(spec(gen, draft), prompts, max_batch=2, arrivals=[0, 1, 3], budget=30) == alone, draft
    for tree in (None, (2, 3)):  # chains and EAGLE-2 trees: a tree stops before the cut
        runner = SpeculativeDecoder(gen, SelfDraftProposer(gen.backend, tree=tree), make_policy(3))
        assert answers(runner, prompts, max_batch=2, arrivals=[0, 1, 3], budget=30) == alone, tree
    pool = PrefixCache(64 << 20)
    shared, longer = base[:70], base[:66] + base[120:130]  # two blocks of 32 in common, past 63
    first, second = answers(gen, [shared, longer], arrivals=[0, 40], prefix=pool, budget=30)
    assert pool.hit == 64 and second == answers(gen, [longer], budget=30)[0]
