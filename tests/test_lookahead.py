"""Lookahead decoding (runtime/drafts/lookahead.py): the Jacobi update read off the verification
step, the diagonal n-grams it harvests, the tree it builds under a budget, and end to end: greedy
output equal to plain decoding, sampled output following the target (chi-square)."""

import numpy as np
import pytest

from specrt.runtime.backends import TorchBackend
from specrt.runtime.backends.base import StepOutput
from specrt.runtime.drafts import DraftInput, make_proposer
from specrt.runtime.drafts.lookahead import LookaheadProposer
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.runtime.verification import Verdict

from conftest import random_model
from test_speculative import LOOPY, SMALL, two_token_pvalue


def _inp(contexts, n, rows=None):
    rows = list(range(len(contexts))) if rows is None else rows
    return DraftInput(rows, contexts, n, [100] * len(rows), SamplingParams(), [np.random.default_rng(0)] * len(rows))


def _logits_with_argmax(argmax_rows, vocab=50):
    """(1, len, vocab) logits whose argmax at each position is argmax_rows[i]."""
    logits = np.zeros((1, len(argmax_rows), vocab), np.float32)
    logits[0, np.arange(len(argmax_rows)), argmax_rows] = 1.0
    return StepOutput(logits, None, [])


def test_window_is_a_chain_after_the_pool_grams_and_the_budget_holds():
    p = LookaheadProposer(window=3, ngram=3, max_ngrams=2, window_share=0.5)
    prompt = [1, 2, 3, 9, 1, 2, 4, 7, 1]  # pool: 1 -> (2, 3), (2, 4); newest first
    p.begin([0], [prompt], None)
    ctx = prompt + [5, 1]  # the root is 1
    tree = p.propose(_inp([ctx], 8))[0]
    # the grams as a trie (2 shared), then the window: the prompt's last 3 tokens as the first guess
    assert tree.tokens.tolist()[:3] == [2, 4, 3] and tree.parents.tolist()[:3] == [-1, 0, 0]
    window = p._rows[0].window_nodes
    assert len(window) == 3 and tree.tokens[window].tolist() == [4, 7, 1]
    assert tree.parents[window].tolist() == [-1, window[0], window[1]]  # a chain from the root
    for budget in (1, 2, 3, 5):
        t = p.propose(_inp([ctx], budget))[0]
        assert 1 <= len(t) <= budget and len(p._rows[0].window_nodes) >= 1  # the window never starves


def test_jacobi_update_shifts_by_the_emitted_tokens_and_harvests_diagonals():
    p = LookaheadProposer(window=3, ngram=2, max_ngrams=0, prompt_ngrams=False, window_share=1.0)
    p.begin([0], [[10, 11, 12]], None)
    ctx = [10, 11, 12, 13]  # root 13 at position 3
    for step, outputs in enumerate(([20, 21, 22, 23], [30, 31, 32, 33])):
        tree = p.propose(_inp([ctx], 3))[0]
        guess = tree.tokens.tolist()
        out = _logits_with_argmax(outputs[: len(tree) + 1])
        verdict = Verdict([], outputs[0])  # nothing accepted: the target's own next token is emitted
        p.commit([0], [tree], [verdict], out)
        ctx = ctx + [outputs[0]]
        row = p._rows[0]
        # the new guess: the outputs after the one emitted (o_j predicts position root + j + 1)
        assert row.guess == outputs[1 : len(tree) + 1]
        # n = 2: each guess g_j (position root + j) followed by the output at its node
        for j, g in enumerate(guess):
            assert (outputs[j + 1],) in row.pool.get(g, {}), (step, g, row.pool)
        if step == 0:
            assert guess == [10, 11, 12]  # the first guess: the prompt's tail


def test_pool_gram_is_accepted_when_the_text_repeats():
    p = make_proposer("lookahead", window=2, ngram=3)
    prompt = [4, 5, 6, 7, 4, 5, 6, 7, 4]
    p.begin([0], [prompt], None)
    tree = p.propose(_inp([prompt + [5]], 6))[0]
    assert tree.tokens.tolist()[:2] == [6, 7]  # the prompt's n-gram after 5


@pytest.mark.parametrize("num_draft", [3, 6, "auto"])
def test_greedy_lookahead_equals_plain(num_draft):
    gen = Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10]]
    plain = gen.generate_ids(prompts, 48)
    for prompt_ngrams in (True, False):
        spec = SpeculativeDecoder(gen, make_proposer("lookahead", prompt_ngrams=prompt_ngrams), make_policy(num_draft))
        out = spec.generate_ids(prompts, 48)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        if num_draft != "auto":
            assert out[0].metrics.accepted_tokens > 0, "no draft was ever accepted: the test exercised nothing"


def test_jacobi_alone_gets_drafts_accepted():
    """Without the context's n-grams the pool holds only what the Jacobi trajectory produced: on a
    model whose greedy text loops, its drafts are accepted (the iteration converges)."""
    gen = Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)))
    spec = SpeculativeDecoder(gen, make_proposer("lookahead", prompt_ngrams=False), make_policy(6))
    m = spec.generate_ids([[1, 2, 3]], 64)[0].metrics
    # 8 accepted without the step floor, 7 with it: a window node off the tree's leading chain is
    # cut (verification.on_leading_chain) and drafted again
    assert m.accepted_tokens >= 6, m


def test_sampled_lookahead_follows_the_model():
    gen = Generator(TorchBackend(random_model(SMALL, seed=4, scale=0.15)))
    gen.eos_ids = frozenset()
    spec = SpeculativeDecoder(gen, make_proposer("lookahead", window=2, ngram=2), make_policy(3))
    assert two_token_pvalue(gen, spec, rounds=15) > 1e-3


def test_rows_keep_their_own_state():
    p = LookaheadProposer(window=2, ngram=2)
    p.begin([0, 1], [[1, 2, 1], [7, 8, 7]], None)
    trees = p.propose(_inp([[1, 2, 1, 2], [7, 8, 7, 8]], 4))
    assert 1 not in trees[1].tokens.tolist()[:1] and 7 not in trees[0].tokens.tolist()[:1]
    p.end([0], [[2]])
    assert 0 not in p._rows and 1 in p._rows
