"""The acceptance rule: greedy tables, and chi-square tests that sampled speculative output is
distributed exactly as the target's, for chains and trees, with and without draft probabilities.

The statistical tests use a Markov "target" p(next | prev) and "draft" q(next | prev) on a
5-token vocabulary and compare the joint distribution of the first two generated tokens (25
cells) against the exact target joint; a deliberately wrong rule must fail the same test.
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from specrt.runtime.verification import DraftTree, Verdict, accept_greedy, accept_sampling

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
    assert not t.is_chain and DraftTree.chain([1, 2]).is_chain
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


def test_all_accepted_when_draft_equals_target():
    target, _ = tables()
    rng = np.random.default_rng(0)
    tree = draft_chain(0, target, rng, 4, point_mass=False)
    probs = np.vstack([target[0]] + [target[int(t)] for t in tree.tokens])
    assert len(accept_sampling(tree, probs, rng).accepted) == 4
