"""Training data for draft heads: the target's answers and its features, resumable on disk."""

import dataclasses
import json

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.backends.base import StepOutput
from specrt.runtime.generator import Generator
from specrt.runtime.row import Request, Row
from specrt.runtime.row_step import RowStep, StepRecord
from specrt.runtime.verification import DraftTree, Verdict
from specrt.training.data import generate_answers, read_answers
from specrt.training.features import FeatureCache, FeatureRecorder, FeatureStore, cache_features
from specrt.training.prompts import build_prompt_set


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


@pytest.fixture(scope="module")
def prompts():
    return build_prompt_set(10, seed=0)


def test_answers_are_the_targets_and_batching_changes_nothing(gen, prompts, tmp_path):
    answers = generate_answers(gen, prompts, tmp_path / "a.jsonl", max_new_tokens=12, batch=4, progress=False)
    assert [a.id for a in answers] == [p.id for p in prompts]
    for p, a in zip(prompts, answers):
        ids = gen.encode_prompt(p.prompt, chat=True)
        alone = gen.generate_ids([ids], 12)[0]
        assert (a.prompt_ids, a.answer_ids, a.finish_reason) == (ids, alone.token_ids, alone.finish_reason)
    # the file holds them in the order they finished
    assert sorted(read_answers(tmp_path / "a.jsonl"), key=lambda a: a.id) == answers


def test_answers_resume_after_an_interruption(gen, prompts, tmp_path, monkeypatch):
    full = generate_answers(gen, prompts, tmp_path / "full.jsonl", max_new_tokens=12, batch=3, progress=False)
    path = tmp_path / "cut.jsonl"
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:4]) + lines[4][:25])  # killed while writing the fifth line
    from specrt.runtime.batching import BatchEngine

    asked = []
    real = BatchEngine.submit
    monkeypatch.setattr(BatchEngine, "submit", lambda self, request: asked.append(request) or real(self, request))
    resumed = generate_answers(gen, prompts, path, max_new_tokens=12, batch=3, progress=False)
    assert resumed == full and len(asked) == 6  # only the 6 missing prompts were generated
    assert sorted(read_answers(path), key=lambda a: a.id) == full


def prefill_features(gen, tokens):
    kv = gen.session.new_cache(1, len(tokens))
    try:
        return gen.session.prefill(kv, [tokens], hidden=True).hidden[0]
    finally:
        gen.session.release(kv)


def close(got, expected):
    return np.abs(got.astype(np.float32) - expected).max() <= 2e-3 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("record", [True, False])
def test_features_are_the_targets_hidden_states(gen, prompts, tmp_path, record):
    """Recorded while answering (a continuous batch of 3, rows joining and leaving) or computed
    after by a prefill, each sequence's features are the target's hidden states of one prefill
    of prompt + answer at every position but the last, and recording changes no answer."""
    f = tmp_path / "f"
    answers = generate_answers(
        gen,
        prompts[:5],
        tmp_path / "a.jsonl",
        max_new_tokens=8,
        batch=3,
        progress=False,
        features=f if record else None,
    )
    assert answers == generate_answers(gen, prompts[:5], tmp_path / "plain.jsonl", max_new_tokens=8, progress=False)
    assert len(FeatureStore(f).records) == (5 if record else 0)
    cache = cache_features(gen.session, answers, f, progress=False)
    assert len(cache) == 5 and len(FeatureStore(f).records) == 5
    width = gen.config.hidden_size * len(gen.session.caps.hidden_layers)
    for i, a in enumerate(answers):
        expected = prefill_features(gen, a.tokens)[:-1]
        got = cache.sequence(i)
        assert got.dtype == np.float16 and got.shape == expected.shape == (len(a.tokens) - 1, width)
        assert close(got, expected)


