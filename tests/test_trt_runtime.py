"""The TensorRT runtime backend.

On the CPU: its glue (profile choice by Q, input shapes, tensor addresses with the KV cache bound
in place, outputs) runs against a real engine's manifest with a stand-in runtime
(fake_tensorrt.py) that executes our PyTorch model from the bound addresses; its refusals
(no GPU, wrong GPU, an engine TensorRT cannot load, foreign I/O, a step no profile holds) are
checked directly. On a GPU with TensorRT (marked gpu, skipped here): the real engine, with and
without CUDA graphs, against the PyTorch reference.
"""

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from specrt.engines.profiles import CACHE_ALIGN, EngineShapes
from specrt.errors import ArtifactError, ManifestMismatchError, PromptError, SpecrtError
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.kv_cache import aligned_zeros
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from fake_tensorrt import fake_tensorrt

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7, 8, 9], [40, 41, 42, 43, 40, 41, 42]]
has_cuda = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from specrt.export.checkpoint import load_model

    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def small_engine(tiny_artifacts, tmp_path_factory):
    """A TensorRT-RTX engine with small profiles: context 64, prefill chunks <= 16, verify Q <= 5."""
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine

    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed (make setup installs it)")
    spec = TrtBuildSpec(flavour="tensorrt-rtx", shapes=EngineShapes(max_context=64, max_prefill=16, max_verify=5))
    return build_trt_engine(tiny_artifacts / "onnx", tmp_path_factory.mktemp("trt") / "small", spec, progress=False)


@pytest.fixture(scope="module")
def batch_engine(tiny_artifacts, tmp_path_factory):
    """The small engine's shapes for up to 3 rows at once."""
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine

    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed (make setup installs it)")
    shapes = EngineShapes(max_batch=3, max_context=64, max_prefill=16, max_verify=5)
    spec = TrtBuildSpec(flavour="tensorrt-rtx", shapes=shapes)
    return build_trt_engine(tiny_artifacts / "onnx", tmp_path_factory.mktemp("trt") / "batch", spec, progress=False)


def fake_backend(engine_dir, model, **kw):
    from specrt.engines.trt import read_trt_manifest
    from specrt.runtime.backends import TrtBackend

    fake = fake_tensorrt(model, read_trt_manifest(engine_dir)["profiles"], **kw)
    return TrtBackend(engine_dir, device="cpu", trt_module=fake), fake.engine


def run(gen, prompts, spec: bool, n=40):
    if spec:
        return [
            r.token_ids
            for r in SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4, 4)).generate_ids(prompts, n)
        ]
    return [r.token_ids for r in gen.generate_ids(prompts, n)]


@pytest.mark.parametrize("spec", [False, True])
def test_engine_steps_equal_the_reference(small_engine, model, spec):
    """Plain and speculative greedy output through the backend's bindings equal the PyTorch
    reference; the 23-token prompt is prefilled in chunks of 16 on the prefill profile, decode and
    verification (Q <= 5) run on the verify profile."""
    backend, engine = fake_backend(small_engine, model)
    gen = Generator(backend)
    assert (gen.max_context, gen.session.prefill_chunk) == (64, 16)  # limited by the engine's profiles
    for prompt in PROMPTS:
        expected = run(Generator(TorchBackend(model), max_context=64), [prompt], spec)
        engine.executed_profiles.clear()
        assert run(gen, [prompt], spec) == expected
        chunks = [min(16, len(prompt) - i) for i in range(0, len(prompt), 16)]
        used = engine.executed_profiles
        assert used[: len(chunks)] == [1 if c > 5 else 0 for c in chunks]  # prefill profile for Q > 5
        assert set(used[len(chunks) :]) == {0} and len(used) > len(chunks) + 5
    assert backend.description.startswith("tensorrt-rtx ")


