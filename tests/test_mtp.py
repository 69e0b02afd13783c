"""MTP modules (DeepSeek-V3 layout) on tiny models: a synthetic checkpoint carrying one, written
here, is loaded as a draft head and checked against the module's formula computed by hand; it
runs through the EAGLE machinery with greedy output equal to plain decoding; a checkpoint without
one, or with a malformed one, is refused; and train-draft --method mtp trains one."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.export.mtp import mtp_head, mtp_modules
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.training.eagle import TrainConfig, train_head
from specrt.training.pipeline import import_mtp

from conftest import TINY_HF


def with_mtp_module(src, out, seed=5, drop=None):
    """A copy of checkpoint `src` carrying one random MTP module in DeepSeek-V3's layout (its
    decoder layer a copy of the target's last, perturbed; embedding and head shared)."""
    import shutil

    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    L, C = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    new = {
        "enorm.weight": 1 + 0.1 * torch.randn(C, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(C, generator=g),
        "eh_proj.weight": 0.2 * torch.randn(C, 2 * C, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(C, generator=g),
    }
    for k, v in state.items():
        if k.startswith(f"model.layers.{L - 1}."):
            new[k.removeprefix(f"model.layers.{L - 1}.")] = v + 0.05 * torch.randn(v.shape, generator=g)
    new.pop(drop, None)
    state.update({f"model.layers.{L}.{k}": v.contiguous() for k, v in new.items()})
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return out, {k: v.float() for k, v in new.items()}


def rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint, tmp_path_factory):
    return with_mtp_module(tiny_checkpoint, tmp_path_factory.mktemp("mtp") / "ckpt")


def test_the_loaded_module_computes_deepseeks_formula(mtp_checkpoint):
    """One position, no past: attention over a single key returns its value, so the module's
    output is computable by hand from the raw tensors (no rotary, no softmax):
    h = eh_proj [enorm(E t) ; hnorm(f)], h += o_proj(v_proj(ln1 h)) (per KV head, repeated),
    h += down(silu(gate(ln2 h)) * up(ln2 h)), logits = head(shared_head.norm(h))."""
    ckpt, w = mtp_checkpoint
    assert mtp_modules(ckpt) == 1
    target = load_model(ckpt).requires_grad_(False)  # the extra layer does not disturb the target itself
    head = mtp_head(ckpt)
    eps, H, Hkv = TINY_HF["rms_norm_eps"], TINY_HF["num_attention_heads"], TINY_HF["num_key_value_heads"]
    C = TINY_HF["hidden_size"]
    D = C // H
    torch.manual_seed(0)
    t, f = torch.tensor([[7]]), torch.randn(1, 1, C)
    E, head_w = target.embed_tokens.weight, target.lm_head.weight
    h = torch.cat([rms(E[t], w["enorm.weight"], eps), rms(f, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
    v = rms(h, w["input_layernorm.weight"], eps) @ w["self_attn.v_proj.weight"].T  # (1, 1, Hkv*D)
    v = v.view(1, 1, Hkv, D).repeat_interleave(H // Hkv, dim=2).reshape(1, 1, H * D)
    h = h + v @ w["self_attn.o_proj.weight"].T
    x = rms(h, w["post_attention_layernorm.weight"], eps)
    h = (
        h
        + (torch.nn.functional.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T))
        @ w["mlp.down_proj.weight"].T
    )
    want = rms(h, w["shared_head.norm.weight"], eps) @ head_w.T
    with torch.no_grad():
        logits, hidden, _, _ = head(
            t, f, torch.zeros(1, 1, C), torch.zeros(1, 1, dtype=torch.bool), torch.tensor([[3]]),
            torch.ones(1, 1, 1, dtype=torch.bool), *head.empty_past(1),
        )  # fmt: skip
    assert torch.allclose(logits, want, atol=1e-4 * float(want.abs().max()))
    assert torch.allclose(hidden, h, atol=1e-5 * float(h.abs().max()))


def test_imported_module_drafts_and_output_equals_plain(mtp_checkpoint, tmp_path):
    ckpt, _ = mtp_checkpoint
    import_mtp(ckpt, tmp_path / "mtp", tensorrt="off")
    gen = Generator.from_checkpoint(ckpt)
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9]]
    plain = gen.generate_ids(prompts, 30)
    for tree in (None, (3, 3)):
        prop = make_proposer("mtp", draft_dir=tmp_path / "mtp", target=gen.session.caps, tree=tree)
        out = SpeculativeDecoder(gen, prop, make_policy(4)).generate_ids(prompts, 30)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        assert out[0].metrics.drafted_tokens > 0 and prop.calls > 0
    with pytest.raises(SpecrtError, match="holds an mtp head, not eagle3"):
        make_proposer("eagle3", draft_dir=tmp_path / "mtp", target=gen.session.caps)


def test_checkpoints_without_a_module_or_with_a_broken_one_are_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(SpecrtError, match="carries 0 MTP modules.*train-draft --method mtp"):
        mtp_head(tiny_checkpoint)
    broken, _ = with_mtp_module(tiny_checkpoint, tmp_path / "broken", drop="hnorm.weight")
    with pytest.raises(SpecrtError, match=r"not in DeepSeek-V3's layout: missing \['hnorm.weight'\]"):
        mtp_head(broken)


def test_training_an_mtp_module_lowers_the_held_out_loss(training_data, tiny_checkpoint, tmp_path):
    cfg = TrainConfig("mtp", epochs=4, lr=1e-3, batch_tokens=1024, eval_every=1000)
    assert cfg.steps == 2
    head, report = train_head(load_model(tiny_checkpoint), training_data, cfg, tmp_path, progress=False)
    assert head.hc.method == "mtp" and head.hc.draft_vocab == TINY_HF["vocab_size"]
    assert report["held_out"]["loss"] < 0.9 * report["held_out_before"]["loss"]
    assert not head.lm_head.weight.requires_grad  # the shared head stays the target's
    assert np.array_equal(
        head.lm_head.weight.detach().numpy(), load_model(tiny_checkpoint).lm_head.weight.detach().numpy()
    )