def test_features_resume_and_skip_other_sequences(gen, prompts, tmp_path):
    """A store cut while writing keeps its whole blocks; an answer made again with other tokens
    gets its features again; an older format is refused with the fix."""
    answers = generate_answers(gen, prompts[:6], tmp_path / "a.jsonl", max_new_tokens=8, progress=False)
    full = cache_features(gen.session, answers, tmp_path / "full", progress=False)
    d = tmp_path / "cut"
    cache_features(gen.session, answers[:3], d, progress=False)
    lines = (d / "records.jsonl").read_text().splitlines(keepends=True)
    (d / "records.jsonl").write_text("".join(lines[:2]) + lines[2][:10])  # killed writing the third record
    with open(d / "features.bin", "ab") as fh:
        fh.write(b"\0" * 100)  # ... and rows of a block without its record
    assert len(FeatureStore(d).records) == 2
    resumed = cache_features(gen.session, answers, d, progress=False)
    assert all(np.array_equal(resumed.sequence(i), full.sequence(i)) for i in range(6))
    assert len((d / "records.jsonl").read_text().splitlines()) == 6  # the first two were kept
    other = [dataclasses.replace(answers[0], answer_ids=answers[0].answer_ids[:-1])] + answers[1:]
    again = cache_features(gen.session, other, d, progress=False)  # answer 0 changed: its block is made anew
    assert again.sequence(0).shape[0] == len(other[0].tokens) - 1
    assert len(FeatureStore(d).records) == 6 and np.array_equal(again.sequence(1), full.sequence(1))
    with pytest.raises(SpecrtError, match="no features for 1 of 6"):
        FeatureCache(FeatureStore(d), answers)  # the old answer 0's block is no longer the newest
    old = tmp_path / "old"
    old.mkdir()
    (old / "index.json").write_text("{}")
    with pytest.raises(SpecrtError, match="older format; delete the directory"):
        cache_features(gen.session, answers, old, progress=False)


def test_a_write_cut_short_is_trimmed_when_the_store_is_opened(gen, prompts, tmp_path):
    """Rows past the last record (a write cut short) are cut when a reader that checked the
    width opens the store, although it appends nothing; a later append lands at the records'
    offset, after an interruption that left a cut record line too."""
    answers = generate_answers(gen, prompts[:5], tmp_path / "a.jsonl", max_new_tokens=8, progress=False)
    full = cache_features(gen.session, answers, tmp_path / "full", progress=False)
    d = tmp_path / "f"
    cache_features(gen.session, answers[:3], d, progress=False)
    intact, log = (d / "features.bin").stat().st_size, (d / "records.jsonl").read_text()
    with open(d / "features.bin", "ab") as fh:
        fh.write(b"\1" * 1000)  # killed while writing a block's rows
    cache_features(gen.session, answers[:3], d, progress=False)  # reads only: every block is there
    assert (d / "features.bin").stat().st_size == intact and (d / "records.jsonl").read_text() == log
    with open(d / "features.bin", "ab") as fh:
        fh.write(b"\1" * 1000)
    with open(d / "records.jsonl", "a") as fh:
        fh.write('{"id": 3, "offs')  # ... and its record's line
    FeatureStore(d)  # without a width to check: nothing is written
    assert (d / "features.bin").stat().st_size == intact + 1000
    resumed = cache_features(gen.session, answers, d, progress=False)
    assert [r["offset"] for r in map(json.loads, (d / "records.jsonl").read_text().splitlines())] == [
        sum(len(a.tokens) - 1 for a in answers[:i]) for i in range(5)
    ]
    assert all(np.array_equal(resumed.sequence(i), full.sequence(i)) for i in range(5))
    assert (d / "features.bin").stat().st_size == (tmp_path / "full" / "features.bin").stat().st_size


def test_the_recorder_keeps_the_root_and_the_accepted_nodes():
    """A step may verify a guess or a grammar's forced tokens: the features of the root and of the
    accepted nodes are the committed positions', the rejected node's are not."""
    recorder = FeatureRecorder()
    recorder.joined(0, Row(0, Request([1, 2]), 3, None), np.zeros((2, 3)))
    hidden = np.arange(12, dtype=np.float32).reshape(1, 4, 3)  # root, three nodes
    step = StepOutput(None, hidden, None)
    row = RowStep(0, None, tree=DraftTree.chain([5, 6, 7]), verdict=Verdict([0, 1], 9))
    recorder.stepped(StepRecord(rows=[row], batch=1, positions=4, out=step))
    recorder.left(0, None, [5, 6, 9])
    kept = recorder.take([1, 2], [5, 6, 9])
    assert np.array_equal(kept[2:], hidden[0, :3]) and len(kept) == 5


