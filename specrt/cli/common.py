"""What the commands share: the group, error handling, parameter types, option groups declared once."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import click

from specrt.calibration import QUANT_SCHEMES as RECIPES
from specrt.errors import SpecrtError, UsageError
from specrt.runtime.drafts import DRAFT_METHODS
from specrt.runtime.runner import BACKENDS
from specrt.runtime.session import EXACTNESS
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
        except UsageError as e:  # options that do not go together: click shows the usage with it
            _close_progress_bars()
            raise click.UsageError(str(e)) from None
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


QUANT_SCHEMES = ["none", *RECIPES]  # build-engines --quantize (specrt/calibration)
DRAFT_CHOICES = ["none", *DRAFT_METHODS]  # --draft: the registry's (importing it loads no torch)


def machine_mb() -> int | None:
    """This machine's physical memory in MiB (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    except (ValueError, OSError, AttributeError):
        return None


def memory_mb(ctx, param, value: int) -> int:
    """A click callback: an amount of memory in MiB this machine can hold (at most its RAM)."""
    most = machine_mb()
    if most is not None and value > most:
        raise click.BadParameter(
            f"{value} MiB is more than this machine's memory ({most} MiB); give at most {most // 2} (half of it "
            "leaves room for the model and the batch)"
        )
    return value


def _methods(which) -> str:
    """The draft methods an option is for, as --help names them (eagle/eagle3/...)."""
    return "/".join(name for name, m in DRAFT_METHODS.items() if which(m))


CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 32, 128  # the default calibration set: ~6.5k tokens


def _parse_layers(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated layer indices, e.g. -1 or 2,15,27") from None


def _parse_methods(value: str) -> tuple[str, ...]:
    """bench --methods: draft methods without weights (the heads come with --drafts)."""
    from specrt.runtime.drafts import DRAFT_METHODS

    lookups = [n for n, m in DRAFT_METHODS.items() if not m.needs_draft_dir]
    out = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in out if v not in lookups]
    if bad:
        raise click.BadParameter(
            f"{', '.join(bad)}: choose among {', '.join(lookups)} (heads: --drafts DIR)", param_hint="--methods"
        )
    return out


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


def tensorrt_option(help: str):
    """--tensorrt auto|off|tensorrt|tensorrt-rtx, for every command that builds engines."""
    return click.option(
        "--tensorrt", "tensorrt", default="auto", show_default=True,
        type=click.Choice(["auto", "off", "tensorrt", "tensorrt-rtx"]), help=help,
    )  # fmt: skip


HEAD_TENSORRT = "Also build the head's TensorRT engine (auto: when tensorrt or tensorrt_rtx is installed)."


def _given(*names: str) -> tuple[str, ...]:
    """The parameters among `names` that the running command was given on its command line."""
    ctx, default = click.get_current_context(), (None, click.core.ParameterSource.DEFAULT)
    return tuple(n for n in names if ctx.get_parameter_source(n) not in default)


def _flags(names) -> str:
    return ", ".join(f"--{n.replace('_', '-')}" for n in names)


def quantize_option(help: str):
    """--quantize, one of build-engines' schemes (none: float32), with the command's own help."""
    return click.option("--quantize", default="none", show_default=True, type=click.Choice(QUANT_SCHEMES), help=help)


def _precision_options() -> list:
    """--quantize and --split: which of an artifact directory's ORT engines runs (the engine
    options below, and bench's)."""
    return [
        quantize_option("--artifacts: run the quantized ORT engine of this scheme (build-engines --quantize)."),
        click.option(
            "--split",
            is_flag=True,
            help="--quantize gguf: one row's one-position steps (decoding) on the 4-bit engine, the others "
            "(prefill, verification, batches) on the float32 engine, which is faster for them here; both compute "
            "the same model.",
        ),
    ]


def precision_options(fn):
    """A command's --quantize and --split (bench: it takes no other engine option)."""
    for option in reversed(_precision_options()):
        fn = option(fn)
    return fn


def engine_options(draft: str = "none"):
    """The options that choose the engine, backend and draft (shared by generate and serve, each
    with its default --draft); the command receives them as one RunnerSpec (runtime/runner.py),
    `choice`."""
    return functools.partial(_with_engine_options, draft=draft)


def _with_engine_options(fn, draft: str):
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
            type=click.Choice(list(BACKENDS)),
            help="; ".join(f"{name}: {b.about}" for name, b in BACKENDS.items()) + ".",
        ),
        click.option(
            "--provider",
            default="cpu",
            show_default=True,
            type=click.Choice(["cpu", "cuda", "tensorrt"]),
            help="ONNX Runtime execution provider.",
        ),
        *_precision_options(),
        click.option(
            "--threads",
            default=0,
            show_default=True,
            type=click.IntRange(min=0),
            help="ORT intra-op threads (0: one per physical core).",
        ),
        click.option(
            "--spin/--no-spin",
            default=False,
            show_default=True,
            help="ORT's threads spin while they wait for work: a few percent faster on a machine of its own "
            "(the 1.5B's decode step 67 against 70 ms), far slower where other processes want its cores.",
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
            default=draft,
            show_default=True,
            type=click.Choice(DRAFT_CHOICES),
            help="Draft method for speculative decoding: "
            + "; ".join(f"{name}: {m.about}" for name, m in DRAFT_METHODS.items())
            + ".",
        ),
        click.option(
            "--draft-dir",
            type=click.Path(path_type=Path),
            default=None,
            help=f"--draft {_methods(lambda m: m.needs_draft_dir)}: the draft's directory (specrt train-draft --out, "
            "specrt import-mtp, or make drafts; a draft model: a smaller model's build-engines --out, or one of its "
            "engines, e.g. ART/engines/ort-cpu-gguf-a8); optional for --draft "
            f"{_methods(lambda m: m.head_optional)}: a trained head (EAGLE-1, EAGLE-3, peagle, MTP, Medusa) or a "
            "draft model's engine it may draft with.",
        ),
        click.option(
            "--draft-tree",
            default="chain",
            show_default=True,
            help=f"--draft {_methods(lambda m: m.takes_tree)}: 'chain', or TOP_K,DEPTH for EAGLE-2 dynamic trees "
            "(e.g. 4,6; the node budget is --num-draft).",
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
            "--exact",
            default="bitwise",
            show_default=True,
            type=click.Choice(EXACTNESS),
            help="bitwise: every step computes at least two positions per row (a one-position step carries a free "
            "guess), so speculative and batched output is bitwise plain output on every engine whose build measured "
            "it (`specrt inspect`); near-ties: one-position steps as they are (faster where two-row products cost "
            "much more), output equal up to near-ties.",
        ),
        click.option(
            "--verify-artifacts",
            is_flag=True,
            help="Hash the engine's files in full before loading (by default only files changed since their last "
            "check are hashed).",
        ),
    ]

    @functools.wraps(fn)
    def bundled(**kwargs):
        from specrt.runtime.runner import DRAFT_OPTIONS, RunnerSpec

        fields = [f.name for f in dataclasses.fields(RunnerSpec) if f.name != "given"]
        return fn(choice=RunnerSpec(**{k: kwargs.pop(k) for k in fields}, given=_given(*DRAFT_OPTIONS)), **kwargs)

    for option in reversed(options):
        bundled = option(bundled)
    return bundled


def open_chosen(spec):
    """(generator, runner) of the engine options (runtime/runner.py), its exactness warning said."""
    from specrt.runtime.runner import open_runner

    gen, runner = open_runner(spec)
    warning = getattr(runner, "exactness_warning", None)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    return gen, runner