def test_pooled_caches_fit_the_engine(small_engine, model):
    """With graphs the generator pools caches rounded up to 256 positions; for an engine the
    rounding stops at the profiles' largest past (context 64 + verify 5, rounded up to 128 so
    that the largest cache's slices are aligned too)."""
    backend, _ = fake_backend(small_engine, model)
    backend.caps = dataclasses.replace(backend.caps, reuse_cache=True)  # as with cuda_graphs on a GPU
    gen = Generator(backend)
    expected = run(Generator(TorchBackend(model), max_context=64), PROMPTS[1:], spec=True)
    assert run(gen, PROMPTS[1:], spec=True) == expected and run(gen, PROMPTS[1:], spec=True) == expected
    assert [c.capacity for c in gen.session.pooled_caches] == [128]


def emulate_capture(backend) -> list[int]:
    """Turn on the graph path with an emulated capture: a 'graph' executes with the shapes and
    addresses its context had when captured (what a real graph bakes in), and refuses to replay
    on a context since bound to anything else (TensorRT promises nothing for that; the backend
    must give the context its captured binding back first). Returns the list the profile of
    every capture is appended to."""
    captures = []

    def capture(profile):
        ctx = backend._contexts[profile]
        shapes, addresses = dict(ctx.shapes), dict(ctx.addresses)
        captures.append(profile)

        def replay():
            assert (ctx.shapes, ctx.addresses) == (shapes, addresses), "replayed on a context bound otherwise"
            backend._execute(profile)

        return replay

    backend.cuda_graphs, backend._capture = True, capture
    return captures


@pytest.mark.parametrize("spec", [False, True])
def test_graph_path_with_emulated_capture(small_engine, model, spec):
    """The CUDA-graph path's bookkeeping on the CPU: a 'graph' executes with the shapes and
    addresses its context had when captured (what a real graph bakes in) and refuses a context
    bound otherwise; decode and verification steps replay from static buffers (prefill chunks,
    on the prefill profile, run eagerly), a second generation replays the first one's graphs,
    and two generations alive at once keep their caches apart."""

    backend, _ = fake_backend(small_engine, model)
    captures = emulate_capture(backend)
    backend.caps = dataclasses.replace(backend.caps, reuse_cache=True)
    gen = Generator(backend)
    reference = Generator(TorchBackend(model), max_context=64)
    counts = []
    for _ in range(2):
        for prompt in PROMPTS:
            assert run(gen, [prompt], spec) == run(reference, [prompt], spec)
        counts.append(len(captures))
    assert counts[0] > 0 and counts[1] == counts[0]  # round 2 captured nothing new
    assert set(captures) == {0}  # the verify profile's shapes only: prefill chunks are not captured
    runner = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4, 4)) if spec else gen
    a, b = runner.iter_generate(PROMPTS[:1], 30), runner.iter_generate(PROMPTS[1:], 30)
    for _ in range(4):
        next(a), next(b)
    assert [r.token_ids for r in a.run()] == run(reference, PROMPTS[:1], spec, 30)
    assert [r.token_ids for r in b.run()] == run(reference, PROMPTS[1:], spec, 30)


def test_graph_key_holds_every_bound_cache_buffer(small_engine, model):
    """A graph bakes in the addresses of both cache tensors: a cache whose values buffer moved
    (keys unchanged) must get a new capture, not a replay that reads the old values."""

    backend, _ = fake_backend(small_engine, model)
    captures = emulate_capture(backend)
    session = Generator(backend).session
    reference = Generator(TorchBackend(model), max_context=64).session
    cache, ref_cache = session.new_cache(1, 32), reference.new_cache(1, 32)
    prompt = PROMPTS[1][:8]
    for c, s in ((cache, session), (ref_cache, reference)):
        s.forward(c, [prompt])
    assert np.allclose(session.forward(cache, [[7]]).logits, reference.forward(ref_cache, [[7]]).logits, atol=1e-4)
    n = len(captures)
    cache.values = aligned_zeros(tuple(cache.values.shape), "cpu").copy_(cache.values)  # same contents, moved
    out = session.forward(cache, [[9]]).logits
    assert len(captures) == n + 1  # captured again for the new binding
    assert np.allclose(out, reference.forward(ref_cache, [[9]]).logits, atol=1e-4)


