"""Continuous batching: requests that join and leave a running batch get the output they get
alone (greedy, and sampled with a seed), for plain and speculative decoding; a cancelled or
finished request frees its slot at once; the cache follows the longest request; each row's draft
stops drafting when its drafts keep failing."""

import pytest

from specrt.errors import PromptError, SpecrtError
from specrt.runtime.backends import TorchBackend
from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.policy import AutoPolicy, CostModel
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from conftest import random_model, tiny_hf_config
from self_draft import SelfDraftProposer
from test_eagle import make_head_dir

LOOPY = tiny_hf_config(vocab_size=32)  # greedy text repeats, so lookup drafts are accepted

# prompts of different lengths (the 40-token one is prefilled in chunks beside decoding rows)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10], [20 + i % 7 for i in range(40)], [17], [3, 4]]
BUDGETS = [30, 12, 25, 40, 8]
ARRIVALS = [0, 0, 3, 5, 11]  # steps before which each request is submitted


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


@pytest.fixture(scope="module")
def loopy_gen():
    return Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)))


def alone(runner, sampling=SamplingParams()):
    return [runner.generate_ids([p], n, sampling)[0].token_ids for p, n in zip(PROMPTS, BUDGETS)]


def requests(sampling=SamplingParams()):
    return [Request(p, n, sampling) for p, n in zip(PROMPTS, BUDGETS)]


@pytest.mark.parametrize("max_batch", [1, 2, 8])
def test_plain_requests_joining_and_leaving_get_their_output_alone(ort_gen, max_batch):
    """Five requests, arriving at different steps into 1, 2 or 8 slots (so some wait and take
    the slot of one that finished), with a prefill budget that chunks the long prompt."""
    engine = BatchEngine(ort_gen, max_batch=max_batch, prefill_budget=8)
    out = engine.run(requests(), ARRIVALS)
    solo = [ort_gen.generate_ids([p], n)[0] for p, n in zip(PROMPTS, BUDGETS)]
    assert [r.token_ids for r in out] == [r.token_ids for r in solo]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in solo]
    assert engine.idle and engine.running == 0 and not engine.decoding()
    assert (engine.cache.lengths == 0).all()  # every slot was freed


def speculative(gen, method):
    if method == "self":
        return SpeculativeDecoder(gen, SelfDraftProposer(gen.backend, check_features=True), make_policy(4))
    if method.startswith("eagle3"):
        return method  # built by the test, which has the head
    name, n = method.split("-")
    return SpeculativeDecoder(gen, make_proposer(name), make_policy(n if n == "auto" else int(n)))


@pytest.mark.parametrize("method", ["ngram-3", "suffix-auto", "self"])
def test_speculative_requests_joining_and_leaving_get_their_output_alone(loopy_gen, method):
    """Speculative decoding in a continuous batch: output equals plain greedy alone, drafts were
    accepted, and (self draft) the target features handed to a row that joined mid-batch are
    the target's at that row's positions."""
    spec = speculative(loopy_gen, method)
    engine = BatchEngine(spec, max_batch=3, prefill_budget=8)
    out = engine.run(requests(), ARRIVALS)
    assert [r.token_ids for r in out] == alone(loopy_gen)
    assert sum(r.metrics.accepted_tokens for r in out) > 0
    if method == "self":
        assert spec.proposer.features_checked > 0 and spec.proposer.cache is None  # all rows ended


@pytest.mark.parametrize("method", ["ngram-3", "suffix-auto"])
def test_a_request_sets_its_own_speculation(loopy_gen, method, steady_costs):
    """Request.max_draft: a request with 0 never drafts, one with 1 drafts at most one token a
    step, the others the decoder's; every output is still its greedy output alone, and the
    row's own metrics show it (the server's per-request `speculation` field rides on this).
    Auto's costs are fixed (`steady_costs`): whether it drafts deep must not hang on timings."""
    spec = speculative(loopy_gen, method)
    caps = [1, 0, None, 0, None]
    reqs = [Request(p, n, max_draft=c) for p, n, c in zip(PROMPTS, BUDGETS, caps)]
    out = BatchEngine(spec, max_batch=3, prefill_budget=8).run(reqs, ARRIVALS)
    assert [r.token_ids for r in out] == alone(loopy_gen)
    deep = [sum(r.metrics.drafted_at_depth[1:]) for r in out]  # drafted past the first token
    assert out[1].metrics.drafted_tokens == out[3].metrics.drafted_tokens == 0
    assert out[0].metrics.drafted_tokens > 0 and deep[0] == 0
    assert deep[2] + deep[4] > 0  # the others draft as the decoder does


