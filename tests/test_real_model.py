"""The default model (SmolLM2-135M-Instruct): specrt against transformers, token for token.

These tests need `make model`; CI runs it and sets SPECRT_REQUIRE_REAL_MODEL=1 so they cannot
silently skip there.
"""

import numpy as np
import pytest
import torch

from specrt.runtime.generator import Generator
from specrt.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

from conftest import REAL_GGUF

pytestmark = pytest.mark.real_model
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "List three colours of the rainbow.",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def hf_model(real_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(real_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(real_model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(real_model_dir))


@pytest.fixture(scope="module")
def ort_gen(real_artifacts):
    return Generator.from_engine(real_artifacts / "engines" / "ort-cpu")


def test_chat_template_matches_transformers(real_model_dir, hf_tokenizer):
    ours = Tokenizer(real_model_dir)
    for p in PROMPTS:
        messages = [{"role": "user", "content": p}]
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(messages) == expected
        assert ours.encode(expected) == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_greedy_output_equals_transformers(ort_gen, hf_model):
    for p in PROMPTS:
        ids = ort_gen.encode_prompt(p)
        ours = ort_gen.generate_ids([ids], max_new_tokens=NEW_TOKENS)[0].token_ids
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(ort_gen.eos_ids),
                pad_token_id=2,
            )
        expected = out[0, len(ids) :].tolist()
        assert ours == expected, p


def test_ort_logits_match_transformers(ort_gen, hf_model):
    ids = ort_gen.encode_prompt(PROMPTS[1])
    cache = ort_gen.session.new_cache(1, len(ids))
    logits = ort_gen.session.forward(cache, [ids]).logits[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(expected).max()
    assert np.abs(logits - expected).max() <= 1e-4 * scale


def test_gguf_read_matches_transformers_gguf_loader(real_model_dir):
    """Our GGUF reader (own q/k unpermute) against transformers' GGUF loader, on logits."""
    if not REAL_GGUF.is_file():
        pytest.skip(f"{REAL_GGUF} not cached (make model keeps it)")
    from specrt.export.checkpoint import load_model
    from specrt.export.llama import causal_mask

    ours = load_model(REAL_GGUF)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(REAL_GGUF.parent), gguf_file=REAL_GGUF.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198]])
    with torch.no_grad():
        a = ours(ids, torch.arange(11)[None], causal_mask(1, 11, 0), ours.empty_past(1))[0]
        b = ref(ids).logits
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_streaming_detokenizer_keeps_multibyte_text(real_model_dir):
    tok = Tokenizer(real_model_dir)
    text = "Café ☕ naïve — 日本語 🤖 done."
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


CODE_EDIT = (
    "Add a docstring to this function and return the whole function:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
)


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_greedy_speculative_equals_plain_on_default_model(ort_gen, method):
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    ids = ort_gen.encode_prompt(CODE_EDIT)
    plain = ort_gen.generate_ids([ids], 64)[0].token_ids
    for num_draft in (5, "auto"):
        r = SpeculativeDecoder(ort_gen, make_proposer(method), make_policy(num_draft)).generate_ids([ids], 64)[0]
        assert r.token_ids == plain, (method, num_draft)
        assert r.metrics.accepted_tokens > 0


def test_eagle3_head_on_default_model(ort_gen, real_model_dir, tmp_path):
    """An EAGLE-3 head for the default model (untrained: initialised from the target, which is
    what training starts from) reads layers 2, 15 and 27 from the real engine's hidden states,
    exports with ORT parity, and keeps greedy output equal to plain, with chains and trees; the
    head initialised from the target already drafts tokens the target accepts."""
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    from test_eagle import make_head_dir

    layout = make_head_dir(real_model_dir, "eagle3", tmp_path / "eagle3", draft_vocab=8192, lowest_ids=True)
    ids = [ort_gen.encode_prompt(p) for p in PROMPTS[:2]]
    plain = [r.token_ids for r in ort_gen.generate_ids(ids, 32)]
    accepted = 0
    # with the step floor a tree's off-chain acceptances are cut (verification.on_leading_chain):
    # the head's acceptance is read without the floor as well, where every branch counts
    loose = Generator(ort_gen.backend, ort_gen.tokenizer, exact="near-ties")
    for gen in (ort_gen, loose):
        for tree in (None, (4, 4)):
            prop = make_proposer("eagle3", draft_dir=layout.root, target=gen.session.caps, tree=tree)
            out = SpeculativeDecoder(gen, prop, make_policy(5)).generate_ids(ids, 32)
            assert [r.token_ids for r in out] == plain, tree
            accepted += out[0].metrics.accepted_tokens
    assert accepted > 0


