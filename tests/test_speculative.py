"""The speculative loop: greedy output identical to plain decoding, sampled output distributed as
the target's, KV rollback and tree compaction, the cost model and the metrics conventions."""

import numpy as np
import pytest
from scipy.stats import chisquare

from conftest import random_model, tiny_hf_config
from specrt.errors import SpecrtError
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.runtime.verification import DraftTree

LOOPY = tiny_hf_config(vocab_size=32)  # a small vocabulary makes greedy text repeat, so drafts hit


@pytest.fixture(scope="module")
def loopy_gen():
    return Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)))


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10]]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("num_draft", [1, 3, "auto"])
def test_greedy_speculative_equals_plain_torch(loopy_gen, method, num_draft):
    plain = loopy_gen.generate_ids(PROMPTS, 48)
    spec = SpeculativeDecoder(loopy_gen, make_proposer(method), make_policy(num_draft))
    out = spec.generate_ids(PROMPTS, 48)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.accepted_tokens > 0, "the drafts were never accepted: the test exercised nothing"
    assert m.steps < sum(len(r.token_ids) for r in plain)  # fewer target steps than tokens


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculative_equals_plain_ort(ort_gen, method):
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42]]
    plain = ort_gen.generate_ids(prompts, 40)
    out = SpeculativeDecoder(ort_gen, make_proposer(method), make_policy(4)).generate_ids(prompts, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]


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
    cache = gen.new_cache(1, 16)
    gen.forward_tokens(cache, [prefix])
    root = 3
    gen.forward_tokens(cache, [[root, *tree.tokens.tolist()]], [(np.concatenate([[0], tree.depths()]), tree.ancestor_mask())])
    cache.keep(0, 6, [6 + 2, 6 + 3])  # accept nodes 2 and 3 (tokens 13, 14)
    chain = gen.new_cache(1, 16)
    gen.forward_tokens(chain, [prefix + [root, 13, 14]])
    assert cache.lengths.tolist() == chain.lengths.tolist() == [8]
    assert np.abs(cache.keys[:, :, :, :8] - chain.keys[:, :, :, :8]).max() < 1e-5
    assert np.abs(cache.values[:, :, :, :8] - chain.values[:, :, :, :8]).max() < 1e-5
    # and the next step after the compacted tree equals the next step after the chain
    a = gen.forward_tokens(cache, [[15]]).logits
    b = gen.forward_tokens(chain, [[15]]).logits
    assert np.abs(a - b).max() < 1e-5


# -- sampling end to end -------------------------------------------------------------------------

SMALL = tiny_hf_config(vocab_size=8)
SAMPLING_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def exact_two_token_joint(gen, params):
    """p(t1, t2 | prompt) from the model itself, with the same temperature/top-k/top-p."""
    cache = gen.new_cache(1, 16)
    p1 = probs_from_logits(gen.forward_tokens(cache, [SAMPLING_PROMPT]).logits[0, -1], params)
    joint = np.zeros((8, 8))
    for t1 in range(8):
        c = gen.new_cache(1, 16)
        p2 = probs_from_logits(gen.forward_tokens(c, [SAMPLING_PROMPT + [t1]]).logits[0, -1], params)
        joint[t1] = p1[t1] * p2
    return joint


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_speculative_output_follows_the_model(method):
    gen = Generator(TorchBackend(random_model(SMALL, seed=4, scale=0.15)))
    gen.eos_ids = frozenset()  # every token counts, EOS included
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=0)
    expected = exact_two_token_joint(gen, params)
    counts = np.zeros((8, 8))
    batch, rounds = 400, 15
    spec = SpeculativeDecoder(gen, make_proposer(method, **({"n_min": 1} if method == "ngram" else {})), make_policy(3))
    accepted = 0
    for r in range(rounds):
        res = spec.generate_ids([SAMPLING_PROMPT] * batch, 2, SamplingParams(temperature=1.0, top_p=0.95, seed=r))
        for x in res:
            counts[x.token_ids[0], x.token_ids[1]] += 1
        accepted += res[0].metrics.accepted_tokens
    assert accepted > 0
    n = batch * rounds
    exp, obs = n * expected.ravel(), counts.ravel()
    assert obs[exp == 0].sum() == 0, "sampled a token that top-p excludes"
    keep, rare = exp >= 5, (exp > 0) & (exp < 5)  # pool the rare cells
    obs = np.append(obs[keep], obs[rare].sum())
    exp = np.append(exp[keep], exp[rare].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3


# -- cost model and policy -----------------------------------------------------------------------


def test_cost_model_turns_speculation_off_when_it_does_not_pay():
    m = CostModel(max_draft=8)
    for _ in range(200):
        m.observe_acceptance(drafted_depth=4, accepted=0)
    for q in (1, 5, 9, 1):
        m.observe_step(q, 1, 0.02 * (1 + (0.1 + 0.04 * (q - 1)) * (q > 1)), 0.0)
    assert int(np.argmax(m.speedups(1))) == 0
    assert AutoPolicy(max_draft=8).num_draft(m, 1) == 0


def test_cost_model_measures_the_verification_jump_and_slope():
    """t(1) = 20 ms; verification steps cost 2 ms more plus 1 ms per position."""
    m = CostModel(max_draft=16)
    for _ in range(5):
        m.observe_step(1, 1, 0.020, 0.0)
    for q in range(2, 40, 4):
        m.observe_step(q, 1, 0.022 + 0.001 * q, 0.0005)
    c = m.cost(1)
    assert abs(c.decode - 0.020) < 1e-9
    assert abs(c.alpha - 0.05) < 1e-6 and abs(c.beta - 0.15) < 1e-6  # (22 + 1) / 20 - 1
    assert abs(c.draft_ratio - 0.025) < 1e-9
    assert c.relative(np.array([0, 4])).tolist() == pytest.approx([1.0, 1 + 0.15 + 0.025 + 0.2])


def test_cost_model_speculates_when_acceptance_is_high_and_less_for_big_batches():
    m = CostModel(max_draft=16)
    for _ in range(200):
        m.observe_acceptance(drafted_depth=16, accepted=16)
    for b in (1, 64):
        m.observe_step(b, b, 0.020 + 0.001 * b, 0.0)  # plain steps: 21 ms at B = 1, 84 ms at B = 64
    for q in range(2, 40, 4):
        m.observe_step(q, 1, 0.020 + 0.001 * q, 0.0)  # c0 = 20 ms, c1 = 1 ms per position
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
        m.observe_step(1, 1, 0.020, 0.0)
        m.observe_step(9, 1, 0.030, 0.0)  # N = 8 always: 1.5x a decode step
    c = m.cost(1)
    assert c.relative(np.array([8]))[0] == pytest.approx(1.5)
    assert c.beta == pytest.approx(0.5 * 0.1 / (0.1 + 0.05 * 8)) and c.alpha > 0
