"""A 4-bit step graph from a GGUF file's own blocks: no second rounding.

A GGUF checkpoint's weights already are low precision, and `specrt convert` writes their exact
dequantization as float32. Quantizing that float model again (round to nearest, `int4`) rounds a
second time onto another grid and changes the model (~28 % top-1 disagreement on the default
model). Here each MatMul of the float step graph is instead computed from the very blocks the GGUF
stores, with ONNX Runtime's 4-bit kernel (MatMulNBits, w = (q - zero_point) · scale per block
of 32 along the input axis), so the engine computes the float model up to float rounding:

    Q4_0   w = d · (q - 8)          one MatMulNBits (its default zero point is 8)
    Q4_1   w = d · q + m            MatMulNBits with zero points 0 gives x·(d·q); the m part is
                                    each block's sum of x times its m: (x · S) · M, with S the
                                    (K, K/32) block-summing 0/1 matrix and M (K/32, N) the offsets
                                    (1/32 of the weights' count, in float32)
    Q8_0   w = d · q, q in -128..127 = 16·hi + lo, lo in 0..15, hi in -8..7: two MatMulNBits,
                                    lo with zero points 0 and scale d, hi + 8 with scale 16·d
                                    (every product is exact in float32: d has 11 significant bits)

MatMulNBits runs at accuracy level 0 (dequantize to float32, multiply in float32), so a
position's logits do not depend on how many positions a step computes (the engine's manifest
measures it), and speculative output stays equal to plain output.

Which GGUF tensor feeds which MatMul is found by content, not by name: a weight is rewritten
only when the float graph's initializer is bit for bit the dequantization of a GGUF tensor (the
q/k rows unpermuted as the conversion does), so the rewrite is exact by construction and a GGUF
that is not the checkpoint's source is refused. Tensors stored as F32/F16 stay as they are; the
embedding lookup keeps its float table (a lookup reads one row per token, not the table).
"""

from __future__ import annotations

import collections
import hashlib
import time
from pathlib import Path

import numpy as np

from specrt.artifacts import atomic_dir, file_sha256, package_versions, write_manifest
from specrt.errors import SpecrtError
from specrt.export.step_graph import ONNX_DATA, ONNX_FILE, ONNX_KIND, read_onnx_manifest, save_graph

BLOCK = 32  # weights per block for Q4_0, Q4_1 and Q8_0
SCHEME = "gguf"
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")


# -- the GGUF's blocks ---------------------------------------------------------------------------


def _split_blocks(raw: np.ndarray, rows: int, kind: str) -> dict[str, np.ndarray]:
    """A tensor's raw bytes (rows, row bytes) as its block fields: d (rows, nb) float32, q (rows,
    nb, 32) integer codes, and m (rows, nb) float32 for Q4_1."""
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    out = {"d": d}
    if kind == "Q8_0":
        out["q"] = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
        return out
    start = 2
    if kind == "Q4_1":
        out["m"] = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        start = 4
    qs = blocks[..., start:]  # byte j: element j (low nibble) and element j + 16 (high nibble)
    out["q"] = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
    return out


