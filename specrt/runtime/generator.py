"""Plain autoregressive generation on a step backend: prefill, then one token per step.

    gen = Generator.from_engine("artifacts/SmolLM2-135M-Instruct/engines/ort-cpu")
    result = gen.generate("What is speculative decoding?", max_new_tokens=64)
    for piece in gen.stream("Tell me a joke"): print(piece, end="")

The ladder of verbs: `forward_tokens` (one step over a ragged batch of new tokens, KV appended),
`prefill` (the prompts, in chunks), `decode_one_token`, `generate_ids`, `generate` / `stream`.
Batches are ragged: every row keeps its own length in the KV cache and the attention mask hides
everything else, so rows of different lengths never need padding in the cache.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Generator as Generator_

import numpy as np

from specrt.errors import PromptError, SpecrtError
from specrt.runtime.backends import StepBackend
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.sampling import SamplingParams, next_tokens
from specrt.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


CACHE_BUCKET = 256  # pooled caches (CUDA-graph backends) have capacities in multiples of this
CACHE_POOL_SIZE = 4


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


@dataclasses.dataclass
class Started:
    """What every generation loop begins with: budgets, a fresh cache, the prefill's first tokens."""

    lens: np.ndarray  # prompt lengths
    budget: np.ndarray  # tokens each row may produce
    cache: KVCache
    rng: np.random.Generator
    first: np.ndarray  # (B,) first generated token of each row
    prefill_seconds: float


