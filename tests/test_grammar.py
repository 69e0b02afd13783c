"""Structured output (runtime/grammar.py): the masks along a draft tree equal a fresh matcher's
per path, constrained greedy speculation equals constrained greedy plain decoding, constrained
sampling follows the masked target exactly (chi-square), grammar drafts are accepted, and bad
grammars are clear errors."""

import json
import re

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.grammar import Grammar
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.runtime.tokenizer import Tokenizer
from specrt.runtime.verification import DraftTree

from conftest import CHAT_TEMPLATE, random_model, tiny_hf_config
from self_draft import SelfDraftProposer
from test_speculative import SAMPLING_PROMPT, SMALL, two_token_pvalue

LOOPY = tiny_hf_config(vocab_size=32)
# token 3 is "a", 4 "b", ... (letter_tokenizer); after h the grammar forces i (a grammar draft)
LOOP_REGEX = r"[c-g]([c-g]|hi)*"
# the first token picks what may follow; after a the grammar forces b
PAIR_REGEX = r"(ab|b[cde]|c[ae]|dcb)[a-e]*"


def tokenizer(tmp_path_factory, vocab):
    """A word-level tokenizer of single letters (token 3 is "a"): every text a grammar forces
    has a tokenization, as with a real byte-level vocabulary."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    d = tmp_path_factory.mktemp(f"tok{vocab}")
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    vocab_map = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab_map.update({letters[i - 3]: i for i in range(3, vocab)})
    tok = HF(models.WordLevel(vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHAT_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(d)


@pytest.fixture(scope="module")
def loopy_gen(tmp_path_factory):
    return Generator(TorchBackend(random_model(LOOPY, seed=3, scale=0.3)), tokenizer(tmp_path_factory, 32))


def words(gen, ids) -> str:
    return "".join(gen.tokenizer.decode([t]) for t in ids)


def test_tree_masks_equal_a_fresh_matcher_per_path(loopy_gen):
    """Every node's mask is what a matcher that consumed exactly the node's path allows; a node
    the grammar forbids (and its subtree) gets its parent's mask, or the tree is cut before it."""
    vocab = loopy_gen.vocabulary()
    grammar = Grammar.regex(LOOP_REGEX)
    m = vocab.matcher(grammar)
    m.advance([5])
    # root ─ d ─ h ─ i ─ e;  root ─ a (forbidden) ─ c;  root ─ g ─ f
    tree = DraftTree([6, 3, 9, 10, 5, 8, 11, 7], [-1, -1, -1, 0, 1, 2, 3, 6])
    kept, masks = m.tree_masks(tree, cut=False)
    assert kept is tree and masks.shape == (9, 32)
    paths = {-1: []}
    for i, p in enumerate(tree.parents):
        paths[i] = paths[int(p)] + [int(tree.tokens[i])]
    for node in range(-1, len(tree)):
        fresh = vocab.matcher(grammar)
        fresh.advance([5])
        path = paths[node]
        if node in (1, 4):  # under the forbidden a: the parent's mask
            np.testing.assert_array_equal(masks[node + 1], masks[int(tree.parents[node]) + 1])
            continue
        fresh.advance(path)
        np.testing.assert_array_equal(masks[node + 1], fresh.mask(), err_msg=f"node {node} path {path}")
    assert masks[0, [5, 6, 7, 8, 9, 10]].all() and not masks[0, [3, 4, 11]].any()
    assert masks[0, 2]  # EOS: the output may end after c
    assert masks[4].tolist() == [t == 11 for t in range(32)]  # after h only i
    np.testing.assert_array_equal(m.mask(), masks[0])  # the matcher ended where it began
    cut, cut_masks = m.tree_masks(tree, cut=True)
    assert cut.tokens.tolist() == [6] and cut_masks.shape == (2, 32)


def test_nothing_is_consumed_after_an_eos_node(loopy_gen):
    """An EOS node ends its path: the tree is cut after it and the matcher is left as it was
    (llguidance does not roll back an EOS)."""
    m = loopy_gen.vocabulary().matcher(Grammar.regex("c"))
    tree, masks = m.tree_masks(DraftTree.chain([5, 2, 2, 5]), cut=True)
    assert tree.tokens.tolist() == [5, 2] and np.flatnonzero(masks[1]).tolist() == [2]
    assert np.flatnonzero(m.mask()).tolist() == [5]
    m.advance([5, 2])
    assert np.flatnonzero(m.mask()).tolist() == [2]


