"""Bad input to the CLI gets one line naming the problem and the fix (exit 2 for a usage error,
1 otherwise), before any slow work, and never a traceback or a silent success: options that
the chosen command or draft would leave unused, numbers out of range (NaN, infinity, negative,
zero), directories that hold another kind of artifact, a draft that cannot serve the target.
"""

import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.engines.build import BuildSpec, build_all

from conftest import random_model, save_checkpoint, tiny_hf_config


@pytest.fixture(scope="module")
def other_vocab_artifacts(tmp_path_factory):
    """build-engines output of a model with another vocabulary than the tiny target's."""
    cfg = tiny_hf_config(vocab_size=100)
    d = tmp_path_factory.mktemp("other-vocab")
    ckpt = save_checkpoint(random_model(cfg, seed=3), cfg, d / "ckpt")
    list(build_all(BuildSpec(checkpoint=ckpt, out=d / "art", tensorrt="off")))
    return d / "art"


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in r.output and not (r.exception and not isinstance(r.exception, SystemExit)), r.output
    return r


def last_line(r) -> str:
    return r.output.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "extra, message",
    [
        # the tree was silently ignored (Medusa refused it)
        (
            ["--draft", "lookahead", "--draft-tree", "4,6"],
            "--draft-tree is for --draft auto, eagle, eagle3, mtp, peagle",
        ),
        (["--draft", "auto", "--draft-tree", "4,6"], "shapes the head's drafts: give its --draft-dir too"),
        (["--draft", "suffix", "--draft-tree", "2,3"], "not --draft suffix"),
        (["--draft", "medusa", "--draft-dir", ".", "--draft-tree", "2,3"], "Medusa heads draft their own tree"),
        # a head given without --draft: plain decoding, the head silently unused
        (["--draft-dir", "."], "--draft-dir: for speculative decoding, so give --draft too"),
        (["--draft-tree", "4,6"], "--draft-tree: for speculative decoding"),
        (["--num-draft", "4", "--max-draft", "8"], "--num-draft, --max-draft: for speculative decoding"),
        (["--draft", "suffix", "--draft-dir", "."], "--draft-dir is for a draft with weights"),
    ],
)
def test_draft_options_that_would_go_unused_are_refused(tiny_artifacts, extra, message):
    r = run("generate", "--artifacts", tiny_artifacts, "--prompt", "w5", "--max-new-tokens", "2", *extra)
    assert r.exit_code == 2 and message in r.output, r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--request-timeout", "nan"], "'nan' is not a finite number"),  # started; nothing ever timed out
        (["serve", "--request-timeout", "inf"], "'inf' is not a finite number"),
        (["serve", "--request-timeout", "0"], "0.0 is not in (0.0, inf)"),
        (["serve", "--max-batch", "0"], "0 is not in the range x>=1"),
        (["serve", "--max-queue", "-1"], "-1 is not in the range x>=0"),
        # a pool the machine cannot hold (the server started, and would fill RAM before evicting)
        (["serve", "--prefix-cache-mb", "1000000000000"], "MiB is more than this machine's memory"),
        (["generate", "--threads", "-1"], "-1 is not in the range x>=0"),  # accepted before
        (["generate", "--max-draft", "0"], "0 is not in the range x>=1"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(args, message):
    """Said while the options are read: were one accepted, the missing artifacts would end the
    command at once (exit 1) rather than a server starting."""
    more = ["--port", "1"] if args[0] == "serve" else ["--prompt", "w5"]
    r = run(*args, "--artifacts", "/nonexistent-artifacts", *more)
    assert r.exit_code == 2 and message in r.output, r.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--opset", "0"], "ONNX opset 0 cannot be exported here"),  # torch's RuntimeError before
        (["--opset", "99"], "give --opset in that range (default 17)"),
        (["--hidden-layers", "99"], "hidden layers [99]: this model has layers 0 to 1"),  # a KeyError before
        (["--hidden-layers", "-2"], "give indices in that range"),
    ],
)
def test_export_options_out_of_range_are_one_line(tiny_checkpoint, tmp_path, extra, message):
    r = run("export", "--model", tiny_checkpoint, "--out", tmp_path / "onnx", *extra)
    assert r.exit_code == 1 and message in last_line(r) and not (tmp_path / "onnx").exists(), r.output


