"""A GGUF model built without a float32 copy: `convert --weights gguf` writes no weights, and the
engine of the file's own blocks is written from the file one tensor at a time, equal bit for bit to
the engine built from the float32 checkpoint of the same file."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.engines.build import BuildSpec, build_all
from specrt.engines.memory import needed_bytes
from specrt.errors import CheckpointError
from specrt.export.checkpoint import checkpoint_hash, gguf_weights, load_model
from specrt.export.gguf import GgufTensors
from specrt.export.gguf_model import GgufWeight, streamed_model
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from conftest import CHAT_TEMPLATE, random_model, tiny_hf_config
from test_gguf_blocks import TYPES
from tiny_gguf import write_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the GGUF file, its checkpoint without weights, its float32 checkpoint)."""
    d = tmp_path_factory.mktemp("stream")
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=21), hf, d / "tiny.gguf", TYPES, tokenizer=True)
    for weights in ("gguf", "float32"):
        r = CliRunner().invoke(main, ["convert", str(d / "tiny.gguf"), "--out", str(d / weights), "--weights", weights])
        assert r.exit_code == 0, r.output
    return d / "tiny.gguf", d / "gguf", d / "float32"


def test_a_checkpoint_without_weights_reads_them_from_its_file(converted):
    path, lean, full = converted
    assert not list(lean.glob("*.safetensors")) and list(full.glob("*.safetensors"))
    assert gguf_weights(lean) == path.resolve() and gguf_weights(full) is None
    assert checkpoint_hash(lean) != checkpoint_hash(full)  # config + the file, not the safetensors
    a, b = load_model(lean).state_dict(), load_model(full).state_dict()
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # the same float32 model
    streamed = streamed_model(path)
    w = streamed.layers[0].self_attn.q_proj.weight
    assert isinstance(w, GgufWeight) and np.array_equal(w.float32(), b["layers.0.self_attn.q_proj.weight"].numpy())
    assert streamed.layers[0].input_layernorm.weight.equal(b["layers.0.input_layernorm.weight"])


def test_the_streamed_engine_is_the_float_checkpoints_bit_for_bit(converted, tmp_path, monkeypatch):
    path, lean, full = converted
    built = {}
    for name, ckpt in (("full", full), ("lean", lean)):
        if name == "lean":  # no matrix of the file is dequantized to float32 on the way
            seen = []
            original = GgufTensors.float32
            monkeypatch.setattr(GgufTensors, "float32", lambda self, t: seen.append(t.name) or original(self, t))
        spec = BuildSpec(checkpoint=ckpt, out=tmp_path / name, quantize="gguf-a8", gguf=path, tensorrt="off")
        built[name] = list(build_all(spec))
    assert not [n for n in seen if n.endswith(".weight") and "norm" not in n], seen
    layout = ArtifactLayout(tmp_path / "lean")
    assert built["lean"][0].startswith("model") and built["lean"][1].startswith("onnx      skipped: the weights stay")
    assert sorted(p.name for p in (tmp_path / "lean").iterdir() if not p.name.startswith(".")) == [
        "engines",
        "model",
        "onnx-fused-gguf-a8",
    ]  # nothing float32: only what the engine needs and the tokenizer a run reads
    assert [p.name for p in layout.engines.iterdir()] == ["ort-cpu-gguf-a8"]
    q = json.loads((layout.fused_onnx("gguf-a8") / "manifest.json").read_text())["quantization"]
    assert q["block_tensors_unused"] == [] and q["rewritten_matmuls"] == {"Q4_0": 4, "Q4_1": 8, "Q8_0": 3}
    import onnx

    graph = onnx.load(str(layout.fused_onnx("gguf-a8") / "model.onnx"), load_external_data=False).graph
    assert not any(i.data_type == onnx.TensorProto.FLOAT and np.prod(i.dims) >= 64 * 128 for i in graph.initializer)

    engines = [Generator.from_engine(ArtifactLayout(tmp_path / n).ort_engine("cpu", "gguf-a8")) for n in built]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 128, 33).tolist(), rng.integers(3, 128, 7).tolist()]
    logits = [g.session.prefill(g.session.new_cache(2, 64), prompts).logits for g in engines]
    assert np.array_equal(logits[0], logits[1])
    for g in engines:
        g.eos_ids = frozenset()
    outs = [[r.token_ids for r in g.generate_ids(prompts, 12)] for g in engines]
    assert outs[0] == outs[1]


def test_a_streamed_build_needs_memory_by_the_files_size_not_float32s(converted):
    path, lean, full = converted
    assert needed_bytes(lean, streamed=path) < needed_bytes(full)


def test_a_checkpoint_whose_file_is_gone_says_so(converted, tmp_path):
    path, lean, _ = converted
    record = json.loads((lean / "gguf_source.json").read_text())
    moved = tmp_path / "ckpt"
    moved.mkdir()
    for f in lean.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    (moved / "gguf_source.json").write_text(json.dumps(record | {"file": str(tmp_path / "gone.gguf")}))
    with pytest.raises(CheckpointError, match=r"reads its weights from the GGUF file .*gone.gguf, which is gone; put"):
        checkpoint_hash(moved)
    r = CliRunner().invoke(main, ["build-engines", "--model", str(moved), "--out", str(tmp_path / "a"), "--quantize",
                                  "gguf-a8", "--tensorrt", "off"])  # fmt: skip
    assert r.exit_code == 1 and "which is gone" in r.output and "Traceback" not in r.output, r.output


