"""Files the draft pipeline reads back, damaged the way a disk, an interrupted copy or a person
would: each is one line naming the file and the fix (exit 1), never a traceback, and nothing
already made is lost (the refusal leaves every file as it was).

One finished train-draft run of the tiny target is copied for each case; the case damages one
file and runs the command that reads it again (train-draft resumes, build-draft re-exports).
"""

import json
import shutil

import pytest
from click.testing import CliRunner

from specrt.cli import main


def train_args(tiny_checkpoint, tiny_artifacts, out):
    args = ["train-draft", "--method", "eagle3", "--model", tiny_checkpoint, "--out", out]
    args += ["--artifacts", tiny_artifacts, "--prompts", "12", "--max-new-tokens", "8", "--epochs", "1"]
    return [str(a) for a in [*args, "--draft-vocab", "64", "--tensorrt", "off"]]


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tiny_artifacts, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "eagle3"
    r = CliRunner().invoke(main, train_args(tiny_checkpoint, tiny_artifacts, out))
    assert r.exit_code == 0, r.output
    return out


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert not (r.exception and not isinstance(r.exception, SystemExit)), f"{r.output}\n{r.exception!r}"
    assert "Traceback" not in r.output
    return r


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path):
    path.write_bytes(b"\x00garbage{")


def damage_second_answer(path):
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = "{not an answer\n"
    path.write_text("".join(lines))


def wrong_width(path):
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "width": 8}))  # a refusal that first cut features.bin to 8-wide rows


CASES = [
    # (file under the head's directory, damage, what the one line says)
    ("data/data.json", cut_in_half, "data.json is not valid JSON"),
    ("data/features/meta.json", garbage, "meta.json is not valid JSON"),
    ("data/features/records.jsonl", damage_second_answer, "records.jsonl:2 is damaged"),
    ("data/features/features.bin", cut_in_half, "features.bin is damaged"),
    ("data/features/meta.json", wrong_width, "says its features are 8 wide, this target returns"),
    ("data/answers.jsonl", damage_second_answer, "answers.jsonl:2 is damaged"),
    ("checkpoint.pt", cut_in_half, "checkpoint.pt is damaged"),
    ("checkpoint.pt", garbage, "training cannot resume from it; delete it to start training over"),
]


@pytest.mark.parametrize("name, damage, message", CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_a_damaged_file_of_a_resumable_run_is_one_line(
    trained, tiny_checkpoint, tiny_artifacts, tmp_path, name, damage, message
):
    out = shutil.copytree(trained, tmp_path / "eagle3")
    damage(out / name)
    before = snapshot(out)
    r = run(*train_args(tiny_checkpoint, tiny_artifacts, out))
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and message in line and str(out / name) in line, r.output
    assert snapshot(out) == before, "the refusal changed files"


def test_rows_past_the_last_record_are_trimmed_by_train_draft(trained, tiny_checkpoint, tiny_artifacts, tmp_path):
    """features.bin with 1,000 bytes past its last record (a write cut short): train-draft
    resumes and the store is back at its intact size, the records as they were."""
    out = shutil.copytree(trained, tmp_path / "eagle3")
    feats, log = out / "data/features/features.bin", out / "data/features/records.jsonl"
    intact, records = feats.read_bytes(), log.read_bytes()
    with open(feats, "ab") as fh:
        fh.write(b"\x01" * 1000)
    r = run(*train_args(tiny_checkpoint, tiny_artifacts, out))
    assert r.exit_code == 0, r.output
    assert feats.read_bytes() == intact and log.read_bytes() == records


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("head/head.json", cut_in_half, "head.json is not valid JSON"),
        ("head/head.safetensors", cut_in_half, "head.safetensors is damaged or missing"),
        ("head/training.json", cut_in_half, "training.json is not valid JSON"),
    ],
)
def test_a_damaged_head_is_one_line_in_build_draft(trained, tiny_checkpoint, tmp_path, name, damage, message):
    out = shutil.copytree(trained, tmp_path / "eagle3")
    damage(out / name)
    before = snapshot(out)
    r = run("build-draft", "--draft-dir", out, "--model", tiny_checkpoint, "--tensorrt", "off")
    assert r.exit_code == 1 and message in r.output.strip().splitlines()[-1], r.output
    assert snapshot(out) == before


@pytest.mark.parametrize("widths", ["other", "same"])
def test_build_draft_for_another_checkpoint_is_refused(trained, tiny_checkpoint, tmp_path, widths):
    """It rewrote the head's manifests to name the other checkpoint, whose widths the head does
    not have; generating was then refused with the wrong advice. Refused by the widths head.json
    records, and by the hash training.json records where the widths agree."""
    from conftest import TINY_HF, random_model, save_checkpoint, tiny_hf_config

    if widths == "other":
        cfg = tiny_hf_config(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1)
    else:
        cfg = TINY_HF
    other = save_checkpoint(random_model(cfg, seed=5), cfg, tmp_path / "other")
    out = shutil.copytree(trained, tmp_path / "eagle3")
    before = snapshot(out)
    r = run("build-draft", "--draft-dir", out, "--model", other, "--tensorrt", "off")
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "was trained for another target checkpoint" in line, r.output
    assert ("hidden_size 64 vs 32" if widths == "other" else "sha256:") in line
    assert f"--model {tiny_checkpoint.resolve()}" in line  # the checkpoint it was trained for
    assert snapshot(out) == before


