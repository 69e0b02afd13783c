"""Draft methods without weights: n-gram / prompt lookup and suffix decoding."""

import dataclasses
import heapq
import itertools
import time

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.drafts import DRAFT_METHODS, DraftInput, make_proposer
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixIndex, SuffixProposer
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.verification import DraftTree


def draft(proposer, contexts, n, rows=None):
    """One batched proposal (Proposer v2) for `contexts`; returns the trees."""
    rows = list(range(len(contexts))) if rows is None else rows
    inp = DraftInput(rows, contexts, n, [100] * len(rows), SamplingParams(), [np.random.default_rng(0)] * len(rows))
    trees = proposer.propose(inp)
    assert len(trees) == len(rows)
    return trees


def one(proposer, context, n, row=0):
    return draft(proposer, [context], n, [row])[0]


@pytest.mark.parametrize(
    "context, n_min, n_max, k, expected",
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 2, 4, 3, [4, 9, 1]),  # longest match "1 2 3"
        ([1, 2, 3, 4, 2, 3, 5, 2, 3], 2, 4, 2, [5, 2]),  # most recent of two "2 3" matches
        ([1, 2, 3, 4, 5], 2, 4, 3, []),  # no repeat
        ([7, 8, 7], 1, 3, 4, [8, 7]),  # unigram match, continuation runs to the end
        ([7, 8, 7], 2, 3, 4, []),  # ... not allowed with n_min = 2
        ([5, 6, 5, 6, 5, 6], 2, 2, 0, []),  # no budget
    ],
)
def test_ngram(context, n_min, n_max, k, expected):
    assert one(NgramProposer(n_min, n_max), context, k).tokens.tolist() == expected


def _scan(ctx, n_min, n_max, k):
    """The n-gram draft by a scan of the whole context (the reference for the index)."""
    L = len(ctx)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        hits = [s for s in range(L - n) if ctx[s : s + n] == ctx[L - n :]]
        if hits:
            return ctx[hits[-1] + n : hits[-1] + n + k]
    return []


def test_ngram_index_grows_with_the_context_and_finds_what_a_scan_finds():
    rng = np.random.default_rng(3)
    p = NgramProposer(2, 4)
    for row in (0, 1):  # two rows, each its own index; a row that begins again starts afresh
        ctx = rng.integers(0, 6, 20).tolist()
        p.begin([row], [ctx], None)
        for _ in range(60):
            assert one(p, ctx, 5, row).tokens.tolist() == _scan(ctx, 2, 4, 5)
            ctx = ctx + rng.integers(0, 6, int(rng.integers(1, 4))).tolist()
    p.begin([0], [[1, 2, 1]], None)
    assert one(p, [1, 2, 1, 2], 3, 0).tokens.tolist() == [1, 2]


