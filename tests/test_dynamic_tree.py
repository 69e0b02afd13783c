"""EAGLE-2 dynamic trees: the growing and reranking rule on a hand-computed example, its
invariants on random draft tables, and trees drafted by a model (the self draft) through the
speculative loop: greedy output equals plain, sampled output follows the target."""

import numpy as np
import pytest

from specrt.runtime.drafts.dynamic_tree import TreeBuilder, grow_tree
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from self_draft import SelfDraftProposer


def markov_step(table):
    """A draft whose next-token distribution depends on the last token of the path."""
    return lambda builder, nodes: {n: table[builder.path(n)[-1]] for n in nodes}


def test_hand_computed_tree():
    """top_k 2, depth 3, budget 5. Values (products along the path):
    layer 1: a=0 .5, b=1 .3;  layer 2: c=0>1 .4, d=0>0 .05, e=1>2 .15, f=1>0 .06 (a tie 0/1 broken
    by token id); layer 3 expands the two best of layer 2 (c, e): g=0>1>2 .2, h=0>1>0 .08,
    i, j=1>2>0, 1>2>1 .0375. The 5 best: a .5, c .4, b .3, g .2, e .15."""
    root = np.array([0.5, 0.3, 0.15, 0.05])
    table = np.array([[0.1, 0.8, 0.05, 0.05], [0.2, 0.2, 0.5, 0.1], [0.25, 0.25, 0.25, 0.25], [1, 0, 0, 0]])
    tree = grow_tree(root, markov_step(table), top_k=2, depth=3, budget=5)
    assert tree.tokens.tolist() == [0, 1, 1, 2, 2]  # a b | c e | g: by depth, then value
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]
    assert tree.scores.tolist() == pytest.approx([0.5, 0.3, 0.4, 0.15, 0.2])
    assert tree.q is None  # top-k children: point masses, exact under sampling


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_k, depth, budget", [(1, 5, 4), (2, 4, 8), (3, 3, 10), (4, 6, 25)])
def test_invariants_on_random_drafts(seed, top_k, depth, budget):
    rng = np.random.default_rng(seed)
    V = 7
    table = rng.dirichlet(np.full(V, 0.4), size=V)
    builder = TreeBuilder(rng.dirichlet(np.full(V, 0.4)), top_k, budget)
    for _ in range(depth - 1):
        nodes = builder.frontier()
        assert len(nodes) <= top_k
        builder.expand(markov_step(table)(builder, nodes))
    tree = builder.tree()
    cands = builder.candidates
    assert len(tree) == min(budget, len(cands))
    assert (tree.parents < np.arange(len(tree))).all()  # parents first (DraftTree also checks it)
    d = tree.depths()
    assert (np.diff(d) >= 0).all() and d.max() <= depth
    kept = sorted(tree.scores, reverse=True)
    dropped = sorted((c.value for c in cands), reverse=True)[len(tree) :]
    assert not dropped or min(kept) >= max(dropped)  # the best nodes, nothing else
    for node in range(len(tree)):  # a node's value is its parent's times its draft probability
        parent = tree.parents[node]
        prev_token = tree.tokens[parent] if parent >= 0 else None
        p = table[prev_token][tree.tokens[node]] if parent >= 0 else None
        if p is not None:
            assert tree.scores[node] == pytest.approx(tree.scores[parent] * p)
    for parent in range(-1, len(tree)):  # siblings: most valuable first
        kids = tree.children(parent)
        assert (np.diff(tree.scores[kids]) <= 1e-12).all()


def test_budget_zero_and_one():
    root = np.array([0.7, 0.2, 0.1])
    assert len(grow_tree(root, None, top_k=2, depth=1, budget=0)) == 0
    t = grow_tree(root, markov_step(np.eye(3)), top_k=2, depth=3, budget=1)
    assert t.tokens.tolist() == [0] and t.parents.tolist() == [-1]


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


@pytest.mark.parametrize("shape", [(2, 3), (3, 4)])
def test_greedy_dynamic_trees_equal_plain(ort_gen, shape):
    """The self draft grows dynamic trees (its own model re-evaluates the candidate tree with a
    tree mask at each depth): the greedy output is plain greedy's, the drafts are accepted (the
    most likely path is the target's own argmax path), and features still line up."""
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9]]
    plain = ort_gen.generate_ids(prompts, 30)
    draft = SelfDraftProposer(ort_gen.backend, tree=shape, check_features=True)
    out = SpeculativeDecoder(ort_gen, draft, make_policy(8)).generate_ids(prompts, 30)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.mean_accepted_length > 2 and draft.features_checked == draft.proposals > 0
    assert draft.widest == shape[0]  # real trees, not chains
    assert 2 <= len(m.drafted_at_depth) <= shape[1]  # trees as deep as asked, no deeper


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_with_its_own_cache_rolls_back_from_the_depth_first_tree(ort_gen, temperature):
    """A tree draft that keeps its nodes in its own KV cache (node i of its proposal after the
    root) is handed the tree that was verified: re-ordered depth first, so a verdict's node
    indexes are not the proposal's. Reading `DraftTree.proposed`, it keeps the accepted path
    and its cache holds the committed context at every step (greedy: plain's tokens); reading
    the verdict's indexes as its own (what the contract said before), it keeps other nodes."""
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9]]
    sampling = SamplingParams(temperature=temperature, seed=2)
    plain = ort_gen.generate_ids(prompts, 30, sampling)
    draft = SelfDraftProposer(ort_gen.backend, tree=(3, 4), keep_tree=True, check_features=True)
    out = SpeculativeDecoder(ort_gen, draft, make_policy(8)).generate_ids(prompts, 30, sampling)
    if not temperature:
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert draft.moved > 0 and draft.rolled_back > 0 and draft.features_checked == draft.proposals > 0

    class ProposalOrder(SelfDraftProposer):
        def proposal_nodes(self, tree, verdict):
            return list(verdict.accepted)

    wrong = ProposalOrder(ort_gen.backend, tree=(3, 4), keep_tree=True)
    with pytest.raises(AssertionError, match="the own cache holds other tokens than the context"):
        SpeculativeDecoder(ort_gen, wrong, make_policy(8)).generate_ids(prompts, 30, sampling)


def test_sampled_dynamic_trees_follow_the_target():
    """Dynamic trees verified as point masses under sampling (temperature 1, top-p 0.95): the
    first two tokens follow the target's exact joint (chi-square), like every other draft."""
    from specrt.runtime.backends import TorchBackend

    from conftest import random_model
    from test_speculative import SMALL, two_token_pvalue

    gen = Generator(TorchBackend(random_model(SMALL, seed=4, scale=0.15)))
    gen.eos_ids = frozenset()
    spec = SpeculativeDecoder(gen, SelfDraftProposer(gen.backend, tree=(3, 2)), make_policy(5))
    assert two_token_pvalue(gen, spec, rounds=10) > 1e-3
