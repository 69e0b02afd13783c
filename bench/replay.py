"""A target that replays recorded greedy answers: the speculation policy measured on a virtual
clock, free of machine noise (bench_policy.py).

`ReplayBackend` is a step backend that knows, for each prompt, the answer the real engine gave
it under greedy decoding. At every position p of a row it returns the token that prompt +
answer has at p + 1, whatever was fed there. That is what the real target computes along the
path a speculative step accepts: the walk from the root follows only nodes whose token is the
argmax at their parent, so every node it reaches lies on the true answer, where the real
target's argmax is the recorded token (greedy speculative output equals plain output: the tests
and `specrt bench` check it on the real engines). Nodes off that path get a token nobody reads.
So speculative generation on the replay target emits the recorded answers with the drafts,
verdicts and step shapes the real engine would have, at no cost; the time is a virtual clock's.

Its KV cache is one layer of one head of width 2 holding the token ids themselves, so the
runtime's own cache bookkeeping (append, tree compaction, rows joining and leaving) keeps each
row's context, and a step reads which request a row serves from the cache's prefix.
"""

from __future__ import annotations

import numpy as np

from specrt.runtime.backends.base import Capabilities, StepBackend, StepOutput
from specrt.schema.config import ModelConfig


class ReplayBackend(StepBackend):
    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab_size: int, eos: tuple[int, ...], **caps):
        """answers: prompt ids -> the ids of the answer the real engine gave (greedy)."""
        self.answers = {tuple(p): list(p) + list(a) for p, a in answers.items()}
        self.prompt_lengths = sorted({len(p) for p in self.answers}, reverse=True)
        self.eos = eos[0] if eos else 0
        self.config = ModelConfig(
            vocab_size=vocab_size,
            hidden_size=1,
            intermediate_size=1,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=2,
            max_position_embeddings=1 << 20,
            eos_token_id=tuple(eos),
        )
        self.description = "replay of recorded greedy answers"
        self.caps = Capabilities(**caps)

    def sequence(self, context: list[int]) -> list[int] | None:
        """The prompt + answer whose prompt `context` starts with (the longest such prompt)."""
        for n in self.prompt_lengths:
            if n <= len(context):
                seq = self.answers.get(tuple(context[:n]))
                if seq is not None:
                    return seq
        return None

    def step(self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index=None, want_logits=True):
        B, Q = input_ids.shape
        top = np.full(logits_index.shape, self.eos, np.int64)
        for b in range(B):
            committed = cache.keys[0, b, 0, : cache.lengths[b], 0].astype(np.int64).tolist()
            prefill = logits_index.shape[1] == 1 and want_logits  # a prompt chunk: its last position
            seq = self.sequence(committed + input_ids[b, : logits_index[b, 0] + 1].tolist() if prefill else committed)
            if seq is None:
                continue
            for k, i in enumerate(logits_index[b]):
                p = int(position_ids[b, i])
                if p + 1 < len(seq):
                    top[b, k] = seq[p + 1]
        ids = np.repeat(input_ids.astype(np.float32)[:, None, :, None], 2, axis=3)  # the cache keeps the token ids
        present = [(ids, ids)]
        if not want_logits:
            return StepOutput(None, None, present, top1=top)
        if logits_index.shape[1] != 1:
            raise ValueError("the replay target gives logits only at a prompt's last position (greedy only)")
        logits = np.full((B, 1, self.config.vocab_size), -1.0, np.float32)
        logits[np.arange(B), 0, top[:, 0]] = 1.0
        return StepOutput(logits, None, present)