def test_eagle_tree_in_a_continuous_batch_equals_plain(ort_gen, tiny_checkpoint, tmp_path):
    layout = make_head_dir(tiny_checkpoint, "eagle3", tmp_path / "h", draft_vocab=64)
    prop = make_proposer("eagle3", draft_dir=layout.root, target=ort_gen.session.caps, tree=(3, 4))
    engine = BatchEngine(SpeculativeDecoder(ort_gen, prop, make_policy(6)), max_batch=2, prefill_budget=16)
    out = engine.run(requests(), ARRIVALS)
    assert [r.token_ids for r in out] == alone(ort_gen)
    assert sum(r.metrics.drafted_tokens for r in out) > 0 and prop.k is None  # the head's cache went back


def test_sampled_rows_draw_what_they_draw_alone(loopy_gen):
    """Each row has its own random generator from its seed: a seeded sampled request gives the
    same tokens in a batch as alone, plain and speculative (fixed N, a stateless lookup draft:
    the suffix draft learns from finished requests, so its drafts depend on their order)."""
    rows = [
        Request(p, n, SamplingParams(temperature=1.0, top_p=0.9, seed=10 + i))
        for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))
    ]
    for runner in (loopy_gen, SpeculativeDecoder(loopy_gen, make_proposer("ngram"), make_policy(3))):
        solo = [runner.generate_ids([r.prompt], r.max_new_tokens, r.sampling)[0].token_ids for r in rows]
        out = BatchEngine(runner, max_batch=3, prefill_budget=8).run(rows, ARRIVALS)
        assert [r.token_ids for r in out] == solo
    greedy = alone(loopy_gen)
    assert solo != greedy  # the test sampled something


def test_eos_and_cancel_free_the_slot_at_once(loopy_gen):
    """A row that reaches EOS and a cancelled row leave between steps; the waiting request takes
    the slot in the very next step and its output is unaffected."""
    plain = alone(loopy_gen)
    gen = Generator(loopy_gen.backend)
    stop = plain[0][6]
    gen.eos_ids = frozenset({stop})
    engine = BatchEngine(gen, max_batch=2, prefill_budget=64)
    a = engine.submit(Request(PROMPTS[0], 30))
    b = engine.submit(Request(PROMPTS[1], 12))
    c = engine.submit(Request(PROMPTS[3], 10))
    finished, got = {}, {a: [], b: [], c: []}
    for _ in range(3):
        for e in engine.step():
            got[e.rid] += e.tokens
    assert engine.running == 2 and len(engine.waiting) == 1
    assert engine.cancel(b) and engine.running == 1 and engine.cache.lengths[1] == 0
    assert engine.slots[1] is None
    events = engine.step()
    assert engine.slots[1] is not None and engine.slots[1].rid == c  # admitted in the next step
    while True:
        for e in events:
            got[e.rid] += e.tokens
            if e.result is not None:
                finished[e.rid] = e.result
        if engine.idle:
            break
        events = engine.step()
    assert finished[a].finish_reason == "stop" and got[a] == plain[0][: plain[0].index(stop) + 1]
    solo_c = gen.generate_ids([PROMPTS[3]], 10)[0].token_ids
    assert got[c] == solo_c and b not in finished
    assert not engine.cancel(b)  # gone


def test_cache_capacity_follows_the_longest_request(ort_gen):
    engine = BatchEngine(ort_gen, max_batch=2)
    engine.submit(Request([5, 6], 3))
    engine.step()
    small = engine.cache.capacity
    assert small < 64 * 2 and small >= 5
    engine.submit(Request([5, 6], 150))  # joins: the cache grows, the running row's entries move
    while not engine.idle:
        engine.step()
    assert engine.cache.capacity >= 152
    engine.submit(Request([5, 6], 3))
    engine.step()
    assert engine.cache.capacity == small  # shrunk once the long one left


