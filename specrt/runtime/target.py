"""The target: the model speculation serves, on its step session, with its tokenizer and limits.

    target = Target.from_engine("artifacts/SmolLM2-135M-Instruct/engines/ort-cpu")
    ids = target.encode_prompt("What is speculative decoding?")
    budgets = target.budgets([ids], max_new_tokens=64)   # checked: PromptError names the problem

and what every generation produces from it: `GenerationResult` per row, and `Stream` (per-step
new tokens as an iterator, the results as a value once it is exhausted). Generation itself is one
loop, runtime/batching.py's engine; runtime/generator.py and runtime/speculative.py are the
facades that run it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Generic, Iterator, TypeVar

import numpy as np

from specrt.errors import PromptError, SpecrtError
from specrt.runtime.backends.base import StepBackend
from specrt.runtime.session import StepSession
from specrt.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class GenerationResult:
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens or the context)
    prefill_seconds: float
    decode_seconds: float  # sum of the decode steps (model step + sampling)
    step_seconds: list[float]  # latency of each decode step (speculative: each draft + verify step)
    text: str | None = None
    metrics: object | None = None  # SpecMetrics for speculative decoding
    acceptance: dict | None = None  # its acceptance report, when its request asked (Request.acceptance)

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which prefill produces) per second of decode steps."""
        return (len(self.token_ids) - 1) / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tokens, generated {self.generated_tokens} ({self.finish_reason}); "
            f"prefill {self.prefill_seconds * 1e3:.0f} ms, decode {self.decode_tokens_per_second:.1f} tokens/s"
        )


T = TypeVar("T")
R = TypeVar("R")


class Stream(Generic[T, R]):
    """An iterator over a generation's steps whose outcome is a value, not an exception:
    iterate it (each item: what the step produced), then read `result`. `close()` ends the
    generation early (its cache is released) and leaves `result` None."""

    def __init__(self, steps: Iterator[T], cleanup: Callable[[], None] | None = None):
        self._steps = steps
        self._cleanup = cleanup  # also run by close() when the steps never started
        self.result: R | None = None
        self.done = False

    def __iter__(self) -> "Stream[T, R]":
        return self

    def __next__(self) -> T:
        try:
            return next(self._steps)
        except StopIteration as stop:
            self.result, self.done = stop.value, True
            raise StopIteration from None

    def run(self) -> R:
        """Run to the end and return the result."""
        for _ in self:
            pass
        return self.result

    def close(self) -> None:
        self._steps.close()
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None

    def __enter__(self) -> "Stream[T, R]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def text_stream(target: "Target", steps: Stream) -> Stream[str, GenerationResult]:
    """Text pieces of row 0 of a token stream; its result is row 0's GenerationResult with text."""

    def pieces():
        detok = IncrementalDetokenizer(target.tokenizer)
        try:
            for new in steps:
                text = "".join(detok.push(t) for t in new[0] if t not in target.eos_ids)
                if text:
                    yield text
        finally:
            steps.close()
        result = steps.result[0]
        result.text = target.decode(result.token_ids)
        return result

    return Stream(pieces(), steps.close)


