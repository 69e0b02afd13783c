"""The memory a build needs, checked before it starts.

Exporting a step graph loads the checkpoint as a float32 model, traces it and writes the graph:
the weights are held several times over. Measured on this project's development machine
(2026-12-05, peak resident set size of `specrt build-engines --tensorrt off`, float32 export,
fused graph and ORT engine): a 2-layer test model 0.41 GB (the libraries alone), SmolLM2-135M
(538 MB of float32 weights) 2.86 GB, so about 0.4 GB plus 4.8 times the float32 weights. A
model past what the machine has free was killed by the kernel (Qwen2.5-Coder-1.5B: 6.2 GB of
float32 weights, killed at 24 GB); a build now refuses it first, naming both figures, before
anything is written. `SPECRT_MEMORY_CHECK=off` skips the check.

A build from a GGUF file's own blocks whose weights stay in the file (`specrt convert --weights
gguf`) streams them one tensor at a time and holds no float32 copy: Qwen2.5-Coder-1.5B's Q4_K_M
file (1.12 GB) peaked at 2.0 GB writing its gguf-a8 graph and 2.4 GB building its engine
(2026-12-05), so about 0.4 GB plus 1.8 times the file; `STREAMED` allows 2.
"""

from __future__ import annotations

import os
from pathlib import Path

from specrt.errors import SpecrtError

GIB = 2**30
LIBRARIES = 0.4 * GIB  # resident before any weight: torch, onnx, onnxruntime
HELD = 4.8  # float32 copies of the weights at the export's peak (module docstring)
STREAMED = 2.0  # a streamed build's peak, in GGUF files (module docstring)


def float32_bytes(checkpoint: str | Path) -> int:
    """The checkpoint's weights in float32, from its safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    from specrt.schema.checkpoint_files import gguf_weights, weight_files

    gguf = gguf_weights(checkpoint)
    if gguf is not None:
        return 4 * _gguf_weights(gguf)
    count = 0
    for f in weight_files(Path(checkpoint)):
        with safe_open(str(f), "np") as fh:
            for name in fh.keys():
                n = 1
                for d in fh.get_slice(name).get_shape():
                    n *= d
                count += n
    return 4 * count


def _gguf_weights(path: Path) -> int:
    """The number of weights a GGUF file holds (its tensor headers; nothing is dequantized)."""
    import gguf

    count = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        count += int(t.n_elements)
    return count


def needed_bytes(checkpoint: str | Path, streamed: Path | None = None) -> int:
    """What exporting the checkpoint holds at its peak (module docstring); `streamed`: the GGUF
    file a streamed build reads."""
    if streamed is not None:
        return int(LIBRARIES + STREAMED * streamed.stat().st_size)
    return int(LIBRARIES + HELD * float32_bytes(checkpoint))


def available_bytes() -> int | None:
    """Memory the kernel can give without swapping (MemAvailable); None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_memory(checkpoint: str | Path, what: str, streamed: Path | None = None) -> None:
    """Refuse a step that would run out of memory (`what` it is), before it writes anything;
    `streamed`: the GGUF file a streamed build reads its weights from, one tensor at a time."""
    if os.environ.get("SPECRT_MEMORY_CHECK", "on") == "off":
        return
    free = available_bytes()
    if free is None:
        return
    need = needed_bytes(checkpoint, streamed)
    held = (
        f"streamed from a GGUF file of {streamed.stat().st_size / GIB:.1f} GiB"
        if streamed is not None
        else f"{float32_bytes(checkpoint) / GIB:.1f} GiB of float32 weights, held about {HELD:g} times over while "
        "the graph is traced and written"
    )
    if need > free:
        raise SpecrtError(
            f"{what} of {checkpoint} needs about {need / GIB:.1f} GiB of memory ({held}), and "
            f"{free / GIB:.1f} GiB are free here; free memory or build on a machine with more (nothing was written; "
            "SPECRT_MEMORY_CHECK=off tries anyway)"
        )


def out_of_memory(checkpoint: str | Path) -> SpecrtError:
    """The error of a build that ran out of memory all the same (a MemoryError)."""
    free = available_bytes()
    said = "" if free is None else f", {free / GIB:.1f} GiB are free now"
    return SpecrtError(
        f"the build ran out of memory (it needs about {needed_bytes(checkpoint) / GIB:.1f} GiB for "
        f"{checkpoint}{said}); what it was writing was removed, the artifacts already built are kept. Free memory "
        "or build on a machine with more."
    )
