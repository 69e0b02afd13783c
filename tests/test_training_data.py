"""Training data for draft heads: the target's answers and its features, resumable on disk."""

import json

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.generator import Generator
from specrt.training.data import FeatureCache, cache_features, generate_answers, read_answers
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


def test_features_are_the_targets_hidden_states(gen, prompts, tmp_path):
    answers = generate_answers(gen, prompts[:5], tmp_path / "a.jsonl", max_new_tokens=8, progress=False)
    cache = cache_features(gen.session, answers, tmp_path / "f", progress=False)
    assert len(cache) == 5
    for i, a in enumerate(answers):
        kv = gen.session.new_cache(1, len(a.tokens))
        expected = gen.session.prefill(kv, [a.tokens], hidden=True).hidden[0]
        got = cache.sequence(i)
        assert got.dtype == np.float16 and got.shape == expected.shape == (
            len(a.tokens),
            gen.config.hidden_size * len(gen.session.caps.hidden_layers),
        )
        assert np.abs(got.astype(np.float32) - expected).max() <= 2e-3 * max(1.0, np.abs(expected).max())
    with pytest.raises(IndexError):
        cache.sequence(5)


def test_features_resume_and_refuse_other_sequences(gen, prompts, tmp_path):
    answers = generate_answers(gen, prompts[:6], tmp_path / "a.jsonl", max_new_tokens=8, progress=False)
    full = cache_features(gen.session, answers, tmp_path / "full", progress=False)
    d = tmp_path / "cut"
    cache_features(gen.session, answers, d, progress=False)
    (d / "done.json").write_text(json.dumps({"sequences": 2}))  # as if killed after two sequences
    arr = np.load(d / "features.npy", mmap_mode="r+")
    arr[full.offsets[2] :] = 0  # ... so nothing after them was written
    arr.flush()
    del arr
    resumed = cache_features(gen.session, answers, d, progress=False)
    assert all(np.array_equal(resumed.sequence(i), full.sequence(i)) for i in range(6))
    with pytest.raises(SpecrtError, match="caches features of other sequences"):
        cache_features(gen.session, answers[:3], d, progress=False)
    assert len(FeatureCache(d)) == 6
