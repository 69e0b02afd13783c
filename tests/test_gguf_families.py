"""GGUF files of the other families and the k-quant blocks: a Gemma 3 GGUF as llama.cpp writes
one (norms stored as 1 + w, the embedding tied to the head, metadata llama.cpp leaves to its
code) with Q5_0, Q4_K, Q6_K and Q8_0 tensors. The blocks dequantize bit for bit as the gguf
package does; the model converted from the file equals transformers' reading of the same file;
the engines computed from the file's own blocks are the float model within float rounding
(`gguf`) and, with int8 activations (`gguf-a8`), their own model; speculative output is their
plain output (on steps within 64 positions: see the last test).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from test_conformance import TOL, walk

from specrt.calibration.gguf_blocks import _split_blocks
from specrt.engines.build import BuildSpec, build_all
from specrt.errors import SpecrtError, UnsupportedArchitectureError
from specrt.export.checkpoint import load_model
from specrt.export.gguf import read_gguf
from specrt.layout import ArtifactLayout
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from conftest import save_checkpoint
from tiny_gguf import random_blocks, write_gemma3_gguf

TYPES = {  # as the Gemma 3 270M file stores them (but v: F16), every k-quant block type somewhere
    "attn_q": "Q5_0",
    "attn_k": "Q5_0",
    "attn_v": "F16",
    "attn_output": "Q4_K",
    "ffn_gate": "Q5_0",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
}


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_k_quant_blocks_dequantize_as_the_gguf_package_does(kind):
    import gguf

    raw = random_blocks(6, 512, kind, np.random.default_rng(0))
    ours = _split_blocks(raw, 6, kind).dequantize()
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, 512)
    assert np.array_equal(ours, want)  # bit for bit


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    """(GGUF file, the checkpoint converted from it, build-engines output with gguf and gguf-a8)."""
    d = tmp_path_factory.mktemp("gemma-gguf")
    # head_dim 256: llama.cpp scales scores by key_length ** -0.5, transformers' GGUF reader by
    # 256 ** -0.5 whatever the key length; they agree at 256, as on every Gemma 3 but the 27B
    write_gemma3_gguf(d / "gemma.gguf", TYPES, layers=6, D=256)
    model = load_model(d / "gemma.gguf")
    ckpt = save_checkpoint(model, model.cfg.to_hf_dict(), d / "ckpt")
    for scheme in ("gguf", "gguf-a8"):
        spec = BuildSpec(checkpoint=ckpt, out=d / "art", quantize=scheme, gguf=d / "gemma.gguf", tensorrt="off")
        list(build_all(spec))
    return d / "gemma.gguf", ckpt, d / "art"


def test_the_conversion_equals_transformers_reading_the_file(gemma_gguf):
    transformers = pytest.importorskip("transformers")
    path, ckpt, _ = gemma_gguf
    cfg, state, _ = read_gguf(path)
    assert cfg.sliding_layers == (0, 1, 2, 3, 4) and cfg.rope_local_theta == 10_000.0 and cfg.attn_scalar == 256
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    theirs = ref.state_dict()
    for name, w in state.items():
        assert torch.equal(w, theirs[name]), name  # every tensor, Gemma's norms included
    ids = torch.randint(3, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids).logits[0].numpy()
    ours = Generator.from_engine(ArtifactLayout(gemma_gguf[2]).ort_engine("cpu", "none"))
    got = ours.session.forward(ours.session.new_cache(1, 64), [ids[0].tolist()]).logits[0]
    assert np.abs(got - want).max() <= TOL * float(np.ptp(want))


def test_the_engine_from_the_blocks_is_the_float_model(gemma_gguf):
    _, _, art = gemma_gguf
    layout = ArtifactLayout(art)
    q = json.loads((layout.source_onnx("gguf", "fused") / "manifest.json").read_text())["quantization"]
    # per layer: q, k, gate (Q5_0) and down (Q6_K) / o, up (Q4_K) / v (F16: a float product); the
    # tied head (Q8_0)
    assert q["rewritten_matmuls"] == {"Q4_1": 12, "Q8_0": 6 * 4 + 1, "float": 6}
    float_run = walk(Generator.from_engine(layout.ort_engine("cpu", "none")).session)
    block_run = walk(Generator.from_engine(layout.ort_engine("cpu", "gguf")).session)
    for (a, _), (b, _) in zip(block_run, float_run):
        assert np.abs(a - b).max() <= TOL * max(float(np.ptp(b)), 1.0)


@pytest.mark.parametrize("scheme", ["gguf", "gguf-a8"])
def test_speculative_output_is_plain_output_on_the_block_engines(gemma_gguf, scheme):
    """Past slot 64 too: ORT's attention with heads of 256 (this model's) adds in another order
    once a step ends past it on an Intel Xeon, and the engine's step cuts keep every step from spanning it
    (tests/test_step_cuts.py), so speculation is bitwise and nothing warns."""
    gen = Generator.from_engine(ArtifactLayout(gemma_gguf[2]).ort_engine("cpu", scheme))
    assert gen.session.exactness()["exact"] == "bitwise"  # with the cuts its CPU has (none on an AMD EPYC)
    gen.eos_ids = frozenset()
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [40, 41, 42, 43, 40, 41, 42, 43, 40]]
    plain = [r.token_ids for r in gen.generate_ids(prompts, 64)]
    for draft in ("suffix", "ngram"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no exactness warning: the engine is bitwise
            spec = SpeculativeDecoder(gen, make_proposer(draft), make_policy(4, 4))
        assert [r.token_ids for r in spec.generate_ids(prompts, 64)] == plain, draft


def test_a_block_type_the_engines_do_not_take_is_refused_by_name(tmp_path):
    """Q5_K converts (the gguf package dequantizes it) but no gguf scheme computes from it."""
    write_gemma3_gguf(tmp_path / "k5.gguf", TYPES | {"ffn_down": "Q5_K"}, layers=1, D=256)
    model = load_model(tmp_path / "k5.gguf")
    ckpt = save_checkpoint(model, model.cfg.to_hf_dict(), tmp_path / "ckpt")
    spec = BuildSpec(checkpoint=ckpt, out=tmp_path / "art", quantize="gguf", gguf=tmp_path / "k5.gguf", tensorrt="off")
    with pytest.raises(SpecrtError, match="stores tensors as Q5_K.*--quantize int8-a8"):
        list(build_all(spec))


def test_a_gguf_of_an_unread_architecture_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'mamba' is not supported.*gemma3"):
        read_gguf(tmp_path / "x.gguf")
