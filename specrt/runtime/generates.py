"""The static conveniences, functions over a decoder (runtime/speculative.py's SpeculativeDecoder;
a Generator's `decoder` for plain decoding): a static batch is the batching engine
(runtime/batching.py) with every request arriving at step 0. Both runners offer them as methods.

    result = generate(decoder, "Write a haiku", max_new_tokens=64)      # or runner.generate(...)
    for piece in stream(decoder, "Write a haiku"): print(piece, end="")

Each row of a static batch has its own random generator (row 0 the request's seed, row b one
seeded from (seed, b)), and each row's result carries the batch's decode time and SpecMetrics.
"""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.batching import BatchEngine, Decoder
from specrt.runtime.grammar import Grammar
from specrt.runtime.row import Request
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.target import GenerationResult, Stream, text_stream


def iter_generate(
    decoder: Decoder,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    grammar: Grammar | None = None,
) -> Stream[list[list[int]], list[GenerationResult]]:
    """Generate for a batch of token-id prompts, step by step: iterating yields, after every
    step, the new tokens of each row (possibly none); `result` is then one GenerationResult per
    row. The prompts are checked and the cache is taken before this returns. `grammar`: every
    row's output follows it (runtime/grammar.py)."""
    decoder.gen.budgets(prompts, max_new_tokens)  # every prompt checked before any is queued
    engine = BatchEngine(decoder, max_batch=len(prompts))
    for b, prompt in enumerate(prompts):
        engine.submit(Request(prompt, max_new_tokens, sampling, _row_rng(sampling.seed, b), grammar=grammar))
    engine.admit()

    def steps():
        results: dict[int, GenerationResult] = {}
        try:
            while not engine.idle:
                new: list[list[int]] = [[] for _ in prompts]
                for event in engine.step():
                    if event.error is not None:
                        raise SpecrtError(event.error)
                    new[event.rid] += event.tokens
                    if event.result is not None:
                        results[event.rid] = event.result
                yield new
        finally:
            engine.close()
        state, metrics = engine.state, decoder.finish(engine.state)
        for r in results.values():  # the batch's decode time and metrics, as one generation
            r.decode_seconds, r.step_seconds, r.metrics = float(sum(state.step_times)), state.step_times, metrics
        return [results[b] for b in range(len(prompts))]

    return Stream(steps(), engine.close)


def stream(
    decoder: Decoder,
    prompt: str,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    chat: bool = True,
    system: str | None = None,
    grammar: Grammar | None = None,
) -> Stream[str, GenerationResult]:
    """Text pieces as tokens are produced; `result` is then the GenerationResult."""
    target = decoder.gen
    prompts = [target.encode_prompt(prompt, chat, system)]
    return text_stream(target, iter_generate(decoder, prompts, max_new_tokens, sampling, grammar))


def generate(
    decoder: Decoder,
    prompt: str,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    chat: bool = True,
    system: str | None = None,
    grammar: Grammar | None = None,
) -> GenerationResult:
    target = decoder.gen
    prompts = [target.encode_prompt(prompt, chat, system)]
    result = iter_generate(decoder, prompts, max_new_tokens, sampling, grammar).run()[0]
    result.text = target.decode(result.token_ids)
    return result


def _row_rng(seed: int | None, b: int) -> np.random.Generator:
    """Row b's random generator in a static batch: row 0 draws as the request alone would."""
    return np.random.default_rng(seed if seed is None or b == 0 else [seed, b])
