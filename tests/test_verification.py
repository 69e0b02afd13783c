"""The acceptance rule: greedy tables, and chi-square tests that sampled speculative output is
distributed exactly as the target's, for chains and trees, with and without draft probabilities.

The statistical tests use a Markov "target" p(next | prev) and "draft" q(next | prev) on a
5-token vocabulary and compare the joint distribution of the first two generated tokens (25
cells) against the exact target joint; a deliberately wrong rule must fail the same test.
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.verification import DraftTree, Verdict, accept_greedy, accept_sampling, on_leading_chain

# -- greedy --------------------------------------------------------------------------------------

GREEDY_CASES = [
    # (name, tokens, parents, target argmax at [root, nodes...], accepted, next)
    ("empty draft", [], [], [7], [], 7),
    ("chain all accepted, bonus", [3, 4, 5], [-1, 0, 1], [3, 4, 5, 9], [0, 1, 2], 9),
    ("chain first rejected", [3, 4, 5], [-1, 0, 1], [8, 4, 5, 9], [], 8),
    ("chain middle rejected", [3, 4, 5], [-1, 0, 1], [3, 6, 5, 9], [0], 6),
    ("tree second branch", [3, 4, 5, 6], [-1, 0, -1, 2], [5, 0, 0, 6, 1], [2, 3], 1),
    ("tree first branch", [3, 4, 5, 6], [-1, 0, -1, 2], [3, 4, 2, 0, 0], [0, 1], 2),
    ("tree no branch", [3, 4, 5, 6], [-1, 0, -1, 2], [1, 4, 2, 6, 0], [], 1),
]


@pytest.mark.parametrize("name, tokens, parents, argmax, accepted, nxt", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_accept_greedy(name, tokens, parents, argmax, accepted, nxt):
    tree = DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))
    v = accept_greedy(tree, np.array(argmax))
    assert (v.accepted, v.next_token) == (accepted, nxt)
    assert v.tokens(tree) == [tokens[i] for i in accepted] + [nxt]


def test_tree_helpers():
    t = DraftTree(np.array([3, 4, 5, 6]), np.array([-1, 0, -1, 2]))
    assert t.depths().tolist() == [1, 2, 1, 2]
    m = t.ancestor_mask()
    assert m[4].tolist() == [True, False, False, True, True]  # node 3 sees root, node 2, itself
    assert m[2].tolist() == [True, True, True, False, False]
    assert DraftTree.chain([1, 2]).parents.tolist() == [-1, 0]
    with pytest.raises(ValueError, match="parent must come before"):
        DraftTree(np.array([1, 2]), np.array([1, -1]))


# -- sampling: distribution tests ----------------------------------------------------------------

V = 5
SAMPLES = 20000
P_MIN = 1e-3


def tables(seed=0):
    r = np.random.default_rng(seed)
    target = r.dirichlet(np.ones(V), size=V)
    draft = 0.5 * r.dirichlet(np.ones(V), size=V) + 0.5 * target[::-1]  # related, but clearly different
    return target, draft / draft.sum(1, keepdims=True)


def draft_chain(start, draft, rng, depth, point_mass):
    toks, qs, prev = [], [], start
    for _ in range(depth):
        q = draft[prev]
        x = int(np.argmax(q)) if point_mass else int(rng.choice(V, p=q))
        toks.append(x)
        qs.append(q)
        prev = x
    return DraftTree.chain(toks, None if point_mass else np.array(qs))


def draft_tree(start, draft, rng, point_mass, without_replacement):
    """Two root children, each with one child."""
    q0 = draft[start]
    if point_mass:
        a, b = (int(i) for i in np.argsort(-q0)[:2])
        qa = qb = None
    elif without_replacement:
        a = int(rng.choice(V, p=q0))
        qb = q0.copy()
        qb[a] = 0
        qb /= qb.sum()
        b = int(rng.choice(V, p=qb))
        qa = q0
    else:
        a, b = (int(x) for x in rng.choice(V, size=2, p=q0))
        qa = qb = q0
    ca = int(np.argmax(draft[a])) if point_mass else int(rng.choice(V, p=draft[a]))
    cb = int(np.argmax(draft[b])) if point_mass else int(rng.choice(V, p=draft[b]))
    q = None if point_mass else np.array([qa, draft[a], qb, draft[b]])
    return DraftTree(np.array([a, ca, b, cb]), np.array([-1, 0, -1, 2]), q)


def generate_two(target, draft, rng, make_draft, verify):
    """Speculative steps from token 0 until two tokens are produced; returns them."""
    out, last = [], 0
    while len(out) < 2:
        tree = make_draft(last, draft, rng)
        probs = np.vstack([target[last]] + [target[int(t)] for t in tree.tokens])
        new = verify(tree, probs, rng).tokens(tree)
        out += new
        last = out[-1]
    return out[:2]


def joint_pvalue(make_draft, verify=accept_sampling, seed=1):
    target, draft = tables()
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(SAMPLES):
        a, b = generate_two(target, draft, rng, make_draft, verify)
        counts[a, b] += 1
    expected = target[0][:, None] * target  # p(a | 0) p(b | a)
    return chisquare(counts.ravel(), SAMPLES * expected.ravel()).pvalue


DRAFTS = {
    "chain with q": lambda s, d, r: draft_chain(s, d, r, 3, point_mass=False),
    "chain point mass": lambda s, d, r: draft_chain(s, d, r, 3, point_mass=True),
    "tree with q, with replacement": lambda s, d, r: draft_tree(s, d, r, point_mass=False, without_replacement=False),
    "tree with q, without replacement": lambda s, d, r: draft_tree(s, d, r, point_mass=False, without_replacement=True),
    "tree point mass": lambda s, d, r: draft_tree(s, d, r, point_mass=True, without_replacement=False),
}


@pytest.mark.parametrize("name", DRAFTS)
def test_sampled_output_follows_target(name):
    assert joint_pvalue(DRAFTS[name]) > P_MIN


def accept_wrong_residual(tree, target_probs, rng):
    """A broken rule: on rejection it resamples from p instead of norm((p - q)+)."""
    accepted, node = [], -1
    while True:
        p = target_probs[node + 1]
        kids = tree.children(node)
        if len(kids) == 0:
            break
        c = int(kids[0])
        x = int(tree.tokens[c])
        q = tree.q[c]
        if rng.random() < min(1.0, p[x] / q[x]):
            accepted.append(c)
            node = c
            continue
        break
    p = target_probs[node + 1]
    return Verdict(accepted, int(rng.choice(len(p), p=p)))


def test_wrong_rule_fails_the_same_test():
    assert joint_pvalue(DRAFTS["chain with q"], verify=accept_wrong_residual) < P_MIN


# -- wider trees, sampling parameters at verification, and the wrong rules they must catch --------


def draft_wide(start, draft, rng, point_mass, without_replacement, width=3, depth=2):
    """`width` siblings at every level below the root (width + width**2 nodes for depth 2): each
    child of a node is drawn from the node's q (i.i.d., or without replacement: q with the earlier
    siblings removed), or for point masses the node's `width` most likely tokens."""
    tokens, parents, qs = [], [], []
    frontier = [(-1, start)]
    for _ in range(depth):
        nxt = []
        for parent, prev in frontier:
            q = draft[prev].copy()
            picked = [int(i) for i in np.argsort(-q)[:width]] if point_mass else []
            for k in range(width):
                if not point_mass:
                    qk = q.copy()
                    if without_replacement:
                        qk[picked] = 0.0
                        if qk.sum() == 0:  # q's support is used up (top-k/top-p drafts)
                            break
                        qk /= qk.sum()
                    picked.append(int(rng.choice(len(q), p=qk)))
                    qs.append(qk)
                tokens.append(picked[k])
                parents.append(parent)
                nxt.append((len(tokens) - 1, picked[k]))
        frontier = nxt
    return DraftTree(np.array(tokens), np.array(parents), None if point_mass else np.array(qs))