class _Trie:
    """The reference the suffix index answers like: a trie of every substring of the sequences
    fed (none across a sequence's end), each node with its count."""

    def __init__(self):
        self.root = {}  # token -> [count, children]

    def feed(self, seq):
        for start in range(len(seq)):
            node = self.root
            for t in seq[start:]:
                child = node.setdefault(t, [0, {}])
                child[0] += 1
                node = child[1]

    def match(self, context, max_match):
        """(m, node) of the longest suffix of `context` (<= max_match) with a continuation."""
        for m in range(min(max_match, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - m :]:
                node = node.get(t, [0, None])[1]
                if node is None:
                    break
            if node:
                return m, node
        return 0, None

    @staticmethod
    def grow(children, budget, min_score):
        """Best-first by frequency, as the suffix draft grows its trees (ties: first seen first)."""
        tokens, parents, scores, tie, heap = [], [], [], itertools.count(), []

        def push(kids, parent, score):
            total = sum(c[0] for c in kids.values())
            for tok, c in kids.items():
                if score * c[0] / total >= min_score:
                    heapq.heappush(heap, (-score * c[0] / total, next(tie), tok, c[1], parent))

        push(children, -1, 1.0)
        while heap and len(tokens) < budget:
            neg, _, tok, kids, parent = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            push(kids, len(tokens) - 1, -neg)
        return tokens, parents, scores


def test_suffix_index_proposes_the_trees_a_trie_of_every_substring_would():
    """Matches and trees of the index against a trie of every substring (fed whole sequences,
    none across their ends): the request's own context, and earlier sequences."""
    rng = np.random.default_rng(5)
    for _ in range(150):
        index, trie = SuffixIndex(), _Trie()
        for _ in range(int(rng.integers(0, 3))):  # earlier sequences
            seq = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()
            index.extend(seq)
            index.end_sequence()
            trie.feed(seq)
        ctx = rng.integers(0, 4, int(rng.integers(1, 40))).tolist()
        index.extend(ctx)
        trie.feed(ctx)
        for max_match in (1, 3, 32):
            m, ends = index.match(ctx, max_match)
            want_m, node = trie.match(ctx, max_match)
            assert m == want_m
            if m:
                budget = int(rng.integers(1, 12))
                tree = index.grow(ends, budget, 0.05)
                tokens, parents, scores = _Trie.grow(node, budget, 0.05)
                assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
                np.testing.assert_allclose(tree.scores, scores, rtol=1e-12)


def test_suffix_index_matches_none_across_a_sequence_end():
    index = SuffixIndex()
    index.extend([1, 2])
    index.end_sequence()
    index.extend([3, 1, 2])  # "1 2" occurred, but only at the end of a sequence: no continuation
    assert index.match([3, 1, 2], 8) == (0, [])
    index.extend([5])
    assert index.match([9, 1, 2], 8) == (2, [5])  # the "1 2" of the current sequence, followed by 5


def test_suffix_tree_proposal_scores_by_frequency():
    p = SuffixProposer(spec_factor=4.0, min_score=0.05)
    # "a b" is followed by "c" three times and by "d" once
    ctx = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 4, 6, 1, 2]
    p.begin([0], [ctx], None)
    tree = one(p, ctx, 6)
    assert tree.tokens[0] == 3 and tree.parents[0] == -1
    assert abs(tree.scores[0] - 0.75) < 1e-9
    assert 4 in tree.tokens[tree.parents == -1]  # the less frequent branch is in the tree too
    assert len(tree) <= 6 and (np.diff(tree.scores[tree.parents == -1]) <= 0).all()


def test_suffix_budget_follows_match_length():
    p = SuffixProposer(spec_factor=1.0, min_score=0.0)
    ctx = [5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 5]  # the match "5" has length 1
    p.begin([0], [ctx], None)
    assert len(one(p, ctx, 8)) == 1


def test_suffix_learns_from_earlier_outputs():
    p = SuffixProposer()
    p.begin([0], [[1, 2]], None)
    p.end([0], [[10, 11, 12, 13, 14, 15]])
    p.begin([0], [[40, 41]], None)
    ctx = [40, 41, 10, 11, 12]
    tree = one(p, ctx, 8)
    assert tree.tokens.tolist()[:3] == [13, 14, 15]


def test_suffix_request_trie_follows_growing_context():
    p = SuffixProposer()
    p.begin([0], [[1, 2, 3, 4]], None)
    assert len(one(p, [1, 2, 3, 4], 4)) == 0
    tree = one(p, [1, 2, 3, 4, 1, 2], 4)  # the two new tokens are fed on the way
    assert tree.tokens.tolist()[:2] == [3, 4]


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_one_call_drafts_for_every_row_and_keeps_rows_apart(method):
    """Proposer v2: one propose() for the batch, one tree per row, each from its own context."""
    p = make_proposer(method)
    a, b = [1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8]
    p.begin([0, 1], [a, b], None)
    trees = draft(p, [a, b], 4)
    assert trees[0].tokens.tolist()[:2] == [3, 4] and trees[1].tokens.tolist()[:1] == [9]
    assert [t.tokens.tolist()[:1] for t in draft(p, [b, a], 4, rows=[1, 0])] == [[9], [3]]
    assert not p.needs_features and not p.cost_per_token


