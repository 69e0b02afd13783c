"""Quantization recipes: the step graph rewritten into a lower-precision one (see each module).

The names of the explicit Q/DQ schemes live here, so the CLI and the engine builder can list them
without importing a recipe (which needs torch and onnx).
"""

QDQ_SCHEMES = ("qdq-int8", "qdq-fp8")  # explicit Q/DQ for TensorRT (qdq.py): TensorRT engines too
