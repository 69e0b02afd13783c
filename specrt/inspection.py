"""`specrt inspect`: what an artifact directory holds and whether it can be used here.

For an artifact directory from build-engines (onnx/ and engines/*) or any one artifact in it:
its kind, model, checkpoint, files and sizes, for a TensorRT engine its flavour, targets and
optimization profiles, and a verdict from the same checks the loaders run (checkpoint, ONNX
export, tool versions, CPU), with every file's sha256 checked in full against the manifest; a
refusal quotes their error, fix included. A manifest that lacks fields is reported, not shown.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specrt.artifacts import MANIFEST
from specrt.calibration import GGUF_SCHEMES
from specrt.errors import SpecrtError
from specrt.layout import ArtifactLayout, HeadLayout


@dataclasses.dataclass
class Inspection:
    path: Path
    kind: str
    lines: list[str]
    usable: bool
    verdict: str


def _size(path: Path) -> str:
    n = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{n / 2**20:.1f} MiB"


def _check(manifest: dict, path: Path) -> str | None:
    """The loader's refusal for this artifact here, or None when it would load."""
    from specrt.engines.head import HEAD_ENGINE_KIND, HEAD_TRT_KIND, load_head_engine, read_head_trt_manifest
    from specrt.engines.ort import ENGINE_KIND, read_engine_manifest
    from specrt.engines.trt import TRT_KIND, read_trt_manifest
    from specrt.schema.graph_files import ONNX_KIND, read_onnx_manifest, source_onnx_files
    from specrt.schema.head_io import HEAD_KIND, read_head_manifest

    if manifest.get("kind") in (HEAD_KIND, HEAD_ENGINE_KIND, HEAD_TRT_KIND):
        try:
            if manifest["kind"] == HEAD_KIND:
                read_head_manifest(path, verify="full")
            elif manifest["kind"] == HEAD_ENGINE_KIND:
                load_head_engine(path, verify="full")
            else:
                read_head_trt_manifest(path, verify="full")
                return _gpu_check(manifest, path)
        except SpecrtError as e:
            return str(e)
        return None

    try:
        onnx_files = source_onnx_files(manifest)
    except SpecrtError as e:
        return f"its ONNX export is not usable: {e}"
    try:
        if manifest["kind"] == ONNX_KIND:
            read_onnx_manifest(path, verify="full")
        elif manifest["kind"] == ENGINE_KIND:
            m = read_engine_manifest(path, verify="full")
            if onnx_files is not None and m["onnx"].get("files") != onnx_files:
                return "built from another export of the ONNX step graph; rebuild it with: specrt build-engines"
        elif manifest["kind"] == TRT_KIND:
            read_trt_manifest(path, onnx_files, verify="full")
            return _gpu_check(manifest, path)
        else:
            return f"unknown artifact kind {manifest['kind']!r}"
    except SpecrtError as e:
        return str(e)
    return None


def _gpu_check(manifest: dict, path: Path) -> str | None:
    from specrt.engines.trt import check_engine_gpu

    try:
        import torch
    except ImportError:
        return "its checks pass, but running it needs PyTorch with CUDA and an NVIDIA GPU"
    if not torch.cuda.is_available():
        return (
            "its checks pass, but running it needs an NVIDIA GPU and there is none here "
            "(torch.cuda.is_available() is False)"
        )
    check_engine_gpu(manifest, torch.cuda.get_device_capability(), torch.cuda.get_device_name(), path)
    return None


def _profiles(manifest: dict) -> list[str]:
    rows = [f"    {'profile':<9}{'batch':>10}{'Q':>12}{'past':>14}"]
    for p in manifest["profiles"]:
        rng = {k: f"{p[k]['min']}..{p[k]['max']}" for k in ("batch", "q_len", "past_len")}
        rows.append(f"    {p['name']:<9}{rng['batch']:>10}{rng['q_len']:>12}{rng['past_len']:>14}")
    return rows


