"""The GPU check's TensorRT block: a TensorRT engine of the check's model, built here where a
TensorRT is installed, checked for accuracy (against float64, gpu_blocks.accuracy_block) and for
its CUDA graphs (gpu_blocks.graphs_block)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gpu_blocks as blocks
import torch


def tensorrt_status(device: str) -> tuple[str | None, str]:
    """(flavour to check, note): None with the reason when TensorRT cannot be checked here."""
    from specrt.engines.trt import available_flavours

    if device != "cuda":
        return None, "needs a CUDA GPU"
    flavours = available_flavours()
    if not flavours:
        return None, "neither tensorrt nor tensorrt_rtx is installed"
    cap = torch.cuda.get_device_capability(0)
    if flavours == ["tensorrt-rtx"] and cap in ((8, 0), (9, 0)):
        return None, f"only TensorRT-RTX is installed, which does not run on SM{cap[0]}{cap[1]}; install tensorrt"
    return flavours[0], ""


def tensorrt_block(model, ckpt, config: dict, flavour: str, reference, ps):
    from safetensors.torch import save_file

    from specrt.engines.profiles import EngineShapes
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine
    from specrt.export.step_graph import export_step_graph
    from specrt.runtime.backends import TrtBackend

    tmp = Path(tempfile.mkdtemp(prefix="specrt-gpu-check-"))
    if ckpt is None:  # random weights: write them as a checkpoint to export from
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        state = {k if k == "lm_head.weight" else "model." + k: v.contiguous() for k, v in model.state_dict().items()}
        if model.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(ckpt / "model.safetensors"))
        (ckpt / "config.json").write_text(json.dumps(config))
    export_step_graph(ckpt, tmp / "onnx")
    caps = ("CURRENT",) if flavour == "tensorrt-rtx" else ()
    spec = TrtBuildSpec(flavour=flavour, shapes=EngineShapes(max_batch=3, max_context=1024), compute_capabilities=caps)
    engine = build_trt_engine(tmp / "onnx", tmp / "engine", spec)
    backends = {f"{flavour}{' graphs' if g else ''}": TrtBackend(engine, cuda_graphs=g) for g in (False, True)}
    exact = blocks.float64_reference(model)
    runs = {name: (b, "float32") for name, b in backends.items()}
    verdict, details = blocks.accuracy_block(runs, {"float32": reference}, exact, ps)
    g_verdict, g_details = blocks.graphs_block(
        lambda: TrtBackend(engine, cuda_graphs=True), lambda: TrtBackend(engine, cuda_graphs=False), ps
    )
    failures = [f for b in backends.values() for f in b.capture_failures]
    lines = details["lines"] + g_details["lines"] + ([f"capture failures: {failures}"] if failures else [])
    ok = verdict == g_verdict == "PASS"
    return ("PASS" if ok else "FAIL"), {"accuracy": details, "graphs": g_details, "lines": lines}
