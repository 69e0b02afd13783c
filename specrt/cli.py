"""The `specrt` command line: a thin click layer; each command calls one library function.

Heavy imports (torch, onnx, onnxruntime) happen inside the commands, so `specrt --help` is instant
and works without them.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import click

from specrt.calibration import QUANT_SCHEMES as RECIPES
from specrt.calibration import TRT_SCHEMES
from specrt.errors import SpecrtError
from specrt.server.limits import ServerLimits

SERVER = ServerLimits()  # the server's defaults, shown in serve --help


def _friendly_errors(fn):
    """SpecrtError -> one clear line and exit status 1 (library code never exits). Progress bars
    still drawn are closed first, so the message gets a line of its own and no bar is redrawn
    after it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecrtError as e:
            _close_progress_bars()
            raise click.ClickException(str(e)) from None

    return wrapper


def _close_progress_bars() -> None:
    if "tqdm" not in sys.modules:
        return
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


class FiniteFloat(click.ParamType):
    """A float in [lo, hi] that is a real number: click's FloatRange lets NaN through (every
    comparison with NaN is False), and 'inf' parses as a float."""

    name = "float"

    def __init__(self, lo: float, hi: float | None = None, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        import math

        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if v < self.lo or (self.lo_open and v == self.lo) or (self.hi is not None and v > self.hi):
            hi = "" if self.hi is None else f", {self.hi}]"
            self.fail(f"{v} is not in {'(' if self.lo_open else '['}{self.lo}{hi or ', inf)'}", param, ctx)
        return v


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrt")
def main():
    """specrt: export LLMs to ONNX, build engines, and generate (speculative decoding runtime)."""


@main.command()
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Checkpoint directory to write (config.json, model.safetensors, tokenizer).",
)
@_friendly_errors
def convert(gguf_file: Path, out: Path):
    """Convert a GGUF file to a float32 Hugging Face checkpoint directory."""
    from specrt.export.gguf import convert_gguf

    convert_gguf(gguf_file, out)
    click.echo(f"wrote {out}")


QUANT_SCHEMES = ["none", *RECIPES]  # build-engines --quantize (specrt/calibration)
# --draft: specrt.runtime.drafts.DRAFT_METHODS, spelled out because importing the drafts costs ~1 s
# that --help should not pay (a test keeps the two equal)
DRAFT_CHOICES = ["none", "ngram", "suffix", "lookahead", "eagle", "eagle3", "mtp", "hybrid", "medusa", "draft-model"]
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 32, 128  # the default calibration set: ~6.5k tokens


