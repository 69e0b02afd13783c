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

from specrt.calibration import GGUF_SCHEMES
from specrt.calibration.blocks import (
    BLOCK,
    Blocks,
    float_source,
    rewrite_matmuls,
    weight_matmuls,
    write_quantized,
)
from specrt.errors import SpecrtError
from specrt.schema.checkpoint_files import file_digest
from specrt.schema.graph_files import ONNX_FILE

# the GGUF block types read here, each in one of blocks.py's layouts (_split_blocks)
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
FLOATS = ("F32", "F16", "BF16")  # tensors the engines keep as float products
# what a graph of these recipes records, so a graph of an older one is made again (2: a Q8_0
# weight is one 8-bit product with int8 activations; 3: block sums by ReduceSum, the embedding looked up
# from its blocks)
RECIPE_VERSION = 3
ROWS_AT_ONCE = 1 << 23  # weights a tensor's blocks are read in (bounds the temporaries: 8M weights)


# -- the GGUF's blocks ---------------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per value (..., 2) as float32 (...)."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., n) as 2n codes: every low nibble, then every high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _split_blocks(raw: np.ndarray, rows: int, kind: str) -> Blocks:
    """A tensor's raw bytes (rows, row bytes) as blocks of one of blocks.py's layouts, each weight
    exactly as the gguf package dequantizes it, codes one byte each (uint8 0..15, int8):

        Q4_0, Q4_1, Q8_0   their own layouts
        Q5_0               Q8_0's (w = d * q) with q = code - 16 in -16..15
        Q4_K               Q4_1's per 32 weights: scale d * sc and offset -(dmin * m), each an
                           exact float32 product of the super-block's float16 and a 6-bit code
        Q6_K               Q8_0's with blocks of 16: scale d * sc (an int8), q = code - 32
    """
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, size)
    d = _f16(blocks[..., :2])
    if kind == "Q8_0":
        return Blocks(kind, d, blocks[..., 2:].copy().view(np.int8))
    if kind == "Q4_0":
        return Blocks(kind, d, _nibbles(blocks[..., 2:]))
    if kind == "Q4_1":
        return Blocks(kind, d, _nibbles(blocks[..., 4:]), _f16(blocks[..., 2:4]))
    if kind == "Q5_0":
        high = blocks[..., 2:6].copy().view(np.uint32)  # bit i: element i's fifth bit
        high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return Blocks("Q8_0", d, ((_nibbles(blocks[..., 6:]) | (high << 4)) - np.uint8(16)).view(np.int8))
    n = blocks.shape[1]
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        sc, mins = (
            a.reshape(rows, n, 8).astype(np.float32) for a in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        )
        q = _nibbles(blocks[..., 16:].reshape(rows, n, 4, 32))  # (rows, n, 4, 64): sub-blocks 2j, 2j + 1
        scale, offset = d[..., None] * sc, -(_f16(blocks[..., 2:4])[..., None] * mins)
        return Blocks("Q4_1", scale.reshape(rows, -1), q.reshape(rows, -1, 32), offset.reshape(rows, -1))
    # Q6_K: low 4 bits in 128 bytes (two halves of 64: low nibbles, then high), high 2 bits in
    # 64 (two halves of 32: four 2-bit fields each), 16 int8 scales, the float16 d last
    low = _nibbles(blocks[..., :128].reshape(rows, n, 2, 64)).reshape(rows, n, 8, 32)
    high = blocks[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = ((low | ((high & 3).reshape(rows, n, 8, 32) << 4)) - np.uint8(32)).view(np.int8)
    scale = _f16(blocks[..., 208:210])[..., None] * blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    return Blocks("Q8_0", scale.reshape(rows, -1), q.reshape(rows, -1, 16), block=16)


def other_block_types(reader) -> list[str]:
    """The block types of a GGUF's matrices that the gguf schemes do not compute from."""
    return sorted({t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} - set(SUPPORTED) - set(FLOATS))


def require_block_types(reader, path) -> None:
    """Refuse, by name, a GGUF whose matrices the gguf schemes cannot compute from."""
    other = other_block_types(reader)
    if other:
        raise SpecrtError(
            f"{path} stores tensors as {', '.join(other)}: block types the gguf schemes do not compute from (they "
            f"take {', '.join(SUPPORTED)} and float tensors); build its converted checkpoint with --quantize "
            "int8-a8 or int4 instead"
        )


def gguf_blocks(path: str | Path) -> list[tuple[str, Blocks]]:
    """(tensor name, its blocks with rows in the checkpoint's order) of every 2-D tensor stored in
    a supported block type."""
    from specrt.export.gguf import gguf_model_facts, open_gguf

    reader = open_gguf(Path(path))
    _, tensors = gguf_model_facts(reader, Path(path))
    require_block_types(reader, path)
    return [
        (t.name, tensor_blocks(t, tensors.heads(t)))
        for t in reader.tensors
        if t.tensor_type.name in SUPPORTED and len(t.shape) == 2
    ]


def tensor_blocks(t, heads: int | None = None) -> Blocks:
    """One GGUF tensor's blocks (a supported block type), rows in the checkpoint's order: `heads`
    the heads whose rows llama.cpp permuted (export/gguf.py GgufTensors.heads), or None."""
    from specrt.export.gguf import unpermute_rows

    raw, kind = np.asarray(t.data), t.tensor_type.name  # (N rows, their bytes): ggml lists dims as (K, N)
    rows = raw.reshape(int(t.shape[1]), -1)
    step = max(1, ROWS_AT_ONCE // max(1, int(t.shape[0])))  # a few million weights at a time
    parts = [_split_blocks(rows[r : r + step], len(rows[r : r + step]), kind) for r in range(0, len(rows), step)]
    b = parts[0] if len(parts) == 1 else Blocks.concat(parts)
    if heads is None:
        return b

    def rows_back(a):  # the conversion's unpermutation: it moves whole rows
        return None if a is None else np.ascontiguousarray(unpermute_rows(a, heads))

    return Blocks(b.layout, rows_back(b.d), rows_back(b.q), rows_back(b.m), b.block)


def float_tensors(path: str | Path) -> list[str]:
    """The digests of the 2-D tensors a GGUF stores as floats (F32, F16, BF16), as the
    conversion dequantizes them (the float model's weights, rows in the checkpoint's order)."""
    from gguf.quants import dequantize

    from specrt.export.gguf import gguf_family, open_gguf, read_gguf

    reader = open_gguf(Path(path))
    if not any(t.tensor_type.name in FLOATS and len(t.shape) == 2 for t in reader.tensors):
        return []
    if gguf_family(reader, Path(path)).gguf.permuted_qk:  # rows moved by the conversion: read it whole
        _, state, _ = read_gguf(path)
        return [_digest(w.numpy()) for w in state.values() if w.ndim == 2]
    out = []
    for t in reader.tensors:
        if t.tensor_type.name in FLOATS and len(t.shape) == 2:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            out.append(_digest(w.reshape([int(d) for d in reversed(t.shape)])))
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
        "gguf": {"file": gguf_path.name, "sha256": file_digest(gguf_path)},
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
    floats = set(float_tensors(gguf_path))  # stored as floats: their MatMuls stay as they are
    unmatched = [model.graph.node[i].name for i, w in weights if i not in assigned and _digest(w.T) not in floats]
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
    from `gguf_path`'s own blocks, written to `out_dir` with the quantization in its manifest.

    A checkpoint whose weights are the GGUF file's (a .gguf, or `convert --weights gguf`) is
    streamed: each product's blocks are read from its own tensor as the writer reaches it, and
    the graph's tensors go to disk as they are made (peak memory about one tensor besides
    ONNX and torch). A float checkpoint's weights are matched to the blocks by content, as
    quantize_from_gguf matches them (every block tensor is read first)."""
    from specrt.calibration.blocks import BlockProducts
    from specrt.export.checkpoint import gguf_weights
    from specrt.export.fused_graph import export_fused_graph
    from specrt.export.gguf import open_gguf
    from specrt.export.gguf_model import GgufWeight

    gguf_path = Path(gguf_path)
    t0 = time.perf_counter()
    recipe = _recipe(gguf_path, scheme)
    source = gguf_weights(checkpoint)  # the file itself is not hashed again: _recipe just did
    same = source is not None and source.resolve() == gguf_path.resolve()
    if source is not None and not same and file_digest(source) != recipe["gguf"]["sha256"]:
        raise SpecrtError(
            f"{checkpoint} reads its weights from {source}, not from --gguf {gguf_path}; give --gguf {source} "
            "(or leave --gguf out)"
        )
    require_block_types(open_gguf(gguf_path), gguf_path)
    used: dict[str, bool] = {}  # block tensor name -> read by a product
    by_content: dict = {}  # a float checkpoint's: digest -> (name, blocks), and the float tensors

    def blocks_of(weight) -> Blocks | None:
        if isinstance(weight, GgufWeight):
            t = weight.tensor
            used.setdefault(t.name, False)
            if t.tensor_type.name in FLOATS:
                return None  # stored as F32/F16/BF16: a float product, as it is
            used[t.name] = True
            blocks = tensor_blocks(t, weight.heads)
            weight.tensors.release(t)
            return blocks
        if not by_content:
            named = gguf_blocks(gguf_path)
            by_content["blocks"] = {_digest(b.dequantize()): (name, b) for name, b in named}  # by the weight (N, K)
            by_content["floats"] = set(float_tensors(gguf_path))
            used.update({name: False for name, _ in named})
        digest = _digest(weight.detach().float().numpy())
        hit = by_content["blocks"].get(digest)
        if hit is None and digest in by_content["floats"]:
            return None
        if hit is None:
            raise SpecrtError(
                f"a weight of {checkpoint} is not the dequantization of a block tensor of {gguf_path}: the checkpoint "
                "was not converted from this GGUF file; give --gguf the file `specrt convert` read, or convert again"
            )
        used[hit[0]] = True
        return hit[1]

    def unused() -> dict:  # e.g. an embedding that is only looked up
        return {"block_tensors_unused": sorted(name for name, read in used.items() if not read)}

    quantization = {**recipe, "fused": True}
    products = BlockProducts(scheme, blocks_of, "gguf", quantization, t0, extra=unused)
    return export_fused_graph(checkpoint, out_dir, hidden_layers, opset, products=products)
