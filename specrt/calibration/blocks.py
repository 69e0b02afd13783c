"""MatMuls of the float step graph computed from 4-bit blocks on ONNX Runtime's fast kernels.

Every 4-bit recipe here ends as blocks of 32 weights along the input axis, in one of three
layouts, and this module turns them into graph nodes (MatMulNBits: w = (q - zero_point) · scale
per block):

    Q4_0   w = d · (q - 8)          one MatMulNBits (its default zero point is 8)
    Q4_1   w = d · q + m            MatMulNBits with zero points 0 gives x·(d·q); the m part is
                                    each block's sum of x times its m: sums(x) · M, the sums a
                                    ReduceSum over x in blocks and M (K/32, N) the offsets (1/32 of
                                    the weights' count, in float32)
    Q8_0   w = d · q, q in -128..127 = 16·hi + lo, lo in 0..15, hi in -8..7: two MatMulNBits,
                                    (blocks of 32 or 16 weights: a GGUF's Q6_K has a scale per 16)
                                    lo with zero points 0 and scale d, hi + 8 with scale 16·d
                                    (every product is exact in float32: d has 11 significant bits);
                                    with int8 activations one 8-bit MatMulNBits of q + 128 (its
                                    default zero point 128): the head 576 x 49152 took 1.95 ms at
                                    one position against 3.88 for the two 4-bit products (at level
                                    0 the 8-bit kernel took 154 ms)

Q4_1 is how a float offset runs on the integer-zero-point kernels: MatMulNBits also takes float
zero points, but its CPU kernels for them ran 6x slower here, while the block sums cost one small
MatMul per input (shared by the weights that read it). The GGUF recipe (gguf_blocks.py) reads
the blocks from the file; HQQ, GPTQ and AWQ (calibrated.py) compute them.

MatMulNBits runs at accuracy level 0 (dequantize to float32, multiply in float32) unless a
recipe asks for level 4 (the activations quantized to int8 per block of a row, integer dot
products: `gguf-a8`). Either way a row's result is the same bits in every product of two or
more rows, so with the runtime's step floor (schema/step_io.py STEP_FLOOR) speculative output is
bitwise plain output; each engine's manifest measures it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import numpy as np

from specrt.artifacts import atomic_dir, file_sha256, package_versions, write_manifest
from specrt.errors import SpecrtError
from specrt.schema.graph_files import ONNX_DATA, ONNX_FILE, ONNX_KIND, read_onnx_manifest, save_graph

BLOCK = 32  # weights per block (Q4_0, Q4_1 and Q8_0 all use 32)
LAYOUTS = ("Q4_0", "Q4_1", "Q8_0")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One weight (N outputs, K = nb · block inputs) in a block layout: d (N, nb) float32 scales,
    q (N, nb, block) integer codes (any integer type that holds them: a GGUF's are one byte
    each), m (N, nb) float32 offsets (Q4_1 only). Blocks are 32 weights
    but for Q8_0's layout, which also takes 16 (a GGUF's Q6_K: a scale per 16 weights)."""

    layout: str
    d: np.ndarray
    q: np.ndarray
    m: np.ndarray | None = None
    block: int = BLOCK

    @property
    def kind(self) -> tuple[str, int]:
        """What weights must share to run as one product: the layout and the block size."""
        return self.layout, self.block

    def dequantize(self) -> np.ndarray:
        """(N, K) float32."""
        d, q = self.d[..., None], self.q.astype(np.float32)
        if self.layout == "Q4_0":
            w = d * (q - 8)
        elif self.layout == "Q4_1":
            w = d * q + self.m[..., None]
        else:
            w = q * d
        return w.reshape(w.shape[0], -1)

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks:
        """Weights of one layout side by side (their outputs concatenated)."""
        if len({p.kind for p in parts}) != 1:
            raise SpecrtError(f"blocks of {sorted({p.kind for p in parts})} cannot run as one product")
        m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
        d, q = np.concatenate([p.d for p in parts]), np.concatenate([p.q for p in parts])
        return Blocks(parts[0].layout, d, q, m, parts[0].block)


