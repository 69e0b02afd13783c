"""Training data for draft heads: the target's own answers on disk (and, recorded on the way,
its features over them: training/features.py).

    answers = generate_answers(gen, prompts, out / "answers.jsonl", batch=16, features=out / "features")

Self-distillation: a draft head learns to predict what the target itself says, so the answers
are the target's (greedy by default) to the prompt set, in its chat template. It can be
interrupted and run again: finished work is kept and only the rest is done.

- answers.jsonl: one line per prompt (id, prompt_ids, answer_ids, finish_reason), appended and
  flushed as each answer finishes (in the order they finish); a line cut short by an
  interruption is dropped on the next run.
- features/ (when asked): the target's hidden states over each prompt and answer, stored as
  each answer finishes, before its line (training/features.py).
- runs.jsonl (`record_run`): one line per run that added answers, what made them (the command,
  the commit, the engine, the date) and how fast, so a corpus that later runs extend says how it
  was made.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from specrt.artifacts import atomic_write_text
from specrt.errors import SpecrtError
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
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
    features: str | Path | None = None,
    runs: str | Path | None = None,
) -> list[Answer]:
    """The target's answers to `prompts` (chat template applied), generated `batch` at a time on
    the continuous batching engine; answers already in `path` are kept and not generated again.
    `features`: a feature directory (training/features.py) that gets each new answer's features
    as the answering steps computed them (no second pass over the data). `runs`: a runs file
    that gets this run's line when it adds answers (`record_run`)."""
    t0 = time.perf_counter()
    from specrt.artifacts import source_commit

    commit = source_commit() if runs is not None else None  # the code that makes them, before it can change
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done, clean = _read(path)
    if not clean:  # drop the line an interruption cut short
        atomic_write_text(path, "".join(json.dumps(dataclasses.asdict(a)) + "\n" for a in done))
    have = {a.id: a for a in done}
    kept = len(done)
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
    recorder, store = None, None
    if features is not None and todo:
        from specrt.training.features import FeatureRecorder, FeatureStore

        # plain decoding, watched by a recorder that keeps the hidden states each step returns
        store, recorder = FeatureStore(features), FeatureRecorder()
    # a continuous batch: a row that finishes takes the next prompt at once, where a static batch
    # would wait for its longest answer (runtime/batching.py)
    engine = BatchEngine(gen, max_batch=batch, observers=(recorder,) if recorder else ())
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
                    if recorder is not None:  # before the answer's line: a kept answer has its features
                        store.append(p.id, answer.tokens, recorder.take(ids, answer.answer_ids))
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
        if runs is not None:  # an interrupted run (Ctrl-C) records what it added too
            seconds = time.perf_counter() - t0
            record_run(runs, gen, done[kept:], done, seconds, commit, batch=batch, max_new_tokens=max_new_tokens)
    order = {p.id: i for i, p in enumerate(prompts)}
    return sorted((a for a in done if a.id in order), key=lambda a: order[a.id])


def record_run(
    path: str | Path, gen: Generator, added: list[Answer], after: list[Answer], seconds: float, commit: str, **settings
):
    """Append what a run `added` (of the answers `after` it) to the runs file `path`: the command
    line, the source `commit` (source_commit() as the run began), the target's engine, the date,
    the answers and answer tokens added and their rate, and `settings` (batch, answer length).
    Nothing when it added nothing."""
    import datetime
    import shlex
    import sys

    if not added:
        return
    tokens = sum(len(a.answer_ids) for a in added)
    caps = gen.session.caps
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": commit,
        "engine": {"precision": caps.precision, "checkpoint_hash": caps.checkpoint_hash},
        "answers_added": len(added),
        "answer_tokens_added": tokens,
        "answers": len(after),
        "answer_tokens": sum(len(a.answer_ids) for a in after),
        "seconds": round(seconds, 1),
        "answer_tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else None,
        **settings,
    }
    with open(path, "a") as fh:  # a line at a time: a run cut short loses only its own line
        fh.write(json.dumps(record) + "\n")