def test_train_draft_out_and_data_that_are_files(tiny_checkpoint, tiny_artifacts, tmp_path):
    (tmp_path / "a-file").write_text("mine")
    r = run(*train_args(tiny_checkpoint, tiny_artifacts, tmp_path / "a-file"))  # a NotADirectoryError before
    assert r.exit_code == 1 and "--out" in r.output and "is a file; give the path of a directory" in r.output
    r = run(*train_args(tiny_checkpoint, tiny_artifacts, tmp_path / "h"), "--data", tmp_path / "a-file" / "d")
    assert r.exit_code == 1 and "lies under" in r.output and "which is a file" in r.output
    assert (tmp_path / "a-file").read_text() == "mine" and not (tmp_path / "h").exists()


@pytest.mark.parametrize("command", ["train-draft", "calibrate"])
def test_hold_out_that_is_not_json_lines(tiny_checkpoint, tiny_artifacts, tmp_path, command):
    bad = tmp_path / "held.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    if command == "train-draft":
        args = train_args(tiny_checkpoint, tiny_artifacts, tmp_path / "h")
    else:
        args = ["calibrate", "--model", tiny_checkpoint, "--artifacts", tiny_artifacts]
    r = run(*args, "--hold-out", bad)  # a JSONDecodeError before
    assert r.exit_code == 1 and f"{bad}:2 is not a JSON line" in r.output and "--hold-out" in r.output, r.output
    bad.write_text('{"text": "no prompt"}\n')
    r = run(*args, "--hold-out", bad)
    assert r.exit_code == 1 and "is not a JSON object with 'prompt'" in r.output


@pytest.mark.parametrize("value", ["one", -1, 1.5, True])
def test_import_mtp_with_a_malformed_module_count(tiny_checkpoint, tmp_path, value):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": value}))
    r = run("import-mtp", "--model", ckpt, "--out", tmp_path / "mtp", "--tensorrt", "off")  # a ValueError before
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "num_nextn_predict_layers must be a whole number >= 0" in line, r.output
    assert not (tmp_path / "mtp").exists()


def test_damaged_features_stop_training_before_a_head_of_nan(trained, tiny_checkpoint, tiny_artifacts, tmp_path):
    """Random bytes of the right size in features.bin (float16 NaN and infinity among them)
    trained a head of NaN that exited 0, passed the export's parity check ("logits within nan")
    and was called usable. Training now stops on the first non-finite loss, naming the cause."""
    import numpy as np

    out = shutil.copytree(trained, tmp_path / "eagle3")
    feats = out / "data/features/features.bin"
    feats.write_bytes(np.random.default_rng(0).bytes(feats.stat().st_size))
    for made in ("checkpoint.pt", "head", "onnx", "engines"):  # train again on the damaged data
        path = out / made
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    r = run(*train_args(tiny_checkpoint, tiny_artifacts, out))
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "training stopped before it wrote a head of NaN" in line, r.output
    assert "delete the data's features directory" in line and not (out / "head").exists()


def test_a_head_of_nan_is_refused_by_the_export(trained, tiny_checkpoint, tmp_path):
    """A head whose weights hold NaN: the parity check read `max_abs > tol`, False for NaN."""
    from safetensors.torch import load_file, save_file

    out = shutil.copytree(trained, tmp_path / "eagle3")
    weights = load_file(out / "head/head.safetensors")
    name = next(n for n, t in weights.items() if t.is_floating_point() and t.ndim == 2)
    weights[name][0, 0] = float("nan")
    save_file(weights, out / "head/head.safetensors")
    r = run("build-draft", "--draft-dir", out, "--model", tiny_checkpoint, "--tensorrt", "off")
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "has weights that are not finite" in line and name in line, r.output


def test_an_export_whose_parity_is_nan_is_refused():
    """A head exported before the parity check failed on NaN records NaN figures: refused."""
    from specrt.errors import SpecrtError
    from specrt.schema.head_io import check_head_parity

    check_head_parity({"ort_parity": {"logits_max_abs": 1e-6, "logits_scale": 3.0}}, "h")
    with pytest.raises(SpecrtError, match="export parity is not finite"):
        check_head_parity({"ort_parity": {"logits_max_abs": float("nan"), "logits_scale": 3.0}}, "h")


class _Planted:
    """A pickle that writes a file when it is loaded: what a planted checkpoint.pt would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_planted_pickle_at_the_resume_path_runs_nothing(trained, tiny_checkpoint, tiny_artifacts, tmp_path):
    """torch.load(weights_only=False) unpickled whatever lay at the resume path: a planted file ran
    its code when training resumed. Now only tensors, dicts, lists and numbers load; the rest is
    refused by name, and the code never runs."""
    import torch

    out = shutil.copytree(trained, tmp_path / "eagle3")
    marker = tmp_path / "ran.txt"
    torch.save({"identity": _Planted(marker), "step": 0}, out / "checkpoint.pt")
    before = snapshot(out)
    r = run(*train_args(tiny_checkpoint, tiny_artifacts, out))
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "refused and nothing in it ran" in line and str(out / "checkpoint.pt") in line, r.output
    assert not marker.exists(), "the planted pickle's code ran"
    assert snapshot(out) == before