def test_a_refused_store_is_left_as_it_was(gen, prompts, tmp_path):
    """A store whose meta.json names the wrong width is refused before anything is written (it
    was cut to the wrong width's rows first, and the rows were lost); fixed, it serves again."""
    answers = generate_answers(gen, prompts[:3], tmp_path / "a.jsonl", max_new_tokens=8, progress=False)
    d = tmp_path / "f"
    full = cache_features(gen.session, answers, d, progress=False)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    meta = d / "meta.json"
    right = meta.read_text()
    meta.write_text(right.replace(f'"width": {full.array.shape[1]}', '"width": 8'))
    edited = meta.read_bytes()
    with pytest.raises(SpecrtError, match="says its features are 8 wide, this target returns"):
        cache_features(gen.session, answers, d, progress=False)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == {**before, "meta.json": edited}
    FeatureStore(d)  # opening one (no width to check) writes nothing either
    assert (d / "features.bin").read_bytes() == before["features.bin"]
    meta.write_text(right)
    again = cache_features(gen.session, answers, d, progress=False)
    assert all(np.array_equal(again.sequence(i), full.sequence(i)) for i in range(3))


def test_held_out_prompts_share_no_source_with_training_and_keep_their_side():
    """The split is by source: no held-out prompt's source unit is a training prompt's (drawn
    records are their own units), about 1 in 20 is held out of a large set, a prompt's side does
    not change as the set grows, and a small set still holds some out (never all)."""
    from specrt.training.prompts import held_out_prompts, source_unit

    big = build_prompt_set(1200, seed=0)
    held = set(held_out_prompts(big))
    assert 0.02 * len(big) < len(held) < 0.1 * len(big)
    assert {p.kind for p in big if p.id in held} == {"chat", "code_edit", "summarization", "json"}
    trained = {source_unit(p) for p in big if p.id not in held}
    assert not [p for p in big if p.id in held and source_unit(p) in trained]
    # a shared source: held out whole (a split by prompt would put its rewordings on both sides)
    shared = [u for u in {source_unit(p) for p in big} if sum(source_unit(p) == u for p in big) > 1]
    assert any(source_unit(p) in shared for p in big if p.id in held)
    assert set(held_out_prompts(big[:300])) == {i for i in held if i < 300}
    for n in (2, 10, 40):
        small = held_out_prompts(big[:n])
        assert 1 <= len(small) <= min(4, n - 1)


def test_training_data_split_by_the_prompt_sets_sources(gen, prompts, tmp_path):
    """TrainingData.load with the prompt set splits the answers as held_out_prompts does."""
    from specrt.training.eagle import TrainingData
    from specrt.training.prompts import held_out_prompts, write_prompt_set

    answers = generate_answers(gen, prompts, tmp_path / "a.jsonl", 4, batch=4, progress=False, features=tmp_path / "f")
    feats = cache_features(gen.session, answers, tmp_path / "f", progress=False)
    write_prompt_set(tmp_path / "p.jsonl", prompts)
    hc = gen.session.caps.hidden_layers
    data = TrainingData.load(answers, feats, hc, gen.config.hidden_size, tmp_path / "p.jsonl")
    assert data.held_out_ids == sorted(held_out_prompts(prompts))
    assert len(data.train) + len(data.held_out) == len(prompts)


def test_an_interrupted_run_keeps_its_answers_and_records_them(gen, prompts, tmp_path, monkeypatch):
    """Ctrl-C during answering: the finished answers are kept, the run's line says how many it
    added, and the next run makes only the rest."""
    from specrt.runtime.batching import BatchEngine

    step, calls = BatchEngine.step, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", interrupted)
    path, runs = tmp_path / "a.jsonl", tmp_path / "runs.jsonl"
    with pytest.raises(KeyboardInterrupt):
        generate_answers(gen, prompts, path, 6, batch=2, progress=False, runs=runs)
    kept = read_answers(path)
    assert 0 < len(kept) < len(prompts)
    first = json.loads(runs.read_text())
    assert first["answers_added"] == first["answers"] == len(kept)
    monkeypatch.setattr(BatchEngine, "step", step)
    assert len(generate_answers(gen, prompts, path, 6, batch=2, progress=False, runs=runs)) == len(prompts)
    second = json.loads(runs.read_text().splitlines()[1])
    assert second["answers_added"] == len(prompts) - len(kept) and second["answers"] == len(prompts)


def test_a_spent_class_gives_way_to_the_others():
    """Past summarization's last distinct prompt (about the 5,785th) the set goes on with the
    other classes, every prompt distinct, and prompt i is the same for any set size."""
    from collections import Counter

    many = build_prompt_set(6200, seed=0)
    assert len({p.prompt for p in many}) == 6200
    kinds = Counter(p.kind for p in many[5800:])
    assert kinds["summarization"] == 0 and min(kinds[k] for k in ("chat", "code_edit", "json")) > 120
    assert build_prompt_set(300, seed=0) == many[:300]
