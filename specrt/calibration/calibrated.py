"""Fitted int4 recipes for checkpoints that are not GGUF: HQQ (data-free), GPTQ and AWQ (calibrated).

All keep blocks of 32 weights along the input axis with a scale and an offset per block, like
round to nearest (`int4`), but fit them better:

  hqq   Half-Quadratic Quantization: per block, the offset is fitted by a proximal solver to
        minimise an lp-norm (p < 1) of the weight error, which spends the 16 levels on the bulk
        of the weights rather than on outliers. No data. ONNX Runtime's quantizer implements the
        solver (`HQQWeightOnlyQuantizer`), and used as it is its offsets are float zero points,
        whose MatMulNBits CPU kernels ran 6x slower here; so the fitted blocks are written in
        the Q4_1 layout of blocks.py (w = d·q + m, m = -d·zero), which computes the same weights on
        the integer kernels at the GGUF engine's speed.
  gptq  GPTQ: weights are rounded one input row at a time, and each row's rounding error is
        pushed onto the rows not yet rounded through the inverse Hessian of the layer's inputs
        (X^T X over the calibration activations), so the layer's output error, not the weight
        error, is minimised. Written here (`gptq_blocks`, in PyTorch) rather than taken from
        ONNX Runtime's quantizer (1.32), which has a GPTQ too: its error feedback reads a column
        of the upper Cholesky factor where the row is needed, so nothing is fed back and its
        result equals min-max rounding (tests/test_calibrated.py shows both); it also runs the
        whole graph over every feed once per MatMul input (181 times for the default model: 81 %
        done after 13 minutes with 32 sequences here; `hessians` runs it once per feed), fails
        on inputs with an odd number of blocks (the tiny test model's MLP), and re-rounds its
        result. Its blocks are min-max with a float offset (the Q4_1 layout, as for HQQ); the
        activations come from `data.step_feeds`: the target's own answers, at prefill, decode
        and verification shapes.

  awq   AWQ: the input of each projection is divided per channel by s = mean|x|^alpha
        (normalised) and the weight rows multiplied by it before rounding, so channels that
        carry large activations, whose weight errors cost the most, get finer steps; alpha is
        chosen per input on a grid over [0, 1] to keep the outputs on a sample of the calibration
        activations (alpha 0 is plain rounding, so the fit is never worse on its sample). The
        division is a Mul before the (fused) MatMulNBits. Written here: the maintained AWQ
        implementations quantize PyTorch models for GPUs (and ONNX Runtime's wraps NVIDIA's
        ModelOpt, which downloads its calibration data).

All start each block from min-max with a float offset, so on a checkpoint whose weights are
already 4-bit blocks of 32 (the default model: its GGUF's Q4_1) they find those blocks again and
compute the float model; what they fit shows on weights that are not on such a grid.

All run at accuracy level 0 (float32 products), so speculative output stays equal to plain
output on them. The manifest records the recipe, and for GPTQ and AWQ the calibration set's hash,
size and origin.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specrt.calibration.blocks import BLOCK, Blocks, float_source, rewrite_matmuls, weight_matmuls, write_quantized
from specrt.calibration.data import CalibrationSet, activations, step_feeds
from specrt.errors import SpecrtError
from specrt.schema.graph_files import ONNX_FILE

RECIPES = ("hqq", "gptq", "awq")
# bumped whenever a recipe computes other blocks: graphs of an older version are made again
RECIPE_VERSION = 3


def hqq_blocks(w: np.ndarray) -> Blocks:
    """HQQ's 4-bit blocks of a MatMul weight w (K, N), in the Q4_1 layout."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=BLOCK, bits=4))
    # blocks run along the input axis: quantize W^T (N, K) along its axis 1
    # round_zero=False: the offset is stored as a float (Q4_1), so it need not be an integer;
    # started from min-max, a block already on a 4-bit grid (a GGUF's Q4_1) stays on it
    q, scale, zero = quantizer.quantize_internal(
        torch.from_numpy(np.ascontiguousarray(w.T)), bits=4, group_size=BLOCK, round_zero=False
    )
    n, k = w.shape[1], w.shape[0]
    d = scale.numpy().astype(np.float32).reshape(n, k // BLOCK)
    m = (-zero.numpy().astype(np.float32).reshape(n, k // BLOCK)) * d  # (q - zero)·d = d·q + m
    return Blocks("Q4_1", d, q.numpy().astype(np.int16).reshape(n, k // BLOCK, BLOCK), m)


def q8_blocks(w: np.ndarray) -> Blocks:
    """Symmetric 8-bit blocks (Q8_0: d = max |w| / 127 per block) of a MatMul weight w (K, N):
    the output head's recipe. A GGUF's Q8_0 head is found again exactly (its largest weight of a
    block is ±127 · d)."""
    K, N = w.shape
    g = np.ascontiguousarray(w.T, dtype=np.float32).reshape(N, K // BLOCK, BLOCK)
    amax = np.abs(g).max(-1)
    d = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    return Blocks("Q8_0", d, np.clip(np.round(g / d[..., None]), -127, 127).astype(np.int16))


def _quantize(
    onnx_dir, out_dir, scheme: str, method: str, fit, progress: bool, fuse: bool, extra=None, scales=None
) -> Path:
    """The driver of the recipes: `fit(node, w)` gives a MatMul's 4-bit blocks; the output head
    (N = the vocabulary) gets 8-bit blocks instead. `extra(model, weights, vocab)`: more manifest fields
    (run first: it may collect statistics). `scales`: {MatMul input: s (K,)} filled by then, for
    recipes whose blocks are of diag(s)·W: the input is divided by s first (one Mul per input)."""
    import onnx
    from tqdm import tqdm

    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    source = float_source(onnx_dir)
    t0 = time.perf_counter()
    model = onnx.load(str(onnx_dir / ONNX_FILE))
    weights = weight_matmuls(model)
    if not weights:
        raise SpecrtError(f"no MatMul with a constant weight in {onnx_dir / ONNX_FILE}; is it a specrt step graph?")
    vocab = source["config"]["vocab_size"]
    fields = extra(model, weights, vocab) if extra else {}
    assigned, kept = {}, []
    for i, w in tqdm(weights, desc=f"quantize {scheme}", unit="matmul", disable=not progress):
        node = model.graph.node[i]
        label = node.name.strip("/").replace("/", ".") or f"matmul{i}"
        if w.shape[1] == vocab:
            kept.append(node.name)
        assigned[i] = (label, q8_blocks(w) if w.shape[1] == vocab else fit(node, w))
    scaled = {}
    for i in assigned:
        node = model.graph.node[i]
        if scales and node.input[0] in scales:
            scaled[node.input[0]] = f"{node.input[0]}.{scheme}_scaled"
            node.input[0] = scaled[node.input[0]]
    counts = rewrite_matmuls(model, assigned, prefix=scheme, fuse=fuse)
    if scaled:
        _insert_input_scales(model, {a: (name, scales[a]) for a, name in scaled.items()})
    quantization = {
        "scheme": scheme,
        "recipe_version": RECIPE_VERSION,
        "method": method,
        "bits": 4,
        "block_size": BLOCK,
        "accuracy_level": 0,
        "rewritten_matmuls": counts,
        # the output head: a fifth of the default model's weights, and the logits' last step
        "kept_in_8bit": kept,
        "fused": fuse,
        **fields,
    }
    return write_quantized(model, source, onnx_dir, out_dir, quantization, t0, "torch")


def _insert_input_scales(model, scaled: dict) -> None:
    """Mul(x, 1 / s) -> the scaled input, placed before the first node that reads it."""
    from onnx import helper, numpy_helper

    graph = model.graph
    nodes = list(graph.node)
    for a, (name, s) in scaled.items():
        first = next(k for k, n in enumerate(nodes) if name in n.input)
        graph.initializer.append(numpy_helper.from_array((1 / s).astype(np.float32), f"{name}.inv"))
        nodes.insert(first, helper.make_node("Mul", [a, f"{name}.inv"], [name], name=f"{name}/Mul"))
    graph.ClearField("node")
    graph.node.extend(nodes)


def rtn_blocks(w: np.ndarray) -> Blocks:
    """Round to nearest in blocks of 32 rows of w (K, N), min-max with a float offset (Q4_1)."""
    K, N = w.shape
    g = np.ascontiguousarray(w.T, dtype=np.float64).reshape(N, K // BLOCK, BLOCK)
    lo, hi = g.min(-1), g.max(-1)
    d = np.where(hi > lo, (hi - lo) / 15, 1.0)
    q = np.clip(np.rint((g - lo[..., None]) / d[..., None]), 0, 15).astype(np.int16)
    return Blocks("Q4_1", d.astype(np.float32), q, lo.astype(np.float32))


def awq_scales(x: np.ndarray, mean_abs: np.ndarray, weights: list[np.ndarray], grid: int = 20) -> tuple:
    """AWQ's per-input-channel scales s (K,) for the weights (K, N_i) that read one input: the
    s = mean|x|^alpha (normalised) of alpha on a grid over [0, 1] whose 4-bit blocks of diag(s)·W
    best keep the outputs on the sample x (T, K), i.e. least ||x W - (x / s) Q(diag(s) W)||.
    Channels that carry large activations get finer steps; alpha 0 (s = 1) is plain rounding,
    so the fit is never worse than that on the sample. Returns (s, alpha, error / plain error)."""
    w = np.concatenate(weights, axis=1).astype(np.float32)
    x = x.astype(np.float32)
    y = x @ w
    best = None
    for alpha in np.linspace(0.0, 1.0, grid + 1):
        s = np.power(np.maximum(mean_abs, 1e-8), alpha)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float64)
        q = rtn_blocks(s[:, None] * w).dequantize().T  # (K, N)
        err = float(np.square(y - (x / s.astype(np.float32)) @ q).sum())
        if best is None or err < best[2]:
            best = (s, float(alpha), err)
        if alpha == 0.0:
            plain = err
    return best[0], best[1], best[2] / plain if plain > 0 else 1.0


def quantize_hqq(onnx_dir: str | Path, out_dir: str | Path, progress: bool = True, fuse: bool = True) -> Path:
    """Every weight MatMul of the float step graph in `onnx_dir` as HQQ 4-bit blocks (the output
    head as 8-bit ones), into `out_dir` (written atomically)."""
    method = "HQQ (half-quadratic offsets per block, data-free), computed in the Q4_1 layout"
    return _quantize(onnx_dir, out_dir, "hqq", method, lambda node, w: hqq_blocks(w), progress, fuse)


def hessians(model, feeds: list[dict], inputs: list[str], progress: bool = True) -> dict[str, np.ndarray]:
    """Per MatMul input name: the mean over every position of every feed of x x^T (K, K),
    float64, from one run of the graph per feed."""
    sums = {name: 0.0 for name in inputs}
    count = 0
    for values in activations(model, feeds, inputs, "gptq: activations", progress):
        for name, x in values.items():
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            sums[name] = sums[name] + x.T @ x
        count += x.shape[0]
    return {name: h / count for name, h in sums.items()}


def gptq_blocks(w: np.ndarray, h: np.ndarray, percdamp: float = 0.01, lazy: int = 128) -> Blocks:
    """GPTQ's 4-bit blocks (Q4_1: a scale and a float offset per block) of a MatMul weight w
    (K, N) whose input has second moments h (K, K).

    Rows (inputs) are rounded in order; after each, its error times the inverse Hessian's
    Cholesky row is subtracted from the rows after it (applied to the rows of the current `lazy`
    batch at once, to the rest once per batch), so the layer's output error on the calibration
    activations, not the weight error, is minimised (Frantar et al., 2022; no reordering by
    activation size). Each block's grid is min-max over its already updated rows, fixed when
    its first row is reached; its offset is a float, so a block already on a 4-bit grid (a
    GGUF's Q4_1) is found again exactly and nothing is fed back."""
    import torch

    K, N = w.shape
    W = torch.tensor(w, dtype=torch.float64)  # copies: the caller's arrays stay as they are
    H = torch.tensor(h, dtype=torch.float64)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[dead] = 0.0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(K, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(K, N, dtype=torch.int16)
    scales = torch.zeros(K // BLOCK, N, dtype=torch.float64)
    offsets = torch.zeros(K // BLOCK, N, dtype=torch.float64)
    for i1 in range(0, K, lazy):
        i2 = min(i1 + lazy, K)
        W1, E1, U1 = W[i1:i2].clone(), torch.zeros(i2 - i1, N, dtype=torch.float64), U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = i1 + i
            if row % BLOCK == 0:
                lo, hi = W1[i : i + BLOCK].min(0).values, W1[i : i + BLOCK].max(0).values
                scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))
                scales[row // BLOCK], offsets[row // BLOCK] = scale, lo
            c = torch.clamp(torch.round((W1[i] - lo) / scale), 0, 15)
            codes[row] = c.to(torch.int16)
            err = (W1[i] - (lo + scale * c)) / U1[i, i]
            W1[i:] -= torch.outer(U1[i, i:], err)
            E1[i] = err
        W[i2:] -= U[i1:i2, i2:].T @ E1
    nb = K // BLOCK
    q = codes.T.reshape(N, nb, BLOCK).numpy()
    return Blocks("Q4_1", scales.T.numpy().astype(np.float32), q, offsets.T.numpy().astype(np.float32))


def quantize_gptq(
    onnx_dir: str | Path,
    out_dir: str | Path,
    calibration: CalibrationSet,
    progress: bool = True,
    max_len: int = 512,
    percdamp: float = 0.01,
    fuse: bool = True,
) -> Path:
    """Every weight MatMul of the float step graph in `onnx_dir` quantized by GPTQ on the
    activations of `calibration` (a set made for this checkpoint; the output head as 8-bit
    blocks), into `out_dir`."""
    feeds = step_feeds(onnx_dir, calibration, max_len=max_len)  # refuses a set of another model
    h = {}

    def collect(model, weights, vocab):
        # the head (N = the vocabulary) is not fitted: its input needs no Hessian
        inputs = sorted({model.graph.node[i].input[0] for i, w in weights if w.shape[1] != vocab})
        h.update(hessians(model, feeds, inputs, progress))
        return {"percdamp": percdamp, **calibration.manifest_fields(feeds, max_len)}

    method = "GPTQ (inverse-Hessian error feedback on calibration activations), min-max blocks, float offsets"
    fit = lambda node, w: gptq_blocks(w, h[node.input[0]], percdamp)  # noqa: E731
    return _quantize(onnx_dir, out_dir, "gptq", method, fit, progress, fuse, extra=collect)


def quantize_awq(
    onnx_dir: str | Path,
    out_dir: str | Path,
    calibration: CalibrationSet,
    progress: bool = True,
    max_len: int = 512,
    sample: int = 512,
    fuse: bool = True,
) -> Path:
    """Every weight MatMul of the float step graph in `onnx_dir` as AWQ 4-bit blocks: per input,
    the activation-aware scales fitted on `sample` positions of the calibration feeds (the head
    as 8-bit blocks), into `out_dir`."""
    feeds = step_feeds(onnx_dir, calibration, max_len=max_len)  # refuses a set of another model
    scales, alphas = {}, {}

    def collect(model, weights, vocab):
        groups = {}
        for i, w in weights:
            if w.shape[1] != vocab:
                groups.setdefault(model.graph.node[i].input[0], []).append(w)
        rows = {a: [] for a in groups}
        sums, count = dict.fromkeys(groups, 0.0), 0
        keep = 2 * sample / sum(f["input_ids"].shape[1] for f in feeds)  # a random share of positions
        rng = np.random.default_rng(0)
        for values in activations(model, feeds, list(groups), "awq: activations", progress):
            first = next(iter(values.values()))
            n = first.size // first.shape[-1]  # positions of this feed
            chosen = rng.random(n) < keep
            for a, x in values.items():
                x = x.reshape(-1, x.shape[-1])
                sums[a] = sums[a] + np.abs(x).sum(0)
                rows[a].append(x[chosen])
            count += n
        from tqdm import tqdm

        for a, ws in tqdm(groups.items(), desc="awq: scales", unit="input", disable=not progress):
            x = np.concatenate(rows[a])[:sample]
            scales[a], alpha, ratio = awq_scales(x, sums[a] / count, ws)
            alphas[a] = (alpha, ratio)
        chosen = [a for a, _ in alphas.values()]
        return {
            "alpha": {"min": min(chosen), "median": float(np.median(chosen)), "max": max(chosen)},
            "sample_error_vs_rounding": float(np.median([r for _, r in alphas.values()])),
            **calibration.manifest_fields(feeds, max_len, sample=sample),
        }

    method = "AWQ (activation-aware per-channel scales, grid over alpha), min-max blocks, float offsets"
    fit = lambda node, w: rtn_blocks(scales[node.input[0]][:, None] * w)  # noqa: E731
    return _quantize(onnx_dir, out_dir, "awq", method, fit, progress, fuse, extra=collect, scales=scales)
