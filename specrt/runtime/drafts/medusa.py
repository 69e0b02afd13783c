"""Medusa drafts: K trained heads (export/medusa.py) guess the next K tokens at once from the
target's last committed feature; their top-k candidates combine into a tree of choices.

The newest committed position j (the root's parent) has the target's feature f[j], which the
target itself turned into the root t[j+1]; head k's candidates are guesses for t[j+1+k], the
draft tokens at depth k. One batched head call drafts every row, whatever the tree's size (the
cost model sees a draft of constant cost). A path (r_1, ..., r_d) of the tree is the r_1-th
candidate of head 1, then the r_2-th of head 2 below it, ...; the tree comes from the heads'
training report (derived from their measured rank accuracies) or `medusa.default_tree`, in
best-first order, so the speculation policy's budget N keeps its N likeliest nodes.

Candidates are point masses (q = None): verification stays exact for greedy and sampling alike
(Medusa's "typical acceptance" is not used). A head trained for another target, or another
precision of it, is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.engines.head import open_head
from specrt.errors import SpecrtError
from specrt.families.medusa import MEDUSA, MEDUSA_INPUTS
from specrt.runtime.backends.base import Capabilities
from specrt.runtime.verification import DraftTree
from specrt.schema.head_io import check_head_target, feature_columns
from specrt.schema.medusa_tree import check_tree, default_tree


class MedusaProposer:
    name = MEDUSA
    needs_features = True
    cost_per_token = False  # one head call for any tree size
    lookup = False  # a head call: drafted only where the plan asks for a draft

    def __init__(
        self,
        draft_dir: str | Path,
        target: Capabilities,
        tree=None,
        threads: int = 0,
        verify: str = "auto",
    ):
        """draft_dir: a `specrt train-draft --method medusa` output; target: the target backend's
        capabilities; tree: paths of candidate ranks (default: the trained heads' own tree)."""
        self.head = open_head(draft_dir, threads, verify)
        m = self.head.manifest
        if m["head"]["method"] != MEDUSA:
            method = m["head"]["method"]
            raise SpecrtError(f"{draft_dir} holds a head of method {method}, not Medusa heads; use --draft {method}")
        check_head_target(m, target.checkpoint_hash, target.precision, str(draft_dir))
        self.cols = feature_columns(target.hidden_layers, m["head"]["layers"], m["config"]["hidden_size"])
        head = m["head"]
        trained = m.get("training", {}).get("tree")
        self.tree = check_tree(
            tree or trained or default_tree(head["num_heads"], head["top_k"]), head["num_heads"], head["top_k"]
        )
        # each path's parent's index in self.tree (-1: the root), fixed once
        index = {p: i for i, p in enumerate(self.tree)}
        self.parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in self.tree], np.int64)
        self.calls = 0

    def begin(self, rows, prompts, prefilled):
        pass

    def commit(self, rows, trees, verdicts, step):
        pass  # stateless: the next proposal reads the newest committed feature

    def end(self, rows, outputs):
        pass

    # auto's two verbs for a head member (runtime/drafts/auto.py): nothing to catch up (stateless),
    # and a draft that reads the newest committed feature as a proposal does
    def catch_up(self, inp) -> None:
        return None

    def draft(self, inp, pending=None) -> list[DraftTree]:
        return self.propose(inp)

    def propose(self, inp) -> list[DraftTree]:
        if inp.features is None:
            raise SpecrtError("Medusa drafts read the target's features; the runtime gave none")
        feats = np.stack([f[-1, self.cols] for f in inp.features]).astype(np.float32)
        logp, ids = self.head.run({MEDUSA_INPUTS[0]: feats})
        self.calls += 1
        n = min(inp.max_tokens, len(self.tree))
        trees = []
        for i, budget in enumerate(inp.budgets):
            keep = min(n, max(0, budget - 1))  # drafting past the token budget is wasted
            tokens = [int(ids[i, len(p) - 1, p[-1]]) for p in self.tree[:keep]]
            scores = np.array([float(np.exp(sum(logp[i, d, r] for d, r in enumerate(p)))) for p in self.tree[:keep]])
            trees.append(DraftTree(np.array(tokens, np.int64), self.parents[:keep], scores=scores))
        return trees