def test_registry():
    from specrt.cli import DRAFT_CHOICES

    assert set(DRAFT_METHODS) >= {"ngram", "suffix", "lookahead"}
    assert DRAFT_CHOICES == ["none", *DRAFT_METHODS]  # the CLI offers what the registry holds
    assert make_proposer("ngram", n_max=3).n_max == 3
    with pytest.raises(SpecrtError, match="unknown draft method 'medusa2'; choose one of ngram, suffix"):
        make_proposer("medusa2")
    with pytest.raises(SpecrtError, match="bad options for draft method 'ngram'"):
        make_proposer("ngram", window=3)


def test_a_registry_entry_is_what_the_option_checks_read(monkeypatch):
    """The runner's checks come from the entry (needs a draft dir, takes a tree), not from lists
    of names elsewhere: a toy method registered here is checked like the built-in ones."""
    from specrt.errors import UsageError
    from specrt.runtime import drafts, runner
    from specrt.runtime.drafts import DraftMethod

    entry = DraftMethod(lambda **kw: None, "a toy", needs_draft_dir=True)
    monkeypatch.setitem(drafts.DRAFT_METHODS, "toy", entry)
    with pytest.raises(UsageError, match="--draft toy needs --draft-dir"):
        runner.check_options(runner.RunnerSpec(artifacts="a", draft="toy"))
    with pytest.raises(UsageError, match="--draft-tree is for"):
        runner.check_options(runner.RunnerSpec(artifacts="a", draft="toy", draft_dir="d", draft_tree="2,3"))


def test_an_unknown_backend_is_named_with_the_choices():
    """The backends are a registry (runner.BACKENDS): a name outside it, given through the Python
    API (the CLI's choices come from the same registry), is a UsageError naming the choices."""
    from specrt.errors import UsageError
    from specrt.runtime import runner

    with pytest.raises(UsageError, match="--backend 'onnx': choose one of ort, trt, torch"):
        runner.open_generator(runner.RunnerSpec(artifacts="a", backend="onnx"))


class Recording:
    """A draft that repeats each row's last token, too long on purpose, and records every call."""

    name, needs_features, cost_per_token, lookup = "recording", False, False, False

    def __init__(self):
        self.begun, self.proposed, self.committed, self.ended = [], [], [], []

    def begin(self, rows, prompts, prefilled):
        assert len(prompts) == len(rows) == prefilled.logits.shape[0]  # prefilled follows rows
        self.begun.append(list(rows))

    def propose(self, inp):
        self.proposed.append(list(inp.rows))
        assert len({id(r) for r in inp.rngs}) == len(inp.rows)  # every row its own generator
        return [DraftTree.chain(np.full(2 * inp.max_tokens, ctx[-1])) for ctx in inp.contexts]

    def commit(self, rows, trees, verdicts, step):
        self.committed.append([len(t) for t in trees])

    def end(self, rows, outputs):
        self.ended.append(list(rows))


def test_the_proposer_contract_as_stated(tiny_artifacts):
    """runtime/drafts/base.py: rows of one sampling setting come in one call, each with its own
    generator (a static batch's as the batching engine's); rows begin and end one by one; the
    loop cuts a tree to the plan and commit gets the cut tree."""
    from specrt.runtime.batching import BatchEngine, Request
    from specrt.runtime.generator import Generator
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    static = Recording()
    SpeculativeDecoder(gen, static, make_policy(3)).generate_ids(prompts, 8, SamplingParams(temperature=0.9, seed=1))
    assert static.begun == [[0], [1], [2]] and static.proposed[0] == [0, 1, 2]
    assert sorted(static.ended) == [[0], [1], [2]] and all(n <= 3 for step in static.committed for n in step)
    engine = Recording()
    requests = [Request(p, 8, SamplingParams(temperature=0.9 if i else 0.5, seed=i)) for i, p in enumerate(prompts)]
    BatchEngine(SpeculativeDecoder(gen, engine, make_policy(3)), max_batch=3).run(requests)
    assert [0] in engine.proposed and [1, 2] in engine.proposed  # by setting, not by seed
    assert sorted(engine.ended) == [[0], [1], [2]] and all(n <= 3 for step in engine.committed for n in step)


