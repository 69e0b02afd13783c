"""Weight-only INT4 / INT8 quantization of the step graph for ONNX Runtime.

    ONNX step graph (float32) -> every MatMul with a constant weight (the projections, the MLP, the
    LM head) becomes MatMulNBits: weights in blocks of `block_size` along the input axis, each
    block with its own scale (symmetric, round to nearest); activations stay float32.

Decoding one token reads every weight once, so on a CPU it is bound by memory bandwidth: 4-bit
weights read ~7x fewer bytes than float32 (scales included). The embedding lookup stays float32.

Schemes: `int4` / `int8` multiply in float32 (ORT accuracy level 0): the logits of a position do
not depend on how many positions a step computes, so speculative output equals plain output.
(`int8` is kept for measurements only: ORT 1.32 has no fast CPU kernel for it, it decoded 7x
slower than float32 here, so the CLI does not offer it.)
`int4-a8` / `int8-a8` also quantize the activations to int8 (level 4, VNNI where the CPU has it):
faster, but ORT then takes different kernels for one position and for several, whose logits
differ by up to ~2 % of their range on the default model, so speculative greedy output can
deviate from plain greedy output. Every ORT engine measures this at build time (ort.py,
`batch_invariance` in its manifest) and the speculative decoder warns about such engines.

The output is an ONNX step graph directory like the export's (same inputs and outputs, so every
runtime path works on it), whose manifest adds `quantization` and the source export's hashes.
Quantization changes the model: `bench/bench_quant.py` measures what it costs in perplexity
and agreement with float32; speculative decoding on it is exact with respect to the quantized
model. This is data-free (no calibration set); MatMulNBits is an ONNX Runtime operator, so these
graphs feed ORT engines, not TensorRT.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from specrt.calibration.blocks import float_source, write_quantized
from specrt.errors import SpecrtError
from specrt.schema.graph_files import ONNX_FILE

SCHEMES = {
    "int4": (4, 0),
    "int8": (8, 0),
    "int4-a8": (4, 4),
    "int8-a8": (8, 4),
}  # scheme -> (weight bits, ORT accuracy level)


@dataclasses.dataclass(frozen=True)
class WeightOnlySpec:
    scheme: str = "int4"  # a key of SCHEMES
    block_size: int = 32  # weights per scale, along the input axis (16..256, a power of two)

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise SpecrtError(f"unknown quantization {self.scheme!r}; choose one of {', '.join(SCHEMES)}.")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise SpecrtError(f"block_size must be 16, 32, 64, 128 or 256, got {self.block_size}.")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme][0]

    @property
    def accuracy_level(self) -> int:
        return SCHEMES[self.scheme][1]


def quantize_weight_only(
    onnx_dir: str | Path, out_dir: str | Path, spec: WeightOnlySpec = WeightOnlySpec(), progress: bool = True
) -> Path:
    """Quantize the exported step graph in `onnx_dir` into `out_dir` (written atomically)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
    from tqdm import tqdm

    spec.validate()
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    source = float_source(onnx_dir)
    bits = spec.bits
    steps = tqdm(total=3, desc=f"quantize {spec.scheme}", unit="step", disable=not progress)
    steps.set_postfix_str("load")
    t0 = time.perf_counter()
    model = onnx.load(str(onnx_dir / ONNX_FILE))
    steps.update()
    steps.set_postfix_str("MatMul -> MatMulNBits")
    config = DefaultWeightOnlyQuantConfig(
        block_size=spec.block_size, is_symmetric=True, accuracy_level=spec.accuracy_level, bits=bits
    )
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=spec.block_size,
        is_symmetric=True,
        accuracy_level=spec.accuracy_level,
        algo_config=config,
    )
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.WARNING)  # it logs two lines per MatMul at INFO
    try:
        quantizer.process()
    finally:
        log.setLevel(level)
    quantized = quantizer.model.model
    count = sum(1 for n in quantized.graph.node if n.op_type == "MatMulNBits")
    if count == 0:
        raise SpecrtError(
            f"no MatMul with a constant weight was found in {onnx_dir / ONNX_FILE}; is it a specrt step graph?"
        )
    steps.update()
    steps.set_postfix_str("save")
    quantization = {
        **dataclasses.asdict(spec),
        "bits": bits,
        "accuracy_level": spec.accuracy_level,
        "symmetric": True,
        "method": "round to nearest, per block (data-free)",
        "quantized_matmuls": count,
    }
    write_quantized(quantized, source, onnx_dir, out_dir, quantization, t0)
    steps.update()
    steps.close()
    return out_dir