def _dequantize(fields: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """(rows, K) float32, as the gguf package dequantizes (the converted checkpoint's weights)."""
    d, q = fields["d"][..., None], fields["q"].astype(np.float32)
    if kind == "Q4_0":
        w = d * (q - 8)
    elif kind == "Q4_1":
        w = d * q + fields["m"][..., None]
    else:
        w = q * d
    return w.reshape(w.shape[0], -1)


def _pack4(q: np.ndarray) -> np.ndarray:
    """(N, nb, 32) codes 0..15 -> MatMulNBits' B (N, nb, 16): element 2j low nibble, 2j+1 high."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def gguf_blocks(path: str | Path) -> list[tuple[str, str, dict[str, np.ndarray]]]:
    """(tensor name, type, block fields with rows in the checkpoint's order) of every 2-D tensor
    stored in a supported block type."""
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
        fields = _split_blocks(np.asarray(t.data), rows, kind)
        role = t.name.split(".")[-2]
        if arch == "llama" and role in ("attn_q", "attn_k"):
            heads = n_head if role == "attn_q" else n_kv
            # the conversion's unpermutation, on the block fields (it moves whole rows)
            fields = {k: np.ascontiguousarray(unpermute_rows(v, heads)) for k, v in fields.items()}
        out.append((t.name, kind, fields))
    return out


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


# -- the graph rewrite ---------------------------------------------------------------------------


class _Rewriter:
    """Replaces MatMul nodes of a float step graph by block computations, collecting the new
    initializers and nodes."""

    def __init__(self, graph):
        self.graph = graph
        self.inits: list = []
        self._ones: dict[int, str] = {}  # K -> name of its (K, K/32) block-summing matrix
        self._sums: dict[str, str] = {}  # input -> its block sums (q, k and v share theirs)

    def add_init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def nbits(self, base: str, a: str, out: str, q: np.ndarray, scale: np.ndarray, zero: bool):
        """One MatMulNBits over codes q (N, nb, 32); zero: explicit zero points 0 (else 8)."""
        from onnx import helper

        N, nb, _ = q.shape
        inputs = [a, self.add_init(f"{base}.q", _pack4(q)), self.add_init(f"{base}.scales", scale.astype(np.float32))]
        if zero:
            inputs.append(self.add_init(f"{base}.zp", np.zeros((N, (nb + 1) // 2), np.uint8)))
        return helper.make_node(
            "MatMulNBits",
            inputs,
            [out],
            name=f"{base}/MatMulNBits",
            domain="com.microsoft",
            K=nb * BLOCK,
            N=N,
            bits=4,
            block_size=BLOCK,
            accuracy_level=0,
        )

    def block_sum_matrix(self, K: int) -> str:
        if K not in self._ones:
            S = np.zeros((K, K // BLOCK), np.float32)
            S[np.arange(K), np.arange(K) // BLOCK] = 1.0
            self._ones[K] = self.add_init(f"gguf.block_sum.{K}", S)
        return self._ones[K]

    def replace(self, nodes: list, kind: str, parts: list[dict[str, np.ndarray]], base: str) -> list:
        """The nodes computing the outputs of `nodes` (MatMuls of one input, their weights all of
        `kind`) from the blocks: one computation over the weights side by side (q, k and v are one
        MatMulNBits), split into the outputs."""
        from onnx import helper

        fields = {k: np.concatenate([f[k] for f in parts]) for k in parts[0]}
        out = nodes[0].output[0] if len(nodes) == 1 else f"{base}.fused"
        new = self._compute(nodes[0].input[0], out, kind, fields, base)
        if len(nodes) > 1:
            sizes = self.add_init(f"{base}.split", np.array([f["d"].shape[0] for f in parts], np.int64))
            outputs = [n.output[0] for n in nodes]
            new.append(helper.make_node("Split", [out, sizes], outputs, axis=-1, name=f"{base}/Split"))
        return new

    def _compute(self, a: str, out: str, kind: str, fields: dict[str, np.ndarray], base: str) -> list:
        from onnx import helper

        d, q = fields["d"], fields["q"]
        nb = q.shape[1]
        if kind == "Q4_0":
            return [self.nbits(base, a, out, q, d, zero=False)]
        if kind == "Q4_1":
            nodes = [self.nbits(base, a, f"{base}.code_part", q, d, zero=True)]
            if a not in self._sums:
                self._sums[a] = f"{base}.block_sums"
                S = self.block_sum_matrix(nb * BLOCK)
                nodes.append(helper.make_node("MatMul", [a, S], [self._sums[a]], name=f"{base}/BlockSum"))
            offset = f"{base}.offset_part"
            return nodes + [
                helper.make_node("MatMul", [self._sums[a], self.add_init(f"{base}.m", fields["m"].T)], [offset]),
                helper.make_node("Add", [f"{base}.code_part", offset], [out], name=f"{base}/Add"),
            ]
        lo = q & 0x0F
        hi = (q - lo) // 16  # -8..7
        return [
            self.nbits(f"{base}.lo", a, f"{base}.lo_part", lo, d, zero=True),
            self.nbits(f"{base}.hi", a, f"{base}.hi_part", hi + 8, 16.0 * d, zero=False),
            helper.make_node("Add", [f"{base}.lo_part", f"{base}.hi_part"], [out], name=f"{base}/Add"),
        ]


def quantize_from_gguf(
    onnx_dir: str | Path, out_dir: str | Path, gguf_path: str | Path, progress: bool = True, fuse: bool = True
) -> Path:
    """Rewrite the float step graph in `onnx_dir` (exported from `gguf_path`'s conversion) onto
    the GGUF's own blocks, into `out_dir` (written atomically). fuse: MatMuls of one input whose
    weights have one 4-bit type run as one."""
    import onnx
    from onnx import numpy_helper
    from tqdm import tqdm

    onnx_dir, out_dir, gguf_path = Path(onnx_dir), Path(out_dir), Path(gguf_path)
    source = read_onnx_manifest(onnx_dir)
    if source.get("quantization"):
        raise SpecrtError(f"{onnx_dir} is already quantized; rewrite the float32 export instead.")
    t0 = time.perf_counter()
    steps = tqdm(total=3, desc="quantize gguf", unit="step", disable=not progress)
    steps.set_postfix_str("read blocks")
    blocks = {}
    for name, kind, fields in gguf_blocks(gguf_path):
        # a weight (N, K) is a MatMul's B as (K, N)
        blocks[_digest(_dequantize(fields, kind).T)] = (name, kind, fields)
    if not blocks:
        raise SpecrtError(
            f"{gguf_path} stores no tensor as {', '.join(SUPPORTED)}; the gguf scheme rewrites those block types only"
        )
    model = onnx.load(str(onnx_dir / ONNX_FILE))
    steps.update()
    steps.set_postfix_str("rewrite")
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    rewriter = _Rewriter(graph)
    matched = {}  # node index -> (GGUF tensor name, block type, fields)
    for i, node in enumerate(graph.node):
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        found = blocks.get(_digest(numpy_helper.to_array(weight))) if weight is not None else None
        if found is not None:
            matched[i] = found
    # MatMuls of one input with weights of one 4-bit type run as one (q/k/v, gate/up): fewer,
    # larger kernel calls; each group is computed where its first member was
    groups = collections.defaultdict(list)
    for i, (_, kind, _) in matched.items():
        groups[(graph.node[i].input[0], kind) if fuse and kind != "Q8_0" else i].append(i)
    first = {members[0]: members for members in groups.values()}
    new_nodes, used, counts = [], set(), collections.Counter()
    for i, node in enumerate(graph.node):
        if i not in matched:
            new_nodes.append(node)
        elif i in first:
            members = first[i]
            kind = matched[i][1]
            base = f"gguf.{matched[i][0]}"
            new_nodes.extend(
                rewriter.replace([graph.node[j] for j in members], kind, [matched[j][2] for j in members], base)
            )
            used.update(matched[j][0] for j in members)
            counts[kind] += len(members)
    if not used:
        raise SpecrtError(
            f"no weight of {onnx_dir} is the dequantization of a block tensor of {gguf_path}: the checkpoint was not "
            f"converted from this GGUF file; give --gguf the file `specrt convert` read, or use --quantize int4"
        )
    missing = sorted(name for name, _, _ in blocks.values() if name not in used)
    unmatched = [n.name for n in new_nodes if n.op_type == "MatMul" and n.input[1] in inits]
    if unmatched:
        raise SpecrtError(
            f"{len(unmatched)} weight(s) of {onnx_dir} match no tensor of {gguf_path} (e.g. {unmatched[0]}): the "
            "checkpoint differs from this GGUF's dequantization; convert the GGUF again (specrt convert) and export"
        )
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    still_read = {x for n in graph.node for x in n.input}
    kept = [i for i in graph.initializer if i.name in still_read]
    graph.ClearField("initializer")
    graph.initializer.extend(kept + rewriter.inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    steps.update()
    steps.set_postfix_str("save")
    with atomic_dir(out_dir) as tmp:
        save_graph(model, tmp)
        manifest = {
            k: v for k, v in source.items() if k not in ("kind", "schema_version", "created", "files", "versions")
        }
        manifest.update(
            {
                "quantization": {
                    "scheme": SCHEME,
                    "method": "the GGUF's own blocks (no second rounding)",
                    "bits": 4,
                    "block_size": BLOCK,
                    "accuracy_level": 0,
                    "gguf": {"file": gguf_path.name, "sha256": file_sha256(gguf_path)},
                    "rewritten_matmuls": dict(sorted(counts.items())),
                    "fused": fuse,
                    "block_tensors_unused": missing,  # e.g. an embedding that is only looked up
                    "seconds": round(time.perf_counter() - t0, 2),
                },
                "source_onnx": {"path": str(onnx_dir.resolve()), "files": source["files"]},
                "files": {ONNX_FILE: file_sha256(tmp / ONNX_FILE), ONNX_DATA: file_sha256(tmp / ONNX_DATA)},
                "versions": package_versions("onnx", "onnxruntime", "gguf"),
            }
        )
        write_manifest(tmp, ONNX_KIND, manifest)
    steps.update()
    steps.close()
    return out_dir
