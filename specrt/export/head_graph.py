"""A draft head's step graph in ONNX, with a manifest that names the target it belongs to.

    export_head(head_dir, out_dir, checkpoint)   # HeadLayout(...).weights -> HeadLayout(...).onnx

The graph is DraftHead.forward (I/O: draft_head.HEAD_INPUTS / HEAD_OUTPUTS): dynamic batch, new
positions and past. `draft_to_target.npy` maps its output rows to target token ids and is hashed
with the graph: a head whose map was lost or swapped would draft wrong ids silently.

The manifest's `target` names what the head was trained against: the target checkpoint's hash,
the layers it reads, and the precision of the target that produced its training features. A
head reads the target's hidden states, and those change with the target's weights and precision
(acceptance collapses), so the runtime refuses a head whose `target` is not the engine it drafts
for (`head_io.check_head_target`).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import torch

from specrt.artifacts import (
    ArtifactError,
    atomic_dir,
    file_sha256,
    package_versions,
    write_manifest,
)
from specrt.export.checkpoint import checkpoint_hash
from specrt.export.draft_head import load_head
from specrt.schema.graph_files import save_graph
from specrt.schema.head_io import (
    D2T_FILE,
    HEAD_DATA,
    HEAD_FILE,
    HEAD_KIND,
)


def export_head(
    head_dir: str | Path,
    out_dir: str | Path,
    checkpoint: str | Path,
    precision: str = "float32",
    training: dict | None = None,
    opset: int = 17,
) -> Path:
    """Export the trained head in `head_dir` to `out_dir` (replaced atomically)."""
    import onnx

    head_dir, out_dir = Path(head_dir), Path(out_dir)
    head = load_head(head_dir)
    bad = [n for n, t in head.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ArtifactError(
            f"the head in {head_dir} has weights that are not finite ({len(bad)} tensors: {', '.join(bad[:3])}...): "
            "its training diverged or its data was damaged; train it again (delete the data's features directory first "
            "if features.bin may be damaged)"
        )
    ckpt_hash = checkpoint_hash(checkpoint)
    with atomic_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        traced = tmp / "traced.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter, as for the target
            warnings.filterwarnings("ignore", message=".*Converting a tensor to a Python.*")
            inputs, outputs, dynamic_axes = head.io
            torch.onnx.export(
                _Graph(head),
                head.example_inputs(),
                str(traced),
                input_names=list(inputs),
                output_names=list(outputs),
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        proto = onnx.load(str(traced))
        traced.unlink()
        save_graph(proto, tmp, HEAD_FILE, HEAD_DATA)
        onnx.checker.check_model(str(tmp / HEAD_FILE), full_check=True)
        np.save(tmp / D2T_FILE, head.draft_to_target.numpy())
        parity = ort_parity(head, tmp / HEAD_FILE)
        # written so that NaN fails: `x > tol` is False for NaN, `not x <= tol` is True
        if not parity["logits_max_abs"] <= PARITY_TOLERANCE * max(1.0, parity["logits_scale"]):
            raise ArtifactError(f"the exported head differs from the PyTorch head: {parity}; please report this")
        write_manifest(
            tmp,
            HEAD_KIND,
            {
                "checkpoint": {"path": str(Path(checkpoint).resolve()), "hash": ckpt_hash},
                "config": head.hc.target.to_dict(),
                "head": head.hc.to_dict() | {"feature_width": head.hc.feature_width},
                "target": {"checkpoint_hash": ckpt_hash, "layers": list(head.hc.layers), "precision": precision},
                "training": training or {},
                "ort_parity": parity,
                "inputs": list(inputs),
                "outputs": list(outputs),
                "opset": opset,
                "export_seconds": round(time.perf_counter() - t0, 2),
                "files": {n: file_sha256(tmp / n) for n in (HEAD_FILE, HEAD_DATA, D2T_FILE)},
                "versions": package_versions("torch", "onnx"),
            },
        )
    return out_dir


PARITY_TOLERANCE = 1e-4  # of the logits' magnitude: float32 rounding of the same computation


def ort_parity(head, onnx_file: Path, seed: int = 0) -> dict:
    """Max |ORT - PyTorch| of the first output (logits or log-probabilities) and of the rest, on
    the head's own parity inputs (DraftHead.parity_inputs: a ragged catch-up and tree step)."""
    import onnxruntime as ort

    inputs = head.parity_inputs(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = head(*inputs)
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = session.run(None, dict(zip(head.io[0], (t.numpy() for t in inputs))))
    diffs = [float(np.abs(a - b.numpy()).max()) for a, b in zip(got, want)]
    out = {"logits_max_abs": diffs[0], "logits_scale": float(want[0].abs().max())}
    names = head.io[1]
    return out | {f"{n}_max_abs": d for n, d in zip(names[1:], diffs[1:])}


class _Graph(torch.nn.Module):
    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head

    def forward(self, *inputs):
        return self.head(*inputs)


__all__ = ["export_head"]
