"""Calibration data: token sequences of one target, and the step-graph feeds made from them.

A calibrated recipe (GPTQ, AWQ, the Q/DQ graphs' activation ranges) fits to the activations the
model sees. The sequences are the target's own text (prompts from the offline prompt set, each
followed by the target's greedy answer: `specrt calibrate` makes them), so they exist only for the
checkpoint whose tokenizer and answers made them: a set records that checkpoint's hash, and a
recipe refuses a set of another model (its token ids would mean other text, its activations
another model's).

The feeds exercise every shape an engine runs: each sequence gives one prefill step (Q = its
length minus a tail, no past) and one step over the tail with that prefill's KV as the past (Q =
1, 5 or 17 in turn: decode and verification), so the statistics include positions that attend to
a cache, as in generation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from specrt.artifacts import atomic_write_text
from specrt.errors import SpecrtError
from specrt.schema.step_io import StepIO, attention_mask

SET_VERSION = 1
TAILS = (1, 5, 17)  # the positions of the step after each prefill, in turn: decode, verification


@dataclasses.dataclass(frozen=True)
class CalibrationSet:
    checkpoint_hash: str  # the target whose tokenizer and answers made the sequences
    source: dict  # how they were made (prompt set, seed, counts)
    sequences: tuple[tuple[int, ...], ...]

    @property
    def sha256(self) -> str:
        data = json.dumps([list(s) for s in self.sequences], separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(data).hexdigest()

    @property
    def tokens(self) -> int:
        return sum(map(len, self.sequences))

    def describe(self) -> dict:
        """What a manifest records of the set."""
        return {"sha256": self.sha256, "sequences": len(self.sequences), "tokens": self.tokens, **self.source}

    def manifest_fields(self, feeds: list[dict], max_len: int, **more) -> dict:
        """The fields a quantized graph's manifest records of the set it was fitted to (the hash
        at the top, compared by the engine builder to decide whether the graph is current)."""
        return {
            "calibration_sha256": self.sha256,
            "calibration": {**self.describe(), "feeds": len(feeds), "max_len": max_len, **more},
        }

    def save(self, path: str | Path) -> None:
        body = {
            "version": SET_VERSION,
            "checkpoint_hash": self.checkpoint_hash,
            "source": self.source,
            "sequences": [list(s) for s in self.sequences],
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(body) + "\n")

    @staticmethod
    def load(path: str | Path) -> CalibrationSet:
        path = Path(path)
        try:
            body = json.loads(path.read_text())
            if body.get("version") != SET_VERSION:
                raise ValueError(f"version {body.get('version')}, expected {SET_VERSION}")
            seqs = tuple(tuple(int(t) for t in s) for s in body["sequences"])
            return CalibrationSet(body["checkpoint_hash"], dict(body["source"]), seqs)
        except FileNotFoundError:
            raise SpecrtError(f"{path}: no calibration set; make one with `specrt calibrate`") from None
        except (ValueError, KeyError, TypeError) as e:
            raise SpecrtError(f"{path} is not a calibration set ({e}); make it again with `specrt calibrate`") from None

    def require_target(self, checkpoint_hash: str, where: str) -> None:
        if self.checkpoint_hash != checkpoint_hash:
            raise SpecrtError(
                f"the calibration set was made by another model (checkpoint {self.checkpoint_hash[:19]}…) than "
                f"{where} (checkpoint {checkpoint_hash[:19]}…); make one for this model with `specrt calibrate`"
            )


def _feed(io: StepIO, ids: list[int], start: int, past: list[np.ndarray], logits_all: bool) -> dict:
    q = len(ids)
    feed = {
        "input_ids": np.array([ids], np.int64),
        "position_ids": np.arange(start, start + q, dtype=np.int64)[None],
        "attention_mask": attention_mask(np.array([start]), start, q),
        "logits_index": (np.arange(q) if logits_all else np.array([q - 1])).astype(np.int64)[None],
    }
    feed.update(zip(io.past_names, past))
    return feed


def step_feeds(onnx_dir: str | Path, cal: CalibrationSet, max_len: int = 512) -> list[dict]:
    """Feeds of the step graph in `onnx_dir` (float32, batch 1): per sequence (cut to `max_len`)
    a prefill and a step over its tail (TAILS in turn) that reads the prefill's KV, which the
    graph itself computes here."""
    import onnxruntime as ort

    from specrt.schema.graph_files import ONNX_FILE, read_onnx_manifest

    manifest = read_onnx_manifest(onnx_dir)
    cal.require_target(manifest["checkpoint"]["hash"], str(onnx_dir))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(Path(onnx_dir) / ONNX_FILE), opts, providers=["CPUExecutionProvider"])
    io = StepIO(manifest["config"]["num_hidden_layers"])
    _, hkv, _, d = sess.get_inputs()[len(io.input_names) - len(io.past_names)].shape
    feeds = []
    for i, seq in enumerate(cal.sequences):
        seq = list(seq[:max_len])
        tail = TAILS[i % len(TAILS)]
        if len(seq) <= tail + 1:
            continue
        empty = [np.zeros((1, hkv, 0, d), np.float32)] * len(io.past_names)
        head = seq[: len(seq) - tail]
        prefill = _feed(io, head, 0, empty, logits_all=False)
        present = sess.run(io.present_names, prefill)
        feeds += [prefill, _feed(io, seq[len(head) :], len(head), present, logits_all=True)]
    if not feeds:
        raise SpecrtError(f"the calibration set has no sequence longer than {max(TAILS) + 1} tokens")
    return feeds


def activations(model, feeds: list[dict], names: list[str], desc: str, progress: bool = True) -> Iterator[dict]:
    """Per feed, {name: value} of the graph's inner tensors `names` (float32), from one run of the
    graph (the tensors made extra outputs); what a recipe's statistics are computed from."""
    import onnx
    import onnxruntime as ort
    from tqdm import tqdm

    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    known = {o.name for o in tapped.graph.output}
    for name in names:
        if name not in known:
            tapped.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="specrt-tap-") as tmp:  # over 2 GB: external data
        onnx.save_model(tapped, f"{tmp}/a.onnx", save_as_external_data=True, location="a.data")
        sess = ort.InferenceSession(f"{tmp}/a.onnx", opts, providers=["CPUExecutionProvider"])
    for feed in tqdm(feeds, desc=desc, unit="step", disable=not progress):
        yield dict(zip(names, sess.run(names, feed)))
