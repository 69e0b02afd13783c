"""The target's features over its answers, on disk: recorded while it answers, or computed after.

    answers = generate_answers(gen, prompts, out / "answers.jsonl", features=out / "features")
    feats = cache_features(session, answers, out / "features")   # fills what was not recorded
    x = feats.sequence(17)                                          # (tokens - 1, H*) float16

A sequence is a prompt and its answer; its features are the target's hidden states (the layers
its step graph returns) at every position but the last: a position's feature predicts the tokens
after it, and the last one's are past the answer, where no draft family has a label. Those are
exactly the positions the target feeds while it answers (the prompt at prefill, then each
step's root), so the answering steps record them (`FeatureRecorder`) and no second pass over
the data is needed; answers made without recording get theirs from one prefill of the whole
sequence (`cache_features`), which is what the recording equals up to float rounding.

The directory is append-only and survives interruption:

- features.bin: float16 rows (H* wide), one block per sequence, in the order they were stored;
- records.jsonl: a line per block, written after its rows are on disk: the answer id, the
  block's first row and row count, and a hash of the sequence's tokens (a block of other tokens,
  e.g. of answers made again, is not used);
- meta.json: the row width and dtype.

A run that is cut short loses at most the block being written: a cut line and rows past the last
record are dropped once every check has passed: when the store is opened for a target whose row
width it checked (`FeatureStore(dir, width)`, as every reader of training data opens it), else
by the first append. Offsets come from the records, never from the file's size, and the drop
comes before any append, so a block is never written after stray bytes. The log is rewritten
to a temporary name and renamed; the rows are cut by one truncation to the length the records
account for (rows on disk before their record: nothing recorded is ever cut). A store opened
without a width check (its meta.json may have been edited) and one refused write nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from specrt.artifacts import atomic_write_text, read_json_object
from specrt.errors import SpecrtError
from specrt.runtime.session import StepSession

FORMAT = 2  # 1: one memory-mapped array over a fixed list of sequences (features.npy, index.json)
_REDO = "delete the directory and run again: the features are made again from the answers, which are kept"


class StaleFeatures(SpecrtError):
    """A feature directory in a format this version does not read (derived data: make it again)."""


def tokens_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:16]


class FeatureStore:
    """The append-only feature directory (module docstring)."""

    def __init__(self, directory: str | Path, width: int | None = None):
        """Open (or begin) the store; `width`: the row width the caller's target returns, checked
        against the store's before anything is read or written. What an interruption left is
        dropped here once that check has passed, else by the first `append` (module docstring)."""
        self.directory = Path(directory)
        if (self.directory / "index.json").exists() or (self.directory / "features.npy").exists():
            raise StaleFeatures(f"{self.directory} holds features in an older format; {_REDO}")
        self.bin, self.log = self.directory / "features.bin", self.directory / "records.jsonl"
        meta = self.directory / "meta.json"
        self.width: int | None = None
        if meta.is_file():
            m = read_json_object(meta, SpecrtError, _REDO)
            w = m.get("width")
            if m.get("format") != FORMAT or m.get("dtype") != "float16" or not isinstance(w, int) or w < 1:
                raise StaleFeatures(f"{meta} is not a feature store of format {FORMAT}; {_REDO}")
            self.width = w
        if width is not None and self.width is not None and self.width != width:
            raise SpecrtError(
                f"{meta} says its features are {self.width} wide, this target returns {width}: the store was made "
                f"for another target or its meta.json was edited; {_REDO}"
            )
        self.records: dict[int, dict] = {}  # answer id -> its newest block
        self._repair: list[str] | None = None  # the log's lines to keep, where an interruption cut it
        self._tidied = False
        self.rows = self._recover()
        if width is not None and self.width == width and self.directory.is_dir():
            self._tidy()

    def _recover(self) -> int:
        """Read the records, noting what an interruption left (a cut last line, rows past the last
        record: rows are on disk before their record) for `_tidy` to drop; returns the rows kept.
        A record whose rows are missing is damage, not an interruption."""
        if self.width is None or not self.log.is_file():
            return 0
        lines, rows = self.log.read_text().splitlines(keepends=True), 0
        size = self.bin.stat().st_size if self.bin.is_file() else 0
        for i, line in enumerate(lines):
            try:
                r = json.loads(line)
                ok = line.endswith("\n") and r["offset"] == rows and r["rows"] >= 0 and isinstance(r["tokens"], str)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                if i < len(lines) - 1:
                    raise SpecrtError(f"{self.log}:{i + 1} is damaged (only the last line can be cut); {_REDO}")
                self._repair = lines[:i]
                break
            rows += r["rows"]
            if rows * self.width * 2 > size:
                raise SpecrtError(
                    f"{self.bin} is damaged ({size} bytes, its records need {rows * self.width * 2}); {_REDO}"
                )
            self.records[r["id"]] = r
        return rows

    def _tidy(self) -> None:
        """Once, before the first write: drop a cut log line and rows past the last record (or
        every file of a store without a meta.json or records)."""
        self._tidied = True
        if self.width is None or not self.log.is_file():
            self.bin.unlink(missing_ok=True)
            self.log.unlink(missing_ok=True)
        if self._repair is not None:
            atomic_write_text(self.log, "".join(self._repair))
            self._repair = None
        if self.width is not None and self.bin.is_file() and self.bin.stat().st_size != self.rows * self.width * 2:
            with open(self.bin, "r+b") as fh:
                fh.truncate(self.rows * self.width * 2)
                os.fsync(fh.fileno())

    def has(self, answer_id: int, tokens: Sequence[int]) -> bool:
        r = self.records.get(answer_id)
        return r is not None and r["tokens"] == tokens_hash(tokens) and r["rows"] == len(tokens) - 1

    def append(self, answer_id: int, tokens: Sequence[int], features: np.ndarray) -> None:
        """Store a sequence's features (len(tokens) - 1 rows): the rows first, then their record."""
        if features.ndim != 2 or features.shape[0] != len(tokens) - 1:
            raise ValueError(f"{features.shape} features for {len(tokens)} tokens (want {len(tokens) - 1} rows)")
        if self.width is not None and features.shape[1] != self.width:
            raise SpecrtError(f"{self.directory} stores features {self.width} wide, these are {features.shape[1]}")
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self._tidied:
            self._tidy()
        if self.width is None:
            self.width = int(features.shape[1])
            meta = {"format": FORMAT, "dtype": "float16", "width": self.width}
            atomic_write_text(self.directory / "meta.json", json.dumps(meta) + "\n")
        with open(self.bin, "ab") as fh:
            fh.write(np.ascontiguousarray(features, dtype=np.float16).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        record = {"id": answer_id, "offset": self.rows, "rows": len(features), "tokens": tokens_hash(tokens)}
        with open(self.log, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
        self.records[answer_id] = record
        self.rows += len(features)


class FeatureCache:
    """The features of a list of answers, in its order, memory-mapped from a FeatureStore."""

    def __init__(self, store: FeatureStore, answers: Sequence):
        missing = [a.id for a in answers if not store.has(a.id, a.tokens)]
        if missing:
            raise SpecrtError(
                f"{store.directory} has no features for {len(missing)} of {len(answers)} answers "
                f"(ids {missing[:5]}...); run cache_features first"
            )
        self.blocks = [(store.records[a.id]["offset"], store.records[a.id]["rows"]) for a in answers]
        shape = (store.rows, store.width or 0)
        self.array = np.memmap(store.bin, np.float16, "r", shape=shape) if store.rows else np.zeros(shape, np.float16)

    def __len__(self) -> int:
        return len(self.blocks)

    def sequence(self, i: int) -> np.ndarray:
        """(tokens - 1, H*) features of sequence i."""
        offset, rows = self.blocks[i]
        return self.array[offset : offset + rows]


def cache_features(
    session: StepSession, answers: Sequence, directory: str | Path, progress: bool = True
) -> FeatureCache:
    """Every answer's features, in the answers' order: those already stored (recorded while
    answering, or by an earlier run) are kept; the rest come from one prefill of the sequence."""
    store = FeatureStore(directory, feature_width(session))
    todo = [a for a in answers if not store.has(a.id, a.tokens)]
    from tqdm import tqdm

    for a in tqdm(todo, desc="target features", unit="seq", disable=not progress or not todo):
        if len(a.tokens) > session.max_context:
            raise SpecrtError(
                f"sequence {a.id} has {len(a.tokens)} tokens, the target's context holds {session.max_context}"
            )
        cache = session.new_cache(1, len(a.tokens))
        try:
            feats = session.prefill(cache, [a.tokens], hidden=True).hidden[0]
        finally:
            session.release(cache)
        store.append(a.id, a.tokens, feats[:-1])
    return FeatureCache(store, answers)


def feature_width(session: StepSession) -> int:
    """H* of the target's hidden_states output (one token through it)."""
    cache = session.new_cache(1, 1)
    try:
        return int(session.prefill(cache, [[0]], hidden=True).hidden[0].shape[-1])
    finally:
        session.release(cache)


class FeatureRecorder:
    """A step observer of the batching engine (runtime/batching.py StepObserver) that keeps each
    row's features as the target computes them: the prompt's when it joins, each step's root and
    accepted nodes (plain decoding verifies the newest token and the floor's guess,
    SpeculativeDecoder.guess). When a row leaves, its features (every position but the last,
    which is never fed) wait under its prompt and output for `take`."""

    needs_features = True

    def __init__(self):
        self._rows: dict[int, tuple[tuple[int, ...], list[np.ndarray]]] = {}
        self._done: dict[tuple, list[np.ndarray]] = {}

    def joined(self, b: int, row, features: np.ndarray) -> None:
        self._rows[b] = (tuple(row.prompt), [np.asarray(features, np.float16)])

    def stepped(self, record) -> None:
        for r in record.rows:  # the root's and the accepted nodes' (a guess, forced tokens)
            kept = [0, *(1 + i for i in r.verdict.accepted)]
            self._rows[r.slot][1].append(record.out.hidden_states[r.slot, kept].astype(np.float16))

    def left(self, b: int, row, tokens) -> None:
        prompt, parts = self._rows.pop(b)
        self._done.setdefault((prompt, tuple(tokens)), []).append(np.concatenate(parts))

    def take(self, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
        """The features of the finished row that had this prompt and output."""
        key = (tuple(prompt), tuple(output))
        got = self._done[key].pop()
        if not self._done[key]:
            del self._done[key]
        return got