class _Fixed:
    """A lookup that always proposes the same chain."""

    needs_features = cost_per_token = lookup = False

    def __init__(self, tokens):
        self.tokens, self.ended = tokens, []

    def begin(self, rows, prompts, prefilled):
        pass

    evidence = ()

    def propose(self, inp):
        return [DraftTree.chain(self.tokens[: inp.max_tokens], evidence=self.evidence) for _ in inp.rows]

    def commit(self, rows, trees, verdicts, step):
        pass

    def end(self, rows, outputs):
        self.ended += list(rows)


def test_auto_gives_each_row_the_draft_the_judge_values_most_and_keeps_the_rest_as_rivals():
    """The judge (the cost model's, by evidence) picks between the members' drafts per row; ties
    go to the first member; the drafts not chosen ride along for hindsight; without a judge the
    first member that drafted wins; end reaches every member."""
    from specrt.runtime.drafts.auto import AutoProposer

    a, b = _Fixed([1, 2, 3]), _Fixed([7, 8, 9])
    a.evidence, b.evidence = ("a", 2), ("b", 2)
    auto = AutoProposer({"a": a, "b": b})
    auto.begin([0, 1], [[0], [0]], None)
    values = {("a", 2): 1.1, ("b", 2): 1.4}
    inp = DraftInput([0, 1], [[0], [0]], 3, [9, 9], SamplingParams(), [np.random.default_rng(0)] * 2)
    inp.judge = lambda evidence, n: (n, values[evidence])
    trees = auto.propose(inp)
    assert [t.tokens.tolist() for t in trees] == [[7, 8, 9]] * 2 and auto.chosen["b"] == 2
    assert [r.tokens.tolist() for r in trees[0].rivals] == [[1, 2, 3]]
    values[("a", 2)] = 1.4  # a tie: the first member
    assert auto.propose(inp)[0].tokens.tolist() == [1, 2, 3]
    inp.judge = None
    assert auto.propose(inp)[0].tokens.tolist() == [1, 2, 3]
    auto.end([0], [[7, 8]])
    assert a.ended == b.ended == [0]


class _Head:
    """A stand-in for an EAGLE head in auto: chains of its token, the features it was fed."""

    name, cost_per_token, needs_features = "eagle3", True, True

    def __init__(self):
        self.fed, self.sizes = {}, []

    def begin(self, rows, prompts, prefilled):
        pass

    def catch_up(self, inp):
        for b, feats in zip(inp.rows, inp.features):
            self.fed[b] = self.fed.get(b, 0) + len(feats)
        return {}

    def draft(self, inp, roots):
        self.sizes.append(inp.max_tokens)
        return [DraftTree.chain([5] * inp.max_tokens) for _ in inp.rows]

    def commit(self, rows, trees, verdicts, step):
        pass

    def end(self, rows, outputs):
        pass


