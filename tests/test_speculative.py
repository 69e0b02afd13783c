"""The speculative loop: greedy output identical to plain decoding, sampled output distributed as
the target's, KV rollback and tree compaction, the cost model and the metrics conventions."""

import numpy as np
import pytest
from scipy.stats import chisquare

from specrt.errors import SpecrtError
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.runtime.verification import DraftTree

from conftest import random_model, tiny_hf_config
from self_draft import SelfDraftProposer

LOOPY = tiny_hf_config(vocab_size=32)  # a small vocabulary makes greedy text repeat, so drafts hit


@pytest.fixture(scope="module")
def loopy_gen():
    return Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)))


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10]]


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
@pytest.mark.parametrize("num_draft", [1, 3, "auto"])
def test_greedy_speculative_equals_plain_torch(loopy_gen, method, num_draft):
    plain = loopy_gen.generate_ids(PROMPTS, 48)
    spec = SpeculativeDecoder(loopy_gen, make_proposer(method), make_policy(num_draft))
    out = spec.generate_ids(PROMPTS, 48)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.accepted_tokens > 0, "the drafts were never accepted: the test exercised nothing"
    assert m.steps < sum(len(r.token_ids) for r in plain)  # fewer target steps than tokens


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_greedy_speculative_equals_plain_ort(ort_gen, method):
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42]]
    plain = ort_gen.generate_ids(prompts, 40)
    out = SpeculativeDecoder(ort_gen, make_proposer(method), make_policy(4)).generate_ids(prompts, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]


@pytest.mark.parametrize("num_draft", [1, 4, "auto"])
def test_greedy_self_draft_is_always_accepted_and_equals_plain(ort_gen, num_draft):
    """A proposer with weights (tests/self_draft.py: the target drafting for itself through a
    second session with its own cache): every greedy draft is accepted, the output is plain
    greedy's, its own cache was rolled back after each step, and the target features handed to
    it (prefill and each step's committed positions) equal what it computed itself."""
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]
    plain = ort_gen.generate_ids(prompts, 40)
    draft = SelfDraftProposer(ort_gen.backend, check_features=True)
    out = SpeculativeDecoder(ort_gen, draft, make_policy(num_draft)).generate_ids(prompts, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.drafted_tokens > 0 and m.acceptance_rate == 1.0
    assert draft.features_checked == draft.proposals > 0  # every proposal's features were compared
    assert draft.rolled_back == 0  # all accepted: nothing to forget ...
    assert draft.cache is None  # ... and its cache went back at the end


def test_self_draft_rolls_back_its_cache_when_drafts_are_rejected(ort_gen):
    """Sampling with q != p (the draft samples hotter than the target): drafts are rejected, the
    draft's cache forgets them, and its next drafts still start from the committed context
    (its features check and cache positions would fail otherwise)."""
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9]]
    draft = SelfDraftProposer(ort_gen.backend, temperature_scale=2.0, check_features=True)
    out = SpeculativeDecoder(ort_gen, draft, make_policy(4)).generate_ids(
        prompts, 40, SamplingParams(temperature=1.0, seed=3)
    )
    m = out[0].metrics
    assert 0 < m.acceptance_rate < 1 and draft.rolled_back > 0 and draft.features_checked > 0


def test_speculative_respects_eos_and_budget(loopy_gen):
    plain = loopy_gen.generate_ids([PROMPTS[0]], 30)[0].token_ids
    stop = plain[12]
    gen = Generator(loopy_gen.backend)
    gen.eos_ids = frozenset({stop})
    r = SpeculativeDecoder(gen, make_proposer("ngram"), make_policy(6)).generate_ids([PROMPTS[0]], 30)[0]
    assert r.token_ids == plain[: plain.index(stop) + 1] and r.finish_reason == "stop"
    r = SpeculativeDecoder(loopy_gen, make_proposer("ngram"), make_policy(6)).generate_ids([PROMPTS[0]], 7)[0]
    assert r.token_ids == plain[:7] and r.finish_reason == "length"