def test_a_head_trains_against_the_streamed_files_engine(tmp_path, monkeypatch):
    """train-draft --quantize gguf-a8 on a model whose weights stay in its GGUF: the file's own
    engine makes the data, only the matrices a head copies (embedding, output head, last layer)
    are read as float32, and the head drafts on that engine with plain's output."""
    hf = tiny_hf_config(max_position_embeddings=4096)  # room for training prompts at a letter a token
    path, lean = tmp_path / "chat.gguf", tmp_path / "lean"
    write_gguf(random_model(hf, seed=22), hf, path, TYPES, tokenizer=True, chat_template=CHAT_TEMPLATE)
    r = CliRunner().invoke(main, ["convert", str(path), "--out", str(lean), "--weights", "gguf"])
    assert r.exit_code == 0, r.output
    art = tmp_path / "art"
    list(build_all(BuildSpec(checkpoint=lean, out=art, quantize="gguf-a8", gguf=path, tensorrt="off")))
    read = []
    original = GgufTensors.float32
    monkeypatch.setattr(GgufTensors, "float32", lambda self, t: read.append(t.name) or original(self, t))
    out = tmp_path / "medusa"
    args = ["train-draft", "--method", "medusa", "--model", str(lean), "--out", str(out), "--artifacts", str(art)]
    args += ["--quantize", "gguf-a8", "--prompts", "6", "--max-new-tokens", "8", "--epochs", "1", "--draft-vocab"]
    args += ["64", "--tensorrt", "off", "--hold-out", str(tmp_path / "none.jsonl")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    matrices = {n for n in read if n.endswith(".weight") and "norm" not in n}
    last = streamed_model(path).cfg.num_hidden_layers - 1
    assert matrices and all(n.startswith(("token_embd", "output", f"blk.{last}.")) for n in matrices), matrices
    manifest = json.loads((out / "onnx" / "manifest.json").read_text())
    assert manifest["target"]["precision"] == "gguf-a8"
    common = ["generate", "--artifacts", str(art), "--quantize", "gguf-a8", "--prompt", "w5 w6", "--max-new-tokens"]
    a = CliRunner().invoke(main, [*common, "12", "--draft", "none"])
    b = CliRunner().invoke(main, [*common, "12", "--draft", "medusa", "--draft-dir", str(out)])
    assert a.exit_code == b.exit_code == 0, b.output
    assert a.stdout.splitlines()[0] == b.stdout.splitlines()[0]
    assert "[medusa draft" in b.output  # it drafted (the engine took the head trained against it)


def test_train_draft_quantize_names_an_engine_of_artifacts(converted, tmp_path):
    _, lean, _ = converted
    args = ["train-draft", "--method", "medusa", "--model", str(lean), "--out", str(tmp_path / "h"), "--quantize"]
    r = CliRunner().invoke(main, [*args, "gguf-a8", "--prompts", "4", "--tensorrt", "off"])
    assert r.exit_code == 1 and "--quantize gguf-a8 names an engine of --artifacts" in r.output, r.output
    assert "Traceback" not in r.output


def test_a_gguf_changed_in_place_under_its_checkpoint_is_refused(converted, tmp_path):
    """4 KiB of tensor data zeroed in place (same size): build-engines made a gguf-a8 engine of the
    changed file without a word. convert records the file's sha256; the build and a run that reads
    the weights from the file check it (a stat when nothing changed) and refuse by name."""
    path, _, _ = converted
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(path.read_bytes())
    lean = tmp_path / "lean"
    assert CliRunner().invoke(main, ["convert", str(gguf), "--out", str(lean), "--weights", "gguf"]).exit_code == 0
    data = bytearray(gguf.read_bytes())
    data[-8192:-4096] = bytes(4096)
    gguf.write_bytes(bytes(data))
    build = ["build-engines", "--model", str(lean), "--out", str(tmp_path / "a"), "--quantize", "gguf-a8"]
    r = CliRunner().invoke(main, [*build, "--tensorrt", "off"])
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and f"{gguf.resolve()} changed since {lean} was converted from it" in line, r.output
    assert f"specrt convert {gguf.resolve()} --out {lean} --weights gguf" in line and "Traceback" not in r.output
    assert not (tmp_path / "a" / "engines").exists()
    run = ["generate", "--backend", "torch", "--model", str(lean), "--no-chat", "--prompt", "a b"]
    run += ["--max-new-tokens", "2"]
    r = CliRunner().invoke(main, run)
    assert r.exit_code == 1 and "changed since" in r.output and "Traceback" not in r.output, r.output
    gguf.write_bytes(path.read_bytes())  # the original bytes back: both run again
    assert CliRunner().invoke(main, run).exit_code == 0


def test_a_project_folder_moved_with_its_models_still_finds_the_file(converted, tmp_path):
    """gguf_source.json names the file by its path and by its place relative to the checkpoint."""
    path, _, _ = converted
    before = tmp_path / "before"
    (before / "models").mkdir(parents=True)
    (before / "models" / "tiny.gguf").write_bytes(path.read_bytes())
    r = CliRunner().invoke(
        main, ["convert", str(before / "models/tiny.gguf"), "--out", str(before / "models/lean"), "--weights", "gguf"]
    )
    assert r.exit_code == 0, r.output
    after = before.rename(tmp_path / "after")
    assert gguf_weights(after / "models" / "lean").resolve() == (after / "models" / "tiny.gguf").resolve()
