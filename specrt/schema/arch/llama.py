"""The Llama family: Llama (and SmolLM, a Llama), Mistral, Qwen2. One block: RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU MLP; Qwen2 adds a bias on q/k/v, Mistral may slide
a window over every layer."""

from __future__ import annotations

from specrt.errors import UnsupportedArchitectureError
from specrt.schema.arch.base import Architecture, Gguf, field


def _window_everywhere(d: dict) -> dict:
    """Mistral's (and Phi-3's) window: the same on every layer, where config.json sets one."""
    w = d.get("sliding_window") if d.get("use_sliding_window", True) else None
    if w is None:
        return {}
    return {"sliding_window": field(d, "sliding_window", int), "sliding_layers": "all"}


def _no_window(name: str):
    def facts(d: dict) -> dict:
        if d.get("use_sliding_window"):
            raise UnsupportedArchitectureError(
                f"{name} with use_sliding_window=true is not supported (its max_window_layers split is not "
                "implemented); set use_sliding_window to false in config.json for contexts up to the window."
            )
        return {}

    return facts


def _window_keys(cfg) -> dict:
    return {"sliding_window": cfg.sliding_window}


LLAMA = Architecture("LlamaForCausalLM", "llama", gguf=Gguf("llama", permuted_qk=True))
MISTRAL = Architecture("MistralForCausalLM", "mistral", facts=_window_everywhere, config_keys=_window_keys)
# an instruct model's GGUF names <|im_end|> its EOS; <|endoftext|> (the end of a document) ends generation too
QWEN2 = Architecture(
    "Qwen2ForCausalLM",
    "qwen2",
    facts=_no_window("Qwen2"),
    attention_bias=True,
    gguf=Gguf("qwen2"),
    end_of_turn=("<|im_end|>", "<|endoftext|>"),
)
