"""The step graph's files and manifest, without torch: what engines and the runtime read of an
export (names, versions, the manifest's reader), apart from the exporter (step_graph.py), so
that reading an engine never imports torch.
"""

from __future__ import annotations

from pathlib import Path

from specrt.artifacts import check_files, file_sha256, package_versions, read_manifest, require_same_checkpoint
from specrt.errors import ArtifactError
from specrt.schema.step_io import INPUT_DTYPES, StepIO

ONNX_KIND = "onnx-step-graph"
# the I/O contract of the step graph; exports of another version are refused and rebuilt
GRAPH_VERSION = 2
ONNX_FILE = "model.onnx"
ONNX_DATA = "model.onnx.data"
DEFAULT_OPSET = 17


def graph_manifest(
    directory: Path, checkpoint: Path, ckpt_hash: str, cfg, hidden_layers, io: StepIO, opset: int, seconds: float
) -> dict:
    """What every step graph's manifest says (either flavour; the exporter adds its own): the
    checkpoint, the model, the features, the I/O and the hashes of the files in `directory`."""
    return {
        "graph_version": GRAPH_VERSION,
        "checkpoint": {"path": str(checkpoint.resolve()), "hash": ckpt_hash},
        "config": cfg.to_dict(),
        "hidden_layers": list(hidden_layers),
        "hidden_size_out": cfg.hidden_size * len(hidden_layers),
        "opset": opset,
        "inputs": io.input_names,
        "outputs": io.output_names,
        "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in io.dynamic_axes.items()},
        "dtypes": {**{n: INPUT_DTYPES[n] for n in io.step_inputs}, "kv": "float32", "logits": "float32"},
        "files": {ONNX_FILE: file_sha256(directory / ONNX_FILE), ONNX_DATA: file_sha256(directory / ONNX_DATA)},
        "export_seconds": round(seconds, 2),
        "versions": package_versions("torch", "onnx", "onnxruntime"),
    }


HOW_TO_EXPORT = "specrt export --model CHECKPOINT --out DIR"
MANIFEST_FIELDS = {"hidden_layers": list, "inputs": list, "outputs": list}  # and graph_version (version 1 had none)


def save_graph(proto, directory: Path, file: str = ONNX_FILE, data: str = ONNX_DATA) -> None:
    """Write a graph as the layout expects it: `file` with every tensor over 1 KiB in `data`
    (the step graph's names by default; draft heads name theirs)."""
    import onnx

    onnx.save_model(
        proto,
        str(Path(directory) / file),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data,
        size_threshold=1024,
    )


def read_onnx_manifest(onnx_dir: str | Path, checkpoint_hash_expected: str | None = None, verify: str = "auto") -> dict:
    """The step graph's manifest; with a checkpoint hash, refuse an export of another checkpoint.
    verify: "auto" hashes model.onnx and its data when they changed since their last check,
    "full" always, "none" never (callers that only compare the recorded hashes)."""
    from specrt.schema.config import config_from_manifest

    m = read_manifest(onnx_dir, ONNX_KIND, HOW_TO_EXPORT, MANIFEST_FIELDS)
    if m.get("graph_version", 1) != GRAPH_VERSION:
        raise ArtifactError(
            f"{onnx_dir} holds step graph version {m.get('graph_version', 1)}, this specrt runs version "
            f"{GRAPH_VERSION}; "
            "re-export it with: specrt export (build-engines does this by itself)"
        )
    config_from_manifest(m, onnx_dir, HOW_TO_EXPORT)
    require_same_checkpoint(
        m,
        checkpoint_hash_expected,
        f"ONNX export {onnx_dir}",
        f"Re-export with: specrt export --model CHECKPOINT --out {onnx_dir}",
    )
    check_files(onnx_dir, m, (ONNX_FILE, ONNX_DATA), HOW_TO_EXPORT, verify)
    return m


def source_onnx_files(manifest: dict) -> dict | None:
    """The file hashes of the ONNX export an engine's manifest names, read from that export's own
    manifest while it is still on disk (None once it is gone); a current engine must match them."""
    source = manifest.get("onnx")
    if (
        not isinstance(source, dict)
        or not isinstance(source.get("path"), str)
        or not (Path(source["path"]) / "manifest.json").is_file()
    ):
        return None
    return read_onnx_manifest(source["path"], verify="none")["files"]
