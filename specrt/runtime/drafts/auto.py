"""`auto`: per row and step, the copy draft (suffix or n-gram) whose draft promises the most.

Both lookups draft for every row on every step (a lookup each, drafts/base.py `lookup`). The row
gets the draft the cost model judges best by its evidence (`DraftInput.judge`: the speedup the
draft's most valuable prefix promises, from the acceptance learnt per method and match length,
runtime/policy.py); the others ride along as its `rivals`, so hindsight (runtime/hindsight.py)
reads how every method's drafts fare, whichever one was verified, and the judgement of each
stays current. Without a judge (a fixed N) the first method in order that drafted wins.

Why not one tree of both: the verification step pays for every position it computes, and the two
lookups mostly propose the same tokens where both match, so their union costs positions for
little. Why the choice is lossless: it reads only what was emitted before the step, so each step
verifies a tree fixed before the target is consulted, as any draft's; its trees are point masses.

Which text suits which: n-gram (the most recent copy of the last few tokens) wins where the answer
quotes its prompt in order (summaries), suffix (the prompt's and earlier answers' continuations
of the context's longest suffix, a tree) where the text repeats with variants (code edits, JSON).
"""

from __future__ import annotations

import collections

from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer
from specrt.runtime.verification import DraftTree


class AutoProposer:
    name = "auto"
    needs_features = False
    cost_per_token = False  # lookups: about the same for any length
    lookup = True  # its members are

    def __init__(self, methods: dict | None = None):
        # members must be lookups: their commit ignores the trees (the chosen method's)
        self.methods = methods or {"suffix": SuffixProposer(), "ngram": NgramProposer()}
        self.chosen = collections.Counter()  # trees given per method (for the benchmark)

    def begin(self, rows, prompts, prefilled):
        for method in self.methods.values():
            method.begin(rows, prompts, prefilled)

    def propose(self, inp: DraftInput) -> list[DraftTree]:
        per_method = [method.propose(inp) for method in self.methods.values()]
        names = list(self.methods)

        def value(tree: DraftTree) -> float:
            return inp.judge(tree.evidence, len(tree))[1] if inp.judge is not None else 0.0

        out = []
        for i in range(len(inp.rows)):
            offered = [(k, trees[i]) for k, trees in enumerate(per_method) if len(trees[i])]
            if not offered:
                out.append(DraftTree.empty())
                continue
            k, best = max(offered, key=lambda kt: (value(kt[1]), -kt[0]))  # ties: the first method
            best.rivals = tuple(tree for j, tree in offered if j != k)
            self.chosen[names[k]] += 1
            out.append(best)
        return out

    def commit(self, rows, trees, verdicts, step):
        for method in self.methods.values():
            method.commit(rows, trees, verdicts, step)

    def end(self, rows, outputs):
        for method in self.methods.values():
            method.end(rows, outputs)