def _parse_layers(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated layer indices, e.g. -1 or 2,15,27") from None


def _parse_fixed_n(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",")) if value.strip() else ()
    except ValueError:
        out = (-1,)
    if any(n < 1 for n in out):
        raise click.BadParameter(
            f"{value!r}: give comma-separated draft lengths >= 1, e.g. 4,8", param_hint="--fixed-n"
        )
    return out


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
    "--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="Checkpoint directory or .gguf file."
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
    "written in place: onnx-fused/, float32 and gguf; TensorRT's the standard opset-23 graph: onnx-standard/) or "
    "portable (both run the traced graph: onnx/).",
)
@click.option(
    "--tensorrt",
    "tensorrt",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "off", "tensorrt", "tensorrt-rtx"]),
    help="TensorRT engine: auto builds one when tensorrt or tensorrt_rtx is installed.",
)
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
@click.option(
    "--quantize",
    default="none",
    show_default=True,
    type=click.Choice(QUANT_SCHEMES),
    help="Also build a quantized graph (onnx-<scheme>/) and its ORT engine (engines/ort-<provider>-<scheme>/): gguf "
    "(the GGUF file's own 4-bit blocks: the float model within float rounding), hqq (int4, offsets fitted, no "
    "data), gptq / awq (int4 fitted to calibration activations; makes the calibration set first, see `specrt "
    "calibrate`), int4 weights rounded to nearest, int8/int4 weights with int8 activations (-a8: faster, but "
    "speculative output may then differ from plain), or qdq-int8/qdq-fp8 (explicit Q/DQ for TensorRT, "
    "calibrated), qdq-int4 (int4 weight-only DQ for TensorRT), fp16 / bf16 (16-bit weights and compute for GPUs; "
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
    help="--quantize gguf: the GGUF file the checkpoint was converted from (default: the one `specrt convert` "
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
    from specrt.training.calibration import SET_FILE, make_calibration_set
    from specrt.training.prompts import benchmark_prompts

    gen = Generator.from_engine(engine, checkpoint)
    held = benchmark_prompts(hold_out) if hold_out.is_file() else ()
    cal = make_calibration_set(gen, out, prompts=prompts, max_new_tokens=max_new_tokens, hold_out=held)
    click.echo(f"calibration {out / SET_FILE}: {len(cal.sequences)} sequences, {cal.tokens} tokens")
    return out / SET_FILE


@dataclasses.dataclass(frozen=True)
class EngineChoice:
    """The options of `_engine_options`: which engine, backend and draft generate and serve run."""

    artifacts: Path | None
    engine: Path | None
    checkpoint: Path | None
    backend: str
    provider: str
    quantize: str
    split: bool
    threads: int
    device: str | None
    cuda_graphs: bool
    draft: str
    num_draft: str
    max_draft: int
    verify_artifacts: bool
    draft_dir: Path | None
    draft_tree: str


def _make_runner(choice: EngineChoice):
    """(generator, runner): the generator on the chosen backend, and the runner (itself, or a
    speculative decoder over it with the chosen draft)."""
    from specrt.layout import TRT_FLAVOURS, ArtifactLayout
    from specrt.runtime.generator import Generator

    artifacts, engine, checkpoint, backend = choice.artifacts, choice.engine, choice.checkpoint, choice.backend
    provider, quantize, device, cuda_graphs = choice.provider, choice.quantize, choice.device, choice.cuda_graphs
    if choice.split and (quantize == "none" or backend != "ort" or engine is not None):
        raise click.UsageError(
            "--split runs two ORT engines of --artifacts: give it with --quantize gguf (the 4-bit engine decodes, "
            "float32 verifies)"
        )
    draft, verify_artifacts = choice.draft, choice.verify_artifacts
    _check_draft_options(choice)

    verify = "full" if verify_artifacts else "auto"

    if quantize != "none" and backend == "torch" or quantize not in ("none", *TRT_SCHEMES) and backend == "trt":
        raise click.UsageError(
            f"--quantize {quantize} runs an ORT engine (MatMulNBits); use it with --backend ort (TensorRT takes the "
            f"Q/DQ and 16-bit schemes: {', '.join(TRT_SCHEMES)})"
        )
    if backend == "torch":
        if checkpoint is None:
            raise click.UsageError("--backend torch needs --model CHECKPOINT")
        gen = Generator.from_checkpoint(checkpoint, device=device or "cpu", cuda_graphs=cuda_graphs)
    elif backend == "trt":
        if engine is None:
            if artifacts is None:
                raise click.UsageError("--backend trt needs --artifacts DIR (from build-engines) or --engine DIR")
            layout = ArtifactLayout(artifacts)
            engine = layout.built_trt_engine(quantize)
            if engine is None:
                built = " or ".join(str(layout.trt_engine(f, quantize)) for f in TRT_FLAVOURS)
                how = "" if quantize == "none" else f" --quantize {quantize}"
                raise SpecrtError(
                    f"{artifacts} has no TensorRT engine ({built}); build one with: "
                    f"specrt build-engines --model CHECKPOINT --out {artifacts} --tensorrt auto{how}"
                )
        gen = Generator.from_trt_engine(
            engine, checkpoint, device=device or "cuda", cuda_graphs=cuda_graphs, verify=verify
        )
    else:
        from specrt.engines.ort import OrtOptions

        if engine is None:
            if artifacts is None:
                raise click.UsageError(
                    "give --artifacts DIR (from build-engines) or --engine DIR, or --backend torch --model CHECKPOINT"
                )
            engine = ArtifactLayout(artifacts).ort_engine(provider, quantize)
            if quantize != "none" and not engine.is_dir():
                raise SpecrtError(
                    f"{engine} does not exist; build it with: specrt build-engines --model CHECKPOINT --out "
                    f"{artifacts} --quantize {quantize}"
                )
        multi = ArtifactLayout(artifacts).ort_engine(provider) if choice.split else None
        gen = Generator.from_engine(
            engine,
            checkpoint,
            options=OrtOptions(provider=provider, intra_op_threads=choice.threads),
            verify=verify,
            multi_engine=multi,
        )
    runner = gen
    if draft != "none":
        import warnings

        from specrt.runtime.drafts import make_proposer
        from specrt.runtime.speculative import SpeculativeDecoder, make_policy

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said once, plainly, below
            runner = SpeculativeDecoder(
                gen,
                make_proposer(draft, **_draft_options(choice, gen)),
                make_policy(choice.num_draft, choice.max_draft),
            )
        if runner.exactness_warning:
            click.echo(f"warning: {runner.exactness_warning}", err=True)
    return gen, runner


def _check_draft_options(choice: EngineChoice) -> None:
    """Usage errors of the draft options, before any engine loads: a draft option that the
    chosen draft (or plain decoding) would silently leave unused is refused."""
    from specrt.runtime.drafts import NEEDS_DRAFT_DIR, TAKES_TREE

    draft = choice.draft
    if draft == "none":
        given = _given("draft_dir", "draft_tree", "num_draft", "max_draft")
        if given:
            raise click.UsageError(
                f"{', '.join(given)}: for speculative decoding, so give --draft too (e.g. --draft suffix, or --draft "
                "eagle3 with a head's --draft-dir), or leave it out for plain decoding"
            )
        return
    if choice.draft_tree != "chain" and draft not in TAKES_TREE:
        own = " (Medusa drafts its own tree of choices)" if draft == "medusa" else ""
        raise click.UsageError(f"--draft-tree is for --draft {', '.join(TAKES_TREE)}, not --draft {draft}{own}")
    if draft not in NEEDS_DRAFT_DIR and choice.draft_dir is not None:
        raise click.UsageError(
            f"--draft-dir is for a draft with weights (--draft {', '.join(NEEDS_DRAFT_DIR)}), not --draft {draft}"
        )
    if draft in NEEDS_DRAFT_DIR and choice.draft_dir is None:
        raise click.UsageError(
            f"--draft {draft} needs --draft-dir DIR: a head from `make drafts` (e.g. "
            "drafts/SmolLM2-135M-Instruct/eagle3) or `specrt train-draft`"
        )
    if choice.draft_tree != "chain":
        _parse_tree(choice.draft_tree)


def _given(*names: str) -> list[str]:
    """The options among `names` (parameter names) given on the command line, as flags."""
    ctx = click.get_current_context(silent=True)  # none: called as a library (a Ray replica)
    if ctx is None:
        return []
    default = (None, click.core.ParameterSource.DEFAULT)
    return [f"--{n.replace('_', '-')}" for n in names if ctx.get_parameter_source(n) not in default]


def _parse_tree(value: str) -> tuple[int, int]:
    try:
        top_k, depth = (int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give 'chain' or TOP_K,DEPTH, e.g. 4,6", param_hint="--draft-tree")
    return top_k, depth


def _draft_options(choice: EngineChoice, gen) -> dict:
    """make_proposer's options for a draft method (checked by _check_draft_options): heads need
    their directory and the target."""
    if choice.draft_dir is None:
        return {}
    options = {"draft_dir": choice.draft_dir, "target": gen.session.caps}
    if choice.draft_tree != "chain":
        options["tree"] = _parse_tree(choice.draft_tree)
    return options


def _engine_options(fn):
    """The options that choose the engine, backend and draft (shared by generate and serve); the
    command receives them as one EngineChoice, `choice`."""
    options = [
        click.option(
            "--artifacts",
            type=click.Path(path_type=Path),
            help="Artifact directory from build-engines (uses its engines/ort-<provider>).",
        ),
        click.option("--engine", type=click.Path(path_type=Path), help="Engine directory (overrides --artifacts)."),
        click.option(
            "--model",
            "checkpoint",
            type=click.Path(path_type=Path),
            help="Checkpoint directory; checked against the engine's manifest. Alone, runs the PyTorch reference.",
        ),
        click.option(
            "--backend",
            default="ort",
            show_default=True,
            type=click.Choice(["ort", "trt", "torch"]),
            help="ort: the ONNX Runtime engine; trt: the TensorRT engine (NVIDIA GPU); torch: the PyTorch model.",
        ),
        click.option(
            "--provider",
            default="cpu",
            show_default=True,
            type=click.Choice(["cpu", "cuda", "tensorrt"]),
            help="ONNX Runtime execution provider.",
        ),
        click.option(
            "--quantize",
            default="none",
            show_default=True,
            type=click.Choice(QUANT_SCHEMES),
            help="--artifacts: run the quantized ORT engine of this scheme (build-engines --quantize).",
        ),
        click.option(
            "--split",
            is_flag=True,
            help="--quantize gguf: one-position steps (decoding) on the 4-bit engine, longer ones (prefill, "
            "verification) on the float32 engine, which is faster for them here; both compute the same model.",
        ),
        click.option(
            "--threads",
            default=0,
            show_default=True,
            type=click.IntRange(min=0),
            help="ORT intra-op threads (0: one per physical core).",
        ),
        click.option(
            "--device",
            default=None,
            help="--backend torch: cpu (the reference, default) or cuda (PyTorch-CUDA backend); --backend trt: the "
            "GPU (default cuda).",
        ),
        click.option(
            "--cuda-graphs",
            is_flag=True,
            help="--backend trt, or torch --device cuda: capture fixed-shape steps as CUDA graphs.",
        ),
        click.option(
            "--draft",
            default="none",
            show_default=True,
            type=click.Choice(DRAFT_CHOICES),
            help="Draft method for speculative decoding (ngram, suffix, lookahead: no weights; eagle, eagle3, mtp, "
            "medusa: a trained head, give --draft-dir; draft-model: a smaller model's build-engines output as "
            "--draft-dir; hybrid: suffix where its match is long, the head in --draft-dir elsewhere).",
        ),
        click.option(
            "--draft-dir",
            type=click.Path(path_type=Path),
            default=None,
            help="--draft eagle/eagle3/mtp/medusa/hybrid: the head's directory (specrt train-draft --out, specrt "
            "import-mtp, or make drafts).",
        ),
        click.option(
            "--draft-tree",
            default="chain",
            show_default=True,
            help="--draft eagle/eagle3/mtp: 'chain', or TOP_K,DEPTH for EAGLE-2 dynamic trees (e.g. 4,6; the node "
            "budget is --num-draft).",
        ),
        click.option(
            "--num-draft",
            default="auto",
            show_default=True,
            help="Draft tokens per step: a number, or 'auto' (chosen each step by the cost model).",
        ),
        click.option(
            "--max-draft",
            default=16,
            show_default=True,
            type=click.IntRange(min=1),
            help="Upper bound for --num-draft auto.",
        ),
        click.option(
            "--verify-artifacts",
            is_flag=True,
            help="Hash the engine's files in full before loading (by default only files changed since their last "
            "check are hashed).",
        ),
    ]
    fields = [f.name for f in dataclasses.fields(EngineChoice)]

    @functools.wraps(fn)
    def bundled(**kwargs):
        return fn(choice=EngineChoice(**{k: kwargs.pop(k) for k in fields}), **kwargs)

    for option in reversed(options):
        bundled = option(bundled)
    return bundled


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt", "prompt_opt", help="Prompt text (or give it as the argument; '-' reads stdin).")
@_engine_options
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(0.0), help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 disables.")
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(0.0, 1.0, lo_open=True), help="1 disables.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed for sampling (an integer >= 0).")
@click.option(
    "--chat/--no-chat", default=True, show_default=True, help="Apply the model's chat template to the prompt."
)
@click.option("--system", default=None, help="System message (chat mode).")
@_friendly_errors
def generate(
    choice,
    prompt,
    prompt_opt,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    chat,
    system,
):
    """Generate text, streaming it as it is produced; ends with token counts and tokens/s
    (and, with --draft, the speculative decoding metrics)."""
    from specrt.runtime.sampling import SamplingParams

    text = prompt_opt if prompt_opt is not None else prompt
    if text is None:
        raise click.UsageError("give a prompt: specrt generate --artifacts DIR --prompt 'Hello'")
    if text == "-":
        text = sys.stdin.read()
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    gen, runner = _make_runner(choice)
    stream = runner.stream(text, max_new_tokens=max_new_tokens, sampling=sampling, chat=chat, system=system)
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    result = stream.result
    click.echo()
    sys.stdout.flush()
    click.echo(f"[{gen.backend.description}] {result.summary()}", err=True)
    if result.metrics is not None:
        click.echo(f"[{choice.draft} draft, num_draft={choice.num_draft}] {result.metrics.summary()}", err=True)


@main.command()
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--served-model-name", default=None, help="Model id clients send (default: the checkpoint directory's name)."
)
@click.option(
    "--max-tokens",
    "max_tokens_limit",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest max_tokens a request may ask for (and the default).",
)
@click.option(
    "--max-body-kb",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest request body; larger ones get 413.",
)
@click.option(
    "--max-queue",
    default=SERVER.max_queue,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests that may wait for a slot; more get 503.",
)
@click.option(
    "--max-batch",
    default=SERVER.max_batch,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests generating together (continuous batching); 1 serves one at a time.",
)
@click.option(
    "--prefill-budget",
    default=SERVER.prefill_budget,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens prefilled per step while other requests decode (a newcomer's prompt in chunks).",
)
@click.option(
    "--request-timeout",
    default=SERVER.request_timeout,
    show_default=True,
    type=FiniteFloat(0.0, lo_open=True),
    help="Seconds a request may take from arrival; past it the request ends with 504.",
)
@click.option("--ray", "use_ray", is_flag=True, help="Serve --replicas engines behind Ray Serve (the ray extra).")
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(min=1), help="With --ray: engines.")
@click.option("--ray-address", default=None, help="With --ray: a running Ray cluster to join (default: start one).")
@_friendly_errors
def serve(
    choice,
    host,
    port,
    served_model_name,
    max_tokens_limit,
    max_body_kb,
    max_queue,
    max_batch,
    prefill_budget,
    request_timeout,
    use_ray,
    replicas,
    ray_address,
):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models, streaming included), optionally with speculative decoding (--draft), on one
    engine or on several behind Ray Serve (--ray --replicas N)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpecrtError(
            "the server needs fastapi and uvicorn: pip install 'specrt[server]' (make setup installs them)"
        ) from None
    from specrt.server import bind_socket

    limits = ServerLimits(
        max_body_bytes=max_body_kb << 10,
        max_tokens=max_tokens_limit,
        max_queue=max_queue,
        max_batch=max_batch,
        prefill_budget=prefill_budget,
        request_timeout=request_timeout,
    )
    sock = bind_socket(host, port)  # before the engine loads: a taken port is said at once
    if use_ray:
        sock.close()  # Ray Serve's proxy listens; it was only checked to be free
        _serve_ray(choice, served_model_name, limits, host, port, replicas, ray_address)
        return
    try:
        gen, runner = _make_runner(choice)
        service = _service(gen, runner, choice, served_model_name, limits)
    except BaseException:
        sock.close()
        raise
    url_host = f"[{host}]" if ":" in host else host
    click.echo(f"serving {service.model_id!r} on http://{url_host}:{port} [{_served(gen, choice)}]", err=True)
    from specrt.server import serve as run_server

    run_server(service, sock)