def test_gguf_engine_is_the_float_model_on_default_model(ort_gen, real_model_dir, real_artifacts):
    """build-engines --quantize gguf on the default model's own Q4_1/Q8_0 file: teacher-forced
    logits and features within float rounding of the float32 engine (top-1 identical), greedy answers identical,
    and speculative output equal to the engine's own plain output."""
    from specrt.engines.build import BuildSpec, build_all
    from specrt.layout import ArtifactLayout
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    if not REAL_GGUF.is_file():
        pytest.skip(f"{REAL_GGUF} not cached (make model keeps it)")
    spec = BuildSpec(checkpoint=real_model_dir, out=real_artifacts, quantize="gguf", gguf=REAL_GGUF, tensorrt="off")
    list(build_all(spec))
    q4 = Generator.from_engine(ArtifactLayout(real_artifacts).ort_engine("cpu", "gguf"))
    text = ort_gen.tokenizer.encode(" ".join(PROMPTS) + " " + CODE_EDIT)
    fa = ort_gen.session.forward(ort_gen.session.new_cache(1, len(text)), [text], hidden=True)
    fb = q4.session.forward(q4.session.new_cache(1, len(text)), [text], hidden=True)
    a, b = fa.logits[0], fb.logits[0]
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()
    # the features draft heads read: heads trained on the float32 engine's serve the 4-bit one
    ha, hb = fa.hidden_states[0], fb.hidden_states[0]
    assert np.abs(ha - hb).max() <= 1e-4 * np.abs(ha).max()
    for prompt in PROMPTS:
        ids = ort_gen.encode_prompt(prompt)
        assert q4.generate_ids([ids], NEW_TOKENS)[0].token_ids == ort_gen.generate_ids([ids], NEW_TOKENS)[0].token_ids
    ids = q4.encode_prompt(CODE_EDIT)
    plain = q4.generate_ids([ids], 64)[0].token_ids
    spec_out = SpeculativeDecoder(q4, make_proposer("suffix"), make_policy("auto")).generate_ids([ids], 64)[0]
    assert spec_out.token_ids == plain and spec_out.metrics.accepted_tokens > 0


@pytest.mark.parametrize("scheme", ["hqq", "gptq", "awq"])
def test_fitted_recipes_find_the_default_models_4bit_grid_again(scheme, ort_gen, real_model_dir, real_artifacts):
    """The default model's weights are Q4_1 blocks (head Q8_0): every fitted recipe starts from
    min-max with a float offset and must find them again (GPTQ has no error to feed back, AWQ
    picks alpha 0), so its engine is the float model within float rounding: what makes the
    recipes safe on an already-4-bit checkpoint. The calibrated ones use a small set (8 prompts,
    answers of up to 32 tokens) to keep this quick."""
    from specrt.engines.build import BuildSpec, build_all
    from specrt.layout import ArtifactLayout
    from specrt.training.calibration_set import SET_FILE, make_calibration_set

    layout = ArtifactLayout(real_artifacts)
    make_calibration_set(ort_gen, layout.calibration, prompts=8, max_new_tokens=32, progress=False)
    spec = BuildSpec(
        checkpoint=real_model_dir,
        out=real_artifacts,
        quantize=scheme,
        tensorrt="off",
        calibration=layout.calibration / SET_FILE,
    )
    list(build_all(spec))
    fitted = Generator.from_engine(layout.ort_engine("cpu", scheme))
    text = ort_gen.tokenizer.encode(" ".join(PROMPTS) + " " + CODE_EDIT)
    a = ort_gen.session.forward(ort_gen.session.new_cache(1, len(text)), [text]).logits[0]
    b = fitted.session.forward(fitted.session.new_cache(1, len(text)), [text]).logits[0]
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()