def test_bad_requests_are_refused_with_a_reason(ort_gen):
    engine = BatchEngine(ort_gen, max_batch=1, max_waiting=1)
    with pytest.raises(PromptError, match="empty"):
        engine.submit(Request([], 4))
    with pytest.raises(SpecrtError, match="max_new_tokens"):
        engine.submit(Request([1], 0))
    engine.submit(Request([1], 4))
    with pytest.raises(SpecrtError, match="wait for a slot"):
        engine.submit(Request([2], 4))
    with pytest.raises(SpecrtError, match="max_batch"):
        BatchEngine(ort_gen, max_batch=0)


# -- draft length per row ------------------------------------------------------------------------


def test_auto_plan_stops_a_row_whose_drafts_keep_failing():
    model = CostModel(max_draft=6)
    for _ in range(40):
        model.observe_step(2, 2, 0.010)  # plain steps of 2 rows
        model.observe_step(8, 2, 0.012)  # verification steps: 6 draft positions
        model.observe_acceptance(3, 3, row=0)
        model.observe_acceptance(3, 0, row=1)
    plan = AutoPolicy(max_draft=6).plan(model, [0, 1])
    assert plan[0] > 0 and plan[1] == 0
    assert model.row_acceptance(1)[0] < 0.3 < model.row_acceptance(0)[0]
    model.forget_row(1)  # a new request in the slot starts from the batch's rates
    assert model.row_acceptance(1)[0] == pytest.approx((2 * model.acceptance()[0]) / 2)
    for _ in range(400):  # the failing row's evidence fades with every step, drafted or not
        model.observe_step(2, 2, 0.010)
    assert model.row_acceptance(0)[0] == pytest.approx(model.acceptance()[0], abs=0.01)


def test_a_batch_that_always_drafts_learns_its_decode_cost_from_the_line():
    """No plain step at batch 8 (it always drafted): T_decode(8) comes from the verification
    line at P = 8 less the jump measured at batch 1, so alpha_8 is right. Backing it out through
    the priors had made a dear batch look cheap (measured: the server drafted more at 8 and 16
    clients than at 1 and lost 18 % to plain)."""

    def t(positions, q):  # a dense step: linear in the positions computed, a jump when Q > 1
        return 0.02 + 0.001 * positions + (0.002 if q > 1 else 0.0)

    model = CostModel(max_draft=16)
    for _ in range(10):
        model.observe_step(1, 1, t(1, 1))
        for q in (5, 17, 9):
            model.observe_step(8 * q, 8, t(8 * q, q))
    cost = model.cost(8)
    assert cost.decode == pytest.approx(t(8, 1), rel=0.05)
    assert cost.alpha == pytest.approx(0.001 * 8 / t(8, 1), rel=0.05)
    for i in range(60):
        model.observe_acceptance(16, int(i % 4 == 0))  # one in four first drafts accepted
    # at batch 1 a draft position costs ~5 % of a step and pays; at batch 8 ~29 % and does not
    assert AutoPolicy(max_draft=16).num_draft(model, 1) >= 1
    assert AutoPolicy(max_draft=16).num_draft(model, 8) == 0


def test_the_cost_of_a_position_is_read_at_the_batch_size_that_pays_it():
    """Steps of one row read the weights once per position (memory-bound: 1 ms a position), steps
    of eight rows compute (8 ms a row-position): the cost of a draft position at batch 8 comes
    from the batch-8 steps, not from a line through both (which made it look 3x cheaper there,
    measured on the virtual crossover: 16 clients at 0.90x plain)."""
    model = CostModel(max_draft=16)
    for _ in range(10):
        for q in (1, 5, 17, 9):
            model.observe_step(q, 1, 0.020 + 0.001 * (q - 1))
        model.observe_step(8, 8, 0.050)
        for q in (2, 5):
            model.observe_step(8 * q, 8, 0.050 + 0.008 * 8 * (q - 1))
    assert model.cost(8).alpha == pytest.approx(0.008 * 8 / 0.050, rel=0.05)
    assert model.cost(1).alpha == pytest.approx(0.001 / 0.020, rel=0.05)


