"""TensorRT runtime backend: a built engine (trt.py) as a step backend on an NVIDIA GPU.

    backend = TrtBackend("artifacts/SmolLM2-135M-Instruct/engines/trt-tensorrt", cuda_graphs=True)
    gen = Generator(backend, Tokenizer(checkpoint))      # or Generator.from_trt_engine(...)

- Refusal before anything runs: the manifest must match the engine file, the installed TensorRT
  (flavour and version) and the checkpoint (`read_trt_manifest`), and the GPU must be one the
  engine was built for (`check_engine_gpu`); an engine that TensorRT cannot deserialize, or whose
  I/O is not the step graph's, is refused too.
- One execution context per optimization profile (verify, prefill); each step takes the first
  profile that holds its (batch, Q, past) (`select_profile`), so decode and verification run on
  the verify profile and long prompt chunks on the prefill profile.
- I/O is bound to PyTorch CUDA tensors: the KV cache lives on the GPU (`cache_device`), each
  layer's full-capacity slice is bound as `past_key_values.i.*` without a copy, and the step is
  enqueued with `execute_async_v3` on the backend's own (non-default) stream.
- CUDA graphs: with full TensorRT each fixed-shape step (batch, Q, K, cache) is captured once with
  `torch.cuda.graph` around `execute_async_v3` (after one plain run, which flushes TensorRT's
  deferred shape updates) and replayed with its inputs copied into static buffers; a context that
  reports `is_stream_capturable() == False` runs without. TensorRT-RTX captures graphs itself
  (`IRuntimeConfig.cuda_graph_strategy = WHOLE_GRAPH_CAPTURE`), so there the flag turns that on.

tensorrt / tensorrt_rtx and torch are imported inside functions: `import specrt` works without them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from specrt.engines.trt import ENGINE_FILE, load_tensorrt, read_trt_manifest, select_profile
from specrt.errors import ArtifactError, ManifestMismatchError, SpecrtError
from specrt.export.config import ModelConfig
from specrt.runtime.backends import MAX_GRAPHS, StepOutput

STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "logits_index")
# TensorRT DataType member name -> torch dtype name
_TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32", "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}
# GPUs a TensorRT-RTX engine built without explicit compute capabilities runs on (its support matrix:
# Ampere 8.0/8.6, Ada 8.9, Blackwell 12.0 and later; Turing 7.5 only when targeted explicitly)
RTX_DEFAULT_SMS = (80, 86, 89)
RTX_DEFAULT_MIN_SM = 120


def sm_name(capability: tuple[int, int]) -> str:
    return f"SM{capability[0]}{capability[1]}"


def check_engine_gpu(manifest: dict, capability: tuple[int, int], gpu_name: str, engine_dir: str | Path = "engine") -> None:
    """Refuse an engine that was not built for this GPU (clear error instead of a TensorRT failure)."""
    sm = capability[0] * 10 + capability[1]
    here = f"this GPU ({gpu_name}) is {sm_name(capability)}"
    if manifest["flavour"] == "tensorrt":
        built = manifest.get("build_gpu")
        if built and built["sm"] != sm_name(capability):
            raise ManifestMismatchError(
                f"engine {engine_dir} was built by TensorRT on {built['name']} ({built['sm']}), but {here}; TensorRT engines "
                f"only run on the GPU architecture they were built on. Rebuild it on this machine: specrt build-engines --tensorrt tensorrt"
            )
        return
    targets = manifest.get("compute_capabilities") or ["library default"]
    if targets == ["library default"]:
        ok = sm in RTX_DEFAULT_SMS or sm >= RTX_DEFAULT_MIN_SM
        built_for = "SM80, SM86, SM89 and SM120+ (the TensorRT-RTX default)"
    else:
        ok = sm_name(capability) in targets
        built_for = ", ".join(targets)
    if not ok:
        raise ManifestMismatchError(
            f"engine {engine_dir} was built by TensorRT-RTX for {built_for}, but {here}. Rebuild it with "
            f"--compute-capability {sm_name(capability)} if TensorRT-RTX supports that GPU, or use full TensorRT "
            f"(--tensorrt tensorrt) or the PyTorch-CUDA backend (--backend torch --device cuda) on it."
        )


def engine_max_context(manifest: dict) -> int:
    """Longest context (prompt + output) the engine's profiles serve: the runtime binds the whole
    cache, which holds the context plus one verification step."""
    verify = manifest["profiles"][0]
    return int(verify["past_len"]["max"] - verify["q_len"]["max"])


def _dtype_name(trt_dtype) -> str:
    name = str(trt_dtype).split(".")[-1].upper()
    if name not in _TORCH_DTYPES:
        raise SpecrtError(f"TensorRT tensor type {trt_dtype} has no PyTorch equivalent here.")
    return _TORCH_DTYPES[name]


class TrtBackend:
    """A TensorRT / TensorRT-RTX engine as a step backend (see the module docstring)."""

    def __init__(self, engine_dir: str | Path, device: str = "cuda", cuda_graphs: bool = False, checkpoint_hash_expected: str | None = None,
                 onnx_files: dict | None = None, max_graph_q: int = 32, trt_module=None, verify: str = "auto"):
        import torch

        self.engine_dir = Path(engine_dir)
        self.manifest = m = read_trt_manifest(self.engine_dir, onnx_files, checkpoint_hash_expected, verify)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda:
            if not torch.cuda.is_available():
                raise SpecrtError(
                    f"running the TensorRT engine {self.engine_dir} needs an NVIDIA GPU, and torch sees none "
                    "(torch.cuda.is_available() is False). On this machine use the ONNX Runtime engine: --backend ort."
                )
            check_engine_gpu(m, torch.cuda.get_device_capability(self.device), torch.cuda.get_device_name(self.device), self.engine_dir)
        elif cuda_graphs:
            raise SpecrtError("CUDA graphs need a CUDA device: pass device='cuda' (or drop cuda_graphs).")
        trt = trt_module if trt_module is not None else load_tensorrt(m["flavour"])[1]
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine((self.engine_dir / ENGINE_FILE).read_bytes())
        if engine is None:
            raise ArtifactError(
                f"TensorRT could not load {self.engine_dir / ENGINE_FILE} (its reason is in the log above): it needs an NVIDIA GPU "
                f"with a driver new enough for {m['flavour']} {m['tensorrt_version']}; otherwise the file is damaged. "
                "Rebuild it with: specrt build-engines --tensorrt " + m["flavour"]
            )
        self._engine = engine
        self.config = ModelConfig.from_dict(m["config"])
        self._io_dtypes = self._check_io(engine)
        self.max_context = engine_max_context(m)
        self.max_step_q = max(p["q_len"]["max"] for p in m["profiles"])
        self.cache_device = str(self.device)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._handle = self._stream.cuda_stream if cuda else 0
        rtx_graphs = cuda_graphs and m["flavour"] == "tensorrt-rtx"
        self._contexts = []
        for i in range(engine.num_optimization_profiles):
            if rtx_graphs:
                rc = engine.create_runtime_config()
                rc.cuda_graph_strategy = trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
                ctx = engine.create_execution_context(rc)
            else:
                ctx = engine.create_execution_context()
            if ctx is None:
                raise SpecrtError(f"TensorRT could not create an execution context for profile {i} of {self.engine_dir} (out of GPU memory?).")
            if i:
                ctx.set_optimization_profile_async(i, self._handle)
            self._contexts.append(ctx)
        self.cuda_graphs = cuda_graphs and not rtx_graphs  # our own capture (full TensorRT)
        self.max_graph_q = max_graph_q
        self._graphs: dict = {}  # (cache address, capacity, profile, B, Q, K) -> (graph, static inputs, outputs) or None
        self.reuse_cache = cuda_graphs  # pooled caches, so graphs (ours or TensorRT-RTX's) outlive one generation
        self.max_cache = int(m["profiles"][0]["past_len"]["max"])  # pooled caches must still fit the profiles
        graphs = ", CUDA graphs (TensorRT-RTX built-in)" if rtx_graphs else ", CUDA graphs" if cuda_graphs else ""
        self.description = f"{m['flavour']} {m['tensorrt_version']} ({self.device}{graphs})"

    def _check_io(self, engine) -> dict[str, str]:
        """{tensor name: torch dtype name}; refuses an engine whose I/O is not the step graph's."""
        c = self.config
        past = [f"past_key_values.{i}.{kv}" for i in range(c.num_hidden_layers) for kv in ("key", "value")]
        present = [f"present.{i}.{kv}" for i in range(c.num_hidden_layers) for kv in ("key", "value")]
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        expected = {*STEP_INPUTS, *past, "logits", "hidden_states", *present}
        if set(names) != expected:
            missing, extra = sorted(expected - set(names)), sorted(set(names) - expected)
            raise ManifestMismatchError(
                f"engine {self.engine_dir} does not have the step graph's I/O (missing {missing[:4]}, unexpected {extra[:4]}); "
                "rebuild it from a current export: specrt build-engines --force"
            )
        dtypes = {n: _dtype_name(engine.get_tensor_dtype(n)) for n in names}
        kv = {dtypes[n] for n in past + present}
        if kv != {"float32"}:
            raise SpecrtError(f"engine {self.engine_dir} keeps its KV cache in {sorted(kv)}; this runtime's cache is float32.")
        return dtypes

    # -- one step -------------------------------------------------------------------------------

    def step(self, input_ids, position_ids, attention_mask, logits_index, cache):
        import torch

        B, Q = input_ids.shape
        profile = select_profile(self.manifest, B, Q, cache.capacity)
        arrays = dict(zip(STEP_INPUTS, (input_ids, position_ids, attention_mask, logits_index)))
        caller = torch.cuda.current_stream(self.device) if self._stream is not None else None  # where the cache is appended to
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream:
            if caller is not None:
                self._stream.wait_stream(caller)  # the cache's last appends come first
            if self.cuda_graphs and Q <= self.max_graph_q:
                out = self._replay(profile, arrays, cache)
            else:
                out = self._run(profile, self._inputs(arrays), cache)
            logits = out["logits"].float().cpu().numpy()  # waits for the step on this stream
            hidden = out["hidden_states"].float().cpu().numpy()
        if caller is not None:
            caller.wait_stream(self._stream)  # the caller's appends of `present` wait for the step
        L = self.config.num_hidden_layers
        present = [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(L)]
        return StepOutput(logits, hidden, present)

    def _inputs(self, arrays: dict) -> dict:
        import torch

        return {n: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, getattr(torch, self._io_dtypes[n])) for n, a in arrays.items()}

    def _bind(self, profile: int, inputs: dict, cache) -> dict:
        """Set the input shapes and every tensor address on the profile's context; returns the outputs."""
        import torch

        ctx = self._contexts[profile]
        bound = dict(inputs)
        for i in range(cache.num_layers):
            bound[f"past_key_values.{i}.key"], bound[f"past_key_values.{i}.value"] = cache.past(i)
        for name, t in bound.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise SpecrtError(f"TensorRT refused shape {tuple(t.shape)} for {name} in profile {profile} of {self.engine_dir}; its manifest does not describe the engine, rebuild it.")
            ctx.set_tensor_address(name, t.data_ptr())
        out = {}
        for name, dtype in self._io_dtypes.items():
            if name in bound:
                continue
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise SpecrtError(f"TensorRT could not infer the shape of {name} ({shape}) for this step; check the engine's profiles.")
            out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            ctx.set_tensor_address(name, out[name].data_ptr())
        return out

    def _execute(self, profile: int) -> None:
        if not self._contexts[profile].execute_async_v3(self._handle):
            raise SpecrtError(f"TensorRT failed to run a step of {self.engine_dir} (its reason is in the log above).")

    def _run(self, profile: int, inputs: dict, cache) -> dict:
        out = self._bind(profile, inputs, cache)
        self._execute(profile)
        return out

    def _replay(self, profile: int, arrays: dict, cache) -> dict:
        """Run the step through a CUDA graph captured for this (profile, batch, Q, K) and cache."""
        import torch

        # a graph is bound to the cache buffers' address and shape; pooled caches (reuse_cache) keep both
        key = (cache.keys.data_ptr(), cache.capacity, profile, *arrays["input_ids"].shape, arrays["logits_index"].shape[1])
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.clear()
            static_in = self._inputs(arrays)
            out = self._run(profile, static_in, cache)  # plain run first: flushes deferred shape updates
            if hasattr(self._contexts[profile], "is_stream_capturable") and not self._contexts[profile].is_stream_capturable(self._handle):
                self._graphs[key] = None
                return out
            self._graphs[key] = (self._capture(profile), static_in, out)
            return out
        entry = self._graphs[key]
        if entry is None:  # this context cannot be captured: run it plainly
            return self._run(profile, self._inputs(arrays), cache)
        replay, static_in, out = entry
        for name, a in arrays.items():
            static_in[name].copy_(torch.from_numpy(np.ascontiguousarray(a)), non_blocking=False)
        replay()
        return out

    def _capture(self, profile: int):
        """Capture the profile's context, as bound now, as a CUDA graph; returns its replay. The one
        seam the CPU tests replace with an emulation."""
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            self._execute(profile)
        return graph.replay