def pack4(q: np.ndarray) -> np.ndarray:
    """(N, nb, block) codes 0..15 -> MatMulNBits' B (N, nb, block / 2): element 2j low nibble,
    2j+1 high."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


class _Rewriter:
    """Builds the nodes and initializers that compute MatMuls from blocks."""

    def __init__(self, prefix: str, accuracy_level: int = 0):
        self.prefix, self.accuracy_level = prefix, accuracy_level
        self.inits: list = []
        self.sink = None  # init(name, array) of a graph being written: its initializers go there instead
        self._sums: dict[str, str] = {}  # input -> its block sums (q, k and v share theirs)

    def add_init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        if self.sink is not None:
            return self.sink(name, array)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def nbits(self, base: str, a: str, out: str, q: np.ndarray, scale: np.ndarray, zero: bool, bits: int = 4):
        """One MatMulNBits over codes q (N, nb, block); zero: explicit zero points 0 (else the
        middle code, 8 or 128); bits 4 or 8 (codes as they are, one byte each)."""
        from onnx import helper

        N, nb, block = q.shape
        codes = pack4(q) if bits == 4 else q.astype(np.uint8)
        inputs = [a, self.add_init(f"{base}.q", codes), self.add_init(f"{base}.scales", scale.astype(np.float32))]
        if zero:
            inputs.append(self.add_init(f"{base}.zp", np.zeros((N, (nb + 1) // 2), np.uint8)))
        return helper.make_node(
            "MatMulNBits",
            inputs,
            [out],
            name=f"{base}/MatMulNBits",
            domain="com.microsoft",
            K=nb * block,
            N=N,
            bits=bits,
            block_size=block,
            accuracy_level=self.accuracy_level,
        )

    def block_sums(self, a: str, nb: int, out: str, base: str) -> list:
        """Each block's sum of `a` (..., nb * 32) as (..., nb): `a` in blocks, summed over each (a
        product with a 0/1 matrix read that matrix, K x K/32 floats: 10 MB for K = 8960; the
        1.5B's decode step took 7 % less without it, 79.5 against 85.2 ms)."""
        from onnx import helper

        shape = self.add_init(f"{base}.in_blocks", np.array([0, 0, nb, BLOCK], np.int64))
        axis = self.add_init(f"{base}.last_axis", np.array([-1], np.int64))
        return [
            helper.make_node("Reshape", [a, shape], [f"{base}.blocks_in"], name=f"{base}/InBlocks"),
            helper.make_node("ReduceSum", [f"{base}.blocks_in", axis], [out], name=f"{base}/BlockSum", keepdims=0),
        ]

    def replace(self, nodes: list, parts: list[Blocks], base: str) -> list:
        """The nodes computing the outputs of `nodes` (MatMuls of one input, their weights all of
        one layout): one computation over the weights side by side (q, k and v are one
        MatMulNBits), split into the outputs."""
        from onnx import helper

        out = nodes[0].output[0] if len(nodes) == 1 else f"{base}.fused"
        new = self._compute(nodes[0].input[0], out, Blocks.concat(parts), base)
        if len(nodes) > 1:
            sizes = self.add_init(f"{base}.split", np.array([p.d.shape[0] for p in parts], np.int64))
            outputs = [n.output[0] for n in nodes]
            new.append(helper.make_node("Split", [out, sizes], outputs, axis=-1, name=f"{base}/Split"))
        return new

    def _compute(self, a: str, out: str, b: Blocks, base: str) -> list:
        from onnx import helper

        nb = b.q.shape[1]
        if b.layout == "Q4_0":
            return [self.nbits(base, a, out, b.q, b.d, zero=False)]
        if b.layout == "Q4_1":
            nodes = [self.nbits(base, a, f"{base}.code_part", b.q, b.d, zero=True)]
            if a not in self._sums:
                self._sums[a] = f"{base}.block_sums"
                nodes += self.block_sums(a, nb, self._sums[a], base)
            offset = f"{base}.offset_part"
            return nodes + [
                helper.make_node("MatMul", [self._sums[a], self.add_init(f"{base}.m", b.m.T)], [offset]),
                helper.make_node("Add", [f"{base}.code_part", offset], [out], name=f"{base}/Add"),
            ]
        if self.accuracy_level == 4:  # int8 activations: one 8-bit product, 2x faster than two 4-bit ones
            codes = b.q.astype(np.int8, copy=False).view(np.uint8) ^ np.uint8(0x80)  # q + 128, in one byte
            return [self.nbits(base, a, out, codes, b.d, zero=False, bits=8)]
        q = b.q.astype(np.int16)
        lo = q & 0x0F
        hi = (q - lo) // 16  # -8..7
        return [
            self.nbits(f"{base}.lo", a, f"{base}.lo_part", lo, b.d, zero=True),
            self.nbits(f"{base}.hi", a, f"{base}.hi_part", hi + 8, 16.0 * b.d, zero=False),
            helper.make_node("Add", [f"{base}.lo_part", f"{base}.hi_part"], [out], name=f"{base}/Add"),
        ]