WIDE = {
    "3 siblings, with q, with replacement": lambda s, d, r: draft_wide(
        s, d, r, point_mass=False, without_replacement=False
    ),
    "3 siblings, with q, without replacement": lambda s, d, r: draft_wide(
        s, d, r, point_mass=False, without_replacement=True
    ),
    "3 siblings, point masses": lambda s, d, r: draft_wide(s, d, r, point_mass=True, without_replacement=False),
    "4 siblings, with q, without replacement": lambda s, d, r: draft_wide(s, d, r, False, True, width=4, depth=1),
}


@pytest.mark.parametrize("name", WIDE)
def test_wide_trees_follow_target(name):
    tree = WIDE[name](0, tables()[1], np.random.default_rng(0))
    assert (tree.children(-1).size >= 3) and (
        name.startswith("4") or all(tree.children(int(c)).size >= 3 for c in tree.children(-1))
    )
    assert joint_pvalue(WIDE[name]) > P_MIN


def accept_residual_not_cumulative(tree, target_probs, rng):
    """Broken: after a rejected sibling the residual is taken from the node's original p, not
    from the residual the earlier siblings left (each sibling forgets the ones before it)."""
    return _accept_variant(tree, target_probs, rng, cumulative=False, renormalise=True)


def accept_residual_not_renormalised(tree, target_probs, rng):
    """Broken: the residual (p - q)+ is used without dividing by its mass."""
    return _accept_variant(tree, target_probs, rng, cumulative=True, renormalise=False)


