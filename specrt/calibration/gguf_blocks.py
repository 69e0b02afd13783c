"""A 4-bit step graph from a GGUF file's own blocks: no second rounding.

A GGUF checkpoint's weights already are low precision, and `specrt convert` writes their exact
dequantization as float32. Quantizing that float model again (round to nearest, `int4`) rounds a
second time onto another grid and changes the model (~28 % top-1 disagreement on the default
model). Here each MatMul of the float step graph is instead computed from the very blocks the GGUF
stores, with ONNX Runtime's 4-bit kernels, in the layouts of `blocks.py` (Q4_0, Q4_1, Q8_0,
the GGUF's own), so the engine computes the float model up to float rounding.

Two schemes compute from the blocks (calibration.GGUF_SCHEMES): `gguf` with float32 activations
(MatMulNBits accuracy level 0), and `gguf-a8` with int8 activations (level 4: the activations of
each block of a row rounded to int8, integer dot products; 2-3x faster kernels, and what
llama.cpp and onnxruntime-genai compute), which is no longer the float model within float
rounding but its own model, and its manifest's precision says so.

Which GGUF tensor feeds which MatMul is found by content, not by name: a weight is rewritten
only when the float graph's initializer is bit for bit the dequantization of a GGUF tensor (the
q/k rows unpermuted as the conversion does), so the rewrite is exact by construction and a GGUF
that is not the checkpoint's source is refused. Tensors stored as F32/F16 stay as they are; the
embedding lookup keeps its float table (a lookup reads one row per token, not the table).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from specrt.artifacts import file_sha256
from specrt.calibration import GGUF_SCHEMES
from specrt.calibration.blocks import (
    BLOCK,
    LAYOUTS,
    Blocks,
    float_source,
    rewrite_matmuls,
    weight_matmuls,
    write_quantized,
)
from specrt.errors import SpecrtError
from specrt.export.graph_files import ONNX_FILE

SUPPORTED = LAYOUTS  # the GGUF block types read here: blocks.py computes each in its own layout
# what a graph of these recipes records, so a graph of an older one is made again (2: a Q8_0
# weight is one 8-bit product with int8 activations)
RECIPE_VERSION = 2


# -- the GGUF's blocks ---------------------------------------------------------------------------


def _split_blocks(raw: np.ndarray, rows: int, kind: str) -> Blocks:
    """A tensor's raw bytes (rows, row bytes) as its blocks: d (rows, nb) float32, q (rows, nb, 32)
    integer codes, and m (rows, nb) float32 for Q4_1."""
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return Blocks(kind, d, blocks[..., 2:].copy().view(np.int8).astype(np.int16))
    start, m = 2, None
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        start = 4
    qs = blocks[..., start:]  # byte j: element j (low nibble) and element j + 16 (high nibble)
    return Blocks(kind, d, np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16), m)


def gguf_blocks(path: str | Path) -> list[tuple[str, Blocks]]:
    """(tensor name, its blocks with rows in the checkpoint's order) of every 2-D tensor stored in
    a supported block type."""
    from specrt.export.gguf import gguf_field, open_gguf, unpermute_rows

    reader = open_gguf(Path(path))
    arch = gguf_field(reader, "general.architecture")
    n_head = int(gguf_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_head))
    out = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED or len(t.shape) != 2:
            continue
        rows = int(t.shape[1])  # ggml lists dims innermost first: (K, N)
        b = _split_blocks(np.asarray(t.data), rows, kind)
        role = t.name.split(".")[-2]
        if arch == "llama" and role in ("attn_q", "attn_k"):
            heads = n_head if role == "attn_q" else n_kv

            def rows_back(a, heads=heads):  # the conversion's unpermutation: it moves whole rows
                return None if a is None else np.ascontiguousarray(unpermute_rows(a, heads))

            b = Blocks(kind, rows_back(b.d), rows_back(b.q), rows_back(b.m))
        out.append((t.name, b))
    return out


def _recipe(gguf_path: Path, scheme: str) -> dict:
    """What a gguf graph's manifest says of how it was made (both flavours)."""
    if scheme not in GGUF_SCHEMES:
        raise SpecrtError(f"unknown GGUF scheme {scheme!r}; choose one of {', '.join(GGUF_SCHEMES)}")
    return {
        "scheme": scheme,
        "method": "the GGUF's own blocks (no second rounding)",
        "bits": 4,
        "block_size": BLOCK,
        "accuracy_level": GGUF_SCHEMES[scheme],
        "recipe_version": RECIPE_VERSION,
        "gguf": {"file": gguf_path.name, "sha256": file_sha256(gguf_path)},
    }


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


# -- the graph rewrite ---------------------------------------------------------------------------


def quantize_from_gguf(
    onnx_dir: str | Path,
    out_dir: str | Path,
    gguf_path: str | Path,
    progress: bool = True,
    fuse: bool = True,
    scheme: str = "gguf",
) -> Path:
    """Rewrite the float step graph in `onnx_dir` (exported from `gguf_path`'s conversion) onto
    the GGUF's own blocks, into `out_dir` (written atomically). fuse: MatMuls of one input whose
    weights have one 4-bit type run as one; scheme: "gguf" or "gguf-a8" (the activations')."""
    import onnx
    from tqdm import tqdm

    onnx_dir, out_dir, gguf_path = Path(onnx_dir), Path(out_dir), Path(gguf_path)
    source = float_source(onnx_dir)
    t0 = time.perf_counter()
    recipe = _recipe(gguf_path, scheme)
    steps = tqdm(total=3, desc=f"quantize {scheme}", unit="step", disable=not progress)
    steps.set_postfix_str("read blocks")
    # a weight (N, K) is a MatMul's B as (K, N)
    blocks = {_digest(b.dequantize().T): (name, b) for name, b in gguf_blocks(gguf_path)}
    if not blocks:
        raise SpecrtError(
            f"{gguf_path} stores no tensor as {', '.join(SUPPORTED)}; the {scheme} scheme rewrites those block "
            "types only"
        )
    model = onnx.load(str(onnx_dir / ONNX_FILE))
    steps.update()
    steps.set_postfix_str("rewrite")
    weights = weight_matmuls(model)
    assigned = {i: blocks[_digest(w)] for i, w in weights if _digest(w) in blocks}
    if not assigned:
        raise SpecrtError(
            f"no weight of {onnx_dir} is the dequantization of a block tensor of {gguf_path}: the checkpoint was not "
            f"converted from this GGUF file; give --gguf the file `specrt convert` read, or use --quantize int4"
        )
    unmatched = [model.graph.node[i].name for i, _ in weights if i not in assigned]
    if unmatched:
        raise SpecrtError(
            f"{len(unmatched)} weight(s) of {onnx_dir} match no tensor of {gguf_path} (e.g. {unmatched[0]}): the "
            "checkpoint differs from this GGUF's dequantization; convert the GGUF again (specrt convert) and export"
        )
    used = {name for name, _ in assigned.values()}
    missing = sorted(name for name, _ in blocks.values() if name not in used)
    counts = rewrite_matmuls(model, assigned, prefix="gguf", fuse=fuse, accuracy_level=recipe["accuracy_level"])
    steps.update()
    steps.set_postfix_str("save")
    quantization = {
        **recipe,
        "rewritten_matmuls": counts,
        "fused": fuse,
        "block_tensors_unused": missing,  # e.g. an embedding that is only looked up
    }
    write_quantized(model, source, onnx_dir, out_dir, quantization, t0, "gguf")
    steps.update()
    steps.close()
    return out_dir


def fused_from_gguf(
    checkpoint: str | Path,
    out_dir: str | Path,
    gguf_path: str | Path,
    hidden_layers: tuple[int, ...] | None = None,
    opset: int = 17,
    scheme: str = "gguf",
) -> Path:
    """The fused step graph (export/fused_graph.py) of `checkpoint` with every product computed
    from `gguf_path`'s own blocks (found by content, as quantize_from_gguf finds them), written
    to `out_dir` with the quantization in its manifest."""
    from specrt.calibration.blocks import BlockProducts
    from specrt.export.fused_graph import export_fused_graph

    gguf_path = Path(gguf_path)
    t0 = time.perf_counter()
    recipe = _recipe(gguf_path, scheme)
    named = gguf_blocks(gguf_path)
    blocks = {_digest(b.dequantize()): (name, b) for name, b in named}  # by the weight (N, K)
    used: set[str] = set()
    if not blocks:
        raise SpecrtError(
            f"{gguf_path} stores no tensor as {', '.join(SUPPORTED)}; the {scheme} scheme rewrites those block "
            "types only"
        )

    def blocks_of(weight: np.ndarray) -> Blocks:
        hit = blocks.get(_digest(weight))
        if hit is None:
            raise SpecrtError(
                f"a weight of {checkpoint} is not the dequantization of a block tensor of {gguf_path}: the checkpoint "
                "was not converted from this GGUF file; give --gguf the file `specrt convert` read, or convert again"
            )
        used.add(hit[0])
        return hit[1]

    def unused() -> dict:  # e.g. an embedding that is only looked up
        return {"block_tensors_unused": sorted(name for name, _ in named if name not in used)}

    quantization = {**recipe, "fused": True}
    products = BlockProducts(scheme, blocks_of, "gguf", quantization, t0, extra=unused)
    return export_fused_graph(checkpoint, out_dir, hidden_layers, opset, products=products)
