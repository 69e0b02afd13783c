"""An edge deployment is a folder you copy: the artifacts of a model whose weights stay in its
GGUF file, copied to another path with the checkpoint, the GGUF and the build tree removed, answer
as before (tokenizer, chat template and config come from the folder's model/); a damaged or
missing model/ is refused by name; an engine built on another CPU names the one command that
rebuilds it from the folder alone, and that command works."""

import json
import shutil

import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.layout import ArtifactLayout

from conftest import CHAT_TEMPLATE, random_model, tiny_hf_config
from test_gguf_blocks import TYPES
from tiny_gguf import write_gguf

PROMPT = ["--prompt", "b c d", "--max-new-tokens", "8", "--chat"]


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert not (r.exception and not isinstance(r.exception, SystemExit)), f"{r.output}\n{r.exception!r}"
    assert "Traceback" not in r.output
    return r


def generate(artifacts, *extra):
    return cli("generate", "--artifacts", artifacts, "--quantize", "gguf-a8", *PROMPT, *extra)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the build tree, its artifacts, the answer they give there): a GGUF converted without a
    float copy of its weights, its gguf-a8 engine built."""
    tree = tmp_path_factory.mktemp("build")
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=31), hf, tree / "tiny.gguf", TYPES, tokenizer=True, chat_template=CHAT_TEMPLATE)
    assert cli("convert", tree / "tiny.gguf", "--out", tree / "ckpt", "--weights", "gguf").exit_code == 0
    art = tree / "artifacts"
    r = cli("build-engines", "--model", tree / "ckpt", "--out", art, "--quantize", "gguf-a8", "--tensorrt", "off")
    assert r.exit_code == 0, r.output
    answer = generate(art)
    assert answer.exit_code == 0, answer.output
    return tree, art, answer.stdout.splitlines()[0]


@pytest.fixture
def copied(built, tmp_path):
    """The artifacts copied elsewhere, and the build tree (checkpoint, GGUF, artifacts) gone."""
    tree, art, answer = built
    copy = shutil.copytree(art, tmp_path / "edge" / "model-folder")
    hidden = tmp_path / "hidden"  # the build tree, out of reach (restored for the next test)
    shutil.move(tree, hidden)
    yield copy, answer
    shutil.move(hidden, tree)


def test_a_copied_folder_answers_without_the_checkpoint(copied):
    """It said "checkpoint directory .../ckpt does not exist": the engine's manifest named the
    checkpoint by absolute path and the run read the tokenizer from there."""
    copy, answer = copied
    assert (ArtifactLayout(copy).model_files / "tokenizer.json").is_file()
    r = generate(copy)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == answer  # the chat template and tokenizer are the checkpoint's


def test_a_damaged_tokenizer_in_the_copy_is_refused(copied):
    copy, _ = copied
    tok = ArtifactLayout(copy).model_files / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"b"', '"B"', 1))
    r = generate(copy)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and f"{tok} does not match the sha256 in its manifest" in line, r.output


def test_a_copy_without_model_files_says_what_to_copy(copied):
    copy, _ = copied
    shutil.rmtree(ArtifactLayout(copy).model_files)
    r = generate(copy)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "which is gone; copy the whole artifacts folder" in line, r.output


def test_an_engine_built_on_another_cpu_names_the_one_command_that_rebuilds_it(copied):
    copy, answer = copied
    engine = ArtifactLayout(copy).ort_engine("cpu", "gguf-a8")
    m = json.loads((engine / "manifest.json").read_text())
    (engine / "manifest.json").write_text(json.dumps(m | {"host_cpu": "Another CPU"}))
    r = generate(copy)
    line = r.output.strip().splitlines()[-1]
    command = f"specrt build-engines --out {copy.resolve()} --quantize gguf-a8"
    assert r.exit_code == 1 and "was optimized on a 'Another CPU' CPU" in line and line.endswith(command), r.output
    r = cli(*command.split()[1:], "--tensorrt", "off")  # no checkpoint: the graph and model/ the folder holds
    assert r.exit_code == 0 and "built for CPUExecutionProvider" in r.output, r.output
    assert json.loads((engine / "manifest.json").read_text())["host_cpu"] != "Another CPU"
    r = generate(copy)
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == answer, r.output


def test_build_without_model_and_without_a_graph_says_what_to_give(tmp_path):
    r = cli("build-engines", "--out", tmp_path / "empty", "--quantize", "gguf-a8")
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "holds no step graph" in line and "--model CHECKPOINT" in line, r.output


def test_an_engine_of_a_checkpoint_given_explicitly_must_be_that_checkpoints(built, tmp_path):
    """--model still wins over the folder's files, and still must be the engine's checkpoint."""
    tree, art, answer = built
    r = generate(art, "--model", tree / "ckpt")
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == answer, r.output


def test_a_missing_gguf_backed_checkpoint_names_what_it_held_and_the_command_that_makes_it(built, copied):
    """It said "Pass a directory with config.json and *.safetensors" of a checkpoint that holds no
    safetensors (its weights stay in the GGUF file)."""
    tree, _, _ = built
    copy, _ = copied
    r = generate(copy, "--model", tree / "ckpt")
    line = r.output.strip().splitlines()[-1]
    remake = f"specrt convert {(tree / 'tiny.gguf').resolve()} --out {(tree / 'ckpt').resolve()} --weights gguf"
    assert r.exit_code == 1 and f"checkpoint directory {tree / 'ckpt'} does not exist" in line, r.output
    assert "converted from a GGUF file; make it again with: " + remake in line


def test_a_converted_checkpoint_without_its_record_says_what_it_lacks(built, tmp_path):
    tree, _, _ = built
    lean = shutil.copytree(tree / "ckpt", tmp_path / "lean")
    (lean / "gguf_source.json").unlink()
    r = cli("generate", "--backend", "torch", "--model", lean, *PROMPT)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "holds config.json but no weights, and no gguf_source.json" in line, r.output


def test_an_engine_from_before_model_files_without_its_checkpoint_says_to_rebuild_once(copied):
    copy, _ = copied
    engine = ArtifactLayout(copy).ort_engine("cpu", "gguf-a8")
    m = json.loads((engine / "manifest.json").read_text())
    m.pop("model_dir")
    (engine / "manifest.json").write_text(json.dumps(m))
    r = generate(copy)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "was built before engines carried their tokenizer" in line, r.output
    assert f"specrt build-engines --model {m['checkpoint']['path']} --out DIR" in line
