"""A draft model: a smaller checkpoint with the target's tokenizer drafts chains autoregressively.

The draft is an ordinary step-graph engine (`specrt build-engines` of a smaller model of the
family, or the one `train-draft --method draft-model` distils) in its own session with its own
KV cache, batched across rows: each proposal feeds every row what the target committed since
the row's last proposal (at least the root) and then one token per drafted position, all rows
in one step. After verification `commit` rolls the cache back to what the target accepted
(the drafted tokens it rejected leave the cache; the accepted ones stay, as the next feed
starts after them).

Greedy requests draft the draft's argmax; sampled ones sample from the draft's distribution at
the request's settings, which goes to verification as q (exact either way). A draft whose
vocabulary is not the target's, or a distilled draft made for another target, is refused.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specrt.artifacts import MANIFEST, read_json_object
from specrt.errors import SpecrtError
from specrt.layout import ArtifactLayout, HeadLayout
from specrt.runtime.backends.base import Capabilities
from specrt.runtime.sampling import probs_from_logits, sample_from_probs
from specrt.runtime.session import StepSession
from specrt.runtime.verification import DraftTree

GROWTH = 64  # positions a new cache holds past what its rows need first
CATCH_UP = 16  # a row fed more tokens than this before a draft is prefilled on its own first


def is_draft_model(directory: str | Path) -> bool:
    """Whether `directory` holds a draft model: a step-graph ORT engine, or a build-engines (or
    `train-draft --method draft-model`) output with one (what `--draft auto --draft-dir` tells from
    a trained head's directory)."""
    from specrt.engines.ort import ENGINE_KIND

    directory = Path(directory)
    return _kind(directory) == ENGINE_KIND or _kind(ArtifactLayout(directory).ort_engine("cpu")) == ENGINE_KIND


def _kind(directory: Path) -> str | None:
    """The kind of artifact `directory` is, by its manifest (None: none there)."""
    manifest = directory / MANIFEST
    return read_json_object(manifest, SpecrtError, f"rebuild {directory}").get("kind") if manifest.is_file() else None


class DraftModelProposer:
    name = "draft-model"
    needs_features = False
    cost_per_token = True  # one draft step per drafted token
    lookup = False

    def __init__(
        self, draft_dir: str | Path, target: Capabilities, threads: int = 0, verify: str = "auto", lazy: bool = False
    ):
        """draft_dir: the draft's build-engines output (its engines/ort-cpu), or one of its ORT
        engines itself (a 4-bit one: engines/ort-cpu-gguf-a8); target: the target backend's
        capabilities (a distilled draft is checked against its checkpoint); lazy: a row's prompt
        is fed at the first draft for it, not when it begins (`begin`)."""
        from specrt.engines.ort import ENGINE_KIND, OrtOptions, load_ort_session
        from specrt.runtime.backends import OrtBackend

        engine = ArtifactLayout(draft_dir).ort_engine("cpu")
        if _kind(Path(draft_dir)) == ENGINE_KIND:
            engine = Path(draft_dir)
        if not Path(draft_dir).is_dir():
            raise SpecrtError(
                f"--draft-dir {draft_dir} does not exist: give a smaller model's build-engines --out directory, or "
                "distil one with specrt train-draft --method draft-model"
            )
        if not engine.is_dir():
            raise SpecrtError(
                f"{draft_dir} holds no draft model engine ({engine}); build one with specrt build-engines --model "
                f"SMALLER_CHECKPOINT --out {draft_dir}, or distil one with specrt train-draft --method draft-model"
            )
        session, manifest, provider = load_ort_session(engine, OrtOptions(intra_op_threads=threads), verify=verify)
        backend = OrtBackend.from_manifest(session, manifest, provider)
        if target.vocab_size is not None and backend.config.vocab_size != target.vocab_size:
            raise SpecrtError(
                f"draft model {draft_dir} has a vocabulary of {backend.config.vocab_size} tokens, the target's has "
                f"{target.vocab_size}: a draft model must share the target's tokenizer. Give a smaller model of the "
                "target's family, or distil one: specrt train-draft --method draft-model --model CHECKPOINT --out DIR"
            )
        report = HeadLayout(draft_dir).report  # a distilled draft's: names the target it was made for
        fix = f"train the draft again with specrt train-draft --method draft-model --out {draft_dir}"
        made_for = read_json_object(report, SpecrtError, fix).get("target", {}) if report.is_file() else {}
        theirs = made_for.get("checkpoint_hash") if isinstance(made_for, dict) else None
        if theirs and target.checkpoint_hash and theirs != target.checkpoint_hash:
            raise SpecrtError(
                f"draft model {draft_dir} was distilled for the target checkpoint {theirs[:19]}..., but the target "
                f"here is {target.checkpoint_hash[:19]}...; its vocabulary and training are that target's. Distil one "
                "for this target with: specrt train-draft --method draft-model --model CHECKPOINT --out DIR"
            )
        self.session = StepSession(backend, exact="near-ties")  # a draft need not be exact: no padding
        self.vocab_size = backend.config.vocab_size
        self.cache, self.lazy = None, lazy
        self._fed: dict[int, int] = {}  # row -> draft tokens the last proposal left in the own cache
        self.calls = 0  # draft steps
        # seconds spent prefilling long gaps (a row's prompt, or what the lookups' steps committed
        # while `auto` drafted with them): a cost of the row's text, paid once whenever the draft
        # next drafts for it, which auto leaves out of the draft's time per drafted token
        self.gap_seconds = 0.0
        self._live: set[int] = set()  # rows begun and not yet ended

    def begin(self, rows, prompts, prefilled):
        """Rows start (others may be running: continuous batching): the draft's cache grows to
        hold them and each prompt is prefilled on its row, or, `lazy`, fed at the first draft for
        the row (inside `--draft auto` a row the lookups serve then never costs the draft model a
        prefill: a 0.5B draft's is a third of a 1.5B target's). Alone it prefills here, as the
        target does: a prefill inside the first draft would count as drafting time, and the cost
        model, reading it per drafted token, turned the draft down (1.22 against 2.44 tokens a
        step on the 1.5B)."""
        width = prefilled.logits.shape[-1]
        if width != self.vocab_size:
            raise SpecrtError(
                f"the draft model's vocabulary has {self.vocab_size} tokens, the target's {width}: a draft model must "
                "share the target's tokenizer"
            )
        self._ensure(max(rows) + 1, max(len(p) for p in prompts) + GROWTH)
        for b, p in zip(rows, prompts):
            self.cache.lengths[b] = 0
            self._fed.pop(b, None)
            if not self.lazy:
                self.session.prefill(self.cache.rows(b, b + 1), [list(p)])
        self._live.update(rows)

    def propose(self, inp) -> list[DraftTree]:
        B = self.cache.batch
        feed = [[] for _ in range(B)]
        n = min(inp.max_tokens, max(0, max(inp.budgets) - 1))
        self._ensure(B, max(len(ctx) for ctx in inp.contexts) + n)
        for b, ctx in zip(inp.rows, inp.contexts):
            feed[b] = list(ctx[int(self.cache.lengths[b]) :])  # committed since the last proposal: the root at least
            if len(feed[b]) > CATCH_UP:  # a prompt, or a long gap: in prefill chunks, this row alone
                t = time.perf_counter()
                self.session.prefill(self.cache.rows(b, b + 1), [feed[b][:-1]])
                self.gap_seconds += time.perf_counter() - t
                feed[b] = feed[b][-1:]
        sampling = None if inp.sampling.greedy else inp.sampling
        rngs = dict(zip(inp.rows, inp.rngs))  # each row draws from its own
        tokens = {b: [] for b in inp.rows}
        qs = {b: [] for b in inp.rows}
        for k in range(n):
            logits = self.session.forward(self.cache, feed, last_only=True).logits[:, 0]
            self.calls += 1
            feed = [[] for _ in range(B)]
            for b in inp.rows:
                if sampling is None:
                    t = int(logits[b].argmax())
                else:
                    q = probs_from_logits(logits[b], sampling)
                    t = int(sample_from_probs(q, rngs[b]))
                    qs[b].append(q)
                tokens[b].append(t)
                if k + 1 < n:
                    feed[b] = [t]
        for b in inp.rows:
            self._fed[b] = max(n - 1, 0)  # the last drafted token was never fed
        return [
            DraftTree.chain(tokens[b][: max(0, budget - 1)], np.stack(qs[b][: max(0, budget - 1)]) if qs[b] else None)
            for b, budget in zip(inp.rows, inp.budgets)
        ]

    # auto's two verbs for a member (runtime/drafts/auto.py): the catch-up is the next draft's feed
    # (what the rows committed since their last proposal), so a row the lookups serve costs nothing
    def catch_up(self, inp) -> None:
        return None

    def draft(self, inp, pending=None) -> list[DraftTree]:
        return self.propose(inp)

    def _ensure(self, batch: int, positions: int) -> None:
        """A cache of at least `batch` rows and `positions` positions, the rows' entries kept. It
        grows by need (at least doubling), not to the engine's whole context: 32,768 positions of
        the 0.5B are 0.8 GB a row, and growing the batch a row at a time copied (so touched) all
        of it."""
        old = self.cache
        if old is not None and old.batch >= batch and old.capacity >= positions:
            return
        grown = positions if old is None else max(positions, 2 * old.capacity)
        capacity = min(grown, self.session.max_context + GROWTH)
        self.cache = self.session.new_cache(max(batch, 0 if old is None else old.batch), capacity)
        if old is not None:  # the running rows' entries move over
            held = min(old.capacity, self.cache.capacity)
            self.cache.keys[:, : old.batch, :, :held] = old.keys[:, :, :, :held]
            self.cache.values[:, : old.batch, :, :held] = old.values[:, :, :, :held]
            self.cache.lengths[: old.batch] = old.lengths
            self.session.release(old)

    def commit(self, rows, trees, verdicts, step):
        """Keep the root and the accepted drafts in the own cache; forget the rejected ones."""
        lengths = self.cache.lengths.copy()
        for b, tree, verdict in zip(rows, trees, verdicts):
            fed = min(self._fed.pop(b, 0), int(lengths[b]))
            lengths[b] = int(lengths[b]) - fed + min(len(verdict.accepted), fed)
        self.cache.rollback(lengths)

    def end(self, rows, outputs):
        self._live.difference_update(rows)
        if self.cache is not None and not self._live:
            self.session.release(self.cache)
            self.cache = None
