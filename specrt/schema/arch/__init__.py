"""The model families specrt exports, one file of facts each (schema/arch/base.py says what a
family declares); `FAMILIES` maps config.json's architecture name to its Architecture.

Adding a family: its file here with one `Architecture`, its line below, and its tiny checkpoint's
parameters in tests/test_conformance.py (docs/architecture.md, "Adding a model family")."""

from __future__ import annotations

from specrt.schema.arch.base import Architecture
from specrt.schema.arch.gemma3 import GEMMA3
from specrt.schema.arch.llama import LLAMA, MISTRAL, QWEN2
from specrt.schema.arch.phi3 import PHI3
from specrt.schema.arch.qwen3 import QWEN3

FAMILIES: dict[str, Architecture] = {f.architecture: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA3)}

__all__ = ["FAMILIES", "Architecture"]
