"""Lookups' drafts judged by their evidence: hindsight reads every draft against what its row
emitted, the cost model learns acceptance per evidence from those readings, and the plan
verifies a draft only on evidence (never on a prior alone)."""

import numpy as np
import pytest

from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.drafts.base import match_evidence
from specrt.runtime.estimators import StepCurve
from specrt.runtime.generator import Generator
from specrt.runtime.hindsight import Hindsight
from specrt.runtime.policy import AutoPolicy, CostModel
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.runtime.verification import DraftTree

from conftest import random_model, tiny_hf_config


def test_hindsight_reads_a_draft_depth_by_depth_as_its_row_emits():
    tree = DraftTree([4, 5, 6, 7], [-1, -1, 1, 2], evidence=("x", 2))  # 4 | 5 -> 6 -> 7
    h = Hindsight()
    out = [1, 2]
    h.draft(0, tree, start=len(out))
    assert h.read(0, out) == []  # nothing emitted after the root yet
    out.append(5)
    (r,) = h.read(0, out)
    assert (r.evidence, r.size, r.depth, r.hits, r.ended) == (("x", 2), 4, 0, 1, False)
    out += [6, 9]  # 6 follows; 9 is no child of 6: the draft ends with a miss at depth 3
    (r,) = h.read(0, out)
    assert (r.depth, r.hits, r.ended) == (1, 1, True)
    out.append(3)
    assert h.read(0, out) == []  # read to its end: dropped


def test_hindsight_ends_a_draft_at_a_leaf_and_forgets_a_row_that_ends():
    h = Hindsight()
    h.draft(0, DraftTree.chain([5, 6]), start=0)
    (r,) = h.read(0, [5, 6, 7])
    assert (r.hits, r.ended) == (2, True)  # a leaf: nothing deeper was drafted
    h.draft(1, DraftTree.chain([5, 6]), start=0)
    h.forget(1)
    assert h.read(1, [5, 6]) == []
    h.draft(2, DraftTree.empty(), start=0)
    assert h.read(2, [1]) == []


def test_readings_teach_the_evidence_and_shorter_matches_back_longer_ones():
    m = CostModel(max_draft=8)
    key, longer = match_evidence("suffix", 3), match_evidence("suffix", 8)
    assert not m.backed(key) and not m.backed(longer) and not m.backed(("ngram", 8))
    h = Hindsight()
    for _ in range(6):  # six drafts after a 3-token match, each accepted 4 deep of 6
        h.draft(0, DraftTree.chain([1, 2, 3, 4, 5, 6], evidence=key), start=0)
        for r in h.read(0, [1, 2, 3, 4, 9]):
            m.observe_reading(r)
    rates = m.rates_of(key)
    assert rates[0] > 0.8 and rates[3] > 0.8 and rates[4] < 0.3  # the miss at depth 5
    assert m.backed(key) and m.backed(longer)  # a longer match of the same method: backed by it
    assert not m.backed(("ngram", 8)) and not m.backed(match_evidence("suffix", 2))


def _teach(model, key, hits, size, times):
    for _ in range(times):
        h = Hindsight()
        h.draft(0, DraftTree.chain(list(range(1, size + 1)), evidence=key), start=0)
        for r in h.read(0, list(range(1, hits + 1)) + [0]):
            model.observe_reading(r)


def test_the_plan_verifies_on_evidence_never_on_a_prior_alone():
    """A draft after a 32-token match has a prior that pays; with nothing read of drafts like
    it, it is not verified. Read as good, it is verified to the length that pays; read as bad,
    not at all; and the judge says how much of such a draft a lookup need make."""
    model, policy = CostModel(max_draft=16), AutoPolicy(max_draft=16)
    for _ in range(4):
        model.observe_step(1, 1, 0.010)
        model.observe_step(9, 1, 0.015)
    key = match_evidence("suffix", 32)
    tree = DraftTree.chain(list(range(16)), evidence=key)
    assert model.draft_speedups(1, [model.reach(tree)])[16] > 1  # the prior alone would verify it
    assert policy.plan(model, [0], [tree]) == [0]
    assert policy.judge(model, 1)(key, 16) == (16, 1.0)  # unread: made in full, for hindsight
    _teach(model, key, 16, 16, 20)
    assert policy.plan(model, [0], [tree]) == [16]
    n, speedup = policy.judge(model, 1)(key, 16)
    assert n == 16 and speedup > 3
    bad = match_evidence("ngram", 32)
    _teach(model, bad, 0, 16, 20)
    assert policy.plan(model, [0], [DraftTree.chain(list(range(16)), evidence=bad)]) == [0]
    assert policy.judge(model, 1)(bad, 16)[0] == 0  # not worth making
    assert policy.judge(model, 4)(bad, 16)[0] == 0  # nor in a batch, where it would count for less


