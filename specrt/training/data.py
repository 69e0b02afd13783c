"""Training data for draft heads: the target's own answers, and its features over them, on disk.

    answers = generate_answers(gen, prompts, out / "answers.jsonl", max_new_tokens=256, batch=16)
    feats = cache_features(session, answers, out / "features")       # memory-mapped, resumable
    x = feats.sequence(17)                                            # (tokens, H*) float16

Self-distillation: a draft head learns to predict what the target itself says, so the answers
are the target's (greedy by default) to the prompt set, in its chat template. Both steps can be
interrupted and run again: finished work is kept and only the rest is done.

- answers.jsonl: one line per prompt (id, prompt_ids, answer_ids, finish_reason), appended and
  flushed as each answer finishes (in the order they finish); a line cut short by an
  interruption is dropped on the next run.
- features/: `features.npy`, a float16 array (all tokens of all sequences, H*) written through a
  memory map, `index.json` (per sequence: offset, length) and `done.json` (how many sequences are
  complete, written after each one). A sequence is its prompt and its answer; each position holds
  the target's hidden states there (the layers its step graph or model was built to return).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from specrt.artifacts import atomic_write_text, read_json_object
from specrt.errors import SpecrtError
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.session import StepSession
from specrt.training.prompts import Prompt


@dataclasses.dataclass(frozen=True)
class Answer:
    id: int
    prompt_ids: list[int]
    answer_ids: list[int]
    finish_reason: str

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def read_answers(path: str | Path) -> list[Answer]:
    """The complete lines of an answers file (a line cut short by an interruption is left out)."""
    return _read(Path(path))[0]


def _read(path: Path) -> tuple[list[Answer], bool]:
    """(complete answers, whether the file holds nothing else)."""
    if not path.is_file():
        return [], True
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecrtError(f"{path} cannot be read ({e}); delete it to make the answers again") from None
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(Answer(**json.loads(line)))
        except (ValueError, TypeError, RecursionError):
            if i == len(lines) - 1:
                break  # the last line of an interrupted run
            raise SpecrtError(
                f"{path}:{i + 1} is damaged (not an answer; only the last line can be cut short by an interruption); "
                f"delete that line to keep the other answers, or the file to make them all again"
            ) from None
    return out, len(out) == len(lines)


def generate_answers(
    gen: Generator,
    prompts: list[Prompt],
    path: str | Path,
    max_new_tokens: int = 256,
    batch: int = 8,
    sampling: SamplingParams = SamplingParams(),
    progress: bool = True,
) -> list[Answer]:
    """The target's answers to `prompts` (chat template applied), generated `batch` at a time on
    the continuous batching engine; answers already in `path` are kept and not generated again."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done, clean = _read(path)
    if not clean:  # drop the line an interruption cut short
        atomic_write_text(path, "".join(json.dumps(dataclasses.asdict(a)) + "\n" for a in done))
    have = {a.id: a for a in done}
    for p in prompts[:64]:  # the kept answers must answer these prompts (ids are positions in the set)
        if p.id in have and have[p.id].prompt_ids != gen.encode_prompt(p.prompt, chat=True):
            raise SpecrtError(
                f"{path} answers other prompts than this prompt set (prompt {p.id} differs); delete it or use "
                "another directory"
            )
    todo = [p for p in prompts if p.id not in have]
    from tqdm import tqdm

    from specrt.runtime.batching import BatchEngine, Request

    bar = tqdm(
        total=len(prompts), initial=len(prompts) - len(todo), desc="target answers", unit="prompt", disable=not progress
    )
    # a continuous batch: a row that finishes takes the next prompt at once, where a static batch
    # would wait for its longest answer (runtime/batching.py)
    engine = BatchEngine(gen, max_batch=batch)
    owner: dict[int, tuple[Prompt, list[int]]] = {}
    try:
        with open(path, "a") as fh:
            while todo or not engine.idle:
                while todo and len(owner) < batch:
                    p = todo.pop(0)
                    ids = gen.encode_prompt(p.prompt, chat=True)
                    # a sampled answer draws from its own stream, seeded by (seed, prompt id)
                    rng = None if sampling.seed is None else np.random.default_rng([sampling.seed, p.id])
                    owner[engine.submit(Request(ids, max_new_tokens, sampling, rng))] = (p, ids)
                for event in engine.step():
                    if event.result is None:
                        continue
                    p, ids = owner.pop(event.rid)
                    answer = Answer(p.id, ids, event.result.token_ids, event.result.finish_reason)
                    fh.write(json.dumps(dataclasses.asdict(answer)) + "\n")
                    fh.flush()  # a line at a time: an interruption loses at most the answer being written
                    done.append(answer)
                    bar.update(1)
                    if bar.n % 16 == 0:
                        os.fsync(fh.fileno())
                        bar.set_postfix(tokens=sum(len(a.answer_ids) for a in done))
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        engine.close()
    bar.close()
    order = {p.id: i for i, p in enumerate(prompts)}
    return sorted((a for a in done if a.id in order), key=lambda a: order[a.id])