def test_graphs_hold_no_reference_to_their_cache(small_engine, model):
    """A captured graph's entry keeps the binding it bakes in as shapes and addresses, not
    tensors: a dropped cache is freed (its graphs held ~400 MB per batch-8 cache before)."""
    import gc
    import weakref

    backend, _ = fake_backend(small_engine, model)
    captures = emulate_capture(backend)
    session = Generator(backend).session
    cache = session.new_cache(1, 32)
    session.forward(cache, [PROMPTS[1][:8]])
    session.forward(cache, [[7]])
    assert backend.captures == len(captures) >= 1
    # the allocations themselves (the buffers are views of aligned allocations; slices of them
    # would keep those alive, not the views)
    alive = [weakref.ref(t if t._base is None else t._base) for t in (cache.keys, cache.values)]
    del cache
    gc.collect()
    assert alive[0]() is None and alive[1]() is None


def test_a_failed_capture_falls_back_to_plain_steps(small_engine, model):
    """TensorRT 11 cannot say beforehand whether a context is capturable: a capture that fails
    leaves that shape running without a graph (once tried, never again), and the output is
    still the reference's."""
    backend, _ = fake_backend(small_engine, model)
    tries = []

    def failing_capture(profile):
        tries.append(profile)
        raise RuntimeError("operation not permitted when stream is capturing")

    backend.cuda_graphs, backend._capture = True, failing_capture
    backend.caps = dataclasses.replace(backend.caps, reuse_cache=True)
    gen = Generator(backend)
    reference = Generator(TorchBackend(model), max_context=64)
    for _ in range(2):
        assert run(gen, PROMPTS[1:], spec=True) == run(reference, PROMPTS[1:], spec=True)
    shapes = len(backend._graphs)
    assert shapes > 0 and all(entry is None for entry in backend._graphs.values())
    assert len(tries) == shapes == len(backend.capture_failures)  # each shape tried once
    assert "RuntimeError: operation not permitted" in backend.capture_failures[0]


def test_kv_slices_are_bound_at_aligned_addresses(small_engine, model):
    """TensorRT requires 256-byte aligned addresses, and layer i's slice of a cache starts at
    i * B * Hkv * C * D * 4 bytes: the session rounds capacities to multiples of 64 positions,
    the engine's largest past is one, and a cache that is not (made by hand) is refused with the
    reason, not bound (the stand-in refuses it the way TensorRT does: a False return)."""
    from specrt.runtime.kv_cache import KVCache

    backend, _ = fake_backend(small_engine, model)
    session = Generator(backend).session
    cfg = backend.config
    assert (cfg.num_key_value_heads * cfg.head_dim * 4 * 69) % 256  # capacity 69 would misalign layer 1
    cache = session.new_cache(1, 69)
    assert cache.capacity % CACHE_ALIGN == 0 and cache.capacity >= 69
    assert all(cache.keys[i].data_ptr() % 256 == 0 for i in range(cfg.num_hidden_layers))
    session.forward(cache, [PROMPTS[1]])
    odd = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 69, cfg.head_dim, device="cpu")
    with pytest.raises(SpecrtError, match="past a 256-byte boundary"):
        session.forward(odd, [PROMPTS[1]])


def test_continuous_batching_on_the_engine(batch_engine, model):
    """Requests joining and leaving a batch on the TensorRT backend: each newcomer is prefilled on
    its own row (a slice bound at an aligned offset inside the cache), and every answer equals
    the reference's alone; a batch larger than the engine's profiles is refused up front."""
    from specrt.runtime.batching import BatchEngine, Request

    backend, _ = fake_backend(batch_engine, model)
    gen = Generator(backend)
    reference = Generator(TorchBackend(model), max_context=64)
    prompts = [PROMPTS[1], PROMPTS[0][:9], [40, 41], PROMPTS[0][:14]]
    expected = [reference.generate_ids([p], 12)[0].token_ids for p in prompts]
    out = BatchEngine(gen, max_batch=3, prefill_budget=4).run([Request(p, 12) for p in prompts], [0, 1, 1, 4])
    assert [r.token_ids for r in out] == expected
    with pytest.raises(SpecrtError, match="at most 3 rows"):
        BatchEngine(gen, max_batch=4)


