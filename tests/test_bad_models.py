"""Bad model files on the surfaces the model families added: GGUF files without a tokenizer, with
damaged block scales, cut short or of block types no engine takes; a checkpoint whose config
disagrees with its tensors or whose context is short; options past the model's context; a build
past the machine's memory. Each is one line naming the problem and the fix (or, where the input
is valid, a build that works), never a traceback, and nothing already made is lost.
"""

import json
import shutil

import gguf
import numpy as np
import pytest
from test_bad_input import last_line, run

from specrt.engines.build import BuildSpec, build_all
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from conftest import random_model, tiny_hf_config
from tiny_gguf import write_gemma3_gguf, write_gguf


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A tiny Llama GGUF with its tokenizer, Q4_0 attention queries."""
    hf = tiny_hf_config()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(random_model(hf, seed=3), hf, path, {"attn_q": "Q4_0"}, tokenizer=True)
    return path


def test_a_gguf_converts_with_its_tokenizer(llama_gguf, tmp_path):
    r = run("convert", llama_gguf, "--out", tmp_path / "ckpt")
    assert r.exit_code == 0 and (tmp_path / "ckpt" / "tokenizer.json").is_file(), r.output


def test_a_gguf_without_a_tokenizer_is_refused_before_dequantizing(tmp_path):
    """It ended in transformers' traceback ("Cannot build a tokenizer from a GGUF file stating
    tokenizer None")."""
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=3), hf, tmp_path / "bare.gguf")
    r = run("convert", tmp_path / "bare.gguf", "--out", tmp_path / "ckpt")
    assert r.exit_code == 1 and "carries no tokenizer (its metadata has no tokenizer.ggml.model" in last_line(r)
    assert "convert the model's Hugging Face checkpoint" in last_line(r) and not (tmp_path / "ckpt").exists()


def test_garbage_block_scales_are_refused_by_tensor(llama_gguf, tmp_path):
    """Scales of infinity (a damaged file): it wrote a checkpoint of non-finite weights and exited 0."""
    reader = gguf.GGUFReader(str(llama_gguf))
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    data = bytearray(llama_gguf.read_bytes())
    for b in range(t.n_bytes // 18):  # Q4_0: a float16 scale, then 16 bytes of codes
        data[t.data_offset + 18 * b : t.data_offset + 18 * b + 2] = b"\x00\x7c"
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    r = run("convert", tmp_path / "bad.gguf", "--out", tmp_path / "ckpt")
    assert r.exit_code == 1 and "tensor blk.1.attn_q.weight (Q4_0) dequantizes to 4096 non-finite values" in last_line(
        r
    )
    assert "the file is damaged; download it again" in last_line(r) and not (tmp_path / "ckpt").exists()


def test_a_gguf_cut_short_is_refused(llama_gguf, tmp_path):
    data = llama_gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 5000])  # mid-tensor
    r = run("convert", tmp_path / "cut.gguf", "--out", tmp_path / "ckpt")
    assert r.exit_code == 1 and "is not a readable GGUF file (cut short or damaged" in last_line(r), r.output
    assert not (tmp_path / "ckpt").exists()


def test_a_gguf_of_an_unread_architecture_is_named_at_convert(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "rwkv7")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run("convert", tmp_path / "x.gguf", "--out", tmp_path / "ckpt")
    assert r.exit_code == 1 and "GGUF architecture 'rwkv7' is not supported" in last_line(r), r.output


