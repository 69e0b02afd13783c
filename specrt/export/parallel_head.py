"""A parallel EAGLE-3 head (P-EAGLE): the first draft token and K - 1 more from one call.

An EAGLE-3 head drafts autoregressively: draft token k + 1 needs the entry of token k, so a
chain of K tokens is K head calls. Here the entries after the root's are *mask entries*: they
read no token and no feature but a learned embedding and a learned hidden state per draft
depth (`mask_emb[d - 1]`, `mask_hidden[d - 1]` for the entry whose logits give draft token
d + 1), sit at the positions the chain's entries would take, and attend causally, like a chain,
to the committed entries and the mask entries before them. So one call over

    [the entries committed since the last call ..., root entry, mask 1, ..., mask K - 1]

catches up and returns the logits of all K draft tokens. The draft tokens after the first do
not read each other's values (each depth's distribution is the same whatever the tokens before
it), which is what a tree without further calls can use: every node of depth d gets depth d's
distribution. Drawing a chain from them stays exact (each token is drawn from a q that the
verification gets).

Tried and dropped: mask entries that read the root's token and feature, each shifted by its
depth's learned vector (what a Medusa head reads, with the attention on top). On the same 380
answers and 72 steps their held-out top-1 per depth was 0.23 / 0.12 / 0.07 / 0.06 / 0.06
against 0.28 / 0.08 / 0.07 / 0.07 / 0.07 for learned constants (expected greedy chain 1.26
against 1.31), and end to end their trees were slower on JSON (1.06x against 1.24x of plain;
chat 0.99x against 0.95x, within noise): the shared layer, pulled towards the deeper depths
from the start, lost more at the first than the second gained.

The graph is the EAGLE-3 head's with one more input, `mask_depth` [B, Q] (0: an ordinary entry,
d >= 1: a mask entry of depth d), so the rest (export, engines, the cache) is the EAGLE head's.
Trained like EAGLE-3's training-time test, with mask entries in place of the head's own outputs
at every unrolled step after the first (training/eagle.py, `unrolled`).
"""

from __future__ import annotations

import torch
from torch import nn

from specrt.export.draft_head import DraftHead, HeadConfig
from specrt.export.llama import mask_bias, rotary
from specrt.families.eagle import HEAD_OUTPUTS
from specrt.families.parallel import PARALLEL_DYNAMIC_AXES, PARALLEL_INPUTS


class ParallelHead(DraftHead):
    io = (PARALLEL_INPUTS, HEAD_OUTPUTS, PARALLEL_DYNAMIC_AXES)

    def __init__(self, hc: HeadConfig):
        super().__init__(hc)
        C = hc.target.hidden_size
        self.mask_emb = nn.Parameter(torch.zeros(hc.parallel, C))  # per depth: what the layer's attention reads
        self.mask_hidden = nn.Parameter(torch.zeros(hc.parallel, C))  # per depth: the residual stream

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
        emb = torch.where(is_mask, self.mask_emb[depth], self.embed_tokens(input_ids))
        x = torch.where(from_draft.unsqueeze(-1), draft_hidden, self.fc(features))
        x = torch.where(is_mask, self.mask_hidden[depth], x)
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


def init_masks(head: ParallelHead, embeddings: torch.Tensor, hidden: torch.Tensor) -> None:
    """Start every depth's mask entry at the mean of what an ordinary entry reads: the answer
    tokens' embeddings and the fused features (`hidden`: fc(features) of training positions).
    From zeros, Adam's ~lr steps would take hundreds of steps to reach the scale of a state."""
    with torch.no_grad():
        head.mask_emb.copy_(embeddings.mean(0).expand_as(head.mask_emb))
        head.mask_hidden.copy_(hidden.mean(0).expand_as(head.mask_hidden))


__all__ = ["ParallelHead", "init_masks"]