def test_auto_head_drafts_where_no_copy_serves_when_judged_worth_its_time():
    """auto with a head: the head drafts where its judged speedup after its own time beats 1 and
    the row's copy draft; where no copy serves and the head does not pay, a short probe every
    PROBE_EVERY-th such step. Its drafts carry their own evidence,
    the copy draft rides along as a rival, and it catches up on every feature it skipped."""
    from specrt.runtime.drafts import auto as auto_module

    copy = _Fixed([1, 2, 3])
    copy.evidence = ("a", 2)
    head = _Head()
    auto = auto_module.AutoProposer({"a": copy}, head=head)
    auto.begin([0, 1], [[0], [0]], None)
    worth = {("a", 2): 0.4, ("eagle3", 0): 0.0}  # the copy (3 tokens) not worth it, the head unbacked
    # the cost model's judge (policy.py), the head's own time `own(n)` in the step's cost
    judge = lambda evidence, n, own=None: (  # noqa: E731
        n,
        (worth[evidence] + 0.2 * n) / (1.0 + (own(n) if own else 0.0)) if n else 1.0,
    )
    feats = [np.zeros((1, 4)), np.zeros((1, 4))]
    inp = DraftInput([0, 1], [[0], [0]], 4, [9, 9], SamplingParams(), [np.random.default_rng(0)] * 2, feats, judge)
    for step in range(1, auto_module.PROBE_EVERY + 1):
        trees = auto.propose(inp)
        probing = step % auto_module.PROBE_EVERY == 0
        assert [t.tokens.tolist()[:1] for t in trees] == ([[5]] * 2 if probing else [[1]] * 2)
    assert head.sizes == [auto_module.PROBE_DRAFT] and head.fed == {0: 8, 1: 8}
    assert trees[0].evidence == ("eagle3", 0) and [r.tokens.tolist() for r in trees[0].rivals] == [[1, 2, 3]]
    auto.head.times.observe(4, 0.001)  # the head's time: a tenth of a step at 4 tokens
    auto.head.step_s.append(0.01)
    worth[("eagle3", 0)] = 1.0  # read to pay: (1 + 0.2 * 4) / 1.1 at 4 tokens beats the copy's 1.0
    assert [t.tokens.tolist() for t in auto.propose(inp)] == [[5] * 4] * 2
    worth[("a", 2)] = 1.2  # a copy worth 1.8: more than the head after its time
    assert [t.tokens.tolist() for t in auto.propose(inp)] == [[1, 2, 3]] * 2
    auto.head.times.calls.clear()
    auto.head.times.observe(4, 0.02)  # the head now costs two steps: not worth it
    worth[("a", 2)] = 0.4
    assert [t.tokens.tolist()[:1] for t in auto.propose(inp)] == [[1]] * 2
    assert auto.chosen["eagle3"] == 4 and auto.chosen["a"] == 2 * auto_module.PROBE_EVERY - 2 + 4


def test_auto_probes_a_head_that_does_not_pay_less_and_less_often():
    """Where no copy serves and the head is judged not to pay, it probes every PROBE_EVERY such
    steps FIRST_PROBES times (what it needs to be judged), then after twice the last wait (to
    PROBE_MOST); once it pays, the wait starts again at PROBE_EVERY. A draft model's prefill of a
    long gap (`gap_seconds`) stays out of its time per drafted token."""
    from specrt.runtime.drafts import auto as auto_module

    copy = _Fixed([1, 2, 3])
    copy.evidence = ("a", 2)
    head = _Head()
    auto = auto_module.AutoProposer({"a": copy}, head=head)
    auto.begin([0], [[0]], None)
    worth = {("a", 2): 0.4, ("eagle3", 0): 0.0}
    judge = lambda evidence, n, own=None: (n, (worth[evidence] + 0.2 * n) / (1.0 + (own(n) if own else 0.0)))  # noqa: E731
    inp = DraftInput([0], [[0]], 4, [9], SamplingParams(), [np.random.default_rng(0)], [np.zeros((1, 4))], judge)
    probes = [step for step in range(1, 200) if auto.propose(inp)[0].tokens.tolist()[:1] == [5]]
    E, M = auto_module.PROBE_EVERY, auto_module.PROBE_MOST
    waits = [E] * auto_module.FIRST_PROBES + [2 * E, 4 * E]
    waits += [min(2 * waits[-1], M)] * 10
    expected = list(itertools.accumulate(waits))
    assert probes == [s for s in expected if s < 200]
    worth[("eagle3", 0)] = 1.0  # it pays: chosen, and the wait starts again
    auto.head.times.observe(4, 0.001)
    auto.head.step_s.append(0.01)
    assert auto.propose(inp)[0].tokens.tolist() == [5] * 4
    worth[("eagle3", 0)] = 0.0
    probes = [step for step in range(1, 30) if auto.propose(inp)[0].tokens.tolist()[:1] == [5]]
    assert probes == [E, 3 * E]

    class _Gappy(_Head):  # a draft model whose call spends most of its time prefilling a gap
        gap_seconds, needs_features = 0.0, False

        def catch_up(self, inp):
            return {}

        def draft(self, inp, roots):
            time.sleep(0.02)
            self.gap_seconds += 0.02
            return super().draft(inp, roots)

    member = auto_module.HeadMember(_Gappy())
    member.wanting = member.next_probe = 10**6  # probe now
    member.serve(dataclasses.replace(inp, features=None), [DraftTree.empty()], [None])
    assert member.times.calls[-1][1] < 0.01  # its 3 tokens' time without the 20 ms of prefill