def test_a_step_weighs_the_rows_it_computes_idle_slots_included():
    """Continuous batching steps the cache's rows up to the last one in use; a slot between them
    whose request ended is computed too (padded to the step's length). The step's record, and so
    the cost model's step times and plan, count the rows computed."""
    gen = Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)))
    gen.eos_ids = frozenset()  # every request runs to its budget
    records = []
    decoder = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy("auto"))
    observe = decoder.observe
    decoder.observe = lambda state, r: records.append((r.batch, r.positions, len(r.rows), r.rows)) or observe(state, r)
    prompts = [[5, 6, 7, 8] * 3, [9, 10], [5, 6, 7, 8] * 3]
    BatchEngine(decoder, max_batch=3).run([Request(p, n) for p, n in zip(prompts, (30, 2, 30))])
    idle = [r for r in records if r[2] == 2 and r[0] == 3]  # rows 0 and 2 running, row 1 ended
    assert idle and all(positions == 3 * (1 + max(len(s.tree) for s in steps)) for _, positions, _, steps in idle)


def test_predictions_that_run_high_are_scaled_by_what_the_steps_gave():
    """The cost model compares, each drafting step, the extra tokens its estimates predicted for
    the lengths asked with what the rows got, and scales its predictions by that ratio."""
    model = CostModel(max_draft=4)
    assert model.calibration() == 1.0
    for _ in range(20):
        model.observe_acceptance(4, 4, row=0)  # the estimates say: everything is accepted
    before = model.speedups(1).max()
    for _ in range(30):
        model.observe_gain([0], [4], [1])  # ... while the steps gave one extra token of four
    assert model.calibration() < 0.4
    assert model.speedups(1).max() < before


@pytest.mark.parametrize("method", [None, "suffix"])
def test_logprobs_are_the_targets_at_the_emitted_tokens(ort_gen, tiny_checkpoint, method):
    """Request.logprobs: each emitted token's log probability and its top alternatives are the
    target's log-softmax at the position it came from (transformers in float64 over prompt +
    output, 1e-4), plain and under speculation (verification positions), greedy and sampled;
    a request that does not ask gets none, beside one that does."""
    import numpy as np
    import torch
    import transformers

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float64).eval()
    runner = ort_gen if method is None else SpeculativeDecoder(ort_gen, make_proposer(method), make_policy(4))
    prompts = [[5, 9, 13, 21, 34] * 4, [77, 78, 3]]
    sampled = SamplingParams(temperature=0.8, seed=3)
    reqs = [Request(prompts[0], 30, logprobs=3), Request(prompts[1], 20, sampled, logprobs=0), Request(prompts[0], 9)]
    events = {}
    engine = BatchEngine(runner, max_batch=3)
    rids = [engine.submit(r) for r in reqs]
    while not engine.idle:
        for ev in engine.step():
            events.setdefault(ev.rid, []).append(ev)
    if method is not None:  # the positions were verification positions
        assert sum(ev.result.metrics.accepted_tokens for evs in events.values() for ev in evs if ev.result) > 0
    for rid, req, top in zip(rids, reqs, (3, 0, None)):
        tokens = [t for ev in events[rid] for t in ev.tokens]
        got = [lp for ev in events[rid] if ev.tokens for lp in (ev.logprobs or [])]
        if top is None:
            assert got == []
            continue
        assert [g.token for g in got] == tokens
        with torch.no_grad():
            logits = ref_model(torch.tensor([req.prompt + tokens])).logits[0].double()
        ref = torch.log_softmax(logits, -1)[len(req.prompt) - 1 : -1].numpy()
        np.testing.assert_allclose([g.logprob for g in got], ref[np.arange(len(tokens)), tokens], atol=1e-4)
        for g, row in zip(got, ref):
            assert len(g.top) == top
            best = np.argsort(-row)[:top]
            np.testing.assert_allclose([lp for _, lp in g.top], row[best], atol=1e-4)