def run_to_end(steps):
    """Drain a step iterator (iter_generate) and return its results."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def stream_text(gen: "Generator", steps) -> Generator_[str, None, "GenerationResult"]:
    """Text pieces of row 0 from a step iterator yielding new tokens per row; returns its result."""
    detok = IncrementalDetokenizer(gen.tokenizer)
    while True:
        try:
            new = next(steps)
        except StopIteration as stop:
            result = stop.value[0]
            break
        text = "".join(detok.push(t) for t in new[0] if t not in gen.eos_ids)
        if text:
            yield text
    result.text = gen.decode(result.token_ids)
    return result


class Generator:
    def __init__(self, backend: StepBackend, tokenizer: Tokenizer | None = None, max_context: int | None = None, prefill_chunk: int = 512,
                 checkpoint: Path | None = None):
        self.backend = backend
        self.checkpoint = checkpoint  # where the weights and tokenizer came from, when known
        self.config = backend.config
        self.tokenizer = tokenizer
        # the smallest of: what was asked, what an engine was built for, what the model supports
        self.max_context = min(v for v in (max_context, getattr(backend, "max_context", None), self.config.max_position_embeddings) if v)
        self.prefill_chunk = min(prefill_chunk, getattr(backend, "max_step_q", None) or prefill_chunk)  # an engine's largest profile
        eos = set(self.config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token and tokenizer.token_id(tokenizer.eos_token) is not None:
            eos.add(tokenizer.token_id(tokenizer.eos_token))
        self.eos_ids = frozenset(eos)
        self._cache_pool: list[KVCache] = []

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_engine(cls, engine_dir: str | Path, checkpoint: str | Path | None = None, options=None, verify: str = "auto", **kw) -> "Generator":
        """A generator on a built ORT engine. The checkpoint (for the tokenizer) defaults to the one
        the engine was built from; a checkpoint given explicitly must be the one in the manifest.
        verify: "auto" hashes the engine's files when they changed since their last check, "full"
        always (see specrt.artifacts)."""
        from specrt.engines.ort import load_ort_session, read_engine_manifest
        from specrt.export.checkpoint import checkpoint_hash
        from specrt.export.config import ModelConfig
        from specrt.runtime.backends import OrtBackend

        manifest = read_engine_manifest(engine_dir, verify="none")  # for the checkpoint's path; the files are checked below
        checkpoint = Path(checkpoint or manifest["checkpoint"]["path"])
        session, manifest, provider = load_ort_session(engine_dir, options, checkpoint_hash_expected=checkpoint_hash(checkpoint), verify=verify)
        backend = OrtBackend(session, ModelConfig.from_dict(manifest["config"]), provider)
        backend.batch_invariance = manifest.get("batch_invariance")  # measured at build (ort.batch_invariance)
        return cls(backend, Tokenizer(checkpoint), checkpoint=checkpoint, **kw)

    @classmethod
    def from_trt_engine(cls, engine_dir: str | Path, checkpoint: str | Path | None = None, device: str = "cuda", cuda_graphs: bool = False,
                        verify: str = "auto", **kw) -> "Generator":
        """A generator on a TensorRT / TensorRT-RTX engine (needs an NVIDIA GPU). The checkpoint (for
        the tokenizer) defaults to the one the engine was built from and must match its manifest;
        so must the ONNX export it was built from, where that is still on disk."""
        from specrt.artifacts import read_manifest
        from specrt.engines.trt import TRT_KIND
        from specrt.engines.trt_runtime import TrtBackend
        from specrt.export.checkpoint import checkpoint_hash

        manifest = read_manifest(engine_dir, TRT_KIND, "specrt build-engines --tensorrt auto")
        checkpoint = Path(checkpoint or manifest["checkpoint"]["path"])
        from specrt.export.step_graph import source_onnx_files

        backend = TrtBackend(engine_dir, device=device, cuda_graphs=cuda_graphs, checkpoint_hash_expected=checkpoint_hash(checkpoint),
                             onnx_files=source_onnx_files(manifest), verify=verify)
        return cls(backend, Tokenizer(checkpoint), checkpoint=checkpoint, **kw)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, device: str = "cpu", cuda_graphs: bool = False, **kw) -> "Generator":
        """A generator on the PyTorch model (no export needed): the reference on CPU, the
        PyTorch-CUDA backend with `device="cuda"` (and CUDA graphs with `cuda_graphs=True`)."""
        from specrt.export.checkpoint import load_model
        from specrt.runtime.backends import TorchBackend

        return cls(TorchBackend(load_model(checkpoint), device=device, cuda_graphs=cuda_graphs), Tokenizer(checkpoint), checkpoint=Path(checkpoint), **kw)

    # -- steps ----------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A KV cache of at least `capacity` positions for `batch` rows.

        Backends that capture CUDA graphs (`reuse_cache = True`) get caches from a small pool, with
        the capacity rounded up to a multiple of CACHE_BUCKET (but not past the backend's
        `max_cache`): a graph is bound to its cache's buffers, so reusing them across generations
        lets each step shape be captured once, not once per generation. A pooled cache is handed
        out again only after `release` (generation loops release theirs when they end)."""
        c = self.config
        device = getattr(self.backend, "cache_device", None)  # backends that keep the KV on a device
        if not getattr(self.backend, "reuse_cache", False):
            return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, capacity, c.head_dim, device=device)
        limit = getattr(self.backend, "max_cache", None) or capacity + CACHE_BUCKET
        capacity = max(capacity, min(-(-capacity // CACHE_BUCKET) * CACHE_BUCKET, limit))
        for cache in self._cache_pool:
            if not cache.in_use and cache.batch == batch and cache.capacity == capacity:
                cache.reset()
                cache.in_use = True
                return cache
        cache = KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, capacity, c.head_dim, device=device)
        cache.in_use = True
        idle = [k for k in self._cache_pool if not k.in_use]
        if len(self._cache_pool) >= CACHE_POOL_SIZE and idle:
            self._cache_pool.remove(idle[0])  # the oldest idle one makes room
        if len(self._cache_pool) < CACHE_POOL_SIZE:
            self._cache_pool.append(cache)
        return cache

    def release(self, cache: KVCache) -> None:
        """The generation that used `cache` is over: a pooled cache may be handed out again."""
        cache.in_use = False

    def forward_tokens(self, cache: KVCache, tokens: list[list[int]], trees: list[tuple[np.ndarray, np.ndarray]] | None = None, last_only: bool = False):
        """One step over new tokens per row (rows may differ in count, even be empty); their KV is
        appended to the cache. Returns the StepOutput (B, Q = longest row, ...): logits at every
        position, or with last_only=True at each row's last token only (B, 1, V).

        trees: per row (depths (n,), mask (n, n)) for tokens that form a tree rather than a
        sequence: position = committed length + depth, and each token sees what its mask allows."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        Q = int(counts.max())
        ids = np.zeros((cache.batch, Q), dtype=np.int64)
        offsets = np.broadcast_to(np.arange(Q, dtype=np.int64), (cache.batch, Q)).copy()
        new_mask = np.broadcast_to(np.tril(np.ones((Q, Q), dtype=bool)), (cache.batch, Q, Q)).copy()
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = t
            if trees is not None and trees[b] is not None:
                depths, mask = trees[b]
                n = len(t)
                offsets[b, :n] = depths
                new_mask[b, :n, :n] = mask
        positions = cache.lengths[:, None] + offsets
        if last_only:
            index = np.maximum(counts - 1, 0)[:, None]
        else:
            index = np.broadcast_to(np.arange(Q, dtype=np.int64), (cache.batch, Q)).copy()
        out = self.backend.step(ids, positions, cache.attention_mask(Q, new_mask), index, cache)
        cache.append(out.present, counts)
        return out

    def prefill(self, cache: KVCache, prompts: list[list[int]]) -> np.ndarray:
        """Run the prompts through the model in chunks; returns each row's last logits (B, V)."""
        last = np.zeros((cache.batch, self.config.vocab_size), dtype=np.float32)
        start = 0
        while start < max(len(p) for p in prompts):
            chunk = [p[start : start + self.prefill_chunk] for p in prompts]
            out = self.forward_tokens(cache, chunk, last_only=True)
            for b, c in enumerate(chunk):
                if c:
                    last[b] = out.logits[b, 0]
            start += self.prefill_chunk
        return last

    def decode_one_token(self, cache: KVCache, tokens: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Feed one token per active row; returns logits (B, V)."""
        out = self.forward_tokens(cache, [[int(t)] if a else [] for t, a in zip(tokens, active)])
        return out.logits[:, 0]

    # -- generation -----------------------------------------------------------------------------

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
                raise PromptError(f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")

    def start(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams, headroom: int = 0) -> Started:
        """Check the prompts, allocate the cache (output plus `headroom` positions) and prefill."""
        if max_new_tokens < 1:
            raise SpecrtError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.check_prompts(prompts)
        lens = np.array([len(p) for p in prompts])
        budget = np.minimum(max_new_tokens, self.max_context - lens)
        cache = self.new_cache(len(prompts), int((lens + budget).max()) + headroom)
        rng = np.random.default_rng(sampling.seed)
        t0 = time.perf_counter()
        first = next_tokens(self.prefill(cache, prompts), sampling, rng)
        return Started(lens, budget, cache, rng, first, time.perf_counter() - t0)

    def iter_generate(
        self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams()
    ) -> Generator_[list[list[int]], None, list[GenerationResult]]:
        """Generate for a batch of token-id prompts, step by step.

        Yields, after every step, the new tokens of each row (one, or none for a finished row).
        Returns (StopIteration.value) one GenerationResult per row."""
        st = self.start(prompts, max_new_tokens, sampling)
        try:
            return (yield from self._steps(st, prompts, sampling))
        finally:
            self.release(st.cache)

    def _steps(self, st: Started, prompts, sampling):
        B = len(prompts)
        out: list[list[int]] = [[] for _ in range(B)]
        reason = ["length"] * B
        active = np.ones(B, dtype=bool)
        steps: list[float] = []
        tokens = st.first
        while True:
            new: list[list[int]] = [[] for _ in range(B)]
            for b in np.flatnonzero(active):
                out[b].append(int(tokens[b]))
                new[b] = [int(tokens[b])]
                if int(tokens[b]) in self.eos_ids:
                    active[b], reason[b] = False, "stop"
                elif len(out[b]) >= st.budget[b]:
                    active[b] = False
            yield new
            if not active.any():
                break
            ts = time.perf_counter()
            logits = self.decode_one_token(st.cache, tokens, active)
            tokens = np.where(active, next_tokens(logits, sampling, st.rng), tokens)
            steps.append(time.perf_counter() - ts)
        decode_s = float(sum(steps))
        return [GenerationResult(int(st.lens[b]), out[b], reason[b], st.prefill_seconds, decode_s, steps) for b in range(B)]

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams()) -> list[GenerationResult]:
        return run_to_end(self.iter_generate(prompts, max_new_tokens, sampling))

    def encode_prompt(self, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise SpecrtError("this generator has no tokenizer; pass token ids to generate_ids instead.")
        if not prompt or not prompt.strip():
            raise PromptError("the prompt is empty; give some text to continue or answer.")
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def stream(
        self, prompt: str, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(), chat: bool = True, system: str | None = None
    ) -> Generator_[str, None, GenerationResult]:
        """Yield text pieces as tokens are produced; returns (StopIteration.value) the GenerationResult."""
        return stream_text(self, self.iter_generate([self.encode_prompt(prompt, chat, system)], max_new_tokens, sampling))

    def generate(self, prompt: str, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(), chat: bool = True, system: str | None = None) -> GenerationResult:
        ids = self.encode_prompt(prompt, chat, system)
        result = self.generate_ids([ids], max_new_tokens, sampling)[0]
        result.text = self.decode(result.token_ids)
        return result

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in token_ids if t not in self.eos_ids])