def test_a_draft_model_of_another_vocabulary_is_refused_before_serving(tiny_artifacts, other_vocab_artifacts):
    """It started, answered /health and failed every request with a 500."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", "--artifacts", tiny_artifacts, "--port", port, "--draft", "draft-model"]
    r = subprocess.run(
        [sys.executable, "-m", "specrt.cli", *map(str, args), "--draft-dir", str(other_vocab_artifacts)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "serving" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("Error: draft model") and "vocabulary of 100 tokens, the target's has 128" in last


@pytest.mark.parametrize(
    "extra, code, message",
    [
        # a report on float32 only, with no word about the engine asked for
        (["--report", "--schemes", "hqq"], 1, "has no engine of hqq (no "),
        (["--schemes", "hqq"], 2, "--schemes: options of the report; give --report too"),
        (["--report-tokens", "16"], 2, "--report-tokens: options of the report"),
        # "no manifest.json" where the directory is another kind of artifact
        (["--report", "--heads", "{art}"], 1, "engines/ort-cpu is a model's engine (build-engines output)"),
        (["--report", "--heads", "{art}/onnx"], 1, "is an artifact of kind 'onnx-step-graph', not a built draft"),
        (["--report", "--heads", "{ckpt}"], 1, "is a checkpoint, not a built draft head"),
    ],
)
def test_calibrate_report_inputs_are_checked_first(tiny_checkpoint, tiny_artifacts, extra, code, message):
    extra = [e.format(art=tiny_artifacts, ckpt=tiny_checkpoint) for e in extra]
    calibration = tiny_artifacts / "calibration"
    before = sorted(calibration.rglob("*")) if calibration.exists() else []
    r = run("calibrate", "--model", tiny_checkpoint, "--artifacts", tiny_artifacts, *extra)
    assert r.exit_code == code and message in last_line(r), r.output
    after = sorted(calibration.rglob("*")) if calibration.exists() else []
    assert after == before  # refused before the calibration set was made


@pytest.mark.parametrize(
    "make, code, message",
    [
        # a schema file that is not UTF-8 (was a UnicodeDecodeError traceback)
        (lambda p: p.write_bytes(b"\xff\xfe"), 2, "is not UTF-8 text (byte 0); save the schema as UTF-8 JSON"),
        # nested past what Python's JSON reader recurses into (was a RecursionError traceback)
        (lambda p: p.write_text("[" * 100000), 1, "the JSON schema nests too deeply to read; flatten it"),
        (lambda p: p.write_text("[" * 100000 + "]" * 100000), 1, "nests too deeply"),
    ],
)
def test_json_schema_files_that_cannot_be_read_are_one_line(tiny_artifacts, tmp_path, make, code, message):
    schema = tmp_path / "schema.json"
    make(schema)
    r = run("generate", "--artifacts", tiny_artifacts, "--prompt", "w5", "--max-new-tokens", 2, "--json-schema", schema)
    assert r.exit_code == code and message in r.output, r.output


def test_a_grammar_past_the_engines_limits_is_one_line(tiny_artifacts):
    """It compiles, then fails on its first token: one line naming the limit and the fix (was
    an error blaming a token, followed by ~20 lines of the grammar engine's state)."""
    r = run("generate", "--artifacts", tiny_artifacts, "--prompt", "w5", "--regex", "(a{1000}){1000}")
    assert r.exit_code == 1 and "regex cannot be used" in r.output and "make it smaller" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and len(r.output) < 600, r.output


@pytest.mark.parametrize("method", ["medusa", "eagle3", "peagle", "mtp", "auto", "draft-model"])
def test_a_draft_dir_that_does_not_exist_is_named(tiny_artifacts, tmp_path, method):
    """It was reported as a missing engines/ort-cpu inside it, with build-draft advice."""
    missing = tmp_path / "no-such-head"
    r = run("generate", "--artifacts", tiny_artifacts, "--prompt", "w5", "--draft", method, "--draft-dir", missing)
    assert r.exit_code == 1 and f"--draft-dir {missing} does not exist" in r.output, r.output
    assert "ort-cpu" not in r.output and "build-draft" not in r.output