def inspect_artifact(path: str | Path) -> Inspection:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        kind = manifest["kind"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        return Inspection(path, "?", [], False, f"no readable {MANIFEST} ({type(e).__name__}); not a specrt artifact")
    refusal = _check(manifest, path)
    try:
        lines = _describe(manifest, kind, path)
    except (KeyError, TypeError, AttributeError, ValueError):  # the verdict names the missing field
        lines = [f"  size        {_size(path)}", "  (the manifest is incomplete: details not shown)"]
    return Inspection(
        path, str(kind), lines, refusal is None, "usable here" if refusal is None else f"refused here: {refusal}"
    )


# bits per weight of the block types a quantized graph's MatMulNBits take (GGUF's names; the fitted
# recipes write theirs in the same layouts)
BLOCK_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q6_K": 6, "Q8_0": 8, "F16": 16, "BF16": 16, "F32": 32}
_INT8_ACTIVATIONS = "int8 activations (MatMulNBits at accuracy level 4: each row quantized to int8 per block)"
_QDQ = {  # the TensorRT graphs: (weights, activations)
    "qdq-int8": ("8-bit integer weights per output channel", "int8 activations (static scales, per tensor)"),
    "qdq-fp8": ("8-bit float (FP8 E4M3) weights per output channel", "FP8 activations (static scales, per tensor)"),
    "qdq-int4": ("4-bit integer weights in blocks of 32", "float32 activations"),
}


def precision_line(q: dict | None) -> str:
    """What a graph or engine computes with, from its quantization record (None: none, the float
    model): the scheme, the weights' bits and the activations' type."""
    if not q:
        return "float32: 32-bit float weights, float32 activations"
    scheme = q.get("scheme")
    if scheme in _QDQ:
        weights, acts = _QDQ[scheme]
    elif "kernel_products" in q:  # gguf-k: the file's blocks read in place by specrt's kernel
        types = q["kernel_products"]
        bits = sorted({BLOCK_BITS.get(t, 0) for t in types if t != "embedding"})
        weights = " and ".join(f"{b}-bit" for b in bits) + " weights read in place from the GGUF"
        weights += " (" + ", ".join(f"{n} {t}" for t, n in types.items() if t != "embedding") + " products)"
        acts = "int8 activations (specrt's kernel: each row quantized to int8 per block)"
    elif "compute_dtype" in q:  # fp16, bf16
        weights, acts = f"16-bit float ({q['compute_dtype']}) weights", f"{q['compute_dtype']} activations"
    elif "bits" in q:  # MatMulNBits: the GGUF's blocks, the fitted recipes, round to nearest
        types = q.get("rewritten_matmuls") or {}
        bits = sorted({BLOCK_BITS.get(t, 0) for t in types}) or [q["bits"]]
        weights = " and ".join(f"{b}-bit" if b else "other" for b in bits) + " weights"
        if types:
            weights += " (" + ", ".join(f"{n} {t}" for t, n in types.items()) + " MatMuls)"
        elif q.get("block_size"):
            weights += f" in blocks of {q['block_size']}"
        acts = _INT8_ACTIVATIONS if q.get("accuracy_level") == 4 else "float32 activations"
    else:
        return f"{scheme}: a scheme this version of specrt does not describe"
    return f"{scheme}: {weights}, {acts}"


def engine_quantization(manifest: dict) -> tuple[bool, dict | None]:
    """(known, the quantization record) of an engine: its own (engines built since it was
    recorded), else that of the ONNX export it names when the export is still there unchanged."""
    if "quantization" in manifest:
        return True, manifest["quantization"]
    source = (manifest.get("onnx") or {}).get("path")
    try:
        m = json.loads((Path(source) / MANIFEST).read_text())
    except (OSError, ValueError, TypeError, RecursionError):
        return False, None
    if not isinstance(m, dict) or m.get("files") != manifest["onnx"].get("files"):
        return False, None
    return True, m.get("quantization")


def _precision(manifest: dict, kind: str) -> str:
    if kind == "onnx-step-graph":
        return f"  precision   {precision_line(manifest.get('quantization'))}"
    known, q = engine_quantization(manifest)
    if known:
        return f"  precision   {precision_line(q)}"
    return (
        f"  precision   not recorded (an engine built before specrt recorded it, its ONNX export moved or changed); "
        f"it computes as {manifest.get('precision', '?')}: rebuild it with specrt build-engines to see more"
    )


def _describe(manifest: dict, kind: str, path: Path) -> list[str]:
    cfg = manifest.get("config", {})
    lines = [f"  created     {manifest.get('created', '?')}"]
    if cfg:
        lines.append(
            f"  model       {cfg.get('architecture')}: {cfg.get('num_hidden_layers')} layers, hidden "
            f"{cfg.get('hidden_size')}, "
            f"vocab {cfg.get('vocab_size')}, {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} heads"
        )
    ckpt = manifest.get("checkpoint") or {}
    if ckpt:
        lines.append(f"  checkpoint  {ckpt.get('path')} ({str(ckpt.get('hash', ''))[:19]}…)")
    lines.append(f"  size        {_size(path)}")
    if kind in ("onnx-step-graph", "ort-engine", "trt-engine"):
        lines.append(_precision(manifest, kind))
    if kind == "onnx-step-graph":
        flavour = manifest.get("graph_flavour", "portable")
        lines.append(
            f"  graph       {flavour} (version {manifest.get('graph_version')}), opset {manifest.get('opset')}, hidden "
            f"layers {manifest.get('hidden_layers')}, "
            + (
                "ORT's fused operators, the KV cache written in place"
                if flavour == "fused"
                else "opset-23 operators, for TensorRT"
                if flavour == "standard"
                else f"tied embedding stored once: {manifest.get('tied_embedding_shared', False)}"
            )
        )
        q = manifest.get("quantization")
        if q and q["scheme"] in GGUF_SCHEMES:
            types = ", ".join(f"{n} {t}" for t, n in q.get("rewritten_matmuls", {}).items())
            lines.append(
                f"  quantized   {q['scheme']}: the GGUF's own blocks ({q['gguf']['file']}): {types} MatMuls, "
                + (
                    "int8 activations (accuracy level 4)"
                    if q.get("accuracy_level") == 4
                    else "float32 activations (the float model within float rounding)"
                )
            )
        elif q and q["scheme"] in ("hqq", "gptq", "awq"):
            types = ", ".join(f"{n} {t}" for t, n in q.get("rewritten_matmuls", {}).items())
            cal = q.get("calibration")
            fitted = (
                f"fitted to {cal['sequences']} calibration sequences ({cal['tokens']} tokens, {cal['sha256'][:15]}…)"
                if cal
                else "fitted without data"
            )
            lines.append(
                f"  quantized   {q['scheme']}: {types} MatMuls ({len(q.get('kept_in_8bit', []))} kept in 8-bit), "
                f"{fitted}, float32 activations"
            )
        elif q and "kernel_products" in q:  # gguf-k
            lines.append(
                f"  quantized   {q['scheme']}: the GGUF's own blocks read in place ({q['gguf']['relative']}) by "
                "specrt's kernel, int8 activations"
            )
        elif q and q["scheme"] == "qdq-int4":
            lines.append(
                f"  quantized   qdq-int4: DQ for TensorRT, {q['quantized_matmuls']} MatMuls with int4 weights in "
                f"blocks of {q['block_size']} ({len(q['kept_in_float32'])} kept in float32), float activations"
            )
        elif q and q["scheme"].startswith("qdq-"):
            cal = q["calibration"]
            lines.append(
                f"  quantized   {q['scheme']}: Q/DQ for TensorRT, {q['quantized_matmuls']} MatMuls "
                f"(SmoothQuant alpha {q['smoothing']['alpha']}; {len(q['kept_in_float32'])} kept in float32), "
                f"activation ranges from {cal['sequences']} calibration sequences ({cal['sha256'][:15]}…)"
            )
        elif q:
            lines.append(
                f"  quantized   {q['scheme']}: {q['bits']}-bit weights in blocks of {q['block_size']}, "
                f"{'int8' if q.get('accuracy_level') == 4 else 'float32'} activations, {q.get('quantized_matmuls')} "
                "MatMuls"
            )
    elif kind == "ort-engine":
        lines.append(
            f"  runtime     onnxruntime {manifest.get('versions', {}).get('onnxruntime')} "
            f"{manifest.get('provider')}, measured on {manifest.get('host_cpu')!r}, "
            f"{manifest.get('graph_flavour', 'portable')} graph"
            + (f" in {manifest['graph_dir']} (optimized as it loads)" if "graph_dir" in manifest else "")
        )
        cuts = manifest.get("step_cuts")
        if cuts:
            found = step_cuts_text(cuts)
            lines.append(f"  step cuts   {found} (probed over {cuts['probed_to']} positions: no step spans a cut)")
        inv = manifest.get("batch_invariance")
        if inv:
            lines.extend(exactness_lines(inv))
    elif kind == "trt-engine":
        gpu = manifest.get("build_gpu")
        targets = manifest.get("compute_capabilities", [])
        targets = "SM86, SM89, SM120+ (the library default)" if targets == ["library default"] else ", ".join(targets)
        lines.append(
            f"  runtime     {manifest.get('flavour')} {manifest.get('tensorrt_version')}, targets {targets}"
            + (f", built on {gpu['name']} ({gpu['sm']})" if gpu else "")
            + f", {manifest.get('graph_flavour', 'portable')} graph"
            + (f" ({manifest['fallback_from']} refused by the parser)" if manifest.get("fallback_from") else "")
        )
        lines.append(
            f"  inputs      {len(manifest.get('inputs', []))}, outputs {len(manifest.get('outputs', []))}, workspace "
            f"{manifest.get('workspace_mib')} MiB"
        )
        lines += _profiles(manifest)
    elif kind in ("onnx-draft-head", "ort-draft-head", "trt-draft-head"):
        lines += _head(manifest)
        if kind == "trt-draft-head":
            lines.append(f"  runtime     {manifest.get('flavour')} {manifest.get('tensorrt_version')}")
            for p in manifest.get("profiles", []):
                if "input_ids" in p["shapes"]:
                    q = p["shapes"]["input_ids"]
                    lines.append(f"    profile {p['name']:<9} Q {q[0][1]}..{q[2][1]}, batch {q[0][0]}..{q[2][0]}")
                else:  # Medusa heads: one feature per row
                    f = next(iter(p["shapes"].values()))
                    lines.append(f"    profile {p['name']:<9} batch {f[0][0]}..{f[2][0]}")
    files = manifest.get("files")
    if isinstance(files, dict) and files:
        lines.append(f"  files       {', '.join(files)} (sha256 checked in full)")
    return lines


def _head(manifest: dict) -> list[str]:
    h, t = manifest["head"], manifest["target"]
    lines = [
        f"  head        {h['method']}: reads target layers {h['layers']}, draft vocabulary {h['draft_vocab']}"
        + (f", {h['num_heads']} heads of {h['top_k']} candidates" if "num_heads" in h else "")
        + (f", {h['parallel'] + 1} draft tokens a call" if h.get("parallel") else ""),
        f"  target      checkpoint {t['checkpoint_hash'][:19]}…, trained against its {t['precision']} engine",
    ]
    held = (manifest.get("training") or {}).get("held_out")
    if held:
        lines.append(
            f"  trained     {manifest['training'].get('steps')} steps on {manifest['training'].get('train_sequences')} "
            f"answers; held-out acceptance per draft step {held['acceptance']}, expected accepted length "
            f"{held['mean_accepted']:.2f}"
        )
    parity = manifest.get("ort_parity")
    if parity:
        lines.append(f"  parity      ONNX Runtime vs PyTorch: logits within {parity['logits_max_abs']:.1e}")
    return lines


def _kind(directory: Path) -> str | None:
    try:
        return json.loads((directory / MANIFEST).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def find_artifacts(path: str | Path) -> list[Path]:
    """The artifact directories at `path`: itself; onnx/ and engines/* under it (build-engines
    output, or a draft head's directory); or those of each draft head under it (make drafts)."""
    path = Path(path)
    if not path.is_dir():
        raise SpecrtError(f"{path} is not a directory; give an artifact directory from: specrt build-engines --out DIR")
    if (path / MANIFEST).is_file():
        return [path]
    found = ArtifactLayout(path).artifact_dirs()
    if not found:  # a `make drafts` directory: one head per subdirectory
        heads = [d for d in sorted(path.iterdir()) if d.is_dir() and _kind(HeadLayout(d).onnx) == "onnx-draft-head"]
        found = [a for d in heads for a in HeadLayout(d).artifact_dirs()]
    if not found:
        raise SpecrtError(
            f"{path} holds no specrt artifacts (no {MANIFEST} in it, in onnx/ or engines/*); create them with: "
            f"specrt build-engines --out {path}"
        )
    return found


def step_cuts_text(cuts: dict) -> str:
    """A manifest's `step_cuts` as people read it: "none", or "63, 319, then every 256"."""
    every = f", then every {cuts['period']}" if cuts.get("period") else ""
    return ", ".join(map(str, cuts["cuts"])) + every if cuts["cuts"] else "none"


def exactness_lines(inv: dict) -> list[str]:
    """What an ORT engine's build measured of its exactness (engines/ort_measure.py)."""
    from specrt.engines.ort_measure import floor_of

    shapes = inv.get("bitwise")
    lines = [
        f"  positions   logits move by {inv['relative']:.1e} of their range between 1- and {inv['positions']}-position "
        f"steps (argmax agrees at {inv['argmax_agreement']:.0%})"
    ]
    if not shapes:
        return lines + ["  bitwise     not measured (built before the step floor): rebuild to measure it"]
    same = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in shapes.items())
    padded = inv.get("padded_relative")
    floored = {k: v for k, v in shapes.items() if not k.startswith("unpadded")}
    if floor_of(inv) == 1:
        verdict = "every step shape gives the same bits, one-position steps too: no step floor needed"
    elif all(floored.values()):
        verdict = "every step shape gives the same bits with the step floor (two positions a step at least)"
    else:
        verdict = "some shapes differ: exact only up to near-ties" + (
            "" if padded is None else f" (padded steps move the logits by {padded:.1e} of their range)"
        )
    verdict += ": speculative and batched output is bitwise plain output" if "same bits" in verdict else ""
    return lines + [f"  bitwise     against one multi-position step: {same}; {verdict}"]