class FeatureCacheMismatch(SpecrtError):
    """A feature directory holds the features of other sequences."""


class FeatureCache:
    """The target's features over a list of sequences, memory-mapped from disk."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index, self.done = _read_index(self.directory), _read_done(self.directory)
        self.offsets, self.lengths = index["offsets"], index["lengths"]
        self.array = _open_features(self.directory, "r")
        if self.done > len(self.lengths) or self.array.shape[0] != sum(self.lengths):
            raise SpecrtError(f"{self.directory}: done.json, index.json and features.npy disagree; {_REDO}")

    def __len__(self) -> int:
        return self.done

    def sequence(self, i: int) -> np.ndarray:
        """(length, H*) features of sequence i."""
        if not 0 <= i < self.done:
            raise IndexError(f"sequence {i} is not cached (done: {self.done})")
        return self.array[self.offsets[i] : self.offsets[i] + self.lengths[i]]


def cache_features(
    session: StepSession, answers: list[Answer], directory: str | Path, progress: bool = True
) -> FeatureCache:
    """Run every sequence (prompt + answer) through the target once and store its hidden states
    at every position; resumes where an earlier run stopped (the sequences must be the same)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lengths = [len(a.tokens) for a in answers]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist() if lengths else []
    index = {"ids": [a.id for a in answers], "offsets": offsets, "lengths": lengths}
    width = _feature_width(session)
    done = 0
    if (directory / "index.json").is_file() and (directory / "features.npy").is_file():
        if _read_index(directory) != index:
            raise FeatureCacheMismatch(
                f"{directory} caches features of other sequences; delete it or choose another directory"
            )
        done = _read_done(directory)
        array = _open_features(directory, "r+")
        if array.shape[1] != width:
            raise SpecrtError(f"{directory} caches features of width {array.shape[1]}, this target returns {width}")
    else:
        array = np.lib.format.open_memmap(
            directory / "features.npy", mode="w+", dtype=np.float16, shape=(sum(lengths), width)
        )
        atomic_write_text(directory / "index.json", json.dumps(index))
        atomic_write_text(directory / "done.json", json.dumps({"sequences": 0}))
    from tqdm import tqdm

    bar = tqdm(total=len(answers), initial=done, desc="target features", unit="seq", disable=not progress)
    for i in range(done, len(answers)):
        tokens = answers[i].tokens
        if len(tokens) > session.max_context:
            raise SpecrtError(
                f"sequence {answers[i].id} has {len(tokens)} tokens, the target's context holds {session.max_context}"
            )
        cache = session.new_cache(1, len(tokens))
        try:
            feats = session.prefill(cache, [tokens], hidden=True).hidden[0]
        finally:
            session.release(cache)
        array[offsets[i] : offsets[i] + lengths[i]] = feats.astype(np.float16)
        array.flush()
        atomic_write_text(directory / "done.json", json.dumps({"sequences": i + 1}))
        bar.update(1)
    bar.close()
    del array
    return FeatureCache(directory)


_REDO = "delete the directory and run again: the features are computed again from the answers, which are kept"


def _read_index(directory: Path) -> dict:
    index = read_json_object(directory / "index.json", SpecrtError, _REDO)
    fields = ("ids", "offsets", "lengths")
    if not all(isinstance(index.get(k), list) for k in fields) or len({len(index[k]) for k in fields}) != 1:
        raise SpecrtError(f"{directory / 'index.json'} is not a feature index (ids, offsets, lengths); {_REDO}")
    return index


def _read_done(directory: Path) -> int:
    """How many sequences are complete (done.json)."""
    done = read_json_object(directory / "done.json", SpecrtError, _REDO).get("sequences")
    if isinstance(done, bool) or not isinstance(done, int) or done < 0:
        raise SpecrtError(f'{directory / "done.json"} should hold {{"sequences": N}}, got {done!r}; {_REDO}')
    return done


def _open_features(directory: Path, mode: str) -> np.ndarray:
    """features.npy memory-mapped, its size checked first: numpy maps a file cut short in "r+"
    mode by growing it with zeros, which would train on zeros in silence."""
    path = directory / "features.npy"
    try:
        with open(path, "rb") as fh:
            fmt = np.lib.format
            read = fmt.read_array_header_1_0 if fmt.read_magic(fh) == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(fh)
            need = fh.tell() + int(np.prod(shape)) * dtype.itemsize
        if path.stat().st_size != need:
            raise ValueError(f"{path.stat().st_size} bytes, its header says {need}")
        return np.lib.format.open_memmap(path, mode=mode)
    except (OSError, ValueError) as e:
        raise SpecrtError(f"{path} is damaged ({e}); {_REDO}") from None


def _feature_width(session: StepSession) -> int:
    """H* of the target's hidden_states output (one token through it)."""
    cache = session.new_cache(1, 1)
    try:
        return int(session.prefill(cache, [[0]], hidden=True).hidden[0].shape[-1])
    finally:
        session.release(cache)
