"""A parallel EAGLE-3 head (P-EAGLE): the first draft token and K - 1 more from one call.

An EAGLE-3 head drafts autoregressively: draft token k + 1 needs the entry of token k, so a
chain of K tokens is K head calls. Here the entries after the root's are *mask entries*, one per
draft depth, at the positions the chain's entries would take: the entry whose logits give draft
token d + 1 reads what the root's entry reads (the root token and the target's feature before
it), each shifted by a learned vector of its depth (`mask_emb[d - 1]` on the embedding,
`mask_hidden[d - 1]` on the fused feature), and attends causally, like a chain, to the committed
entries and the mask entries before it. So one call over

    [the entries committed since the last call ..., root entry, mask 1, ..., mask K - 1]

catches up and returns the logits of all K draft tokens. The draft tokens after the first do not
read each other (a depth's distribution is the same whatever the tokens before it), which a tree
can use without further calls: every node of depth d gets depth d's distribution. Drawing a
chain from them stays exact (each token is drawn from a q that verification gets).

Why the root's inputs and not learned constants alone (P-EAGLE's mask tokens): with one layer,
a constant mask entry learns only through its attention, whose values are a 3 x 64-wide
projection of the context; on 380 answers that gave depth 2 a held-out top-1 of 0.08 (the
root's depth 0.28). Reading the root's full feature in the residual stream is what a Medusa
head reads (its second head: 0.30 on 1000 answers), with the attention over the context on top.

The graph is the EAGLE-3 head's with one more input, `mask_depth` [B, Q] (0: an ordinary entry,
d >= 1: a mask entry of depth d), so the rest (export, engines, the cache) is the EAGLE head's.
Trained like EAGLE-3's training-time test, with mask entries in place of the head's own outputs
at every unrolled step after the first (training/eagle.py `unrolled`).
"""

from __future__ import annotations

import torch
from torch import nn

from specrt.export.draft_head import DraftHead, HeadConfig
from specrt.export.head_io import HEAD_OUTPUTS, PARALLEL_DYNAMIC_AXES, PARALLEL_INPUTS
from specrt.export.llama import mask_bias, rotary


class ParallelHead(DraftHead):
    io = (PARALLEL_INPUTS, HEAD_OUTPUTS, PARALLEL_DYNAMIC_AXES)

    def __init__(self, hc: HeadConfig):
        super().__init__(hc)
        C = hc.target.hidden_size
        # per depth, added to the root's embedding (the attention's input) and fused feature (the
        # residual stream); zero at first: every depth starts as a copy of the root's entry
        self.mask_emb = nn.Parameter(torch.zeros(hc.parallel, C))
        self.mask_hidden = nn.Parameter(torch.zeros(hc.parallel, C))

    def forward(
        self, input_ids, features, draft_hidden, from_draft, position_ids, attention_mask, past_k, past_v, mask_depth
    ):
        h, k, v = self.body(
            input_ids, features, draft_hidden, from_draft, position_ids, attention_mask, past_k, past_v, mask_depth
        )
        return self.project(h), h, k, v

    def body(
        self, input_ids, features, draft_hidden, from_draft, position_ids, attention_mask, past_k, past_v, mask_depth
    ):
        is_mask = (mask_depth > 0).unsqueeze(-1)
        depth = (mask_depth - 1).clamp(min=0)
        zero = torch.zeros((), dtype=features.dtype)
        emb = self.embed_tokens(input_ids) + torch.where(is_mask, self.mask_emb[depth], zero)
        x = torch.where(from_draft.unsqueeze(-1), draft_hidden, self.fc(features))
        x = x + torch.where(is_mask, self.mask_hidden[depth], zero)
        cos, sin = rotary(position_ids, self.inv_freq)
        return self.layer(emb, x, cos, sin, mask_bias(attention_mask, x.dtype), past_k, past_v)

    def example_inputs(self, batch: int = 2, q: int = 3, past: int = 4) -> tuple[torch.Tensor, ...]:
        depth = torch.zeros(batch, q, dtype=torch.int64)
        depth[:, -1] = 1
        return (*super().example_inputs(batch, q, past), depth)

    def parity_inputs(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        inputs = super().parity_inputs(g)
        B, Q = inputs[0].shape
        depth = torch.randint(0, self.hc.parallel + 1, (B, Q), generator=g)
        return (*inputs, depth)


__all__ = ["ParallelHead"]