class BlockProducts:
    """The fused step graph's products (export/fused_graph.py) computed from blocks: the weights
    of one product side by side as one MatMulNBits computation per layout (q/k/v, gate/up: one
    product each), the same nodes the portable graph's rewrite writes. `blocks_of` gives a
    weight's blocks (the float weight (N, K) in, its Blocks out, or None: a weight the recipe
    keeps as floats, whose product is a MatMul; a product with one such weight is all float)."""

    def __init__(self, scheme: str, blocks_of, prefix: str, quantization: dict, t0: float, extra=None):
        """quantization: what the manifest says of the recipe; extra(): more of it, once every
        product is written."""
        self.scheme, self.blocks_of, self.prefix = scheme, blocks_of, prefix
        self.quantization, self.t0, self.extra = quantization, t0, extra
        self.rewriter = _Rewriter(prefix, quantization.get("accuracy_level", 0))
        self.counts: collections.Counter = collections.Counter()

    def manifest(self) -> dict:
        """What the graph's manifest says of the products: the recipe and what it computed."""
        done = {
            "rewritten_matmuls": dict(sorted(self.counts.items())),
            "seconds": round(time.perf_counter() - self.t0, 2),
        }
        return {"quantization": {**self.quantization, **done, **(self.extra() if self.extra else {})}}

    def lookup(self, g, embed, tied: bool) -> str:
        """The embedding of input_ids (B, Q, C) gathered from the table's blocks: one row of codes
        and its scales per token, dequantized in the graph as Blocks.dequantize computes it (the
        same float32 operations, so the same values as the float table), which is never stored:
        the table in 4 or 8 bits, not 32 (a 151,936 x 1536 table: 0.13 GB, not 0.93). A table the
        recipe keeps as floats is looked up as the float graph does."""
        b = self.blocks_of(embed)
        if b is None:
            from specrt.export.graph_writer import FloatProducts

            return FloatProducts().lookup(g, embed, tied)
        return gather_blocks(g, b, "input_ids", "embed.blocks")

    def product(self, g, x: str, weights: list, name: str) -> str:
        from onnx import helper

        self.rewriter.sink = g.init
        parts = [self.blocks_of(w) for w in weights]
        for b in parts:
            self.counts["float" if b is None else b.layout] += 1
        # consecutive weights of one kind run as one computation (a weight kept as floats: a
        # MatMul); kinds side by side are concatenated
        runs: list[list[int]] = []
        for i, b in enumerate(parts):
            kind = None if b is None else b.kind
            if runs and (None if parts[runs[-1][0]] is None else parts[runs[-1][0]].kind) == kind:
                runs[-1].append(i)
            else:
                runs.append([i])
        outs = []
        for j, run in enumerate(runs):
            out = f"{name}/out" if len(runs) == 1 else f"{name}/part{j}"
            if parts[run[0]] is None:
                from specrt.export.graph_writer import FloatProducts

                out = FloatProducts().product(
                    g, x, [weights[i] for i in run], name if len(runs) == 1 else f"{name}.{j}"
                )
            else:
                blocks = Blocks.concat([parts[i] for i in run])
                g.nodes.extend(self.rewriter._compute(x, out, blocks, f"{self.prefix}.{name}.{j}"))
            outs.append(out)
        if len(outs) > 1:
            g.nodes.append(helper.make_node("Concat", outs, [f"{name}/out"], name=f"{name}/Concat", axis=-1))
        return f"{name}/out"