def test_a_drafting_models_time_is_counted_once_in_the_steps_cost():
    """A member that costs time per drafted token (a draft model inside auto): the judge puts its
    time beside the verification's, speedup = tokens / (1 + verification + own), not the
    speedup divided by 1 + own (which counted a dear draft's time twice and judged a draft
    model accepting 80 % never to pay)."""
    model, policy = CostModel(max_draft=4), AutoPolicy(max_draft=4)
    for _ in range(4):
        model.observe_step(1, 1, 0.010)
        model.observe_step(3, 1, 0.013)
    key = ("draft-model", 0)
    _teach(model, key, 2, 2, 40)  # both drafted tokens read as right
    alone = model.draft_speedups(1, [model.reach(key, 2)])
    own = lambda n: 0.35 * n  # noqa: E731
    dear = model.draft_speedups(1, [model.reach(key, 2)], own)
    for n in (1, 2):
        tokens, verification = alone[n] * (1 + model.cost(1).verification(n)), model.cost(1).verification(n)
        assert dear[n] == pytest.approx(tokens / (1 + verification + own(n)))
        assert dear[n] > alone[n] / (1 + own(n))
    n, speedup = policy.judge(model, 1)(key, 2, own)
    assert n == 2 and speedup == pytest.approx(dear[2]) and speedup > 1


def test_a_batch_verifies_every_row_to_the_step_length_its_best_drafts_set():
    """The step is dense: once one row's draft pays, the others' ride along up to that length."""
    model, policy = CostModel(max_draft=8), AutoPolicy(max_draft=8)
    good, poor = match_evidence("suffix", 16), match_evidence("suffix", 1)
    _teach(model, good, 8, 8, 20)
    _teach(model, poor, 0, 8, 20)
    trees = [DraftTree.chain(list(range(8)), evidence=good), DraftTree.chain([1, 2, 3], evidence=poor)]
    assert policy.plan(model, [0, 1], trees) == [8, 3]


def test_a_first_bet_is_backed_twice():
    """On the 4-bit engine's costs (a verification step costs two decode steps): one reading of
    a match is not enough to verify its drafts; two readings of it are, and drafts read deeper
    are verified whole."""
    model, policy = CostModel(max_draft=16), AutoPolicy(max_draft=16)
    for _ in range(4):
        model.observe_step(1, 1, 0.0146)  # the 4-bit engine's measured step costs (ms by positions)
        model.observe_step(3, 1, 0.0320)
        model.observe_step(9, 1, 0.0433)
    key = match_evidence("ngram", 4)
    tree = DraftTree.chain(list(range(1, 11)), evidence=key)
    _teach(model, key, 2, 2, 1)  # one draft of two nodes read: both right
    assert policy.plan(model, [0], [tree]) == [0]  # backed by one reading: not yet
    _teach(model, key, 2, 2, 1)
    assert policy.plan(model, [0], [tree])[0] > 0
    _teach(model, key, 8, 8, 3)  # read deeper
    assert policy.plan(model, [0], [tree])[0] == 10


@pytest.fixture(scope="module")
def loopy_gen():
    return Generator(TorchBackend(random_model(tiny_hf_config(vocab_size=32), seed=3, scale=0.3)))


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_lookups_learn_from_drafts_that_were_never_verified(loopy_gen, method, steady_costs):
    """On a repetitive text the cost model's readings come from every step's draft: more readings
    than verified drafts (guesses at the floor's position aside), and greedy output equal to plain."""
    ids = [5, 6, 7, 8, 9] * 8
    plain = loopy_gen.generate_ids([ids], 40)[0].token_ids
    decoder = SpeculativeDecoder(loopy_gen, make_proposer(method), make_policy("auto"))
    states = []
    new_state = decoder.new_state
    decoder.new_state = lambda *a: states.append(new_state(*a)) or states[-1]
    result = decoder.generate_ids([ids], 40)[0]
    assert result.token_ids == plain
    m = result.metrics
    verified = m.drafted_at_depth[0] if m.drafted_at_depth else 0
    # a draft's first token rides the step floor's position as a guess when the plan verifies none
    assert states[0].cost.readings > verified and verified + m.guessed_tokens >= 1


# the 1.5B's gguf-k engine as its build measured it: ms per step by positions
STEP_MS_15B = {1: 35.6, 2: 38.4, 3: 37.6, 5: 43.7, 9: 69.6, 17: 119.3}


