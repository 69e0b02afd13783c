"""`specrt bench` end to end on the tiny model (no transformers baseline): table, JSON, PNG."""

import json

import pytest
from click.testing import CliRunner

from specrt.benchmark import load_prompts
from specrt.cli import main
from specrt.errors import SpecrtError


def test_bench_command_writes_table_json_and_plot(tiny_artifacts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(p)
            for p in [
                {"class": "chat", "prompt": "w5 w6 w7"},
                {"class": "code_edit", "prompt": "w9 w10 w11 w9 w10 w11 w9 w10"},
            ]
        )
    )
    out = tmp_path / "results"
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "--artifacts",
            str(tiny_artifacts),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--quick",
            "--no-transformers",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "ngram N=auto" in r.output and "suffix N=4" in r.output and "sweep (ngram, code_edit)" in r.output
    result = json.loads(next(out.glob("speculative-*.json")).read_text())
    assert result["machine"]["cpu"] and result["versions"]["onnxruntime"] and result["date"]
    assert set(result["summary"]) == {"chat", "code_edit"}
    for entry in result["summary"]["code_edit"].values():
        n, total = entry["same_as_plain"].split("/")
        assert n == total  # greedy speculative output equals plain in every run
    assert len(result["sweep"]["measured"]) == len(result["sweep"]["predicted"]) == 2
    png = next(out.glob("speedup-vs-n-*.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_prompt_file(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "no class"}\n')
    with pytest.raises(SpecrtError, match="bad.jsonl:1: each line must be a JSON object with 'class' and 'prompt'"):
        load_prompts(p)
    with pytest.raises(SpecrtError, match="not found"):
        load_prompts(tmp_path / "none.jsonl")


def test_the_bench_harness_serves_and_stops(tiny_artifacts, tmp_path):
    """bench/harness.py: the envelope every result starts with, and a server that answers
    /health before the script measures it and is gone after."""
    import json
    import sys
    import urllib.request
    from pathlib import Path

    pytest.importorskip("fastapi", reason="fastapi is not installed (the server extra)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from harness import envelope, running_server

    env = envelope("numpy", threads=2)
    assert set(env) == {"date", "commit", "machine", "versions"} and env["machine"]["threads"] == 2
    assert len(env["commit"].partition("+")[0]) == 40  # this checkout's HEAD (a git checkout here)
    assert "numpy" in env["versions"]
    with running_server(tiny_artifacts, ["--max-batch", "2"], log=tmp_path / "server.log") as base:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
            assert json.load(r)["data"][0]["object"] == "model"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/health", timeout=2)


def test_head_variants_follow_the_draft_registry(tmp_path):
    """specrt bench --drafts runs every method with weights whose `make drafts` directory has an
    engine (read from DRAFT_METHODS: a new family needs no edit here): chains and trees for
    the tree-taking heads, auto on each head it takes, Medusa and
    a draft model as they draft."""
    from specrt.benchmark import SpecBenchConfig, head_variants
    from specrt.layout import HeadLayout

    for method in ("eagle3", "peagle", "medusa"):
        HeadLayout(tmp_path / method).ort_engine().mkdir(parents=True)
    logged = []
    cfg = SpecBenchConfig(engine_dir=tmp_path, checkpoint=None, prompts=tmp_path, out_dir=tmp_path, drafts=tmp_path)
    got = [(label, method, opts.get("tree")) for label, method, opts in head_variants(cfg, logged.append)]
    assert got == [
        ("auto+eagle3", "auto", cfg.tree),
        ("auto+peagle", "auto", cfg.tree),
        ("auto+medusa", "auto", None),  # Medusa drafts its own tree of choices
        ("eagle3 chain", "eagle3", None),
        ("eagle3 tree", "eagle3", cfg.tree),
        ("peagle chain", "peagle", None),
        ("peagle tree", "peagle", cfg.tree),
        ("medusa", "medusa", None),
    ]
    assert any("skipped eagle chain, eagle tree" in line for line in logged)


def test_policy_bench_runs_on_a_virtual_clock(tiny_artifacts):
    """bench/bench_policy.py: a generation on the virtual clock is a function of the policy alone
    (the same seconds twice, noise included: it is seeded); on the replay target it emits the
    recorded answer; an ablation runs the same tokens on another clock reading, and the
    heuristics are restored after it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from specrt.runtime.generator import Generator
    from specrt.runtime.policy import CostModel
    from specrt.runtime.target import Target

    from bench_policy import VirtualClock, engine_costs, patched, run_virtual
    from replay import ReplayBackend

    curve = engine_costs(tiny_artifacts)["f32"]
    assert sorted(curve) == [1, 2, 3, 5, 9, 17]
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    gen.eos_ids = frozenset()
    ids = [5, 6, 7, 8] * 6  # repetitive: the suffix draft proposes
    plain = gen.generate_ids([ids], 40)[0].token_ids
    replay = Target(ReplayBackend({tuple(ids): plain}, gen.config.vocab_size, (), step_ms=curve))
    seconds = []
    for target in (gen, replay, replay):
        res, s = run_virtual(target, "suffix", ids, 40, VirtualClock(curve, 0.01, 0.05, seed=3))
        assert res.token_ids == plain
        seconds.append(s)
    assert seconds[1] == seconds[2] > 0
    counts, backed = CostModel._counts, CostModel.backed
    restore = patched({"calibration", "spike", "trust", "gate", "pooling"})
    try:
        res, _ = run_virtual(replay, "suffix", ids, 40, VirtualClock(curve, 0.01, 0.05, seed=3), ("hindsight",))
    finally:
        restore()
    assert res.token_ids == plain
    from specrt.runtime import estimators

    assert estimators.SPIKE == 3.0 and estimators.TRUST == 3  # restored
    assert CostModel._counts is counts and CostModel.backed is backed
    # --bursts: load periods in virtual time, the same for two clocks of one seed whatever their steps
    a, b = VirtualClock(curve, 0.0, 0.0, seed=4, bursts=True), VirtualClock(curve, 0.0, 0.0, seed=4, bursts=True)
    assert a.periods == b.periods and len(a.periods) > 10
    start, end, factor = a.periods[0]
    quiet = a.step(1, 1)
    b.now = (start + end) / 2
    assert 1.5 <= factor <= 3.0 and b.step(1, 1) == pytest.approx(quiet * factor)


def test_a_second_result_of_the_same_day_does_not_overwrite_the_first(tmp_path):
    from specrt.benchmark import write_result_json

    first = write_result_json({"run": 1}, tmp_path, "exact")
    second = write_result_json({"run": 2}, tmp_path, "exact")
    third = write_result_json({"run": 3}, tmp_path, "exact")
    assert first != second != third and second.name.endswith("-2.json") and third.name.endswith("-3.json")
    assert [json.loads(p.read_text())["run"] for p in (first, second, third)] == [1, 2, 3]
    # --out given as a file: that file (it made a folder of that name), then -2 beside it
    named = [write_result_json({"run": r}, tmp_path / "sub" / "exact-gemma.json", "exact") for r in (4, 5)]
    assert [p.name for p in named] == ["exact-gemma.json", "exact-gemma-2.json"] and named[0].is_file()
