"""Plain autoregressive generation: prefill, then one token per step.

    gen = Generator.from_engine("artifacts/SmolLM2-135M-Instruct/engines/ort-cpu")
    result = gen.generate("What is speculative decoding?", max_new_tokens=64)
    stream = gen.stream("Tell me a joke")
    for piece in stream: print(piece, end="")
    print(stream.result.summary())

A Generator is the target (runtime/target.py: its session, tokenizer, limits and loaders) with
the static conveniences (runtime/generates.py) over its `decoder`. Plain decoding is speculation
with N = 0: that decoder is a SpeculativeDecoder with no draft, whose step verifies the root
alone, so plain and speculative generation run the same loop (the batching engine) and differ
only in what is drafted.
"""

from __future__ import annotations

import functools

from specrt.runtime.drafts.base import NoDraft
from specrt.runtime.policy import FixedPolicy
from specrt.runtime.speculative import SpeculativeDecoder
from specrt.runtime.target import Target


class Generator(Target):
    @functools.cached_property
    def decoder(self) -> SpeculativeDecoder:
        """The decoder plain generation steps with: no draft, N = 0."""
        return SpeculativeDecoder(self, NoDraft(), FixedPolicy(0))

    def iter_generate(self, *args, **kw):
        """SpeculativeDecoder.iter_generate on plain decoding (runtime/generates.py)."""
        return self.decoder.iter_generate(*args, **kw)

    def generate_ids(self, *args, **kw):
        return self.decoder.generate_ids(*args, **kw)

    def stream(self, *args, **kw):
        return self.decoder.stream(*args, **kw)

    def generate(self, *args, **kw):
        return self.decoder.generate(*args, **kw)
