"""Checkpoint loading (safetensors directory, GGUF) and the errors bad checkpoints get."""

import json
import re
import shutil

import pytest
import torch

from specrt.errors import CheckpointError, UnsupportedArchitectureError
from specrt.export.checkpoint import checkpoint_hash, load_config, load_model
from specrt.schema.config import ModelConfig

from conftest import random_model, tiny_hf_config
from tiny_gguf import write_gguf


def clone(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_load_roundtrip(tiny_checkpoint):
    m = load_model(tiny_checkpoint)
    ref = random_model(tiny_hf_config())
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist.*make model"):
        load_model("/nonexistent/ckpt")


def test_no_safetensors_mentions_pickle(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors.*pickle weights \\(pytorch_model.bin\\)"):
        load_model(d)


def test_corrupt_safetensors(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(d)


def test_truncated_safetensors(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(d)


def test_missing_config(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(d)


def test_corrupt_config(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    (d / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(d)


def test_config_missing_key(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks the required key 'hidden_size'"):
        load_model(d)


def test_config_does_not_match_weights(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight has shape .* config.json does not match"):
        load_model(d)


def test_incomplete_sharded_checkpoint(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="incomplete: shards model-00002-of-00002.safetensors"):
        load_model(d)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
        (
            {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64},
            "use_sliding_window=true is not supported",
        ),
        ({"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        (
            {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "longrope"}},
            "'longrope' is not supported",
        ),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_architectures(overrides, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_hf_dict(tiny_hf_config(**overrides))


def test_hash_changes_with_weights(tiny_checkpoint, tmp_path):
    d = clone(tiny_checkpoint, tmp_path / "c")
    h = checkpoint_hash(d)
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (d / "model.safetensors").write_bytes(bytes(data))
    assert checkpoint_hash(d) != h


def test_hash_cache_is_used_and_invalidated_by_changes(tiny_checkpoint, tmp_path):
    import os

    d = clone(tiny_checkpoint, tmp_path / "c")
    h = checkpoint_hash(d)
    from specrt.schema.checkpoint_files import _hash_cache_path

    cache_file = _hash_cache_path()
    cache = json.loads(cache_file.read_text())
    key = next(k for k, v in cache.items() if v == h and str(d.resolve()) in k)
    cache[key] = "sha256:from-cache"
    cache_file.write_text(json.dumps(cache))
    assert checkpoint_hash(d) == "sha256:from-cache"
    os.utime(d / "model.safetensors", ns=(1, 1))  # same bytes, other mtime: key changes
    assert checkpoint_hash(d) == h


def test_gguf_weights_unpermuted(tmp_path):
    hf = tiny_hf_config()
    model = random_model(hf, seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, hf, path)
    loaded = load_model(path)
    assert loaded.cfg.num_key_value_heads == 2 and not loaded.cfg.tie_word_embeddings
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_model(p)


def test_missing_gguf(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "none.gguf")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_attention_heads": -4}, "num_attention_heads must be a positive integer, got -4"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"num_hidden_layers": "two"}, 'num_hidden_layers must be an integer, got "two"'),
        ({"vocab_size": 12.5}, "vocab_size must be an integer, got 12.5"),
        ({"intermediate_size": None}, "lacks the required key 'intermediate_size'; restore it"),
        ({"head_dim": True}, "head_dim must be an integer, got true"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"rms_norm_eps": "small"}, 'rms_norm_eps must be a number, got "small"'),
        ({"rope_theta": -1.0}, "rope_theta must be a positive finite number, got -1.0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id must be token ids"),
    ],
)
def test_config_with_impossible_values_is_one_line(tiny_checkpoint, tmp_path, overrides, message):
    """Every reader of config.json (export, build-engines, the torch backend) goes through one
    check that names the field; the CLI prints it as one line, no traceback."""
    from click.testing import CliRunner

    from specrt.cli import main

    d = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(overrides)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_config(d)
    r = CliRunner().invoke(main, ["export", "--model", str(d), "--out", str(tmp_path / "onnx")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert r.output.strip().splitlines()[-1].startswith(f"Error: {d / 'config.json'}: {message}")
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ("{corrupt", "tokenizer_config.json is not valid JSON"),
        ("[1, 2]", "tokenizer_config.json must hold a JSON object, not list"),
        ('{"eos_token": 5}', "eos_token must be a string"),
        ('{"chat_template": 7}', "chat_template must be a string"),
    ],
)
def test_corrupt_tokenizer_config_is_one_line(tiny_checkpoint, tmp_path, content, message):
    from click.testing import CliRunner

    from specrt.cli import main

    d = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    (d / "tokenizer_config.json").write_text(content)
    r = CliRunner().invoke(
        main, ["generate", "--backend", "torch", "--model", str(d), "--prompt", "w5", "--max-new-tokens", "2"]
    )
    assert (
        r.exit_code == 1
        and message in r.output
        and not isinstance(r.exception, (ValueError, TypeError, AttributeError))
    ), r.output