class Target:
    """The model being served: its step session, tokenizer, EOS tokens and context limit. A
    Generator (runtime/generator.py) is a Target that also generates; a SpeculativeDecoder
    drafts for one."""

    def __init__(
        self,
        backend: StepBackend,
        tokenizer: Tokenizer | None = None,
        max_context: int | None = None,
        prefill_chunk: int = 512,
        checkpoint: Path | None = None,
        exact: str = "bitwise",
    ):
        """exact: "bitwise" (steps keep the floor: runtime/session.py) or "near-ties" (one-position
        steps as they are)."""
        self.session = StepSession(backend, max_context, prefill_chunk, exact)
        self.backend = backend
        self.checkpoint = checkpoint  # where the weights and tokenizer came from, when known
        self.config = backend.config
        self.tokenizer = tokenizer
        self.max_context = self.session.max_context
        eos = set(self.config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token and tokenizer.token_id(tokenizer.eos_token) is not None:
            eos.add(tokenizer.token_id(tokenizer.eos_token))
        self.eos_ids = frozenset(eos)
        self._vocabulary = None

    def vocabulary(self):
        """The tokenizer as the grammar engine reads it (runtime/grammar.py), made on first use."""
        if self._vocabulary is None:
            from specrt.runtime.grammar import Vocabulary

            self._vocabulary = Vocabulary(self.tokenizer, self.config.vocab_size, self.eos_ids)
        return self._vocabulary

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_engine(
        cls,
        engine_dir: str | Path,
        checkpoint: str | Path | None = None,
        options=None,
        verify: str = "auto",
        multi_engine: str | Path | None = None,
        **kw,
    ) -> "Target":
        """The target on a built ORT engine. The tokenizer and chat template come from the files
        the artifacts carry (schema/model_files.py: no checkpoint needed), or from the checkpoint
        the engine was built from for an engine without them; a checkpoint given explicitly wins
        and must be the one in the manifest. verify: "auto" hashes the engine's files when they
        changed since their last check, "full" always (see specrt.artifacts). multi_engine: another
        engine of the same model for steps of more than one position (backends.SplitBackend: e.g.
        gguf decodes, float32 verifies)."""
        from specrt.engines.ort import load_ort_session, read_engine_manifest
        from specrt.runtime.backends import OrtBackend, SplitBackend

        manifest = read_engine_manifest(engine_dir, verify="none")  # the files are checked below
        checkpoint, tokenizer_dir, expected = _tokenizer_source(engine_dir, manifest, checkpoint, verify)

        def load(directory):
            session, manifest, provider = load_ort_session(
                directory, options, checkpoint_hash_expected=expected, verify=verify
            )
            return OrtBackend.from_manifest(session, manifest, provider)

        backend = load(engine_dir)
        if multi_engine is not None:
            backend = SplitBackend(single=backend, multi=load(multi_engine))
        return cls(backend, Tokenizer(tokenizer_dir), checkpoint=checkpoint, **kw)

    @classmethod
    def from_trt_engine(
        cls,
        engine_dir: str | Path,
        checkpoint: str | Path | None = None,
        device: str = "cuda",
        cuda_graphs: bool = False,
        verify: str = "auto",
        **kw,
    ) -> "Target":
        """The target on a TensorRT / TensorRT-RTX engine (needs an NVIDIA GPU). The checkpoint (for
        the tokenizer) defaults to the one the engine was built from and must match its manifest;
        so must the ONNX export it was built from, where that is still on disk."""
        from specrt.artifacts import read_manifest
        from specrt.engines.trt import TRT_KIND
        from specrt.runtime.backends import TrtBackend
        from specrt.schema.graph_files import source_onnx_files

        manifest = read_manifest(engine_dir, TRT_KIND, "specrt build-engines --tensorrt auto")
        checkpoint, tokenizer_dir, expected = _tokenizer_source(engine_dir, manifest, checkpoint, verify)
        backend = TrtBackend(
            engine_dir,
            device=device,
            cuda_graphs=cuda_graphs,
            checkpoint_hash_expected=expected,
            onnx_files=source_onnx_files(manifest),
            verify=verify,
        )
        return cls(backend, Tokenizer(tokenizer_dir), checkpoint=checkpoint, **kw)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path,
        device: str = "cpu",
        cuda_graphs: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        dtype: str = "float32",
        **kw,
    ) -> "Target":
        """The target on the PyTorch model (no export needed): the reference on CPU, the
        PyTorch-CUDA backend with `device="cuda"` (and CUDA graphs with `cuda_graphs=True`).
        hidden_layers: the features its hidden states carry (default: what an export returns).
        dtype: the weights' and compute's (float32, float16, bfloat16; what a 16-bit export runs)."""
        from specrt.export.checkpoint import load_model
        from specrt.export.step_graph import DTYPES
        from specrt.runtime.backends import TorchBackend
        from specrt.schema.checkpoint_files import checkpoint_hash

        model = load_model(checkpoint, hidden_layers=hidden_layers)
        if dtype != "float32":
            model.to_dtype(DTYPES[dtype])
        return cls(
            TorchBackend(model, device=device, cuda_graphs=cuda_graphs, checkpoint_hash=checkpoint_hash(checkpoint)),
            Tokenizer(checkpoint),
            checkpoint=Path(checkpoint),
            **kw,
        )

    # -- requests -------------------------------------------------------------------------------

    def check_prompts(self, prompts: list[list[int]]) -> None:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise PromptError(f"prompt {i} is empty (0 tokens); give at least one token of text.")
            if len(p) >= self.max_context:
                raise PromptError(
                    f"prompt {i} has {len(p)} tokens, but the context holds {self.max_context} and generation "
                    f"needs at least one free position; shorten the prompt to under {self.max_context} tokens."
                )
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise PromptError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
                )

    def budgets(self, prompts: list[list[int]], max_new_tokens: int) -> np.ndarray:
        """Check a request (its prompts, max_new_tokens); each row's token budget, bounded by the
        context (PromptError / SpecrtError name the problem)."""
        if max_new_tokens < 1:
            raise SpecrtError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.check_prompts(prompts)
        return np.minimum(max_new_tokens, self.max_context - np.array([len(p) for p in prompts]))

    def encode_prompt(self, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise SpecrtError("this target has no tokenizer; pass token ids to generate_ids instead.")
        if not prompt or not prompt.strip():
            raise PromptError("the prompt is empty; give some text to continue or answer.")
        if not chat:
            # the tokenizer's own special tokens, as transformers adds them (Gemma's and Llama's BOS)
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in token_ids if t not in self.eos_ids])


def _tokenizer_source(engine_dir, manifest: dict, checkpoint, verify: str) -> tuple[Path, Path, str | None]:
    """(the checkpoint, the folder the tokenizer is read from, the checkpoint hash the engine must
    have: None where the engine's own manifest is the only record) of an engine: a checkpoint
    given explicitly is hashed and read; else the run-time files the artifacts carry; else (an
    engine built before they did) the checkpoint its manifest names, which must still be there."""
    from specrt.errors import CheckpointError
    from specrt.schema.checkpoint_files import checkpoint_hash, require_checkpoint
    from specrt.schema.model_files import engine_model_files, missing_checkpoint_advice, model_files_remake

    if checkpoint is not None:
        require_checkpoint(checkpoint, model_files_remake(engine_dir, manifest, checkpoint))
        return Path(checkpoint), Path(checkpoint), checkpoint_hash(checkpoint)
    recorded = Path(manifest["checkpoint"]["path"])  # its name names the served model
    folder = engine_model_files(engine_dir, manifest, verify)
    if folder is not None:
        return recorded, folder, None
    if not recorded.exists():
        raise CheckpointError(missing_checkpoint_advice(engine_dir, manifest))
    return recorded, recorded, checkpoint_hash(recorded)
