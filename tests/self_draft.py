"""A proposer with weights, written against the Proposer v2 contract: the target drafts for
itself through a second step session with its own KV cache.

It is what every learned draft (EAGLE, Medusa, a draft model) will look like to the loop: a
batched forward per draft token for all rows at once, sampling with the request's parameters
and randomness (q is the distribution each token was really drawn from), its own cache rolled
back in `commit` to what the target accepted, and the target's features read and checked.

- temperature_scale: the draft samples at the request's temperature times this (1.0: q = p, so
  every draft is accepted; other values make q differ from p, and rejections happen).
- check_features: ask for the target's features and check each handed-over row against the
  draft's own hidden states at the same positions (same model: they must agree).
- tree=(top_k, depth): draft EAGLE-2 dynamic trees (runtime/drafts/dynamic_tree.py) instead of
  chains: each depth re-evaluates the candidate tree in one tree-masked step of the own session
  (then rolled back), and a TreeBuilder per row picks what to expand and what to keep.
- keep_tree: in tree mode, feed the drafted tree into the own cache and keep it there (node i
  of the proposal at the slot after the root plus i, as a tree draft with a cache keeps its
  nodes); `commit` compacts the accepted path behind the root, reading each verified node's
  index in the proposal (`DraftTree.proposed`: the loop verifies trees depth first, so a
  verdict's node indexes are not the proposal's).

Every mode keeps the tokens its cache holds per row and checks, at each proposal, that they are
the committed context: a rollback that kept the wrong positions fails there.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrt.runtime.drafts.dynamic_tree import TreeBuilder
from specrt.runtime.sampling import SamplingParams, probs_from_logits, sample_from_probs
from specrt.runtime.session import StepSession
from specrt.runtime.verification import DraftTree


class SelfDraftProposer:
    name = "self"
    cost_per_token = True  # one batched forward per drafted token
    lookup = False

    def __init__(
        self,
        backend,
        temperature_scale: float = 1.0,
        check_features: bool = False,
        tree: tuple[int, int] | None = None,
        keep_tree: bool = False,
    ):
        self.session = StepSession(backend)
        self.session.cuts = ()  # a draft need not be exact: its trees may span the step cuts
        self.tree_shape = tree
        self.keep_tree = keep_tree
        self._tokens: dict[int, list[int]] = {}  # row -> the tokens its own cache holds, slot by slot
        self.moved = 0  # accepted nodes kept whose verified index was not their index in the proposal
        self._fed: dict[int, int] = {}  # row -> draft tokens left in the own cache by the last proposal
        self.widest = 0  # most children of a tree's root seen (tree mode)
        self.temperature_scale = temperature_scale
        self.needs_features = check_features
        self.cache = None
        self.proposals = 0  # propose() calls (the loop skips them on steps without a draft)
        self.features_checked = 0  # proposals whose handed-over features were compared
        self.rolled_back = 0  # drafted positions dropped from the own cache after verification
        self._hidden: dict[int, list[np.ndarray]] = {}  # row -> own hidden states of every cached position
        self.live: set[int] = set()  # rows begun and not yet ended

    def begin(self, rows, prompts, prefilled):
        """Rows start (others may be running: continuous batching): the own cache grows to hold
        them and each prompt is prefilled on its own row."""
        B = max(rows) + 1
        if self.cache is None or self.cache.batch < B:
            old = self.cache
            # the context and one draft beyond it (drafts are at most a few dozen tokens)
            self.cache = self.session.new_cache(max(B, 0 if old is None else old.batch), self.session.max_context + 64)
            if old is not None:
                self.cache.keys[:, : old.batch], self.cache.values[:, : old.batch] = old.keys, old.values
                self.cache.lengths[: old.batch] = old.lengths
        for i, (b, p) in enumerate(zip(rows, prompts)):
            self.cache.lengths[b] = 0
            self._fed.pop(b, None)
            self._tokens[b] = list(p)
            pre = self.session.prefill(self.cache.rows(b, b + 1), [list(p)], hidden=self.needs_features)
            if self.needs_features:
                self._hidden[b] = list(pre.hidden[0])
                assert prefilled.hidden is not None and np.allclose(prefilled.hidden[i], pre.hidden[0], atol=1e-4)
        self.live.update(rows)

    def propose(self, inp):
        B = self.cache.batch
        feed = [[] for _ in range(B)]
        for b, ctx in zip(inp.rows, inp.contexts):
            held = self._tokens[b]
            assert held == list(ctx[: len(held)]), f"row {b}: the own cache holds other tokens than the context"
            feed[b] = list(ctx[int(self.cache.lengths[b]) :])  # what the target committed since: at least the root
            held += feed[b]
        self.proposals += 1
        if self.needs_features:
            self._check(inp, feed)
        drafting = self._draft_params(inp.sampling)
        if self.tree_shape is not None:
            return self._propose_trees(inp, feed, drafting)
        rngs = dict(zip(inp.rows, inp.rngs))  # each row draws from its own
        tokens = {b: [] for b in inp.rows}
        qs = {b: [] for b in inp.rows}
        for k in range(inp.max_tokens):
            out = self.session.forward(self.cache, feed, last_only=True, hidden=self.needs_features)
            if self.needs_features:
                for b in inp.rows:
                    self._hidden[b].extend(out.hidden_states[b, : len(feed[b])])
            logits = out.logits[:, 0]
            feed = [[] for _ in range(B)]
            for b in inp.rows:
                if drafting is None:
                    t = int(logits[b].argmax())
                else:
                    q = probs_from_logits(logits[b], drafting)
                    t = int(sample_from_probs(q, rngs[b]))
                    qs[b].append(q)
                tokens[b].append(t)
                if k + 1 < inp.max_tokens:
                    feed[b] = [t]
                    self._tokens[b].append(t)
        for b in inp.rows:
            self._fed[b] = max(inp.max_tokens - 1, 0)  # the last draft token was never fed
        return [DraftTree.chain(tokens[b], np.stack(qs[b]) if qs[b] else None) for b in inp.rows]

    def _propose_trees(self, inp, feed, drafting):
        top_k, depth = self.tree_shape
        confidence = drafting or SamplingParams(temperature=1.0)  # greedy requests: the draft's softmax
        out = self.session.forward(self.cache, feed, last_only=True, hidden=self.needs_features)
        if self.needs_features:
            for b in inp.rows:
                self._hidden[b].extend(out.hidden_states[b, : len(feed[b])])
        builders = {
            b: TreeBuilder(probs_from_logits(out.logits[b, 0], confidence), top_k, inp.max_tokens) for b in inp.rows
        }
        for _ in range(depth - 1):
            frontier = {b: builders[b].frontier() for b in inp.rows}
            if not any(frontier.values()):
                break
            # every candidate so far, as a tree after the root, in one tree-masked step; then forgotten
            start = self.cache.lengths.copy()
            B = self.cache.batch
            tokens, shapes = [[] for _ in range(B)], [None] * B
            for b in inp.rows:
                cands = builders[b].candidates
                t = DraftTree(np.array([c.token for c in cands]), np.array([c.parent for c in cands]))
                tokens[b] = t.tokens.tolist()
                shapes[b] = (t.depths() - 1, t.ancestor_mask()[1:, 1:])
            step = self.session.forward(self.cache, tokens, shapes)
            self.cache.rollback(start)
            for b in inp.rows:
                builders[b].expand({n: probs_from_logits(step.logits[b, n], confidence) for n in frontier[b]})
        trees = [builders[b].tree() for b in inp.rows]
        for b, t in zip(inp.rows, trees):
            self._fed[b] = len(t) if self.keep_tree else 0  # the own cache ends at the root, or at the tree
        if self.keep_tree:  # the tree after the root, node i at slot root + 1 + i, kept
            B = self.cache.batch
            tokens, shapes = [[] for _ in range(B)], [None] * B
            for b, t in zip(inp.rows, trees):
                tokens[b], shapes[b] = t.tokens.tolist(), (t.depths() - 1, t.ancestor_mask()[1:, 1:])
                self._tokens[b] += tokens[b]
            step = self.session.forward(self.cache, tokens, shapes, hidden=self.needs_features)
            if self.needs_features:
                for b, t in zip(inp.rows, trees):
                    self._hidden[b].extend(step.hidden_states[b, : len(t)])
        self.widest = max([self.widest, *(len(t.children(-1)) for t in trees)])
        return trees

    def proposal_nodes(self, tree, verdict) -> list[int]:
        """The accepted nodes' indexes in the proposal, up to the first the proposal did not hold
        (a forced token, the floor's guess): those are the slots after the root to keep."""
        nodes = []
        for n in tree.proposed()[verdict.accepted].tolist():
            if n < 0:
                break
            nodes.append(n)
        self.moved += sum(n != v for n, v in zip(nodes, verdict.accepted))
        return nodes

    def commit(self, rows, trees, verdicts, step):
        """Keep the root and the accepted drafts in the own cache; forget the rest."""
        if self.keep_tree:
            return self._commit_tree(rows, trees, verdicts)
        lengths = self.cache.lengths.copy()
        for b, tree, verdict in zip(rows, trees, verdicts):
            fed_drafts = self._fed.pop(b, 0) if len(tree) else 0
            keep = int(lengths[b]) - fed_drafts + min(len(verdict.accepted), fed_drafts)
            self.rolled_back += int(lengths[b]) - keep
            lengths[b] = keep
            if self.needs_features:
                del self._hidden[b][keep:]
            del self._tokens[b][keep:]
        self.cache.rollback(lengths)

    def _commit_tree(self, rows, trees, verdicts):
        for b, tree, verdict in zip(rows, trees, verdicts):
            fed = self._fed.pop(b, 0)
            root = int(self.cache.lengths[b]) - fed - 1  # the root's slot; the proposal's nodes follow it
            kept = [root + 1 + n for n in self.proposal_nodes(tree, verdict)] if fed else []
            self.rolled_back += int(self.cache.lengths[b]) - (root + 1 + len(kept))
            self.cache.keep(b, root + 1, kept)
            for held in (self._tokens[b], self._hidden.get(b)):
                if held is not None:
                    held[root + 1 :] = [held[i] for i in kept]

    def end(self, rows, outputs):
        self.live.difference_update(rows)
        for b in rows:
            self._tokens.pop(b, None)
        if self.cache is not None and not self.live:
            self.session.release(self.cache)
            self.cache = None

    def _draft_params(self, sampling):
        if sampling.greedy:
            return None
        return dataclasses.replace(sampling, temperature=sampling.temperature * self.temperature_scale)

    def _check(self, inp, feed):
        """The features the loop handed over are the target's hidden states at the positions
        committed since the last proposal (the newest committed ones): where the own cache holds
        the same positions, the draft computed them itself and they must agree."""
        compared = False
        for b, ctx, feats in zip(inp.rows, inp.contexts, inp.features):
            committed = len(ctx) - 1  # the root is not committed yet
            first = committed - len(feats)  # position of the first handed-over feature
            end = min(committed, len(self._hidden[b]))
            if end > first:
                mine = np.stack(self._hidden[b][first:end])
                assert np.allclose(feats[: end - first], mine, atol=1e-4), (
                    "features are not the target's at the committed positions"
                )
                compared = True
        self.features_checked += compared