@pytest.mark.parametrize("kind", ["Q5_K", "IQ4_XS"])
def test_block_types_no_engine_takes_convert_with_a_note_and_are_refused_before_the_build(tmp_path, kind):
    """The float checkpoint converts (the engines of int8 weights build from it) and says so;
    --quantize gguf is refused before the float export, nothing written."""
    types = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q4_K", "ffn_up": "Q4_K", "ffn_down": kind}
    write_gemma3_gguf(tmp_path / "m.gguf", types, layers=1, D=256, tokenizer=True)
    r = run("convert", tmp_path / "m.gguf", "--out", tmp_path / "ckpt")
    assert r.exit_code == 0 and f"stores tensors as {kind}, which the engines of its own blocks" in r.output
    assert "build " + str(tmp_path / "ckpt") + " with --quantize int8-a8 or int4" in r.output, r.output
    r = run("build-engines", "--model", tmp_path / "ckpt", "--out", tmp_path / "art", "--quantize", "gguf")
    assert r.exit_code == 1 and f"stores tensors as {kind}: block types the gguf schemes" in last_line(r)
    assert not (tmp_path / "art").exists()


def _edited(src, out, **config):
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | config))
    return out


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from test_conformance import checkpoint, reference

    ref = reference("gemma3")
    return ref, checkpoint(ref, tmp_path_factory.mktemp("gemma") / "ckpt")


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_attention_heads": 8}, "q_proj.weight has shape (64, 64), the config implies (128, 64)"),
        ({"head_dim": 8}, "q_proj.weight has shape (64, 64), the config implies (32, 64)"),
        ({"num_key_value_heads": 4}, "k_proj.weight has shape (32, 64), the config implies (64, 64)"),
    ],
)
def test_a_config_that_disagrees_with_the_tensors_is_one_line(gemma, tmp_path, config, message):
    ckpt = _edited(gemma[1], tmp_path / "ckpt", **config)
    r = run("build-engines", "--model", ckpt, "--out", tmp_path / "art", "--tensorrt", "off")
    assert r.exit_code == 1 and message in last_line(r) and "config.json does not match the weights" in last_line(r)
    assert not (tmp_path / "art" / "onnx").exists()


def test_a_sliding_window_past_the_context_is_full_attention(gemma, tmp_path):
    """A window longer than the context (Qwen2's configs carry 131072 beside 32768) is valid: every
    position sees every other, and greedy output is transformers' for the same config."""
    import torch
    from test_conformance import checkpoint, reference

    ref = reference("gemma3", sliding_window=4096)
    ckpt = checkpoint(ref, tmp_path / "ckpt")
    list(build_all(BuildSpec(checkpoint=ckpt, out=tmp_path / "art", tensorrt="off")))
    gen = Generator.from_engine(tmp_path / "art" / "engines" / "ort-cpu")
    prompt = list(range(5, 45))  # longer than the conformance models' window of 8
    ours = gen.generate_ids([prompt], 16)[0].token_ids
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert ours == want[0, len(prompt) :].tolist()


def test_a_short_context_builds_and_speculates_to_its_end(tiny_checkpoint, tmp_path):
    """A model of 64 positions: the build's checks stepped past its rotary table (a traceback from
    ORT's GroupQueryAttention), and a speculative step near the context's end did too. Built, it
    generates to the end of its context with speculation in a batch exactly as plain decoding."""
    ckpt = _edited(tiny_checkpoint, tmp_path / "ckpt", max_position_embeddings=64)
    r = run("build-engines", "--model", ckpt, "--out", tmp_path / "art", "--tensorrt", "off")
    assert r.exit_code == 0, r.output
    gen = Generator.from_engine(tmp_path / "art" / "engines" / "ort-cpu")
    assert gen.max_context == 64
    gen.eos_ids = frozenset()  # every row runs to the context's end
    base = np.random.default_rng(0).integers(3, 100, 20).tolist()
    prompts = [(base * 3)[:58], (base * 3)[:30], [5, 6, 7]]
    plain = gen.generate_ids(prompts, 100)
    assert [len(p) + len(r.token_ids) for p, r in zip(prompts, plain)] == [64, 64, 64]
    for method in ("suffix", "ngram"):
        out = SpeculativeDecoder(gen, make_proposer(method), make_policy(8)).generate_ids(prompts, 100)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain], method


