"""Loading checkpoints: a Hugging Face directory (config.json + safetensors, never pickle) or GGUF.

`load_model(path)` returns our LlamaModel in float32 with the checkpoint's weights.
`checkpoint_hash(path)` is the fingerprint every artifact manifest records.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from specrt.errors import CheckpointError
from specrt.export.config import ModelConfig
from specrt.export.llama import LlamaModel

_HASH_CHUNK = 8 << 20


def require_checkpoint_dir(ckpt_dir: Path) -> None:
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(
            f"checkpoint directory {ckpt_dir} does not exist. Pass a directory with config.json and "
            "*.safetensors, or a .gguf file (for the default model run `make model`)."
        )


def weight_files(ckpt_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    ckpt_dir = Path(ckpt_dir)
    require_checkpoint_dir(ckpt_dir)
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in ckpt_dir.glob("*.bin")) + sorted(p.name for p in ckpt_dir.glob("*.pt"))
        hint = (
            f" It has pickle weights ({', '.join(pickles)}), which specrt does not load; re-save them as safetensors."
            if pickles
            else ""
        )
        raise CheckpointError(f"no *.safetensors files in {ckpt_dir}.{hint}")
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            needed = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is corrupt ({e}); restore it from the original checkpoint.") from None
        missing = sorted(needed - {f.name for f in files})
        if missing:
            raise CheckpointError(
                f"{ckpt_dir} is incomplete: shards {', '.join(missing)} named in {index.name} are missing."
            )
    return files


def _hash_cache_path() -> Path:
    root = os.environ.get("SPECRT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "specrt"
    )
    return Path(root) / "checkpoint-hashes.json"


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over config.json and the weight files (or over the GGUF file).

    Hashing a checkpoint reads all of it (~1.3 s for 540 MB), so results are remembered in
    ~/.cache/specrt keyed by each file's path, size and modification time; any change to a file
    changes its key and forces a fresh hash.
    """
    path = Path(path)
    if path.is_file():
        files = [path]
    else:
        files = weight_files(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} has no config.json; a checkpoint directory needs it next to its safetensors files."
            )
        files = [path / "config.json", *files]
    stats = [os.stat(f) for f in files]
    key = "|".join(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}" for f, st in zip(files, stats))
    cache_path = _hash_cache_path()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
    digest = "sha256:" + h.hexdigest()
    try:  # the cache is an optimisation: a read-only home directory only costs time
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache = {k: v for k, v in cache.items() if not k.startswith(str(files[0].resolve().parent))}
        cache[key] = digest
        tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return digest


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.suffix == ".gguf":
        from specrt.export.gguf import read_gguf

        return read_gguf(path)[0]
    require_checkpoint_dir(path)
    return ModelConfig.from_json_file(path / "config.json")


def read_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for f in weight_files(ckpt_dir):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({e}); re-download or re-convert it."
            ) from None
    return state


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str, hidden_layers=None) -> LlamaModel:
    """Our model from a transformers-named state dict ('model.' prefixes optional). hidden_layers:
    the features `hidden_states` carries (default: what the step graph exports, every draft
    head's layers)."""
    if hidden_layers is None:
        from specrt.export.head_io import default_target_layers

        hidden_layers = default_target_layers(cfg.num_hidden_layers)
    state = {k.removeprefix("model."): v.to(torch.float32) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = LlamaModel(cfg, hidden_layers=hidden_layers)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{source} lacks {len(missing)} weights the config asks for (first: {missing[0]}); "
            "the checkpoint is incomplete or its config.json belongs to another model."
        )
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise CheckpointError(
                f"{source}: weight {k} has shape {tuple(state[k].shape)}, the config implies {tuple(shape)}; "
                "config.json does not match the weights."
            )
    model.load_state_dict({k: state[k] for k in expected}, strict=False)
    return model.eval()


def load_model(path: str | Path, hidden_layers=None) -> LlamaModel:
    """Our float32 model from a HF checkpoint directory or a .gguf file."""
    path = Path(path)
    if path.suffix == ".gguf":
        from specrt.export.gguf import read_gguf

        cfg, state, _ = read_gguf(path)
        return build_model(cfg, state, str(path), hidden_layers)
    cfg = load_config(path)
    return build_model(cfg, read_state_dict(path), str(path), hidden_layers)
