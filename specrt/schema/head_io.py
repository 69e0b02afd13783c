"""The draft heads' I/O and files, without torch: the one definition of each head family's graph
I/O, its files and the manifest's reader and checks, what the runtime's proposers and the
engines read of a head (the exporters in draft_head.py, head_graph.py and medusa.py import these).
Importing the runtime's drafts therefore never loads torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from specrt.artifacts import ArtifactError, ManifestMismatchError, check_files, read_manifest
from specrt.errors import SpecrtError
from specrt.families import HeadGraph, View
from specrt.schema.config import config_from_manifest

WEIGHTS_FILE, CONFIG_FILE = "head.safetensors", "head.json"


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high feature layers of a target with `num_layers` layers
    (2, L/2, L-3; a model of under 6 layers: 0, L/2, L-1)."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers - 1)


def feature_columns(target_layers, head_layers, hidden_size: int) -> list[int]:
    """Columns of the target's `hidden_states` (layers `target_layers`, `hidden_size` wide each)
    that hold a head's features (layers `head_layers`, in its order); refuses a target that
    lacks one of them."""
    target_layers = list(target_layers)
    missing = [layer for layer in head_layers if layer not in target_layers]
    if missing:
        layers = ",".join(str(x) for x in dict.fromkeys([*target_layers, *head_layers]))
        raise SpecrtError(
            f"the target's step graph returns the features of layers {target_layers}, the head reads "
            f"{list(head_layers)} (missing {missing}); re-export the target with: specrt export --hidden-layers "
            f"{layers} (or build-engines, whose default export returns every head's layers)"
        )
    return [target_layers.index(layer) * hidden_size + i for layer in head_layers for i in range(hidden_size)]


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """What the target's step graph returns by default: every head's layers (EAGLE-3's three,
    then -1, the final normed state, for EAGLE-1), so one export serves both heads."""
    return (*dict.fromkeys(eagle3_layers(num_layers)), -1)


HEAD_KIND = "onnx-draft-head"
HEAD_FILE, HEAD_DATA, D2T_FILE = "head.onnx", "head.onnx.data", "draft_to_target.npy"
HOW_TO_MAKE = "specrt train-draft --method eagle3 --model CHECKPOINT --out DIR"
MANIFEST_FIELDS = {"head": dict, "target": dict, "inputs": list, "outputs": list}


HEAD_FAMILIES = View(lambda family: family.head)  # method -> its HeadGraph, for every family with a head


def head_family(method, where: str = "a head") -> HeadGraph:
    if method not in HEAD_FAMILIES:
        raise ArtifactError(
            f"{where} is of an unknown head family {method!r} (known: {', '.join(HEAD_FAMILIES)}); "
            f"make it again with: {HOW_TO_MAKE}"
        )
    return HEAD_FAMILIES[method]


def head_io(method: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, outputs) of a head family's graph: the one definition the manifest is checked against."""
    family = head_family(method)
    return family.inputs, family.outputs


def read_head_manifest(onnx_dir: str | Path, verify: str = "auto") -> dict:
    """The head export's manifest, its files checked (verify as in specrt.artifacts.check_files)."""
    m = read_manifest(onnx_dir, HEAD_KIND, HOW_TO_MAKE, MANIFEST_FIELDS)
    config_from_manifest(m, onnx_dir, HOW_TO_MAKE)
    family = head_family(m["head"].get("method"), str(onnx_dir))
    inputs, outputs = family.inputs, family.outputs
    if list(m["inputs"]) != list(inputs) or list(m["outputs"]) != list(outputs):
        raise ArtifactError(f"{onnx_dir} holds a head graph of another I/O version; re-export it with: {HOW_TO_MAKE}")
    check_files(onnx_dir, m, (HEAD_FILE, HEAD_DATA, D2T_FILE), HOW_TO_MAKE, verify)
    check_head_parity(m, onnx_dir)
    return m


def check_head_parity(manifest: dict, where) -> None:
    """Refuse a head whose export's parity figures are not finite: its weights are NaN or
    infinite (exports made before the parity check failed on NaN passed such heads)."""
    parity = manifest.get("ort_parity") or {}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in parity.values()):
        raise ArtifactError(
            f"{where} holds a head whose export parity is not finite ({parity}): its weights are NaN or infinite; "
            "train it again (delete the data's features directory first if features.bin may be damaged)"
        )


def read_draft_to_target(onnx_dir: str | Path, manifest: dict) -> np.ndarray:
    d2t = np.load(Path(onnx_dir) / D2T_FILE)
    V, n = manifest["config"]["vocab_size"], manifest["head"]["draft_vocab"]
    if d2t.shape != (n,) or d2t.min() < 0 or d2t.max() >= V or len(np.unique(d2t)) != n:
        raise ArtifactError(f"{onnx_dir}/{D2T_FILE} is not a map of {n} distinct target ids; re-export the head")
    return d2t.astype(np.int64)


def check_head_target(manifest: dict, checkpoint_hash: str | None, precision: str, where: str) -> None:
    """Refuse a head trained against another target, or against another precision of it."""
    t = manifest["target"]
    fix = (
        "train a head for this target with: specrt train-draft --method "
        f"{manifest['head']['method']} --model CHECKPOINT --out DIR"
    )
    if checkpoint_hash is not None and t["checkpoint_hash"] != checkpoint_hash:
        raise ManifestMismatchError(
            f"draft head {where} was trained for the target checkpoint {t['checkpoint_hash'][:19]}..., but the target "
            f"here is {checkpoint_hash[:19]}...; a head reads its own target's hidden states. Use that target's "
            f"engines, or {fix}"
        )
    if t["precision"] != precision:
        raise ManifestMismatchError(
            f"draft head {where} was trained against the target in {t['precision']}, but the target engine here runs "
            f"{precision}; its hidden states differ and acceptance collapses. Use a {t['precision']} engine of the "
            f"target (train-draft trains against float32 features, the precision the float32 and gguf engines "
            "compute)"
        )
