"""GGUF (llama.cpp) checkpoints: read the config and dequantized float32 weights, convert to a
Hugging Face directory (config.json, model.safetensors, tokenizer files, chat template).

Weights are read with the `gguf` package directly. What differs between families (llama.cpp's
q/k permutation of Llama models, Gemma's norms stored as 1 + w, tensor names, metadata that
llama.cpp leaves to its code) is each family's `Gguf` (schema/arch/).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from specrt.artifacts import atomic_dir
from specrt.errors import CheckpointError, SpecrtError, UnsupportedArchitectureError
from specrt.schema.arch import FAMILIES
from specrt.schema.checkpoint_files import GGUF_SOURCE, file_digest, recorded_file
from specrt.schema.config import ModelConfig

# GGUF tensor name (after the block prefix) -> transformers name
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
# GGUF general.architecture -> the family that reads it
GGUF_FAMILIES = {f.gguf.arch: f for f in FAMILIES.values() if f.gguf is not None}


def open_gguf(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist.")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on garbage
        raise CheckpointError(
            f"{path} is not a readable GGUF file (cut short or damaged: {type(e).__name__}: {e}); download it again."
        ) from None


def gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows (head, dim/2, 2) -> (head, 2, dim/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_family(reader, path: Path):
    """The family of a GGUF file, or an UnsupportedArchitectureError naming the ones read."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; specrt reads {', '.join(GGUF_FAMILIES)} GGUF files."
        )
    return GGUF_FAMILIES[arch]


