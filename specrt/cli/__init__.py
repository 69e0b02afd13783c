"""The `specrt` command line: a thin click layer; each command calls one library function.

    common.py   the group, errors, parameter types, the option groups several commands share
    build.py    convert, export, build-engines, calibrate, inspect
    run.py      generate, serve, bench
    drafts.py   train-draft, make-data, build-draft, import-mtp
    models.py   assemble (a model file from its chunk packages)

Heavy imports (torch, onnx, onnxruntime) happen inside the commands, so `specrt --help` is instant
and works without them.
"""

from specrt.cli import build, drafts, models, run  # noqa: F401  (each registers its commands on `main`)
from specrt.cli.common import DRAFT_CHOICES, QUANT_SCHEMES, main

__all__ = ["DRAFT_CHOICES", "QUANT_SCHEMES", "main"]