def test_a_long_copy_is_priced_by_the_builds_step_costs_where_no_step_that_long_was_timed():
    """Steps of 2-3 positions that cost what a plain one does fit a flat line (alpha 0); a
    16-token copy then looked free. With the build's step costs (estimators.StepCurve) it is
    priced as the 17-position step it is (3.4 plain steps) and verified only as far as pays;
    the sizes that were timed keep the line's price.
    (Seen on the 1.5B: story's 16-token copy verified after such a run, 0.96x plain.)"""
    key = match_evidence("ngram", 3)
    tree = DraftTree.chain(list(range(16)), evidence=key)
    plans = {}
    for step_ms in (None, STEP_MS_15B):
        model, policy = CostModel(max_draft=16, step_ms=step_ms), AutoPolicy(max_draft=16)
        for _ in range(6):
            model.observe_step(1, 1, 0.0356)
            model.observe_step(2, 1, 0.0356)
            model.observe_step(3, 1, 0.0356)
        _teach(model, key, 2, 16, 6)  # such copies gave two tokens: reach ~1.2 at 16
        plans[step_ms is not None] = policy.plan(model, [0], [tree])[0]
        if step_ms:
            assert model.cost(1).verification(16) == pytest.approx(119.3 / 35.6 - 1)
            assert model.cost(1).verification(2) == pytest.approx(0.0, abs=1e-9)  # timed: the line's
    assert plans[False] == 16  # the flat line's price: every position free
    assert 1 <= plans[True] <= 4


def test_step_curve_reads_between_and_past_the_measured_sizes():
    curve = StepCurve(STEP_MS_15B)
    assert curve.at(1) == 35.6 and curve.at(4) == pytest.approx((37.6 + 43.7) / 2)
    assert curve.at(25) == pytest.approx(119.3 + (119.3 - 69.6))  # the last segment, continued
    assert curve.extra(3, 2) == 0.0  # a cheaper size is no saving below the plain step
    many = [0.5, 1, 4, 17, 25]  # as an array (the N-plan's expected positions): the same numbers
    assert curve.at(np.array(many)).tolist() == pytest.approx([curve.at(p) for p in many])
    assert curve.extra(np.array(many), 2).tolist() == pytest.approx([curve.extra(p, 2) for p in many])
    assert not StepCurve(None) and not StepCurve({1: 10.0}) and StepCurve(None).extra(9, 1) == 0.0


def test_under_the_step_floor_the_sizes_timed_are_read_past_its_free_position():
    """With a floor of 2 (one free draft position), a timed step of 5 positions is stored as 4
    past the free one (CostModel.observe_step); a 4-token draft (5 positions) is a size the line
    was fitted through and keeps its price, a 5-token draft is past it and gets the curve's."""
    curve = {1: 10.0, 2: 10.0, 5: 20.0, 6: 30.0, 9: 40.0, 17: 60.0}  # 5 positions: twice the plain step
    model = CostModel(max_draft=16, free=1, step_ms=curve)
    for _ in range(4):
        model.observe_step(2, 1, 0.010)  # the plain step: the floor's two positions
        model.observe_step(5, 1, 0.010)
    cost = model.cost(1)
    assert cost.alpha == pytest.approx(0.0, abs=1e-9) and cost.seen == 4
    assert cost.verification(4) == pytest.approx(0.0, abs=1e-9)  # timed
    assert cost.verification(5) == pytest.approx(30.0 / 10.0 - 1)  # not timed: the curve's


def test_a_member_drafting_on_demand_keeps_what_its_probes_taught():
    """A head or draft model inside auto drafts only when served (ON_DEMAND evidence): its counts
    age by its own drafts, not by target steps, so three probes 16 steps apart back it until the
    next (a lookup's evidence read as rarely has faded below BACKED by then), and its prior is
    even odds, not a 0-token match's 0, so three drafts accepted 3 deep read as a rate near 0.8."""
    from specrt.runtime.policy import evidence_prior
    from specrt.runtime.verification import ON_DEMAND

    m = CostModel(max_draft=8)
    member, lookup = ("draft-model", ON_DEMAND), match_evidence("ngram", 2)
    assert evidence_prior(member) == 0.5
    for _ in range(3):
        for _ in range(16):  # target steps between probes
            m.observe_step(1, 1, 0.010)
        _teach(m, member, 3, 3, 1)
        _teach(m, lookup, 3, 3, 1)
    for _ in range(16):  # until the next probe would come
        m.observe_step(1, 1, 0.010)
    assert m.backed(member) and not m.backed(lookup)
    assert 0.75 < m.rates_of(member)[0] < 0.9