def read_gguf(path: str | Path, progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    """(config, float32 state dict with transformers names, the open reader)."""
    from tqdm import tqdm

    path = Path(path)
    reader = open_gguf(path)
    cfg, tensors = gguf_model_facts(reader, path)
    state = {}
    for t in tqdm(reader.tensors, desc="dequantize GGUF", unit="tensor", disable=not progress):
        state[tensors.hf_name(t)] = torch.from_numpy(tensors.float32(t))
    return cfg, state, reader


class GgufTensors:
    """How a GGUF file's tensors read as the checkpoint's: their transformers names and their
    exact float32 dequantization (q/k rows unpermuted, values as transformers stores them)."""

    def __init__(self, path: Path, family, n_head: int, n_kv: int, reader=None):
        self.path, self.facts, self.n_head, self.n_kv, self.reader = path, family.gguf, n_head, n_kv, reader
        self.block_names = _BLOCK_NAMES | self.facts.names

    def hf_name(self, t) -> str:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in self.block_names:
            return f"model.layers.{parts[1]}.{self.block_names[parts[2]]}.{parts[3]}"
        if parts[0] in _TOP_NAMES:
            return ("" if parts[0] == "output" else "model.") + f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
        raise CheckpointError(f"{self.path}: unexpected tensor {t.name!r} for a {self.facts.arch} model.")

    def heads(self, t) -> int | None:
        """The heads whose rows llama.cpp permuted in this tensor (None: rows as stored)."""
        role = t.name.split(".")[-2]
        if not (self.facts.permuted_qk and role in ("attn_q", "attn_k")):
            return None
        return self.n_head if role == "attn_q" else self.n_kv

    def float32(self, t) -> np.ndarray:
        w = self._finite(t, t.data)
        self.release(t)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml lists dims innermost first
        heads = self.heads(t)
        if heads is not None:
            w = unpermute_rows(w, heads)
        return np.ascontiguousarray(self.facts.weight(self.hf_name(t), w))

    def release(self, t) -> None:
        """Let the kernel take back this process's pages of tensor t (the file is memory-mapped:
        a tensor read stays resident until then; the page cache keeps them for a reread)."""
        import mmap

        mapped = getattr(getattr(self.reader, "data", None), "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise"):
            return
        start = t.data_offset - t.data_offset % mmap.PAGESIZE
        end = min(t.data_offset + t.n_bytes, len(mapped))
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # an advice the system does not take: only memory is lost
            pass

    def check(self, t, rows: int = 4096) -> None:
        """Refuse a tensor whose values are not all finite, reading `rows` rows at a time (a
        table of 151,936 x 1536 is 0.9 GB as float32)."""
        data = t.data if t.data.ndim > 1 else t.data[None]
        for r in range(0, len(data), rows):
            self._finite(t, data[r : r + rows])
        self.release(t)

    def _finite(self, t, raw) -> np.ndarray:
        from gguf.quants import dequantize

        with np.errstate(all="ignore"):  # garbage scales: said below, by tensor, not as numpy's warnings
            w = dequantize(raw, t.tensor_type).astype(np.float32)
        finite = np.isfinite(w)
        if not finite.all():
            raise CheckpointError(
                f"{self.path}: tensor {t.name} ({t.tensor_type.name}) dequantizes to {w.size - int(finite.sum())} "
                f"non-finite values (NaN or infinity) of {w.size}: the file is damaged; download it again."
            )
        return w


def gguf_model_facts(reader, path: Path) -> tuple[ModelConfig, GgufTensors]:
    """(the model's config, how its tensors read) from a GGUF file's metadata."""
    family = gguf_family(reader, path)
    facts, p = family.gguf, family.gguf.arch + "."

    def read(key, default=None):
        return gguf_field(reader, p + key, default)

    n_head = int(read("attention.head_count"))
    n_kv = int(read("attention.head_count_kv", n_head))
    hidden = int(read("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = read("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    hf = {
        "architectures": [family.architecture],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(read("feed_forward_length")),
        "num_hidden_layers": int(read("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(read("attention.key_length", 0) or hidden // n_head),
        "rms_norm_eps": float(read("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(read("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(read("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _end_of_turn(reader, family),
    }
    cfg = ModelConfig.from_hf_dict(hf | facts.config(read))
    if read("rope.scaling.type") not in (None, "none"):
        raise UnsupportedArchitectureError(
            f"{path}: GGUF rope scaling is not supported; convert from the HF checkpoint instead."
        )
    return cfg, GgufTensors(path, family, n_head, n_kv, reader)


def _end_of_turn(reader, family) -> list[int]:
    """EOS and the family's end-of-turn tokens the file's vocabulary has (Gemma's <end_of_turn>)."""
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    ids = [] if eos is None else [int(eos)]
    if family.end_of_turn:
        tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
        ids += [tokens.index(t) for t in family.end_of_turn if t in tokens and tokens.index(t) not in ids]
    return ids


WEIGHTS = ("float32", "gguf")  # what a conversion writes of the weights (convert --weights)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True, weights: str = "float32") -> Path:
    """Write a Hugging Face checkpoint directory (config.json, tokenizer, chat template) for a
    GGUF file; weights: "float32" writes the float32 dequantization as model.safetensors (the
    checkpoint stands alone, for transformers), "gguf" writes no weights: the directory reads
    them from the GGUF file, which must stay where it is (no float32 copy on disk or in memory:
    a 1.5B model's is 6 GB).

    The directory is written under a temporary name and renamed into place, so an interrupted
    conversion never leaves a half-written checkpoint behind.
    """
    if weights not in WEIGHTS:
        raise SpecrtError(f"--weights {weights!r}: choose one of {', '.join(WEIGHTS)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    gguf_family(reader, gguf_path)  # before minutes of dequantizing: a family specrt reads,
    _require_tokenizer(reader, gguf_path)  # with a tokenizer
    if weights == "float32":
        cfg, state, reader = read_gguf(gguf_path, progress=progress)
    else:  # each tensor read once, to refuse a damaged file now rather than at the build
        cfg, tensors = gguf_model_facts(reader, gguf_path)
        for t in _progress(reader.tensors, progress):
            tensors.hf_name(t)
            tensors.check(t)
    with atomic_dir(out_dir) as tmp:
        if weights == "float32":
            from safetensors.torch import save_file

            if cfg.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
            del state
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        _write_tokenizer(gguf_path, reader, tmp)
        # build-engines --quantize gguf computes from the GGUF's own blocks: it finds the file here
        source = {
            "file": str(gguf_path.resolve()),
            "relative": os.path.relpath(gguf_path.resolve(), out_dir.resolve()),  # moves with a project folder
            "sha256": file_digest(gguf_path),  # remembered: the build checks it for the cost of a stat
        }
        if weights == "gguf":
            source["weights_in_file"] = True  # schema/checkpoint_files.py gguf_weights
        (tmp / GGUF_SOURCE).write_text(json.dumps(source, indent=2) + "\n")
    return out_dir


def _progress(tensors, progress: bool):
    from tqdm import tqdm

    return tqdm(tensors, desc="check GGUF", unit="tensor", disable=not progress)


def gguf_origin(checkpoint: str | Path) -> Path | None:
    """The GGUF file a checkpoint directory was converted from, when it records one and the
    file is still there with the same contents; None otherwise."""
    record = Path(checkpoint) / GGUF_SOURCE
    try:
        source = json.loads(record.read_text())
        path = recorded_file(checkpoint, source)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return path if path.is_file() and file_digest(path) == source.get("sha256") else None


def _require_tokenizer(reader, path: Path) -> None:
    """A conversion makes the checkpoint's tokenizer from the file's own: refuse a file without one."""
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in reader.fields]
    if missing:
        raise CheckpointError(
            f"{path} carries no tokenizer (its metadata has no {' or '.join(missing)}), and specrt converts the "
            "tokenizer from the file itself; use a GGUF written with its tokenizer (llama.cpp's convert_hf_to_gguf.py "
            "writes it), or convert the model's Hugging Face checkpoint directory instead."
        )


def _write_tokenizer(gguf_path: Path, reader, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) from the GGUF metadata.

    transformers builds the fast tokenizer from GGUF vocab and merges (or its SentencePiece
    vocabulary and scores); only this conversion step uses transformers, the runtime reads
    tokenizer.json with the `tokenizers` package. A file without a chat template gets its
    family's (Gemma 3's: the 270M GGUF carries none).
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SpecrtError("converting a GGUF tokenizer needs transformers: pip install 'specrt[convert]'") from None

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, TypeError, IndexError) as e:  # a tokenizer transformers does not build
        kind = gguf_field(reader, "tokenizer.ggml.model")
        raise CheckpointError(
            f"{gguf_path}: its tokenizer ({kind!r}) cannot be converted ({type(e).__name__}: {e}); convert the "
            "model's Hugging Face checkpoint directory instead."
        ) from None
    tok.save_pretrained(str(out))
    arch = gguf_field(reader, "general.architecture")
    template = gguf_field(reader, "tokenizer.chat_template") or GGUF_FAMILIES[arch].chat_template
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    if template and not tc.get("chat_template"):
        tc["chat_template"] = template
    tc_path.write_text(json.dumps(tc, indent=2))
