"""Commands that make and look at artifacts: convert, export, build-engines, calibrate, inspect."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specrt.cli.common import (
    CALIBRATION_PROMPTS,
    CALIBRATION_TOKENS,
    RECIPES,
    SERVER,
    _flags,
    _friendly_errors,
    _given,
    _parse_layers,
    main,
    quantize_option,
    tensorrt_option,
)


@main.command()
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Checkpoint directory to write (config.json, tokenizer, model.safetensors with --weights float32).",
)
@click.option(
    "--weights",
    type=click.Choice(["float32", "gguf"]),
    default="float32",
    show_default=True,
    help="float32: write the weights' float32 dequantization (a standalone checkpoint, 4-8x the file's size); "
    "gguf: write none, read them from the GGUF file (keep it where it is), one tensor at a time: what a "
    "1B+ model needs on a machine of its size.",
)
@_friendly_errors
def convert(gguf_file: Path, out: Path, weights: str):
    """Convert a GGUF file to a Hugging Face checkpoint directory."""
    from specrt.calibration.gguf_blocks import SUPPORTED, other_block_types
    from specrt.export.gguf import convert_gguf, open_gguf

    convert_gguf(gguf_file, out, weights=weights)
    click.echo(f"wrote {out}" + (f" (weights read from {gguf_file})" if weights == "gguf" else ""))
    other = other_block_types(open_gguf(gguf_file))
    if other:
        click.echo(
            f"note: {gguf_file} stores tensors as {', '.join(other)}, which the engines of its own blocks (--quantize "
            f"gguf, gguf-a8: {', '.join(SUPPORTED)}) do not compute from; build {out} with --quantize int8-a8 or int4"
        )


@main.command()
@click.option(
    "--model",
    "checkpoint",
    required=True,
    type=click.Path(path_type=Path),
    help="Checkpoint directory (config.json + safetensors) or .gguf file.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory for model.onnx, its weights and manifest.json.",
)
@click.option(
    "--opset", default=17, show_default=True, type=int, help="ONNX opset (9 up to the newest torch's exporter writes)."
)
@click.option(
    "--hidden-layers",
    default=None,
    help="Layers whose output `hidden_states` carries (-1: final normed state; e.g. 2,15,27 for EAGLE-3). Default: "
    "what every draft head reads (EAGLE-3's low, middle and high layers, then -1).",
)
@_friendly_errors
def export(checkpoint: Path, out: Path, opset: int, hidden_layers: str):
    """Export the target step graph (prefill, decode and verification in one graph) to ONNX."""
    from specrt.export.step_graph import export_step_graph

    layers = None if hidden_layers is None else _parse_layers(hidden_layers)
    export_step_graph(checkpoint, out, opset=opset, hidden_layers=layers)
    click.echo(f"wrote {out}")


@main.command("build-engines")
@click.option(
    "--model",
    "checkpoint",
    default=None,
    type=click.Path(path_type=Path),
    help="Checkpoint directory or .gguf file. Without it, the ORT engine of --quantize is built for this machine "
    "from the graph the --out folder holds (a folder copied from another machine).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Artifact directory: onnx/ and engines/ are written under it.",
)
@click.option(
    "--provider",
    default="cpu",
    show_default=True,
    type=click.Choice(["cpu", "cuda", "tensorrt"]),
    help="ONNX Runtime execution provider to optimize for.",
)
@click.option("--force", is_flag=True, help="Rebuild even when up-to-date artifacts exist.")
@click.option(
    "--graph",
    default="fused",
    show_default=True,
    type=click.Choice(["fused", "portable"]),
    help="The step graphs: fused (ORT's engines run ORT's fused attention, norm and 4-bit kernels with the KV cache "
    "written in place: onnx-fused/, float32, gguf, gguf-a8 and the weight-only int4, int4-a8, int8-a8; "
    "TensorRT's the standard opset-23 graph: "
    "onnx-standard/) or portable (both run the traced graph: onnx/).",
)
@tensorrt_option("TensorRT engine: auto builds one when tensorrt or tensorrt_rtx is installed.")
@click.option(
    "--max-context",
    default=2048,
    show_default=True,
    type=click.IntRange(min=2),
    help="TensorRT profiles: longest context (prompt + output).",
)
@click.option(
    "--max-prefill",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="TensorRT prefill profile: longest prompt chunk.",
)
@click.option(
    "--max-verify",
    default=17,
    show_default=True,
    type=click.IntRange(min=1),
    help="TensorRT verify profile: max draft tokens (or tree size) + 1.",
)
@click.option(
    "--max-batch",
    default=SERVER.max_batch,
    show_default=True,
    type=click.IntRange(min=1),
    help="TensorRT profiles: largest batch (serve's continuous batch needs at least its --max-batch).",
)
@click.option(
    "--compute-capability",
    "compute_capabilities",
    multiple=True,
    help="TensorRT-RTX target GPU, e.g. SM89, or CURRENT (this machine's GPU); repeatable; default: the library's "
    "(SM86, 89, 120+; SM75 only when targeted; TensorRT-RTX does not support SM80 or SM90).",
)
@click.option(
    "--workspace-mib",
    default=4096,
    show_default=True,
    type=click.IntRange(min=16),
    help="TensorRT builder workspace limit.",
)
@quantize_option(
    "Also build a quantized graph (onnx-<scheme>/) and its ORT engine (engines/ort-<provider>-<scheme>/): gguf "
    "(the GGUF file's own 4-bit blocks: the float model within float rounding), gguf-a8 (the same blocks with int8 "
    "activations: faster, and its own model), hqq (int4, offsets fitted, no data), gptq / awq (int4 fitted to "
    "calibration activations; makes the calibration set first, see `specrt calibrate`), int4 weights rounded to "
    "nearest, int8/int4 weights with int8 activations (-a8: faster), or qdq-int8/qdq-fp8 (explicit Q/DQ for "
    "TensorRT, calibrated), qdq-int4 (int4 weight-only DQ for TensorRT), fp16 / bf16 (16-bit weights and compute "
    "for GPUs; "
    "bf16 has no ORT engine: ORT's CPU provider lacks its kernels); these also build a TensorRT engine "
    "engines/trt-<flavour>-<scheme>/.",
)
@click.option(
    "--calibration",
    type=click.Path(path_type=Path),
    default=None,
    help="--quantize gptq, awq, qdq-int8, qdq-fp8: the calibration set (`specrt calibrate`; default: "
    f"OUT/calibration/set.json, made when missing from {CALIBRATION_PROMPTS} prompts and the target's answers).",
)
@click.option(
    "--gguf",
    "gguf_file",
    type=click.Path(path_type=Path),
    default=None,
    help="--quantize gguf / gguf-a8: the GGUF file the checkpoint was converted from (default: the one `specrt "
    "convert` "
    "recorded in the checkpoint).",
)
@click.option(
    "--quant-block-size",
    default=32,
    show_default=True,
    type=click.Choice(["16", "32", "64", "128", "256"]),
    help="Weights per quantization scale.",
)
@_friendly_errors
def build_engines(
    checkpoint: Path,
    out: Path,
    provider: str,
    force: bool,
    graph: str,
    tensorrt: str,
    max_context: int,
    max_prefill: int,
    max_verify: int,
    max_batch: int,
    compute_capabilities: tuple[str, ...],
    workspace_mib: int,
    quantize: str,
    gguf_file: Path | None,
    calibration: Path | None,
    quant_block_size: str,
):
    """Export the ONNX step graph (if needed) and build engines from it: ONNX Runtime always,
    TensorRT / TensorRT-RTX when installed."""
    from specrt.engines.build import BuildSpec, build_all
    from specrt.engines.profiles import EngineShapes
    from specrt.engines.trt import TrtBuildSpec
    from specrt.layout import ArtifactLayout

    if checkpoint is not None:
        _check_max_context(checkpoint, max_context)
    shapes = EngineShapes(max_batch=max_batch, max_context=max_context, max_prefill=max_prefill, max_verify=max_verify)
    trt_spec = TrtBuildSpec(
        shapes=shapes,
        workspace_mib=workspace_mib,
        compute_capabilities=compute_capabilities,
        timing_cache=ArtifactLayout(out).timing_cache,
    )
    spec = BuildSpec(
        checkpoint=checkpoint,
        out=out,
        provider=provider,
        force=force,
        graph=graph,
        tensorrt=tensorrt,
        trt=trt_spec,
        quantize=quantize,
        quant_block_size=int(quant_block_size),
        gguf=gguf_file,
        calibration=calibration,
        make_calibration=lambda engine: _calibration_set(engine, checkpoint, ArtifactLayout(out).calibration),
    )
    for line in build_all(spec):
        click.echo(line)


def _check_max_context(checkpoint: Path, max_context: int) -> None:
    """An explicit --max-context past the model's own context (the positions its rotary settings
    and tables cover) is refused by name; the default only ever serves the model's context."""
    from specrt.errors import UsageError
    from specrt.export.checkpoint import load_config

    if click.get_current_context().get_parameter_source("max_context") != click.core.ParameterSource.COMMANDLINE:
        return
    limit = load_config(checkpoint).max_position_embeddings
    if max_context > limit:
        raise UsageError(
            f"--max-context {max_context}: the model's context is {limit} positions (max_position_embeddings in "
            f"{checkpoint}/config.json; its rotary settings cover no more); give --max-context {limit} or less"
        )