def test_tree_acceptance_compacts_kv_like_a_chain(loopy_gen):
    """Verify a two-branch tree, keep the second branch: the cache equals a plain chain run."""
    gen = loopy_gen
    prefix = [5, 6, 7, 8, 9]
    tree = DraftTree(np.array([11, 12, 13, 14]), np.array([-1, 0, -1, 2]))
    cache = gen.session.new_cache(1, 16)
    gen.session.forward(cache, [prefix])
    root = 3
    gen.session.forward(
        cache, [[root, *tree.tokens.tolist()]], [(np.concatenate([[0], tree.depths()]), tree.ancestor_mask())]
    )
    cache.keep(0, 6, [6 + 2, 6 + 3])  # accept nodes 2 and 3 (tokens 13, 14)
    chain = gen.session.new_cache(1, 16)
    gen.session.forward(chain, [prefix + [root, 13, 14]])
    assert cache.lengths.tolist() == chain.lengths.tolist() == [8]
    assert np.abs(cache.keys[:, :, :, :8] - chain.keys[:, :, :, :8]).max() < 1e-5
    assert np.abs(cache.values[:, :, :, :8] - chain.values[:, :, :, :8]).max() < 1e-5
    # and the next step after the compacted tree equals the next step after the chain
    a = gen.session.forward(cache, [[15]]).logits
    b = gen.session.forward(chain, [[15]]).logits
    assert np.abs(a - b).max() < 1e-5


# -- sampling end to end -------------------------------------------------------------------------

SMALL = tiny_hf_config(vocab_size=8)
SAMPLING_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def exact_two_token_joint(gen, params):
    """p(t1, t2 | prompt) from the model itself, with the same temperature/top-k/top-p."""
    cache = gen.session.new_cache(1, 16)
    p1 = probs_from_logits(gen.session.forward(cache, [SAMPLING_PROMPT]).logits[0, -1], params)
    joint = np.zeros((8, 8))
    for t1 in range(8):
        c = gen.session.new_cache(1, 16)
        p2 = probs_from_logits(gen.session.forward(c, [SAMPLING_PROMPT + [t1]]).logits[0, -1], params)
        joint[t1] = p1[t1] * p2
    return joint


def make_draft(method, gen):
    if method == "ngram":
        return make_proposer("ngram", n_min=1)
    if method in ("suffix", "auto"):
        return make_proposer(method)
    return SelfDraftProposer(gen.backend, temperature_scale={"self q=p": 1.0, "self q!=p": 1.7}[method])


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto", "self q=p", "self q!=p"])
def test_sampled_speculative_output_follows_the_model(method):
    """Point-mass drafts (ngram, suffix) and a draft with a real q (the self draft, sampling at
    the target's temperature or hotter): the first two sampled tokens follow the target's exact
    joint distribution (chi-square)."""
    gen = Generator(TorchBackend(random_model(SMALL, seed=4, scale=0.15)))
    gen.eos_ids = frozenset()  # every token counts, EOS included
    assert two_token_pvalue(gen, SpeculativeDecoder(gen, make_draft(method, gen), make_policy(3)), rounds=15) > 1e-3