def _service(gen, runner, choice: EngineChoice, served_model_name, limits):
    from specrt.server import CompletionService

    name = served_model_name or Path(gen.checkpoint or choice.checkpoint or choice.artifacts or choice.engine).name
    return CompletionService(runner, name, limits)


def _served(gen, choice: EngineChoice) -> str:
    return f"{gen.backend.description}{', ' + choice.draft + ' draft' if choice.draft != 'none' else ''}"


def _serve_ray(choice: EngineChoice, served_model_name, limits, host, port, replicas, address) -> None:
    """`serve --ray`: replicas of the engine behind Ray Serve's proxy (server/ray.py)."""
    import os

    try:
        import ray  # noqa: F401
        from ray import serve as _  # noqa: F401
    except ImportError:
        raise SpecrtError("--ray needs Ray Serve: pip install 'specrt[ray]' (or pip install 'ray[serve]')") from None
    from specrt.server.ray import serve_ray

    cpus = max(1, (os.cpu_count() or 1) // replicas)  # per replica; its ONNX Runtime threads match
    if choice.threads == 0:
        choice = dataclasses.replace(choice, threads=cpus)
    if address is None:  # one machine: load the engine here first, so a bad option fails before Ray starts
        gen, _ = _make_runner(choice)
        what = _served(gen, choice)
        del gen
    else:
        what = choice.draft

    def make_service():
        gen, runner = _make_runner(choice)
        return _service(gen, runner, choice, served_model_name, limits)

    url_host = f"[{host}]" if ":" in host else host
    click.echo(f"serving {replicas} replicas on http://{url_host}:{port} via Ray Serve [{what}]", err=True)
    serve_ray(make_service, replicas, host, port, cpus, limits.max_batch + limits.max_queue, address=address)


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
    help="--report: also run these trained draft heads (e.g. drafts/SmolLM2-135M-Instruct/eagle3) on each engine; "
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
        raise click.UsageError(f"{', '.join(unused)}: options of the report; give --report too, or leave them out")
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


@main.command("train-draft")
@click.option(
    "--method",
    required=True,
    type=click.Choice(["eagle", "eagle3", "mtp", "medusa", "draft-model"]),
    help="EAGLE-1 or EAGLE-3 head, an MTP module (DeepSeek-V3 layout), Medusa heads, or a draft model distilled "
    "from the target's layers.",
)
@click.option("--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="The target's checkpoint.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The head's directory (--draft-dir).")
@click.option(
    "--artifacts",
    type=click.Path(path_type=Path),
    default=None,
    help="The target's build-engines directory: its ORT engine makes the training data (faster than PyTorch).",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="Training data directory, shared by the heads of one target (default: OUT/data).",
)
@click.option("--prompts", default=2000, show_default=True, type=click.IntRange(min=2), help="Prompts to answer.")
@click.option("--max-new-tokens", default=192, show_default=True, type=click.IntRange(min=1), help="Per answer.")
@click.option("--gen-batch", default=16, show_default=True, type=click.IntRange(min=1), help="Answers per batch.")
@click.option(
    "--hold-out",
    type=click.Path(path_type=Path),
    default=Path("bench/prompts.jsonl"),
    show_default=True,
    help="Benchmark prompts never trained on (skipped when the file is absent).",
)
@click.option("--epochs", default=2.0, show_default=True, type=FiniteFloat(0.0, lo_open=True))
@click.option("--lr", default=1e-3, show_default=True, type=FiniteFloat(0.0, lo_open=True))
@click.option(
    "--ttt-steps", default=None, type=click.IntRange(min=1), help="Unrolled draft steps (eagle 1, mtp 2, eagle3 3)."
)
@click.option(
    "--draft-vocab", default=8192, show_default=True, type=click.IntRange(min=1), help="eagle3, medusa, draft-model."
)
@click.option("--medusa-heads", default=4, show_default=True, type=click.IntRange(min=1), help="medusa: heads (K).")
@click.option("--batch-tokens", default=4096, show_default=True, type=click.IntRange(min=64))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--max-minutes", default=None, type=FiniteFloat(0.0, lo_open=True), help="Stop training (checkpointed) after this."
)
@click.option(
    "--tensorrt",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "off", "tensorrt", "tensorrt-rtx"]),
    help="Also build the head's TensorRT engine (auto: when tensorrt or tensorrt_rtx is installed).",
)
@_friendly_errors
def train_draft(
    method,
    checkpoint,
    out,
    artifacts,
    data,
    prompts,
    max_new_tokens,
    gen_batch,
    hold_out,
    epochs,
    lr,
    ttt_steps,
    draft_vocab,
    medusa_heads,
    batch_tokens,
    seed,
    max_minutes,
    tensorrt,
):
    """Train a draft head (EAGLE-1, EAGLE-3 or Medusa) on the target's own answers
    (self-distillation), then export it to ONNX and build its engine. Every step resumes where an
    interrupted run stopped."""
    from specrt.training.eagle import TrainConfig
    from specrt.training.medusa import MedusaTrainConfig
    from specrt.training.pipeline import TrainDraftSpec, train_draft
    from specrt.training.prompts import benchmark_prompts

    if method == "draft-model":
        from specrt.training.draft_model import DraftModelConfig

        cfg = DraftModelConfig(
            draft_vocab=draft_vocab, epochs=epochs, lr=lr, batch_tokens=batch_tokens, seed=seed, max_minutes=max_minutes
        )
    elif method == "medusa":
        cfg = MedusaTrainConfig(
            num_heads=medusa_heads, draft_vocab=draft_vocab, epochs=epochs, lr=lr, seed=seed, max_minutes=max_minutes
        )
    else:
        cfg = TrainConfig(
            method,
            ttt_steps=ttt_steps,
            epochs=epochs,
            lr=lr,
            batch_tokens=batch_tokens,
            draft_vocab=draft_vocab if method == "eagle3" else None,
            seed=seed,
            max_minutes=max_minutes,
        )
    spec = TrainDraftSpec(
        method=method,
        checkpoint=checkpoint,
        out=out,
        data=data,
        artifacts=artifacts,
        prompts=prompts,
        seed=seed,
        max_new_tokens=max_new_tokens,
        gen_batch=gen_batch,
        hold_out=benchmark_prompts(hold_out) if hold_out.is_file() else (),
        train=cfg,
        tensorrt=tensorrt,
    )
    report = train_draft(spec)
    h = report["held_out"]
    click.echo(
        f"{method} head in {out}: {report['steps']} steps ({report['stopped']}), {report['train_sequences']} "
        f"sequences; held-out acceptance per draft step {h['acceptance']}, expected accepted length "
        f"{h['mean_accepted']:.2f} (chain, bonus included)"
    )