def _accept_variant(tree, target_probs, rng, cumulative, renormalise):
    accepted, node = [], -1
    while True:
        original = target_probs[node + 1].astype(np.float64)
        p = original.copy()
        nxt = None
        for c in tree.children(node):
            x, q = int(tree.tokens[c]), tree.q[c]
            if q[x] > 0 and rng.random() < min(1.0, p[x] / q[x]):
                nxt = int(c)
                break
            p = np.maximum((p if cumulative else original) - q, 0.0)
            if p.sum() <= 0:  # as accept_sampling: only reachable with probability 0
                p = original.copy()
            if renormalise:
                p /= p.sum()
        if nxt is None:
            return Verdict(accepted, int(rng.choice(len(p), p=p / p.sum())))
        accepted.append(nxt)
        node = nxt


@pytest.mark.parametrize("wrong", [accept_residual_not_cumulative, accept_residual_not_renormalised])
def test_wrong_residuals_fail_the_wide_tree_test(wrong):
    assert joint_pvalue(WIDE["3 siblings, with q, without replacement"], verify=wrong) < P_MIN


def draft_forgetting_removed_siblings(start, draft, rng):
    """Breaks the proposer contract (drafts/base.py): siblings drawn without replacement, each
    reported with its parent's whole q rather than q with its earlier siblings removed."""
    tree = draft_wide(start, draft, rng, point_mass=False, without_replacement=True)
    prev = [start if p < 0 else int(tree.tokens[p]) for p in tree.parents]
    return DraftTree(tree.tokens, tree.parents, np.array([draft[t] for t in prev]))


def test_a_draft_that_misstates_its_siblings_q_is_caught():
    assert joint_pvalue(draft_forgetting_removed_siblings) < P_MIN


# the sampling parameters a request may set, applied to the target and the draft alike
PARAMS = SamplingParams(temperature=1.2, top_k=3, top_p=0.85)  # each one binds: ignoring it moves the joint by 10-15 %


def logit_tables(seed=2):
    r = np.random.default_rng(seed)
    V6 = 6
    target = r.normal(0, 1.5, (V6, V6))
    draft = 0.5 * r.normal(0, 1.5, (V6, V6)) + 0.5 * target[::-1]
    return target, draft


def params_pvalue(point_mass: bool, verify_params: SamplingParams, seed=3) -> float:
    """Speculative sampling where target and draft are logits and the request's temperature,
    top-k and top-p turn them into distributions; `verify_params` is what verification applies
    to the target (PARAMS when right). Compared with the exact joint under PARAMS."""
    target_logits, draft_logits = logit_tables()
    p_req = probs_from_logits(target_logits, PARAMS)
    p_verify = probs_from_logits(target_logits, verify_params)
    q = probs_from_logits(draft_logits, PARAMS)  # a draft honours the request's parameters
    rng = np.random.default_rng(seed)
    V6 = p_req.shape[0]
    counts = np.zeros((V6, V6))
    for _ in range(SAMPLES):
        a, b = generate_two(
            p_verify, q, rng, lambda s, d, r: draft_wide(s, d, r, point_mass, not point_mass), accept_sampling
        )
        counts[a, b] += 1
    expected = (p_req[0][:, None] * p_req).ravel() * SAMPLES
    obs = counts.ravel()
    if obs[expected == 0].sum():  # a token the request's top-k/top-p excludes was sampled
        return 0.0
    keep = expected > 0
    return chisquare(obs[keep], expected[keep]).pvalue