def test_prompt_longer_than_the_engine_context(small_engine, model):
    gen = Generator(fake_backend(small_engine, model)[0])
    with pytest.raises(PromptError, match="context holds 64"):
        gen.generate_ids([list(range(3, 70))], 4)


def test_step_no_profile_holds(small_engine, model):
    gen = Generator(fake_backend(small_engine, model)[0])
    with pytest.raises(SpecrtError, match="no profile of this engine holds batch 2"):
        gen.generate_ids(PROMPTS, 4)  # the engine was built for batch 1


def test_engine_whose_profiles_differ_from_its_manifest(small_engine, model):
    from specrt.engines.trt import read_trt_manifest
    from specrt.runtime.backends import TrtBackend

    profiles = read_trt_manifest(small_engine)["profiles"]
    profiles[0] = {
        **profiles[0],
        "q_len": {"min": 1, "opt": 1, "max": 1},
    }  # the engine serves less than its manifest says
    backend = TrtBackend(small_engine, device="cpu", trt_module=fake_tensorrt(model, profiles))
    with pytest.raises(SpecrtError, match="TensorRT refused shape .* for input_ids in profile 0"):
        run(Generator(backend), PROMPTS[1:], spec=True)


def test_engine_with_foreign_io_is_refused(small_engine, model):
    with pytest.raises(
        ManifestMismatchError, match=r"does not have the step graph's I/O \(missing \['hidden_states'\]"
    ):
        fake_backend(small_engine, model, drop=("hidden_states",))


def test_engine_tensorrt_cannot_load(small_engine, model):
    with pytest.raises(ArtifactError, match="TensorRT could not load .*model.engine"):
        fake_backend(small_engine, model, loadable=False)


@pytest.mark.skipif(has_cuda, reason="checks the CPU-only refusal")
def test_real_runtime_without_a_gpu(small_engine, tiny_checkpoint):
    """With the installed TensorRT-RTX: on a machine without a GPU the engine is refused with a
    clear error, both when a GPU is asked for and when deserialization is tried anyway."""
    from specrt.runtime.backends import TrtBackend

    with pytest.raises(SpecrtError, match="needs an NVIDIA GPU, and torch sees none"):
        Generator.from_trt_engine(small_engine, tiny_checkpoint)
    with pytest.raises(ArtifactError, match="TensorRT could not load"):
        TrtBackend(small_engine, device="cpu")


def test_engine_from_a_stale_onnx_export_is_refused(small_engine, tiny_checkpoint, tmp_path):
    """Generator.from_trt_engine checks the engine against the ONNX export it was built from (when
    that is still on disk) before it looks for a GPU."""
    import json
    import shutil

    e = shutil.copytree(small_engine, tmp_path / "e")
    m = json.loads((e / "manifest.json").read_text())
    m["onnx"]["files"]["model.onnx"] = "sha256:" + "0" * 64  # built from an earlier export
    (e / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestMismatchError, match="built from another export of the ONNX step graph"):
        Generator.from_trt_engine(e, tiny_checkpoint)