def gather_blocks(g, b: Blocks, ids: str, name: str) -> str:
    """Rows `ids` (B, Q) of the weight in blocks `b` (V, K), dequantized: (B, Q, K) float32.
    The codes stay packed two to a byte (4-bit layouts) or one int8 each (Q8_0's) until a row
    is gathered; w = d * (q - 8), d * q + m or q * d, as Blocks.dequantize."""
    V, nb, block = b.q.shape
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    if b.layout == "Q8_0":
        codes = g.init(f"{name}.codes", b.q.astype(np.int8).reshape(V, -1))
    else:
        codes = g.init(f"{name}.codes", pack4(b.q).reshape(V, -1))
    rows = g.node("Gather", [codes, ids], [f"{name}/codes"], f"{name}/GatherCodes")[0]  # (B, Q, K or K/2)
    q = g.node("Cast", [rows], [f"{name}/codes32"], f"{name}/CastCodes", to=6)[0]  # int32
    if b.layout != "Q8_0":  # element 2j in the low nibble, 2j + 1 in the high one (pack4)
        sixteen, last = g.init(f"{name}.16", np.array(16, np.int32)), g.init(f"{name}.last", i64(-1))
        high = g.node("Div", [q, sixteen], [f"{name}/high"], f"{name}/High")[0]
        high16 = g.node("Mul", [high, sixteen], [f"{name}/high16"], f"{name}/High16")[0]
        low = g.node("Sub", [q, high16], [f"{name}/low"], f"{name}/Low")[0]
        pairs = [g.node("Unsqueeze", [t, last], [f"{t}/1"], f"{t}/Unsqueeze")[0] for t in (low, high)]
        q = g.node("Concat", pairs, [f"{name}/pairs"], f"{name}/Pairs", axis=-1)[0]
    shape = g.init(f"{name}.blocks", i64(0, 0, nb, block))  # (B, Q, nb, block): 0 keeps B and Q
    q = g.node("Reshape", [q, shape], [f"{name}/q"], f"{name}/Blocks")[0]
    w = g.node("Cast", [q], [f"{name}/qf"], f"{name}/CastFloat", to=1)[0]
    d = g.node("Gather", [g.init(f"{name}.d", b.d[..., None]), ids], [f"{name}/d"], f"{name}/GatherD")[0]
    if b.layout == "Q4_0":
        eight = g.init(f"{name}.8", np.array(8, np.float32))
        w = g.node("Sub", [w, eight], [f"{name}/centred"], f"{name}/Centre")[0]
    w = g.node("Mul", [d, w], [f"{name}/scaled"], f"{name}/Scale")[0]
    if b.layout == "Q4_1":
        m = g.node("Gather", [g.init(f"{name}.m", b.m[..., None]), ids], [f"{name}/m"], f"{name}/GatherM")[0]
        w = g.node("Add", [w, m], [f"{name}/offset"], f"{name}/Offset")[0]
    return g.node("Reshape", [w, g.init(f"{name}.rows", i64(0, 0, nb * block))], [f"{name}/rows"], f"{name}/Rows")[0]


