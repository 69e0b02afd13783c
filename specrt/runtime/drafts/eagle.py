"""EAGLE drafts: a trained head (EAGLE-1 or EAGLE-3) drafts chains or EAGLE-2 dynamic trees.

The head (export/draft_head.py) runs as its own small step graph in ONNX Runtime, with a KV
cache of its one layer. Head entry j reads (t[j+1], the target's features at j), so each
proposal first *catches up*: one batched call over the positions the target committed since the
row's previous proposal, whose last entry (the root's) gives the first draft token's
distribution. Later draft tokens read the head's own hidden state instead of a target feature:

    chain   one call per further token (the entry of token k gives token k+1);
    tree    EAGLE-2: a TreeBuilder per row (dynamic_tree.py) picks the frontier; one call per
            depth feeds every frontier node of every row, each attending to the committed
            entries and its own ancestors (a tree mask), and the builders rerank at the end.

Draft entries are discarded after each proposal (the cache keeps only target-fed entries): the
accepted tokens come back as committed positions with real target features at the next one,
which is what the head was trained on. Chains sample from the head's distribution (its q goes
to verification); tree children are the head's top-k (point masses), so both stay exact.

The head must match the target it drafts for (checkpoint, the layers it reads, the precision of
the target it was trained against); the constructor refuses it otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.engines.head import open_head
from specrt.errors import SpecrtError
from specrt.families.eagle import HEAD_INPUTS
from specrt.runtime.backends.base import Capabilities
from specrt.runtime.drafts.dynamic_tree import TreeBuilder
from specrt.runtime.sampling import SamplingParams, probs_from_logits, sample_from_probs
from specrt.runtime.verification import DraftTree
from specrt.schema.head_io import check_head_target, feature_columns

CONFIDENCE = SamplingParams(temperature=1.0)  # greedy requests: trees follow the head's softmax


class EagleProposer:
    needs_features = True
    cost_per_token = True  # one head call per drafted token (per depth for trees)
    lookup = False

    def __init__(
        self,
        draft_dir: str | Path,
        target: Capabilities,
        tree: tuple[int, int] | None = None,
        threads: int = 0,
        verify: str = "auto",
        method: str | None = None,
    ):
        """draft_dir: a `specrt train-draft` output; target: the target backend's capabilities
        (what the head is checked against); tree: (top_k, depth) for EAGLE-2 dynamic trees,
        None for chains; method: "eagle" or "eagle3" to insist on one."""
        self.head = open_head(draft_dir, threads, verify)
        m, self.d2t = self.head.manifest, self.head.draft_to_target
        check_head_target(m, target.checkpoint_hash, target.precision, str(draft_dir))
        cfg = m["config"]
        self.name = m["head"]["method"]
        if method is not None and method != self.name:
            raise SpecrtError(f"{draft_dir} holds an {self.name} head, not {method}; use --draft {self.name}")
        self.cols = feature_columns(target.hidden_layers, m["head"]["layers"], cfg["hidden_size"])
        self.V, self.C = cfg["vocab_size"], cfg["hidden_size"]
        self.kv_shape = (cfg["num_key_value_heads"], cfg["head_dim"])
        self.feature_width = m["head"]["feature_width"]
        self.parallel = int(m["head"].get("parallel", 0))  # a parallel head's mask depths (parallel.py)
        if tree is not None and (tree[0] < 1 or tree[1] < 1):
            raise SpecrtError(f"tree=(top_k, depth) needs both >= 1, got {tree}")
        self.tree_shape = tree
        self.manifest = m
        self._identity = len(self.d2t) == self.V and bool((self.d2t == np.arange(self.V)).all())
        self.k = self.v = None
        self.length = np.zeros(0, np.int64)  # per row: target-fed entries in the head's cache
        self._used: dict[int, int] = {}  # per row, during a proposal: slots used, draft entries included
        self._live: set[int] = set()  # rows begun and not yet ended
        self.calls = 0  # head forwards

    # -- the proposer contract ------------------------------------------------------------

    def begin(self, rows, prompts, prefilled):
        """Rows start (others may be running: continuous batching): the head's cache grows to
        hold them, and their entries start empty."""
        B = max(rows) + 1
        Hkv, D = self.kv_shape
        cap = max(len(p) for p in prompts) + 64
        if self.k is None or self.k.shape[0] < B or self.k.shape[2] < cap:
            old = self.k, self.v
            keep = 0 if old[0] is None else old[0].shape[0]
            cap = max(cap, 0 if old[0] is None else old[0].shape[2])
            B = max(B, keep)
            self.k = np.zeros((B, Hkv, cap, D), np.float32)
            self.v = np.zeros_like(self.k)
            if keep:
                self.k[:keep, :, : old[0].shape[2]], self.v[:keep, :, : old[1].shape[2]] = old
            self.length = np.concatenate([self.length[:keep], np.zeros(B - keep, np.int64)])
        self.length[list(rows)] = 0
        self._live.update(rows)

    def propose(self, inp):
        return self.draft(inp, self.catch_up(inp))

    def draft(self, inp, roots: dict) -> list[DraftTree]:
        """Trees for inp.rows (a subset of the rows caught up is fine) from their roots."""
        try:
            if self.tree_shape is None:
                trees = self._chains(inp, roots)
            else:
                trees = self._trees(inp, roots)
        finally:
            self._used.clear()  # draft entries are scratch: the next call writes over them
        # drafting past a row's token budget is wasted (the loop stops at it)
        return [t.truncate(max(0, budget - 1)) for t, budget in zip(trees, inp.budgets)]

    def commit(self, rows, trees, verdicts, step):
        pass  # draft entries were already dropped; accepted tokens come back as committed positions

    def end(self, rows, outputs):
        self._live.difference_update(rows)
        if not self._live:
            self.k = self.v = None
            self.length = np.zeros(0, np.int64)

    # -- drafting -------------------------------------------------------------------------

    def catch_up(self, inp) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Feed the positions committed since each row's previous proposal (one batched call);
        returns per row the root entry's (draft logits, hidden), from which `draft` goes on."""
        entries = {b: self._committed(b, ctx, feats) for b, ctx, feats in zip(inp.rows, inp.contexts, inp.features)}
        out = self._run(entries)
        for b in inp.rows:
            self.length[b] += len(entries[b])  # target-fed entries stay
        self._used.clear()
        return {b: (logits[-1], hidden[-1]) for b, (logits, hidden, _) in out.items()}

    def _committed(self, b: int, ctx, feats) -> list[tuple]:
        """Row b's entries for the positions committed since its previous proposal (`_run`'s form)."""
        committed = len(ctx) - 1
        start = int(self.length[b])
        if committed - start != len(feats):
            raise SpecrtError(
                f"row {b}: {len(feats)} feature rows for {committed - start} newly committed positions; the "
                "speculative loop and the EAGLE draft disagree (a bug)"
            )
        if committed == start:
            raise SpecrtError(f"row {b}: nothing committed since the previous proposal (a bug in the loop)")
        return [
            (ctx[j + 1], feats[i, self.cols], None, j, list(range(start)), "causal")
            for i, j in enumerate(range(start, committed))
        ]

    def _chains(self, inp, roots):
        greedy = inp.sampling.greedy
        rngs = dict(zip(inp.rows, inp.rngs))  # each row draws from its own
        tokens = {b: [] for b in inp.rows}
        qs = {b: [] for b in inp.rows}
        state = dict(roots)  # row -> (logits, hidden) of the newest entry
        slots = {b: [] for b in inp.rows}  # the chain's own entries so far
        for k in range(inp.max_tokens):
            for b in inp.rows:
                logits = state[b][0]
                if greedy:
                    t = int(self.d2t[int(logits.argmax())])
                else:
                    q = probs_from_logits(self._full(logits), inp.sampling)
                    t = int(sample_from_probs(q, rngs[b]))
                    qs[b].append(q)
                tokens[b].append(t)
            if k + 1 == inp.max_tokens:
                break
            entries = {}
            for b in inp.rows:
                committed = int(self.length[b])
                pos = committed + k  # token k+1 of the chain sits one past the root's entry (committed-1)
                entries[b] = [(tokens[b][-1], None, state[b][1], pos, list(range(committed)) + slots[b], "self")]
            out = self._run(entries)
            for b in inp.rows:
                logits, hidden, written = out[b]
                slots[b].append(written[0])
                state[b] = (logits[0], hidden[0])
        return [DraftTree.chain(tokens[b], np.stack(qs[b]) if qs[b] else None) for b in inp.rows]

    def _trees(self, inp, roots):
        top_k, depth = self.tree_shape
        conf = CONFIDENCE if inp.sampling.greedy else inp.sampling
        # trees grow in draft-vocabulary ids (a softmax over the draft vocabulary only: the rest
        # has probability 0), mapped to target ids when fed back and at the end
        builders = {b: TreeBuilder(probs_from_logits(roots[b][0], conf), top_k, inp.max_tokens) for b in inp.rows}
        node_hidden = {b: {-1: roots[b][1]} for b in inp.rows}  # candidate -> hidden of its entry
        node_slot = {b: {-1: None} for b in inp.rows}
        for _ in range(min(depth, inp.max_tokens) - 1):
            frontier = {b: builders[b].frontier() for b in inp.rows}
            if not any(frontier.values()):
                break
            entries = {}
            for b in inp.rows:
                committed = int(self.length[b])
                cands = builders[b].candidates
                entries[b] = []
                for n in frontier[b]:
                    c = cands[n]
                    ancestors, p = [], c.parent
                    while p >= 0:
                        ancestors.append(node_slot[b][p])
                        p = cands[p].parent
                    visible = list(range(committed)) + ancestors[::-1]
                    pos = committed - 1 + c.depth
                    token = int(self.d2t[c.token])
                    entries[b].append((token, None, node_hidden[b][c.parent], pos, visible, "self"))
            out = self._run(entries)
            for b in inp.rows:
                logits, hidden, written = out[b]
                probs = {}
                for i, n in enumerate(frontier[b]):
                    node_slot[b][n], node_hidden[b][n] = written[i], hidden[i]
                    probs[n] = probs_from_logits(logits[i], conf)
                builders[b].expand(probs)
        trees = [builders[b].tree() for b in inp.rows]
        for t in trees:
            t.tokens = self.d2t[t.tokens]
        return trees

    def _full(self, logits: np.ndarray) -> np.ndarray:
        """Draft-vocabulary logits over the target vocabulary (-inf outside)."""
        if self._identity:
            return logits
        full = np.full(self.V, -np.inf, np.float32)
        full[self.d2t] = logits
        return full

    # -- one head call ----------------------------------------------------------------------

    def _run(self, entries: dict) -> dict[int, tuple[np.ndarray, np.ndarray, list[int]]]:
        """One batched head forward. entries: row -> [(token, feature | None, own hidden | None,
        position, visible cache slots, "causal" | "self"[, mask depth])]; "causal": the row's new
        entries see each other causally (catch-up), "self": only themselves (draft entries); a
        mask depth d >= 1 makes a parallel head's mask entry (parallel.py). New entries are
        written to the cache after each row's used slots (`_used`, else `length`) and counted as
        used; the caller decides what stays (catch-up) and what is scratch (drafts). Returns per
        row (logits (n, Vd), hidden (n, C), the cache slots written)."""
        B = self.k.shape[0]
        Q = max(1, max((len(e) for e in entries.values()), default=1))
        base = {b: int(self._used.get(b, self.length[b])) for b in range(B)}
        P = max(base.values()) if base else 0
        self._ensure(P + Q)
        ids = np.zeros((B, Q), np.int64)
        feats = np.zeros((B, Q, self.feature_width), np.float32)
        own = np.zeros((B, Q, self.C), np.float32)
        from_draft = np.zeros((B, Q), bool)
        pos = np.zeros((B, Q), np.int64)
        mask = np.zeros((B, Q, P + Q), bool)
        depth = np.zeros((B, Q), np.int64)
        for b in range(B):
            rows = entries.get(b, [])
            for i in range(Q):
                mask[b, i, P + i] = True  # every entry (padding too) sees itself
            for i, (tok, feat, hid, p, visible, kind, *d) in enumerate(rows):
                ids[b, i], pos[b, i] = tok, p
                depth[b, i] = d[0] if d else 0
                if hid is not None:
                    own[b, i], from_draft[b, i] = hid, True
                elif feat is not None:  # a mask entry reads neither (its depth's parameters)
                    feats[b, i] = feat
                mask[b, i, visible] = True
                if kind == "causal":
                    mask[b, i, P : P + i + 1] = True
        past = (np.ascontiguousarray(self.k[:, :, :P]), np.ascontiguousarray(self.v[:, :, :P]))
        feeds = dict(zip(HEAD_INPUTS, (ids, feats, own, from_draft, pos, mask, *past)))
        if self.parallel:
            feeds["mask_depth"] = depth
        logits, hidden, pk, pv = self.head.run(feeds)
        self.calls += 1
        out = {}
        for b, rows in entries.items():
            n, s = len(rows), base[b]
            self.k[b, :, s : s + n] = pk[b, :, :n]
            self.v[b, :, s : s + n] = pv[b, :, :n]
            self._used[b] = s + n
            out[b] = (logits[b, :n], hidden[b, :n], list(range(s, s + n)))
        return out

    def _ensure(self, slots: int) -> None:
        """Grow the head's cache to hold `slots` entries per row."""
        cap = self.k.shape[2]
        if slots <= cap:
            return
        new = max(slots, 2 * cap)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = np.zeros((*old.shape[:2], new, old.shape[3]), np.float32)
            grown[:, :, :cap] = old
            setattr(self, name, grown)
