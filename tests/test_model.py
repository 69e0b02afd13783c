"""Our Llama-family step model against transformers (the independent reference), float32.

Tolerance: max |ours - transformers| <= 1e-4 * max(1, max |logit|) on the logits.
"""

import pytest
import torch

from specrt.export.llama import causal_mask
from specrt.schema.config import ModelConfig, rope_inv_freq

from conftest import random_model, tiny_hf_config

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "llama-untied-gqa": tiny_hf_config(),
    "llama-tied": tiny_hf_config(tie_word_embeddings=True),
    "llama-mha": tiny_hf_config(num_key_value_heads=4),
    "llama3-rope": tiny_hf_config(
        rope_theta=500000.0,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear-rope": tiny_hf_config(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2-bias": tiny_hf_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True),
    "mistral": tiny_hf_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
}


def hf_model(hf_config: dict, ours):
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    cls = getattr(transformers, hf_config["architectures"][0])
    ref = cls(cfg).eval()
    state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in ours.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m for m in missing), missing
    return ref


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(name):
    hf = VARIANTS[name]
    ours = random_model(hf, seed=1)
    ref = hf_model(hf, ours)
    ids = torch.randint(0, hf["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))
    # positions far from 0 exercise the rope scaling
    pos = torch.arange(100, 140).unsqueeze(0).expand(2, 40)
    with torch.no_grad():
        logits, hidden, present = ours(ids, pos, causal_mask(2, 40, 0), ours.empty_past(2))
        expected = ref(input_ids=ids, position_ids=pos, output_hidden_states=True)
    scale = max(1.0, expected.logits.abs().max().item())
    assert (logits - expected.logits).abs().max().item() <= 1e-4 * scale
    assert torch.allclose(hidden, expected.hidden_states[-1], atol=1e-4)
    assert len(present) == hf["num_hidden_layers"] and present[0][0].shape == (2, hf.get("num_key_value_heads"), 40, 16)


def test_incremental_steps_match_one_pass():
    """prefill 30 + verify 5 + decode 1 on the returned KV equals one pass over all 36 tokens."""
    hf = tiny_hf_config()
    m = random_model(hf)
    ids = torch.randint(0, 128, (1, 36), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _, _ = m(ids, torch.arange(36)[None], causal_mask(1, 36, 0), m.empty_past(1))
        past = m.empty_past(1)
        pieces = []
        for a, b in ((0, 30), (30, 35), (35, 36)):
            lg, _, pres = m(ids[:, a:b], torch.arange(a, b)[None], causal_mask(1, b - a, a), past)
            past = [(torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in zip(past, pres)]
            pieces.append(lg)
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)


def test_hidden_layers_option_concatenates_taps():
    hf = tiny_hf_config()
    m = random_model(hf)
    m.hidden_layers = (0, 1, -1)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        _, hidden, _ = m(ids, torch.arange(5)[None], causal_mask(1, 5, 0), m.empty_past(1))
    assert hidden.shape == (1, 5, 3 * hf["hidden_size"])


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = VARIANTS["llama3-rope"]
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = torch.tensor(rope_inv_freq(ModelConfig.from_hf_dict(hf)), dtype=torch.float32)
    assert torch.allclose(ours, expected.float(), rtol=1e-6)