def float_source(onnx_dir: str | Path) -> dict:
    """The manifest of the float32 step graph a recipe starts from; a graph already quantized is
    refused (every recipe computes from the float weights)."""
    source = read_onnx_manifest(onnx_dir)
    if source.get("quantization"):
        raise SpecrtError(
            f"{onnx_dir} is already quantized ({source['quantization']['scheme']}); quantize the float32 export "
            "instead."
        )
    return source


def replace_nodes(graph, nodes: list, new_inits: list) -> None:
    """Give `graph` these nodes, and keep of its initializers only those still read, plus `new_inits`."""
    graph.ClearField("node")
    graph.node.extend(nodes)
    read = {x for n in graph.node for x in n.input}
    kept = [i for i in graph.initializer if i.name in read]
    graph.ClearField("initializer")
    graph.initializer.extend(kept + new_inits)


def weight_matmuls(model) -> list[tuple[int, np.ndarray]]:
    """(node index, weight (K, N) float32) of every MatMul whose second input is a constant 2-D
    initializer: the matrices a recipe quantizes."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for i, node in enumerate(model.graph.node):
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in inits:
            w = numpy_helper.to_array(inits[node.input[1]])
            if w.ndim == 2 and w.shape[0] % BLOCK == 0:
                out.append((i, w))
    return out


def rewrite_matmuls(
    model, assigned: dict[int, tuple[str, Blocks]], prefix: str, fuse: bool = True, accuracy_level: int = 0
) -> dict:
    """Replace the MatMul nodes `assigned` (node index -> (a label, its weight's blocks)) in place;
    returns how many of each layout. fuse: MatMuls of one input whose weights have one 4-bit
    layout run as one (q/k/v, gate/up: fewer, larger kernel calls), where the first of them was."""
    import onnx

    graph = model.graph
    rewriter = _Rewriter(prefix, accuracy_level)
    groups = collections.defaultdict(list)
    for i, (_, b) in assigned.items():
        groups[(graph.node[i].input[0], b.kind) if fuse and b.layout != "Q8_0" else i].append(i)
    first = {members[0]: members for members in groups.values()}
    new_nodes, counts = [], collections.Counter()
    for i, node in enumerate(graph.node):
        if i not in assigned:
            new_nodes.append(node)
        elif i in first:
            members = first[i]
            base = f"{prefix}.{assigned[i][0]}"
            new_nodes.extend(
                rewriter.replace([graph.node[j] for j in members], [assigned[j][1] for j in members], base)
            )
            counts[assigned[i][1].layout] += len(members)
    replace_nodes(graph, new_nodes, rewriter.inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return dict(sorted(counts.items()))


def write_quantized(
    model, source: dict, onnx_dir: Path, out_dir: Path, quantization: dict, t0: float, *packages: str
) -> Path:
    """Save a quantized step graph to `out_dir` (atomically) with the source export's manifest
    plus `quantization` (its time since `t0` added) and the source's hashes."""
    with atomic_dir(out_dir) as tmp:
        save_graph(model, tmp)
        manifest = {
            k: v for k, v in source.items() if k not in ("kind", "schema_version", "created", "files", "versions")
        }
        manifest.update(
            {
                "quantization": {**quantization, "seconds": round(time.perf_counter() - t0, 2)},
                "source_onnx": {"path": str(Path(onnx_dir).resolve()), "files": source["files"]},
                "files": {ONNX_FILE: file_sha256(tmp / ONNX_FILE), ONNX_DATA: file_sha256(tmp / ONNX_DATA)},
                "versions": package_versions("onnx", "onnxruntime", *packages),
            }
        )
        write_manifest(tmp, ONNX_KIND, manifest)
    return out_dir
