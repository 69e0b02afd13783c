"""`peagle`: a parallel EAGLE-3 head (P-EAGLE) drafts K tokens in one head call.

The head (export/parallel_head.py) is an EAGLE-3 head whose entries after the root's are mask
entries, one per draft depth, so one call feeds the positions committed since the row's last
proposal (their real features: the catch-up) and K - 1 mask entries behind them, and returns
the logits of all K draft tokens. An EAGLE-3 chain of K tokens costs a catch-up call and K - 1
more; on a CPU, where a call's fixed cost is most of a small head's time, that is the point.

    chain   draft token d from depth d's distribution (argmax, or drawn from the row's own
            generator with q going to verification: exact, since the q a token was drawn from
            is the one verification reads, whatever the tokens before it);
    tree    `--draft-tree TOP_K,DEPTH`: EAGLE-2's dynamic tree (dynamic_tree.py) grown without
            further calls: every node of depth d expands with depth d + 1's distribution (a
            depth's distribution does not depend on the tokens before it). Children are top-k
            point masses, so sampling stays exact.

Mask entries are scratch, like an EAGLE chain's entries: the head's cache keeps the target-fed
entries only, and the accepted tokens come back with their real features at the next call.
"""

from __future__ import annotations

import numpy as np

from specrt.families.parallel import PARALLEL
from specrt.runtime.drafts.dynamic_tree import TreeBuilder
from specrt.runtime.drafts.eagle import CONFIDENCE, EagleProposer
from specrt.runtime.sampling import probs_from_logits, sample_from_probs
from specrt.runtime.verification import DraftTree


class ParallelProposer(EagleProposer):
    cost_per_token = False  # one head call for any draft up to K tokens

    def __init__(self, draft_dir, target, tree=None, threads: int = 0, verify: str = "auto"):
        super().__init__(draft_dir, target, tree, threads, verify, method=PARALLEL)
        self.K = self.parallel + 1  # tokens one call drafts

    def catch_up(self, inp) -> dict:
        """The rows' entries to feed, as EagleProposer.catch_up makes them, not yet run: the
        draft's one call feeds them with the mask entries (so `auto` keeps its two verbs)."""
        return {b: self._committed(b, ctx, feats) for b, ctx, feats in zip(inp.rows, inp.contexts, inp.features)}

    def draft(self, inp, pending: dict) -> list[DraftTree]:
        """One call: each row's committed entries, then mask entries of depths 1..K-1 (as many
        as the draft needs), all causal; returns the chains or trees."""
        width = self.tree_shape[1] if self.tree_shape else inp.max_tokens
        n = max(1, min(self.K, inp.max_tokens, width))
        entries = {}
        for b in inp.rows:
            start = int(self.length[b])
            new = pending[b]
            root = new[-1][3]  # the root's entry position (its token's parent)
            masks = [(0, None, None, root + d, list(range(start)), "causal", d) for d in range(1, n)]
            entries[b] = new + masks
        try:
            out = self._run(entries)
        finally:
            self._used.clear()  # mask entries are scratch
        for b in inp.rows:
            self.length[b] += len(pending[b])  # the target-fed entries stay
        depths = {b: out[b][0][len(pending[b]) - 1 :] for b in inp.rows}  # (n, Vd): depth 1..n
        trees = self._chains(inp, depths) if self.tree_shape is None else self._trees(inp, depths)
        return [t.truncate(max(0, budget - 1)) for t, budget in zip(trees, inp.budgets)]

    def _chains(self, inp, depths):
        out = []
        for b, rng in zip(inp.rows, inp.rngs):
            if inp.sampling.greedy:
                out.append(DraftTree.chain(self.d2t[depths[b].argmax(-1)]))
                continue
            qs = [probs_from_logits(self._full(logits), inp.sampling) for logits in depths[b]]
            out.append(DraftTree.chain([int(sample_from_probs(q, rng)) for q in qs], np.stack(qs)))
        return out

    def _trees(self, inp, depths):
        top_k = self.tree_shape[0]
        conf = CONFIDENCE if inp.sampling.greedy else inp.sampling
        trees = []
        for b in inp.rows:
            probs = [probs_from_logits(logits, conf) for logits in depths[b]]
            builder = TreeBuilder(probs[0], top_k, inp.max_tokens)
            for p in probs[1:]:
                frontier = builder.frontier()
                if not frontier:
                    break
                builder.expand({node: p for node in frontier})
            tree = builder.tree()
            tree.tokens = self.d2t[tree.tokens]
            trees.append(tree)
        return trees