def test_a_context_too_short_for_an_engine_is_refused_by_its_length(tiny_checkpoint, tmp_path):
    ckpt = _edited(tiny_checkpoint, tmp_path / "ckpt", max_position_embeddings=16)
    r = run("build-engines", "--model", ckpt, "--out", tmp_path / "art", "--tensorrt", "off")
    assert r.exit_code == 1 and "the model's context length is 16 positions" in last_line(r), r.output
    assert "an engine needs at least 20" in last_line(r) and not (tmp_path / "art").exists()


def test_max_context_past_the_models_is_a_usage_error(tiny_checkpoint, tmp_path):
    r = run("build-engines", "--model", tiny_checkpoint, "--out", tmp_path / "art", "--max-context", "4096")
    assert r.exit_code == 2 and "--max-context 4096: the model's context is 256 positions" in last_line(r)
    assert "give --max-context 256 or less" in last_line(r) and not (tmp_path / "art").exists()


def test_a_build_past_the_free_memory_is_refused_with_the_size(tiny_checkpoint, tmp_path, monkeypatch):
    """The kernel killed a build of the 1.5B model at 24 GB; a build now says what it needs first,
    and a MemoryError all the same is one line, with nothing half-written left."""
    import specrt.engines.build as build
    import specrt.engines.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 100 << 20)
    r = run("build-engines", "--model", tiny_checkpoint, "--out", tmp_path / "art", "--tensorrt", "off")
    line = last_line(r)
    assert r.exit_code == 1 and "exporting the step graph of" in line and "needs about 0.4 GiB of memory" in line
    assert "and 0.1 GiB are free here" in line and not (tmp_path / "art" / "onnx").exists()

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setenv("SPECRT_MEMORY_CHECK", "off")
    monkeypatch.setattr(build, "export_fused_graph", exhausted, raising=False)
    monkeypatch.setattr("specrt.export.fused_graph.export_fused_graph", exhausted)
    r = run("build-engines", "--model", tiny_checkpoint, "--out", tmp_path / "art", "--tensorrt", "off")
    assert r.exit_code == 1 and "the build ran out of memory (it needs about 0.4 GiB" in last_line(r), r.output
    assert (tmp_path / "art" / "onnx").is_dir() and not list((tmp_path / "art").glob(".*.tmp"))


def test_an_unknown_model_name_is_refused_by_the_makefile():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(["make", "-n", "MODEL=llama-70b", "model"], cwd=root, capture_output=True, text=True)
    assert r.returncode != 0 and "MODEL=llama-70b is not a model this Makefile fetches" in r.stderr
    assert "smollm2, gemma3-270m, qwen2.5-coder-1.5b or qwen2.5-coder-0.5b" in r.stderr


def test_the_makefile_builds_the_draft_model_it_is_asked_for_and_only_that_one():
    """DRAFT_MODEL=qwen2.5-coder-0.5b with the 1.5B: its engine is made first (a sub-make) and
    generate and serve get --draft-dir; any other pairing is refused with the one that works."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = dict(cwd=root, capture_output=True, text=True)
    ok = ["make", "-n", "MODEL=qwen2.5-coder-1.5b", "DRAFT_MODEL=qwen2.5-coder-0.5b"]
    r = subprocess.run([*ok, "generate"], **run)
    assert r.returncode == 0, r.stderr
    assert "build-engines MODEL=qwen2.5-coder-0.5b" in r.stdout
    assert "--draft auto --draft-dir artifacts/qwen2.5-coder-0.5b/engines/ort-cpu-gguf-k" in r.stdout
    r = subprocess.run([*ok, "DRAFT=draft-model", "serve"], **run)
    serve = "serve --artifacts artifacts/qwen2.5-coder-1.5b --quantize gguf-k --draft draft-model --draft-dir"
    assert serve in r.stdout
    r = subprocess.run(["make", "-n", "DRAFT_MODEL=qwen2.5-coder-0.5b", "generate"], **run)
    assert r.returncode != 0 and "for MODEL=qwen2.5-coder-1.5b" in r.stderr