@main.command("build-draft")
@click.option("--draft-dir", required=True, type=click.Path(path_type=Path), help="A train-draft output directory.")
@click.option("--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="The target's checkpoint.")
@click.option(
    "--tensorrt",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "off", "tensorrt", "tensorrt-rtx"]),
    help="Also build the head's TensorRT engine (auto: when tensorrt or tensorrt_rtx is installed).",
)
@_friendly_errors
def build_draft(draft_dir, checkpoint, tensorrt):
    """Export a trained head to ONNX again and rebuild its engines (after an onnxruntime upgrade,
    or on another CPU)."""
    from specrt.training.pipeline import build_draft

    for d in build_draft(draft_dir, checkpoint, tensorrt=tensorrt):
        click.echo(f"wrote {d}")


@main.command("import-mtp")
@click.option(
    "--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="A checkpoint with MTP modules."
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The head's directory (--draft-dir).")
@click.option("--index", default=0, show_default=True, type=click.IntRange(min=0), help="Which MTP module.")
@click.option(
    "--tensorrt",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "off", "tensorrt", "tensorrt-rtx"]),
    help="Also build the head's TensorRT engine (auto: when tensorrt or tensorrt_rtx is installed).",
)
@_friendly_errors
def import_mtp(checkpoint, out, index, tensorrt):
    """Make a draft head of a multi-token-prediction module the checkpoint carries (DeepSeek-V3's
    layout: num_nextn_predict_layers in config.json), for --draft mtp --draft-dir OUT."""
    from specrt.training.pipeline import import_mtp

    for d in import_mtp(checkpoint, out, index, tensorrt):
        click.echo(f"wrote {d}")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@_friendly_errors