def test_matchers_of_one_grammar_are_independent(loopy_gen):
    """The vocabulary compiles a grammar once and hands out copies: advancing one request's
    matcher leaves another's where it was."""
    vocab, grammar = loopy_gen.vocabulary(), Grammar.regex(r"cde")
    a, b = vocab.matcher(grammar), vocab.matcher(grammar)
    a.advance([5, 6])
    assert np.flatnonzero(a.mask()).tolist() == [7] and np.flatnonzero(b.mask()).tolist() == [5]
    assert np.flatnonzero(vocab.matcher(grammar).mask()).tolist() == [5]


def test_forced_tokens_and_eos(loopy_gen):
    m = loopy_gen.vocabulary().matcher(Grammar.regex(r"cde"))
    assert m.forced(8) == [5, 6, 7] and m.forced(2) == [5, 6] and m.forced(0) == []
    m.advance([5, 6, 7])
    assert np.flatnonzero(m.mask()).tolist() == sorted(loopy_gen.eos_ids)  # complete: EOS only


@pytest.mark.parametrize("method", ["grammar", "ngram", "suffix", "auto"])
@pytest.mark.parametrize("num_draft", [4, "auto"])
def test_constrained_greedy_speculation_equals_constrained_plain(loopy_gen, method, num_draft):
    grammar = Grammar.regex(LOOP_REGEX)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10], [20, 21]]
    plain = loopy_gen.generate_ids(prompts, 40, grammar=grammar)
    free = loopy_gen.generate_ids(prompts, 40)
    assert [r.token_ids for r in plain] != [r.token_ids for r in free], "the grammar changed nothing"
    for r in plain:
        assert re.fullmatch(LOOP_REGEX, words(loopy_gen, r.token_ids)), words(loopy_gen, r.token_ids)
    spec = SpeculativeDecoder(loopy_gen, make_proposer(method), make_policy(num_draft))
    out = spec.generate_ids(prompts, 40, grammar=grammar)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.accepted_tokens > 0 and m.steps < sum(len(r.token_ids) for r in plain)
    assert m.forced_tokens > 0 and m.forced_accepted == m.forced_tokens  # h forces i, always taken


def test_constrained_and_free_rows_share_a_batch(loopy_gen):
    """A constrained request beside free ones: each row's output is its output alone."""
    from specrt.runtime.batching import BatchEngine, Request

    grammar = Grammar.regex(LOOP_REGEX)
    spec = SpeculativeDecoder(loopy_gen, make_proposer("suffix"), make_policy(4))
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10], [20, 21]]
    alone = [
        spec.generate_ids([p], 30, grammar=grammar if i != 1 else None)[0].token_ids for i, p in enumerate(prompts)
    ]
    engine = BatchEngine(spec, max_batch=3)
    requests = [Request(p, 30, grammar=grammar if i != 1 else None) for i, p in enumerate(prompts)]
    got = engine.run(requests, arrivals=[0, 2, 5])
    assert [r.token_ids for r in got] == alone


@pytest.mark.parametrize("method", ["grammar", "suffix", "self q!=p"])
def test_constrained_sampling_follows_the_masked_target(tmp_path_factory, method):
    """The first two sampled tokens under PAIR_REGEX follow the target's exact joint after the
    mask (chi-square); a draft with a real q (the self draft, sampling hotter than the target,
    unaware of the grammar) keeps its forbidden nodes, which are never accepted."""
    gen = Generator(TorchBackend(random_model(SMALL, seed=4, scale=0.15)), tokenizer(tmp_path_factory, 8))
    grammar = Grammar.regex(PAIR_REGEX)
    draft = SelfDraftProposer(gen.backend, temperature_scale=1.7) if method == "self q!=p" else make_proposer(method)
    spec = SpeculativeDecoder(gen, draft, make_policy(3))
    pvalue = two_token_pvalue(gen, spec, rounds=12, new_tokens=4, grammar=grammar, joint=masked_joint(gen, grammar))
    assert pvalue > 1e-3


