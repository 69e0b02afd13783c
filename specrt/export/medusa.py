"""Medusa heads (Cai et al., arXiv 2401.10774): K small heads on the target's last hidden state,
head k guessing the token k places after the one the target itself predicts.

For a feature f[j] (the target's final normed state at position j, which predicts t[j+1]),
head k (1..K) predicts t[j+1+k]:

    logits_k = W_out (f + SiLU(W_k f + b_k))        one residual block per head (Medusa-1)

W_out is one projection shared by the heads, over a reduced draft vocabulary (the most frequent
tokens of the training answers, mapped back by `draft_to_target`), initialised from the
target's own output head rows; W_k starts at zero, so every head starts as the target's next-
token guess and learns to shift. Training needs only the frozen target's features (Medusa-1).

The graph returns each head's top-k candidates (ids already in the target's vocabulary, with
their log-probabilities), not K x Vd logits: a proposal needs only those. Candidates combine
into a tree of *choices*: a path (r_1, ..., r_d) is the r_1-th candidate of head 1, then the
r_2-th of head 2 under it, and so on (schema/medusa_tree.py). `DEFAULT_TREE` is the tree for K = 4 (from assumed
accuracies; `default_tree` for other K); `derive_tree` makes one from measured per-head rank
accuracies (the best-first expansion of Medusa's paper: a path's value is the product of its
ranks' accuracies, and each path comes after its parent).

Shapes: B batch, C hidden, K heads, k candidates per head, Vd draft vocab.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from specrt.errors import SpecrtError
from specrt.export.llama import LlamaModel
from specrt.families.medusa import MEDUSA, MEDUSA_DYNAMIC_AXES, MEDUSA_INPUTS, MEDUSA_OUTPUTS
from specrt.schema.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    target: ModelConfig
    num_heads: int = 4
    draft_vocab: int = 8192
    top_k: int = 8  # candidates per head the graph returns (the deepest rank a tree may use + 1)
    method: str = MEDUSA

    def __post_init__(self):
        if self.num_heads < 1 or self.top_k < 1 or not 1 <= self.draft_vocab <= self.target.vocab_size:
            raise SpecrtError(
                f"Medusa needs num_heads >= 1, top_k >= 1 and a draft vocabulary in 1..{self.target.vocab_size}; got "
                f"{self.num_heads}, {self.top_k}, {self.draft_vocab}"
            )
        if self.top_k > self.draft_vocab:
            raise SpecrtError(f"top_k {self.top_k} exceeds the draft vocabulary {self.draft_vocab}")

    layers = (-1,)  # the feature it reads: the target's final normed state

    @property
    def feature_width(self) -> int:
        return self.target.hidden_size

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "target": self.target.to_dict(),
            "layers": list(self.layers),
            "num_heads": self.num_heads,
            "draft_vocab": self.draft_vocab,
            "top_k": self.top_k,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "MedusaConfig":
        return cls(ModelConfig.from_dict(d["target"]), int(d["num_heads"]), int(d["draft_vocab"]), int(d["top_k"]))


class MedusaHeads(nn.Module):
    """K residual blocks and one shared output projection (see the module docstring)."""

    io = (MEDUSA_INPUTS, MEDUSA_OUTPUTS, MEDUSA_DYNAMIC_AXES)

    def __init__(self, hc: MedusaConfig):
        super().__init__()
        self.hc = hc
        C = hc.target.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(C, C) for _ in range(hc.num_heads))
        self.lm_head = nn.Linear(C, hc.draft_vocab, bias=False)
        self.register_buffer("draft_to_target", torch.arange(hc.draft_vocab, dtype=torch.int64))

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """(..., K, C): each head's residual block applied to features (..., C)."""
        return torch.stack([features + nn.functional.silu(block(features)) for block in self.blocks], dim=-2)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(..., K, Vd) draft-vocabulary logits."""
        return self.lm_head(self.hidden(features))

    def forward(self, features):
        """See MEDUSA_INPUTS / MEDUSA_OUTPUTS: each head's top_k candidates as target ids."""
        logp = torch.log_softmax(self.logits(features), dim=-1)
        top, rows = torch.topk(logp, self.hc.top_k, dim=-1)
        return top, self.draft_to_target[rows]

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch, self.hc.target.hidden_size),)

    def parity_inputs(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(3, self.hc.target.hidden_size, generator=g),)


def medusa_from_target(target: LlamaModel, hc: MedusaConfig, draft_ids, seed: int = 0) -> MedusaHeads:
    """New heads: the projection from the target's output head rows `draft_ids` (most frequent
    first), the blocks at zero (each head starts as the target's next-token guess)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(hc)
    ids = torch.as_tensor(draft_ids, dtype=torch.int64)
    if len(ids) != hc.draft_vocab:
        raise SpecrtError(f"{len(ids)} draft ids for a draft vocabulary of {hc.draft_vocab}")
    with torch.no_grad():
        heads.draft_to_target.copy_(ids)
        heads.lm_head.weight.copy_(target.lm_head.weight[ids])
        for block in heads.blocks:
            block.weight.zero_()
            block.bias.zero_()
    return heads