@pytest.mark.parametrize("point_mass", [False, True])
def test_temperature_top_k_top_p_are_applied_at_verification(point_mass):
    assert params_pvalue(point_mass, PARAMS) > P_MIN


@pytest.mark.parametrize(
    "wrong",
    [
        SamplingParams(temperature=1.2, top_k=3),  # top-p ignored
        SamplingParams(temperature=1.2, top_p=0.85),  # top-k ignored
        SamplingParams(temperature=1.0, top_k=3, top_p=0.85),  # temperature ignored
    ],
    ids=["top-p ignored", "top-k ignored", "temperature ignored"],
)
def test_verification_that_ignores_a_sampling_parameter_fails(wrong):
    assert params_pvalue(False, wrong) < P_MIN


def test_all_accepted_when_draft_equals_target():
    target, _ = tables()
    rng = np.random.default_rng(0)
    tree = draft_chain(0, target, rng, 4, point_mass=False)
    probs = np.vstack([target[0]] + [target[int(t)] for t in tree.tokens])
    assert len(accept_sampling(tree, probs, rng).accepted) == 4


def test_a_greedy_verdict_is_cut_where_it_leaves_the_leading_chain():
    # root -> 0 (a) -> 1 (b) -> 3 (d); root -> 2 (c): the leading chain is nodes 0, 1
    tree = DraftTree(np.array([10, 11, 12, 13]), np.array([-1, 0, -1, 1]))
    assert on_leading_chain(tree, Verdict([0, 1], 7)) == Verdict([0, 1], 7)  # on it: as it was
    # node 3 is at depth 3 but slot 4, after the masked node 2: kept up to node 1, then node 3's token
    assert on_leading_chain(tree, Verdict([0, 1, 3], 7)) == Verdict([0, 1], 13)
    assert on_leading_chain(tree, Verdict([2], 7)) == Verdict([], 12)  # a sibling branch: its token only
    assert on_leading_chain(DraftTree.empty(), Verdict([], 5)) == Verdict([], 5)


def test_depth_first_puts_the_best_guess_at_every_depth_on_the_leading_chain():
    # breadth first: root -> 0, 1; 0 -> 2, 3; 2 -> 4
    tree = DraftTree(np.array([10, 11, 12, 13, 14]), np.array([-1, -1, 0, 0, 2]), scores=np.arange(5.0))
    d = tree.depth_first()
    assert d.tokens.tolist() == [10, 12, 14, 13, 11] and d.parents.tolist() == [-1, 0, 1, 0, -1]
    assert d.origin.tolist() == [0, 2, 4, 3, 1] and d.scores.tolist() == [0, 2, 4, 3, 1]
    assert np.array_equal(d.ancestor_mask()[3], [True, True, True, True, False, False])  # 14 sees 10, 12
    chain = DraftTree.chain([1, 2, 3])
    assert chain.depth_first() is chain  # nothing moves


def test_a_verified_tree_names_each_node_in_the_proposal():
    """Cut, behind a grammar's forced tokens, then depth first: `proposed` still names each
    node's index in the proposer's tree (-1 for the forced tokens and the floor's guess)."""
    tree = DraftTree(np.array([10, 11, 12, 13, 14]), np.array([-1, -1, 0, 0, 2]))
    assert tree.proposed().tolist() == [0, 1, 2, 3, 4]
    verified = tree.truncate(4).behind([7, 8]).depth_first()
    assert verified.tokens.tolist() == [7, 8, 10, 12, 13, 11]
    assert verified.proposed().tolist() == [-1, -1, 0, 2, 3, 1]
    assert np.array_equal(tree.tokens[verified.proposed()[2:]], verified.tokens[2:])
    assert DraftTree.imposed([5]).proposed().tolist() == [-1]
    assert DraftTree.imposed([5]).depth_first().proposed().tolist() == [-1]
