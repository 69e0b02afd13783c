"""The PyTorch backend with a device-resident KV cache (the PyTorch-CUDA path) and CUDA graphs.

The device-cache path is exercised on the CPU by keeping the cache in torch tensors; the CUDA
tests are marked `gpu` and skip (visibly, with -rs) on machines without a CUDA GPU.
"""

import dataclasses

import pytest
import torch

from specrt.errors import SpecrtError
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from conftest import random_model, tiny_hf_config

HF = tiny_hf_config(vocab_size=32)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 3, 4, 9, 10]]
has_cuda = torch.cuda.is_available()
gpu = pytest.mark.skipif(not has_cuda, reason="needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is False)")


def outputs(backend, spec: bool):
    gen = Generator(backend)
    if spec:
        return [
            r.token_ids
            for r in SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)).generate_ids(PROMPTS, 40)
        ]
    return [r.token_ids for r in gen.generate_ids(PROMPTS, 40)]


@pytest.fixture(scope="module")
def reference():
    model = random_model(HF, seed=3, scale=0.3)
    b = TorchBackend(model)
    return model, {spec: outputs(b, spec) for spec in (False, True)}


@pytest.mark.parametrize("spec", [False, True])
def test_torch_tensor_cache_equals_numpy_cache(reference, spec):
    model, expected = reference
    backend = TorchBackend(model)
    backend.caps = dataclasses.replace(backend.caps, cache_device="cpu")  # keep the cache in torch tensors, as on a GPU
    gen = Generator(backend)
    cache = gen.session.new_cache(1, 8)
    assert isinstance(cache.keys, torch.Tensor)
    assert outputs(backend, spec) == expected[spec]


def test_cuda_graphs_need_cuda():
    with pytest.raises(SpecrtError, match="CUDA graphs need a CUDA device"):
        TorchBackend(random_model(HF), device="cpu", cuda_graphs=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("spec", [False, True])
def test_cuda_backend_matches_reference(reference, graphs, spec):
    model, expected = reference
    backend = TorchBackend(random_model(HF, seed=3, scale=0.3), device="cuda", cuda_graphs=graphs)
    gen = Generator(backend)
    runner = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)) if spec else gen
    counts = []
    for _ in range(2):  # the second generation replays graphs captured in the first (pooled caches)
        assert [r.token_ids for r in runner.generate_ids(PROMPTS, 40)] == expected[spec]
        counts.append(backend.captures)
    if graphs:  # captured in the first generation, none in the second (a recapture each time passed before)
        assert counts[0] > 0 and counts[1] == counts[0], counts
        assert backend._graphs and all(entry is not None for entry in backend._graphs.values())
    else:
        assert counts == [0, 0] and not backend._graphs


def test_graph_backends_reuse_their_caches(reference):
    """With reuse_cache (set by CUDA-graph backends) the generator pools caches: capacities are
    rounded up to 256, a finished generation's cache is handed to the next one (so captured graphs
    stay valid), two generations running at once get different caches, and outputs are unchanged."""
    model, expected = reference
    backend = TorchBackend(model)
    backend.caps = dataclasses.replace(backend.caps, cache_device="cpu", reuse_cache=True)
    gen = Generator(backend)
    seen = []
    real_new = gen.session.new_cache
    gen.session.new_cache = lambda b, c: seen.append(real_new(b, c)) or seen[-1]
    for spec in (False, True, False):
        assert outputs(backend, spec) == expected[spec]  # a fresh generator each: its own pool
        got = [
            r.token_ids
            for r in (SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)) if spec else gen).generate_ids(
                PROMPTS, 40
            )
        ]
        assert got == expected[spec]
    assert len({id(c) for c in seen}) == 1 and seen[0].capacity == 256 and not seen[0].in_use
    a, b = gen.iter_generate(PROMPTS, 40), gen.iter_generate(PROMPTS, 40)
    next(a), next(b)  # both hold a cache now
    assert len({id(c) for c in seen[-2:]}) == 2

    assert [r.token_ids for r in b.run()] == expected[False]
    a.close()  # an abandoned generation gives its cache back too
    assert not any(c.in_use for c in seen)


def emulate_graphs(backend):
    """Turn on the CUDA-graph path on the CPU, with capture emulated: a 'graph' re-runs the step on
    the buffers it was captured with and writes the same output tensors, as a replay does. This
    tests the bookkeeping (static inputs, keys per shape and cache, pooled caches); the real capture
    runs only on a GPU. Returns the list of captures made."""
    captures = []

    def capture(fn):
        out = fn()
        captures.append(out)

        def replay():
            for dst, src in zip(out, fn()):
                dst.copy_(src)

        return replay, out

    backend.cuda_graphs = True
    backend.caps = dataclasses.replace(backend.caps, cache_device="cpu", reuse_cache=True)
    backend._capture = capture
    return captures


def interleaved(runner, prompts, n):
    """Two generations of one generator advanced in turn (each holds its own cache)."""

    a, b = runner.iter_generate(prompts, n), runner.iter_generate(prompts[::-1], n)
    for _ in range(5):
        next(a), next(b)
    return [r.token_ids for r in a.run()], [r.token_ids for r in b.run()]


@pytest.mark.parametrize("spec", [False, True])
def test_graph_path_bookkeeping_with_emulated_capture(reference, spec):
    model, expected = reference
    backend = TorchBackend(model)
    captures = emulate_graphs(backend)
    gen = Generator(backend)
    runner = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)) if spec else gen
    assert [r.token_ids for r in runner.generate_ids(PROMPTS, 40)] == expected[spec]
    first = len(captures)
    assert first >= 1
    # decode and verification shapes only: the prefill chunks (Q 7 and 10, logits at the last
    # position) ran eagerly, not captured
    assert all(q == 1 or k == q for (*_, (_, q), (_, k)) in backend._graphs)
    assert [r.token_ids for r in runner.generate_ids(PROMPTS, 40)] == expected[spec]
    assert len(captures) == first  # the second generation replayed the first one's graphs
    a, b = interleaved(runner, PROMPTS, 40)  # two caches alive at once: graphs must not mix them up
    assert a == expected[spec]
    if not spec:
        assert b == [r.token_ids for r in Generator(TorchBackend(model)).generate_ids(PROMPTS[::-1], 40)]


def test_greedy_steps_copy_tokens_not_logits_from_a_device_cache_backend(reference):
    """want_logits=False (greedy): the backend takes the argmax where the logits are and hands
    back (B, K) tokens, no (B, K, V) logits; they equal the reference's argmax."""
    import numpy as np

    model, _ = reference
    backend = TorchBackend(model)
    backend.caps = dataclasses.replace(backend.caps, cache_device="cpu")  # the device-cache path, as on a GPU
    session, ref = Generator(backend).session, Generator(TorchBackend(model)).session
    cache, ref_cache = session.new_cache(2, 32), ref.new_cache(2, 32)
    for s, c in ((session, cache), (ref, ref_cache)):
        s.forward(c, PROMPTS)
    out = session.forward(cache, [[3, 4, 5], [6]], want_logits=False)
    expected = ref.forward(ref_cache, [[3, 4, 5], [6]]).logits.argmax(-1)
    assert out.logits is None and out.top1.shape == (2, 3)
    assert np.array_equal(out.argmax()[0], expected[0]) and out.argmax()[1, 0] == expected[1, 0]
