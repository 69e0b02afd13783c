"""Step backends: one forward step of the target model, behind one declared contract.

    step(input_ids (B, Q), position_ids (B, Q), attention_mask (B, Q, C+Q), logits_index (B, K),
         cache, hidden_index (B, Kh) | None) -> StepOutput

A backend reads the past KV straight from the cache's preallocated buffers (no copy) and returns
the KV of the Q new positions, which the caller commits with `cache.append`. Hidden states come
back only for the positions asked for (`hidden_index`); nobody asking means no host copy.
What the runtime may rely on beyond `step` is declared in `Capabilities`, a value every backend
sets in its constructor: there is no attribute probing.

- OrtBackend (ort.py): an ONNX Runtime session on a built engine (the deployment path on CPU).
- TorchBackend (torch_model.py): our PyTorch model: the reference on CPU, and a GPU path with a
  device-resident cache and CUDA graphs.
- TrtBackend (trt.py): a TensorRT / TensorRT-RTX engine on an NVIDIA GPU.
- SplitBackend (split.py): two engines of one model, one for single-position steps and one for
  the rest (the 4-bit `gguf` engine decodes faster, float32 verifies faster).
"""

from specrt.runtime.backends.base import MAX_GRAPHS, Capabilities, StepBackend, StepOutput
from specrt.runtime.backends.ort import OrtBackend
from specrt.runtime.backends.split import SplitBackend
from specrt.runtime.backends.torch_model import TorchBackend
from specrt.runtime.backends.trt import TrtBackend

__all__ = [
    "MAX_GRAPHS",
    "Capabilities",
    "StepBackend",
    "StepOutput",
    "OrtBackend",
    "SplitBackend",
    "TorchBackend",
    "TrtBackend",
]