def masked_joint(gen, grammar):
    """p(t1, t2 | prompt) of the target after the grammar's masks, float64, one position a step."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    vocab = gen.vocabulary()

    def dist(prefix):
        m = vocab.matcher(grammar)
        m.advance(prefix)
        logits = gen.session.forward(gen.session.new_cache(1, 16), [SAMPLING_PROMPT + prefix]).logits[0, -1]
        return probs_from_logits(m.masked(logits.astype(np.float64)), params)

    p1 = dist([])
    joint = np.zeros((8, 8))
    for t1 in np.flatnonzero(p1):
        joint[t1] = p1[t1] * dist([int(t1)])
    assert (joint > 0).sum() < 16  # the mask removed most pairs
    return joint


def test_bad_grammars_are_clear_errors(loopy_gen):
    with pytest.raises(SpecrtError, match="not valid JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(SpecrtError, match="must be a JSON object"):
        Grammar.json_schema("[1, 2]")
    with pytest.raises(SpecrtError, match="JSON schema cannot be compiled: .*objectx"):
        loopy_gen.vocabulary().matcher(Grammar.json_schema({"type": "objectx"}))
    for _ in range(2):  # a grammar that failed is not kept: it fails again
        with pytest.raises(SpecrtError, match="regex cannot be compiled"):
            loopy_gen.vocabulary().matcher(Grammar.regex("(c"))
    with pytest.raises(SpecrtError, match="non-empty"):
        Grammar.regex("")
    bare = Generator(TorchBackend(random_model(LOOPY, seed=3)))
    with pytest.raises(SpecrtError, match="needs the target's tokenizer"):
        bare.generate_ids([[5, 6]], 4, grammar=Grammar.regex(LOOP_REGEX))


# compiles, then passes llguidance's lexer limit on its first "a" (a regex of a million states)
HUGE_REGEX = "(a{1000}){1000}"
# the same limit, reached only after ten letters: past the first tokens Vocabulary.matcher tries
LATE_REGEX = "[c-g]{10}(a{1000}){1000}"


def test_a_grammar_past_the_engines_limits_is_refused_before_it_runs(loopy_gen):
    """A grammar that compiles but fails on its first tokens is refused by Vocabulary.matcher
    (the server's check before queueing: a 400, not a 500 after the first token), with a short
    message: not llguidance's parser state."""
    alts = " | ".join(f'"b" "c" r{i}' for i in range(3000))
    rules = "\n".join(f'r{i}: "d"' for i in range(3000))
    wide = Grammar.lark(f'start: "a" ({alts})\n{rules}')  # a row of 3,001 parser items after "a"
    for grammar, limit in [(Grammar.regex(HUGE_REGEX), "too many expressions"), (wide, "max is 2000")]:
        with pytest.raises(SpecrtError, match=f"cannot be used: .*{limit}.*make it smaller") as e:
            loopy_gen.vocabulary().matcher(grammar)
        assert len(str(e.value)) < 600 and "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["grammar", "suffix"])
def test_a_grammar_that_fails_mid_answer_ends_its_row_with_an_error(loopy_gen, method):
    """Past the first tokens the matcher records the failure instead of raising mid-step: the
    row ends with a clear error, the rows beside it finish as they would alone."""
    from specrt.runtime.batching import BatchEngine, Request

    late = Grammar.regex(LATE_REGEX)
    loopy_gen.vocabulary().matcher(late)  # its first tokens pass
    with pytest.raises(SpecrtError, match="could not be followed"):
        loopy_gen.generate_ids([[5, 6, 7]], 20, grammar=late)
    spec = SpeculativeDecoder(loopy_gen, make_proposer(method), make_policy(4))
    with pytest.raises(SpecrtError, match="regex could not be followed to the end of the answer: .*too many"):
        spec.generate_ids([[5, 6, 7]], 20, grammar=late)
    free = spec.generate_ids([[9, 10, 11]], 20)[0].token_ids
    engine = BatchEngine(spec, max_batch=2)
    engine.submit(Request([5, 6, 7], 20, grammar=late))
    engine.submit(Request([9, 10, 11], 20))
    events = []
    while not engine.idle:
        events += engine.step()
    failed = [e for e in events if e.error is not None]
    assert [e.rid for e in failed] == [0] and "too many expressions" in failed[0].error
    done = [e.result for e in events if e.result is not None]
    assert len(done) == 1 and done[0].token_ids == free