def test_engine_gpu_checks():
    from specrt.engines.trt import check_engine_gpu

    rtx = {"flavour": "tensorrt-rtx", "compute_capabilities": ["library default"]}
    for ok in [(8, 6), (8, 9), (12, 0), (12, 1)]:
        check_engine_gpu(rtx, ok, "gpu")
    # Turing: supported, but only by engines that target it
    with pytest.raises(ManifestMismatchError, match=r"this GPU \(RTX 2080 Ti\) is SM75.*--compute-capability SM75"):
        check_engine_gpu(rtx, (7, 5), "RTX 2080 Ti")
    # A100 and Hopper (this project's lent GPU is an H200): not in TensorRT-RTX's support matrix at all,
    # targeted or not; the message names the backends that do run there
    for bad, name in [((9, 0), "NVIDIA H200"), ((8, 0), "NVIDIA A100")]:
        for targets in (["library default"], [f"SM{bad[0]}{bad[1]}"]):
            with pytest.raises(
                ManifestMismatchError,
                match=f"is SM{bad[0]}{bad[1]}, which TensorRT-RTX does not support.*--backend torch --device cuda",
            ):
                check_engine_gpu({**rtx, "compute_capabilities": targets}, bad, name)
    check_engine_gpu({**rtx, "compute_capabilities": ["SM75"]}, (7, 5), "RTX 2080 Ti")
    with pytest.raises(ManifestMismatchError, match="built by TensorRT-RTX for SM75"):
        check_engine_gpu({**rtx, "compute_capabilities": ["SM75"]}, (8, 9), "RTX 4090")
    full = {"flavour": "tensorrt", "build_gpu": {"name": "NVIDIA H200", "sm": "SM90"}}
    check_engine_gpu(full, (9, 0), "NVIDIA H100")
    with pytest.raises(
        ManifestMismatchError, match=r"built by TensorRT on NVIDIA H200 \(SM90\), but this GPU \(NVIDIA A100\) is SM80"
    ):
        check_engine_gpu(full, (8, 0), "NVIDIA A100")


# -- real engines on a GPU (skipped without one) ---------------------------------------------------

runnable_flavours = [
    f for f, mod in (("tensorrt", "tensorrt"), ("tensorrt-rtx", "tensorrt_rtx")) if importlib.util.find_spec(mod)
]


@pytest.fixture(scope="module")
def gpu_engine(tiny_artifacts, tmp_path_factory):
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine

    flavour = runnable_flavours[0]
    major, minor = torch.cuda.get_device_capability(0)
    if flavour == "tensorrt-rtx" and (major, minor) in ((8, 0), (9, 0)):
        # as the GPU check does: TensorRT-RTX builds nothing for data-center SM80 / SM90 GPUs
        pytest.skip(f"only tensorrt-rtx is installed, which does not run on SM{major}{minor}; install tensorrt")
    caps = () if flavour == "tensorrt" else ("CURRENT",)
    spec = TrtBuildSpec(
        flavour=flavour, shapes=EngineShapes(max_context=64, max_prefill=16, max_verify=5), compute_capabilities=caps
    )
    return build_trt_engine(
        tiny_artifacts / "onnx", tmp_path_factory.mktemp("gpu-engine") / flavour, spec, progress=False
    )


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda, reason="needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is False)")
@pytest.mark.skipif(not runnable_flavours, reason="needs tensorrt or tensorrt_rtx installed")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("spec", [False, True])
def test_real_engine_on_gpu_equals_reference(gpu_engine, model, graphs, spec):
    from specrt.runtime.backends import TrtBackend

    backend = TrtBackend(gpu_engine, device="cuda", cuda_graphs=graphs)
    gen, counts = Generator(backend), []
    for _ in range(2):  # the second round replays graphs captured in the first (pooled caches)
        for prompt in PROMPTS:
            assert run(gen, [prompt], spec) == run(Generator(TorchBackend(model), max_context=64), [prompt], spec)
        counts.append(backend.captures)
    assert backend.capture_failures == []
    if backend.cuda_graphs:  # our own capture (full TensorRT): in the first round only
        assert counts[0] > 0 and counts[1] == counts[0], counts
        assert backend._graphs and all(entry is not None for entry in backend._graphs.values())
    else:  # eager, or TensorRT-RTX's built-in graphs: nothing captured by us
        assert counts == [0, 0], counts