def two_token_pvalue(gen, spec, rounds: int, batch: int = 400, new_tokens: int = 2, grammar=None, joint=None) -> float:
    """Sample the first two tokens `batch * rounds` times through `spec` (temperature 1, top-p
    0.95) and return the chi-square p-value against the target's exact joint (rare cells pooled;
    `joint`: another expected joint, as a grammar's masks make it). new_tokens > 2 generates
    further (a draft that respects the token budget drafts nothing when only one token is left
    after the prompt's)."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    expected = exact_two_token_joint(gen, params) if joint is None else joint
    counts = np.zeros((8, 8))
    accepted = 0
    for r in range(rounds):
        res = spec.generate_ids(
            [SAMPLING_PROMPT] * batch, new_tokens, SamplingParams(temperature=1.0, top_p=0.95, seed=r), grammar
        )
        for x in res:
            counts[x.token_ids[0], x.token_ids[1]] += 1
        accepted += res[0].metrics.accepted_tokens
    assert accepted > 0, "no draft was ever accepted: the test exercised nothing"
    exp, obs = batch * rounds * expected.ravel(), counts.ravel()
    assert obs[exp == 0].sum() == 0, "sampled a token that top-p excludes"
    keep, rare = exp >= 5, (exp > 0) & (exp < 5)  # pool the rare cells
    obs, exp = np.append(obs[keep], obs[rare].sum()), np.append(exp[keep], exp[rare].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


# -- cost model and policy -----------------------------------------------------------------------


def test_cost_model_turns_speculation_off_when_it_does_not_pay():
    m = CostModel(max_draft=8)
    for _ in range(200):
        m.observe_acceptance(drafted_depth=4, accepted=0)
    for q in (1, 5, 9, 1):
        m.observe_step(q, 1, 0.02 * (1 + (0.1 + 0.04 * (q - 1)) * (q > 1)))
    assert int(np.argmax(m.speedups(1))) == 0
    assert AutoPolicy(max_draft=8).num_draft(m, 1) == 0


def test_cost_model_measures_the_verification_jump_and_slope():
    """t(1) = 20 ms; verification steps cost 2 ms more plus 1 ms per position."""
    m = CostModel(max_draft=16)
    for _ in range(5):
        m.observe_step(1, 1, 0.020)
    for q in range(2, 40, 4):
        m.observe_step(q, 1, 0.022 + 0.001 * q)
        m.observe_draft(q - 1, 0.0005)
    c = m.cost(1)
    assert abs(c.decode - 0.020) < 1e-9
    assert abs(c.alpha - 0.05) < 1e-6 and abs(c.beta - 0.15) < 1e-6  # (22 + 1) / 20 - 1
    assert abs(c.draft_ratio(4) - 0.025) < 1e-9 and c.draft_ratio(0) == 0  # a lookup: the same for any length
    assert c.relative(np.array([0, 4])).tolist() == pytest.approx([1.0, 1 + 0.15 + 0.025 + 0.2])


def test_cost_model_speculates_when_acceptance_is_high_and_less_for_big_batches():
    m = CostModel(max_draft=16)
    for _ in range(200):
        m.observe_acceptance(drafted_depth=16, accepted=16)
    for b in (1, 64):
        m.observe_step(b, b, 0.020 + 0.001 * b)  # plain steps: 21 ms at B = 1, 84 ms at B = 64
    for q in range(2, 40, 4):
        m.observe_step(q, 1, 0.020 + 0.001 * q)  # c0 = 20 ms, c1 = 1 ms per position
    n1 = int(np.argmax(m.speedups(1)))
    assert n1 == 16 and m.speedups(1)[16] > 5
    assert m.cost(64).alpha > 0.7 and m.speedups(64).max() < m.speedups(1).max()
    assert int(np.argmax(m.speedups(64))) <= n1


def test_auto_policy_probes_while_off():
    m = CostModel(max_draft=4)
    for _ in range(100):
        m.observe_acceptance(4, 0)
    p = AutoPolicy(max_draft=4, probe_every=4, probe_draft=2)
    picks = [p.num_draft(m, 1) for _ in range(8)]
    assert picks == [0, 0, 0, 2, 0, 0, 0, 2]


def test_metrics_conventions():
    m = SpecMetrics()
    m.observe_draft(4, 4, 4)  # all accepted: 5 tokens
    m.observe_draft(4, 1, 4)  # 2 tokens
    m.observe_draft(0, 0, 0)  # plain step: 1 token
    assert m.acceptance_rate == 5 / 8
    assert m.mean_accepted_length == (5 + 3) / 3
    assert m.per_position_acceptance == [1.0, 0.5, 0.5, 0.5]


@pytest.mark.parametrize("value", ["fast", -1, None])
def test_bad_num_draft(value):
    with pytest.raises(SpecrtError, match="num_draft must be"):
        make_policy(value)


def test_cost_model_with_one_verification_size_uses_its_measured_cost():
    m = CostModel(max_draft=8)
    for _ in range(4):
        m.observe_step(1, 1, 0.020)
        m.observe_step(9, 1, 0.030)  # N = 8 always: 1.5x a decode step
    c = m.cost(1)
    assert c.relative(np.array([8]))[0] == pytest.approx(1.5)
    assert c.beta == pytest.approx(0.5 * 0.1 / (0.1 + 0.05 * 8)) and c.alpha > 0


def test_draft_that_pays_per_token_is_fitted_as_a_line_and_drafts_less():
    """A learned draft costs per drafted token (T_draft = d0 + d1 N); a lookup does not. With
    the same mean draft cost the per-token one is cheaper at small N and dearer at large N."""
    per_token, fixed = CostModel(max_draft=16, draft_per_token=True), CostModel(max_draft=16)
    for m in (per_token, fixed):
        for i in range(200):  # half the drafts run out at depth 4: deeper tokens pay off less
            m.observe_acceptance(drafted_depth=16, accepted=(16, 4)[i % 2])
        for _ in range(4):
            m.observe_step(1, 1, 0.020)
        for n in (2, 4, 8, 12, 16):
            m.observe_step(n + 1, 1, 0.020 + 0.001 * (n + 1))
            m.observe_draft(n, 0.0002 + 0.003 * n if m is per_token else 0.0002 + 0.003 * 8.4)
    c = per_token.cost(1)
    assert c.draft0 == pytest.approx(0.0002 / 0.020) and c.draft1 == pytest.approx(0.003 / 0.020)
    assert c.draft_ratio(16) == pytest.approx((0.0002 + 0.048) / 0.020)
    assert fixed.cost(1).draft1 == 0
    assert int(np.argmax(per_token.speedups(1))) < int(np.argmax(fixed.speedups(1))) == 16


def test_one_slow_step_early_does_not_switch_speculation_off():
    """A long exact copy (every draft accepted) where the first verification step took 0.5 s
    instead of ~28 ms (another process had the core): `auto` must go on drafting long drafts.
    Without the robust fit that step alone gave alpha ~ 1 and N = 0 for the rest of the window."""
    m, policy = CostModel(max_draft=16), AutoPolicy(max_draft=16)

    def step_time(n):  # 20 ms decode, beta 0.1, alpha 0.04
        return 0.020 * (1 + (0.1 + 0.04 * n) * (n > 0))

    picks = []
    for i in range(60):
        n = policy.num_draft(m, 1)
        picks.append(n)
        m.observe_step(n + 1, 1, 0.5 if i == 0 else step_time(n))
        if n:
            m.observe_acceptance(drafted_depth=n, accepted=n)
            m.observe_draft(n, 0.0003)
    assert picks[0] > 0 and min(picks[1:]) >= 8, picks
    m.observe_step(17, 1, 0.5)  # a second slow step at that size: still an outlier to the median
    assert int(np.argmax(m.speedups(1))) >= 8


def test_speculation_longer_than_the_engine_verifies_is_refused_at_construction():
    import dataclasses

    gen = Generator(TorchBackend(random_model(SMALL, seed=4)))
    gen.backend.caps = dataclasses.replace(gen.backend.caps, max_verify=9)
    SpeculativeDecoder(gen, make_proposer("ngram"), make_policy(8))
    with pytest.raises(SpecrtError, match="verifies at most 9 positions .* up to 16 draft tokens .* --max-verify 17"):
        SpeculativeDecoder(gen, make_proposer("ngram"), make_policy("auto", max_draft=16))
