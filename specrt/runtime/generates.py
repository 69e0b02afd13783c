"""The static conveniences of every runner (a SpeculativeDecoder, and the Generator: plain
decoding, a decoder with no draft): a static batch is the batching engine (runtime/batching.py)
with every request arriving at step 0.

    result = runner.generate("Write a haiku", max_new_tokens=64)
    for piece in runner.stream("Write a haiku"): print(piece, end="")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.grammar import Grammar
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.target import GenerationResult, Stream, text_stream

if TYPE_CHECKING:
    from specrt.runtime.speculative import SpeculativeDecoder


class Generates:
    """The static conveniences, written once for both runners (`self.decoder`: the decoder this
    runner steps with). A static batch is the batching engine with every request at step 0;
    each row has its own random generator (row 0 the request's seed, row b one seeded from
    (seed, b)), and each row's result carries the batch's decode time and SpecMetrics."""

    decoder: "SpeculativeDecoder"

    def iter_generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        grammar: Grammar | None = None,
    ) -> Stream[list[list[int]], list[GenerationResult]]:
        """Generate for a batch of token-id prompts, step by step: iterating yields, after every
        step, the new tokens of each row (possibly none); `result` is then one GenerationResult
        per row. The prompts are checked and the cache is taken before this returns. `grammar`:
        every row's output follows it (runtime/grammar.py)."""
        decoder = self.decoder
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

    def generate_ids(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        grammar: Grammar | None = None,
    ) -> list[GenerationResult]:
        return self.iter_generate(prompts, max_new_tokens, sampling, grammar).run()

    def stream(
        self,
        prompt: str,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        chat: bool = True,
        system: str | None = None,
        grammar: Grammar | None = None,
    ) -> Stream[str, GenerationResult]:
        """Text pieces as tokens are produced; `result` is then the GenerationResult."""
        target = self.decoder.gen
        prompts = [target.encode_prompt(prompt, chat, system)]
        return text_stream(target, self.iter_generate(prompts, max_new_tokens, sampling, grammar))

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        chat: bool = True,
        system: str | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationResult:
        target = self.decoder.gen
        result = self.generate_ids([target.encode_prompt(prompt, chat, system)], max_new_tokens, sampling, grammar)[0]
        result.text = target.decode(result.token_ids)
        return result


def _row_rng(seed: int | None, b: int) -> np.random.Generator:
    """Row b's random generator in a static batch: row 0 draws as the request alone would."""
    return np.random.default_rng(seed if seed is None or b == 0 else [seed, b])