def inspect(paths: tuple[Path, ...]):
    """Show what artifact directories hold (build-engines output, draft heads from train-draft or
    make drafts, or single artifacts), TensorRT profiles included, and whether each would load
    here; exit status 1 if any would be refused. E.g.: specrt inspect artifacts/M drafts/M"""
    from specrt.inspect import find_artifacts, inspect_artifact

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


@main.command()
@click.option(
    "--artifacts",
    type=click.Path(path_type=Path),
    default=Path("artifacts/SmolLM2-135M-Instruct"),
    show_default=True,
    help="Artifact directory from build-engines.",
)
@click.option(
    "--model",
    "checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="Checkpoint (default: the one the engine was built from).",
)
@click.option(
    "--prompts",
    type=click.Path(path_type=Path),
    default=Path("bench/prompts.jsonl"),
    show_default=True,
    help="JSON lines with 'class' and 'prompt'.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("bench/results"),
    show_default=True,
    help="Where the JSON and the PNG go.",
)
@click.option("--max-new-tokens", default=192, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--no-transformers", is_flag=True, help="Skip the transformers baselines.")
@click.option("--quick", is_flag=True, help="One repeat, 48 tokens, N in {2, 4}: a smoke run.")
@click.option("--sweep-only", is_flag=True, help="Only the speedup-vs-N sweep and its plot.")
@click.option("--no-sweep", is_flag=True, help="Skip the speedup-vs-N sweep.")
@click.option(
    "--fixed-n",
    default="4,8",
    show_default=True,
    help="Fixed draft lengths for ngram, suffix and lookahead ('' for none).",
)
@click.option(
    "--drafts",
    type=click.Path(path_type=Path),
    default=None,
    help="A `make drafts` directory (drafts/MODEL): also run its EAGLE heads (chains, EAGLE-2 trees) and the hybrid.",
)
@_friendly_errors
def bench(
    artifacts,
    checkpoint,
    prompts,
    out,
    max_new_tokens,
    repeats,
    no_transformers,
    quick,
    sweep_only,
    no_sweep,
    fixed_n,
    drafts,
):
    """Benchmark speculative decoding on a prompt set: table, JSON and a speedup-vs-N plot."""
    from specrt.benchmark import SpecBenchConfig, format_table, run_spec_benchmark, write_results
    from specrt.layout import ArtifactLayout

    cfg = SpecBenchConfig(
        engine_dir=ArtifactLayout(artifacts).ort_engine(),
        checkpoint=checkpoint,
        prompts=prompts,
        out_dir=out,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        transformers=not no_transformers,
        main_runs=not sweep_only,
        sweep=not no_sweep,
        fixed_n=_parse_fixed_n(fixed_n),
        drafts=drafts,
    )
    if quick:
        cfg = dataclasses.replace(cfg, repeats=1, max_new_tokens=48, fixed_n=(4,), sweep_n=(2, 4))
    result = run_spec_benchmark(cfg, log=lambda line: click.echo(line, err=True))
    click.echo(format_table(result))
    sweep = result["sweep"]
    if sweep["measured"]:
        click.echo(
            f"\nsweep ({sweep['method']}, {sweep['class']}): "
            + "  ".join(
                f"N={n}: {m:.2f}x (model {p:.2f}x)"
                for n, m, p in zip(
                    sweep["n"], sweep["measured"], sweep["predicted"] or [float("nan")] * len(sweep["n"])
                )
            )
        )
    json_path, png = write_results(result, out)
    click.echo(f"wrote {json_path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":  # pragma: no cover
    main()
