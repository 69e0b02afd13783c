"""The offline prompt set for draft-head training: reproducible, balanced over the benchmark's
classes, built from topics, Python's own documentation and source and synthetic records, with the
benchmark's prompts (and their texts) held out."""

import ast
import json
import re

import pytest

from specrt.errors import SpecrtError
from specrt.training.prompts import (
    CLASSES,
    TOPICS,
    benchmark_prompts,
    build_prompt_set,
    documented_objects,
    prompt_set_hash,
    read_prompt_set,
    short_functions,
    write_prompt_set,
)

from conftest import ROOT

BENCH = ROOT / "bench" / "prompts.jsonl"


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b, c = build_prompt_set(200, seed=1), build_prompt_set(200, seed=1), build_prompt_set(200, seed=2)
    assert a == b and prompt_set_hash(a) == prompt_set_hash(b)
    assert a != c and prompt_set_hash(a) != prompt_set_hash(c)
    assert build_prompt_set(50, seed=1) == a[:50]  # a longer set extends a shorter one


def test_classes_are_balanced_and_prompts_distinct():
    prompts = build_prompt_set(403, seed=0)
    counts = {k: sum(p.kind == k for p in prompts) for k in CLASSES}
    assert max(counts.values()) - min(counts.values()) <= 1 and set(CLASSES) == set(counts)
    assert len({p.prompt for p in prompts}) == len(prompts) == 403
    assert [p.id for p in prompts] == list(range(403))
    assert all(20 < len(p.prompt) < 2500 for p in prompts)
    assert len({p.source for p in prompts}) > 250  # many sources, not a few
    kinds = {p.source.split(":")[0] if ":" in p.source else "python" for p in prompts}
    assert kinds == {"topic", "python", "records", "sequence"}
    assert set(CLASSES) == {
        line.split('"class": "')[1].split('"')[0] for line in BENCH.read_text().splitlines() if line
    }


def test_the_benchmark_is_held_out():
    held_out = benchmark_prompts(BENCH)
    assert len(held_out) == 12
    prompts = build_prompt_set(300, seed=3, exclude=held_out + (build_prompt_set(1, seed=3)[0].prompt,))
    assert not set(held_out) & {p.prompt for p in prompts}
    assert prompts[0].prompt != build_prompt_set(1, seed=3)[0].prompt  # an excluded prompt is never drawn


def test_text_comes_from_the_standard_library_docs():
    objects = documented_objects()
    names = [q for _, q, _ in objects]
    assert names == sorted(names) and "textwrap.dedent" in names and "json.dumps" in names
    dedent = next(doc for _, q, doc in objects if q == "textwrap.dedent")
    prompts = [p for p in build_prompt_set(2000, seed=0) if p.source == "textwrap.dedent"]
    assert prompts and any("`textwrap.dedent`" in p.prompt or dedent.split(".")[0] in p.prompt for p in prompts)


def test_no_benchmark_text_is_a_training_source():
    """Held out means more than the exact prompts: no benchmark passage, program or record is
    quoted in a training prompt, and no topic is a benchmark subject."""
    bench = [json.loads(line)["prompt"] for line in BENCH.read_text().splitlines() if line]
    quoted = [part for b in bench for part in b.split("\n\n")[1:] if len(part) > 40]
    prompts = build_prompt_set(1000, seed=0)
    assert len(quoted) >= 8 and not any(q in p.prompt for q in quoted for p in prompts)
    for topic in TOPICS:
        assert not any(re.search(rf"\b{re.escape(topic)}\b", b, re.IGNORECASE) for b in bench), topic
    assert not {"ocean", "sky", "healthy"} & {w for t in TOPICS for w in t.split()}


def test_code_edits_quote_real_source_that_the_edit_applies_to():
    functions = {f.qualname: f for f in short_functions()}
    assert len(functions) > 300
    edits = [p for p in build_prompt_set(600, seed=0) if p.kind == "code_edit" and "```python" in p.prompt]
    assert len(edits) > 80
    for p in edits:
        f = functions[p.source]
        code = p.prompt.split("```python\n")[1].split("\n```")[0]
        assert code == f.source.rstrip() and ast.parse(code)  # the function as the library spells it
        ask = p.prompt.split("\n")[0]
        for pattern in (r"number (\d+) to", r"parameter `(\w+)`", r'string "([^"]+)"', r"function `(\w+)`"):
            named = re.search(pattern, ask)
            if named:  # what the edit names is in the code
                assert named.group(1) in code, (ask, named.group(1))


def test_write_and_read_back(tmp_path):
    prompts = build_prompt_set(40, seed=5)
    write_prompt_set(tmp_path / "p.jsonl", prompts)
    assert read_prompt_set(tmp_path / "p.jsonl") == prompts
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(SpecrtError, match="not a prompt set written by specrt"):
        read_prompt_set(tmp_path / "bad.jsonl")


def test_more_prompts_than_can_be_made_is_a_clear_error(monkeypatch):
    import specrt.training.prompts as prompts_module

    few = [f"Tell me about topic {i}." for i in range(30)]
    monkeypatch.setattr(prompts_module._Sources, "make", lambda self, kind, rng: (few[rng.integers(30)], "topic"))
    with pytest.raises(SpecrtError, match="only 30 distinct prompts can be made here"):
        build_prompt_set(100, seed=0)


def test_held_out_sequences_cover_every_class_alike():
    """Training holds out runs of 4 consecutive prompts, which (classes in turn) is one of each."""
    from specrt.training.eagle import held_out_ids

    prompts = build_prompt_set(1000, seed=0)
    held = held_out_ids(len(prompts))
    assert 40 <= len(held) <= 60
    counts = {k: sum(prompts[i].kind == k for i in held) for k in CLASSES}
    assert len(set(counts.values())) == 1, counts
    assert held_out_ids(40) == [36, 37, 38, 39] and held_out_ids(2) == [1]