def _calibration_set(
    engine: Path,
    checkpoint: Path,
    out: Path,
    prompts: int = CALIBRATION_PROMPTS,
    max_new_tokens: int = CALIBRATION_TOKENS,
    hold_out: Path = Path("bench/prompts.jsonl"),
) -> Path:
    """Make (or reuse) the calibration set in `out` with the float engine; returns its file."""
    from specrt.runtime.generator import Generator
    from specrt.training.calibration_set import SET_FILE, make_calibration_set
    from specrt.training.prompts import benchmark_prompts

    gen = Generator.from_engine(engine, checkpoint)
    held = benchmark_prompts(hold_out) if hold_out.is_file() else ()
    cal = make_calibration_set(gen, out, prompts=prompts, max_new_tokens=max_new_tokens, hold_out=held)
    click.echo(f"calibration {out / SET_FILE}: {len(cal.sequences)} sequences, {cal.tokens} tokens")
    return out / SET_FILE


@main.command()
@click.option("--model", "checkpoint", required=True, type=click.Path(exists=True, path_type=Path), help="The target.")
@click.option(
    "--artifacts",
    required=True,
    type=click.Path(path_type=Path),
    help="build-engines output: its float ORT engine answers the prompts; the set goes to ARTIFACTS/calibration/.",
)
@click.option("--prompts", default=CALIBRATION_PROMPTS, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--max-new-tokens",
    default=CALIBRATION_TOKENS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Longest answer per prompt.",
)
@click.option(
    "--hold-out",
    type=click.Path(path_type=Path),
    default=Path("bench/prompts.jsonl"),
    show_default=True,
    help="Benchmark prompts never to calibrate on (JSON lines with 'prompt'; skipped when absent).",
)
@click.option(
    "--report",
    is_flag=True,
    help="Also compare every quantized ORT engine built in ARTIFACTS with float32: quality on held-out text, "
    "batch variance, decode speed, step cost by positions, memory, and speculative decoding on each; a table, "
    "JSON and a plot (speed against agreement) in --report-out.",
)
@click.option(
    "--schemes", default=None, help="--report: comma-separated schemes to include (default: every one built)."
)
@click.option(
    "--report-out",
    type=click.Path(path_type=Path),
    default=None,
    help="--report: where the JSON and PNG go (default: ARTIFACTS/calibration).",
)
@click.option(
    "--heads",
    "heads",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="--report: also run these trained draft heads (e.g. drafts/SmolLM2-135M-Instruct/medusa) on each engine; "
    "repeatable.",
)
@click.option(
    "--report-tokens",
    default=64,
    show_default=True,
    type=click.IntRange(min=8),
    help="--report: tokens per generated answer.",
)
@_friendly_errors
def calibrate(
    checkpoint: Path,
    artifacts: Path,
    prompts: int,
    max_new_tokens: int,
    hold_out: Path,
    report: bool,
    schemes: str | None,
    report_out: Path | None,
    heads: tuple[Path, ...],
    report_tokens: int,
):
    """Make the calibration set of a target (prompts from the offline prompt set and the target's own greedy
    answers, for build-engines --quantize gptq and qdq-*); with --report, measure every quantized engine
    against float32."""
    from specrt.layout import ArtifactLayout

    layout = ArtifactLayout(artifacts)
    engine = layout.ort_engine("cpu")
    if not engine.is_dir():
        raise click.UsageError(
            f"no float ORT engine in {artifacts}; run `specrt build-engines --out {artifacts}` first"
        )
    chosen = None
    if schemes is not None:
        chosen = tuple(s.strip() for s in schemes.split(",") if s.strip())
        unknown = [s for s in chosen if s not in RECIPES]
        if unknown:
            raise click.BadParameter(f"{', '.join(unknown)}: choose from {', '.join(RECIPES)}", param_hint="--schemes")
    unused = _given("schemes", "report_out", "heads", "report_tokens")
    if unused and not report:
        raise click.UsageError(f"{_flags(unused)}: options of the report; give --report too, or leave them out")
    from specrt.report import ReportSpec, report_inputs

    spec = ReportSpec(
        artifacts,
        checkpoint,
        schemes=chosen,
        prompts=hold_out if hold_out.is_file() else None,
        new_tokens=report_tokens,
        heads=heads,
    )
    if report:
        report_inputs(spec)  # a scheme not built, a --heads that is no head: said before any work
    _calibration_set(engine, checkpoint, layout.calibration, prompts, max_new_tokens, hold_out)
    if not report:
        return
    import datetime

    from specrt.benchmark import write_result_json
    from specrt.report import format_report, plot_report, quant_report

    result = quant_report(spec, log=lambda line: click.echo(line, err=True))
    click.echo(format_report(result))
    out = report_out or layout.calibration
    click.echo(f"wrote {write_result_json(result, out, 'quant-report')}")
    png = plot_report(result, Path(out) / f"quant-report-{datetime.date.today().isoformat()}.png")
    click.echo(f"wrote {png}" if png else "no plot: matplotlib is not installed (pip install matplotlib)")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@_friendly_errors
def inspect(paths: tuple[Path, ...]):
    """Show what artifact directories hold (build-engines output, draft heads from train-draft or
    make drafts, or single artifacts), TensorRT profiles included, and whether each would load
    here; exit status 1 if any would be refused. E.g.: specrt inspect artifacts/M drafts/M"""
    from specrt.inspection import find_artifacts, inspect_artifact

    refused = 0
    for p in [a for path in paths for a in find_artifacts(path)]:
        r = inspect_artifact(p)
        click.echo(f"{r.path}  [{r.kind}]")
        for line in r.lines:
            click.echo(line)
        click.echo(f"  status      {r.verdict}\n")
        refused += not r.usable
    if refused:
        sys.exit(1)
