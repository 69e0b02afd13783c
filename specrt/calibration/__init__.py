"""Quantization recipes: the step graph rewritten into a lower-precision one (see each module).

The names of the schemes live here, so the CLI, the engine builder and the report can list them
without importing a recipe (which needs torch and onnx).
"""

QDQ_SCHEMES = ("qdq-int8", "qdq-fp8", "qdq-int4")  # explicit Q/DQ for TensorRT (qdq.py): TensorRT engines too
HALF_SCHEMES = ("fp16", "bf16")  # 16-bit weights and compute for GPU engines (half.py): TensorRT engines too
TRT_SCHEMES = (*QDQ_SCHEMES, *HALF_SCHEMES)  # the schemes TensorRT builds (the others use MatMulNBits)
# the GGUF's own blocks (gguf_blocks.py), by the activations its 4-bit products compute with:
# float32 (accuracy level 0) or int8 (level 4: 2-3x faster kernels, as llama.cpp and
# onnxruntime-genai compute)
GGUF_SCHEMES = {"gguf": 0, "gguf-a8": 4}
# the GGUF's blocks read in place by specrt's own kernel (gguf_kernel.py, engines/kernels)
KERNEL_SCHEMES = ("gguf-k",)
# every `build-engines --quantize` scheme: gguf (gguf_blocks.py), the fitted recipes
# (calibrated.py), round to nearest (weight_only.py; int8 weights alone have no fast CPU kernel,
# so only int8-a8 is offered), the Q/DQ graphs and the 16-bit ones
QUANT_SCHEMES = ("gguf", "gguf-a8", *KERNEL_SCHEMES, "hqq", "gptq", "awq", "int4", "int8-a8", "int4-a8", *TRT_SCHEMES)
