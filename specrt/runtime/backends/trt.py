"""TensorRT runtime backend: a built engine (engines/trt.py) as a step backend on an NVIDIA GPU.

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
  enqueued with `execute_async_v3` on the backend's own (non-default) stream. TensorRT requires
  256-byte aligned addresses: cache capacities are multiples of CACHE_ALIGN positions
  (`cache_align`; the engines' largest past is one too), so every layer's and row's slice is
  aligned, and a refused binding (TensorRT says so only by a False return) raises with the reason.
- CUDA graphs: with full TensorRT each fixed-shape step (batch, Q, K, cache) is captured once with
  `torch.cuda.graph` around `execute_async_v3` (after one plain run, which flushes TensorRT's
  deferred shape updates) and replayed with its inputs copied into static buffers. Every step of
  a profile rebinds that profile's one context, and TensorRT promises nothing for a graph whose
  context was bound otherwise since its capture, so before a replay the context gets the graph's
  captured binding (shapes and addresses) back, unless it still has it. That binding is kept
  as names, shapes and addresses, not tensors, so a graph holds no reference to the cache it was
  captured on (a dropped cache's memory is freed, not kept until graphs are cleared). A shape
  whose capture fails runs without a graph (`capture_failures` says which, why).
  TensorRT-RTX captures graphs itself (`IRuntimeConfig.cuda_graph_strategy =
  WHOLE_GRAPH_CAPTURE`), so there the flag turns that on.
- Inputs reach the GPU by asynchronous copies from pinned staging memory (`runtime/transfer.py`),
  so a step makes the host wait once, for its tokens or logits.

tensorrt / tensorrt_rtx and torch are imported inside functions: `import specrt` works without them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from specrt.engines.profiles import CACHE_ALIGN
from specrt.engines.trt import (
    ENGINE_FILE,
    check_engine_gpu,
    engine_max_context,
    load_tensorrt,
    read_trt_manifest,
    select_profile,
)
from specrt.errors import ArtifactError, ManifestMismatchError, SpecrtError
from specrt.runtime.backends.base import (
    MAX_GRAPHS,
    Capabilities,
    StepBackend,
    StepOutput,
    cache_key,
    device_logits,
    gather_rows,
    graphable,
)
from specrt.runtime.transfer import copy_into, to_device
from specrt.schema.config import ModelConfig
from specrt.schema.step_io import HIDDEN, LOGITS, STEP_INPUTS, StepIO

# TensorRT DataType member name -> torch dtype name
_TORCH_DTYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT64": "int64",
    "INT32": "int32",
    "BOOL": "bool",
    "INT8": "int8",
    "UINT8": "uint8",
}


def _dtype_name(trt_dtype) -> str:
    name = str(trt_dtype).split(".")[-1].upper()
    if name not in _TORCH_DTYPES:
        raise SpecrtError(f"TensorRT tensor type {trt_dtype} has no PyTorch equivalent here.")
    return _TORCH_DTYPES[name]


class TrtBackend(StepBackend):
    """A TensorRT / TensorRT-RTX engine as a step backend (see the module docstring)."""

    def __init__(
        self,
        engine_dir: str | Path,
        device: str = "cuda",
        cuda_graphs: bool = False,
        checkpoint_hash_expected: str | None = None,
        onnx_files: dict | None = None,
        max_graph_q: int = 32,
        trt_module=None,
        verify: str = "auto",
    ):
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
            check_engine_gpu(
                m,
                torch.cuda.get_device_capability(self.device),
                torch.cuda.get_device_name(self.device),
                self.engine_dir,
            )
        elif cuda_graphs:
            raise SpecrtError("CUDA graphs need a CUDA device: pass device='cuda' (or drop cuda_graphs).")
        trt = trt_module if trt_module is not None else load_tensorrt(m["flavour"])[1]
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine((self.engine_dir / ENGINE_FILE).read_bytes())
        if engine is None:
            raise ArtifactError(
                f"TensorRT could not load {self.engine_dir / ENGINE_FILE} (its reason is in the log above): it needs "
                "an NVIDIA GPU "
                f"with a driver new enough for {m['flavour']} {m['tensorrt_version']}; otherwise the file is damaged. "
                "Rebuild it with: specrt build-engines --tensorrt " + m["flavour"]
            )
        self._engine = engine
        self.config = ModelConfig.from_dict(m["config"])
        self._io_dtypes = self._check_io(engine)
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
                raise SpecrtError(
                    f"TensorRT could not create an execution context for profile {i} of {self.engine_dir} (out of "
                    "GPU memory?)."
                )
            if i:
                ctx.set_optimization_profile_async(i, self._handle)
            self._contexts.append(ctx)
        self.cuda_graphs = cuda_graphs and not rtx_graphs  # our own capture (full TensorRT)
        self.max_graph_q = max_graph_q
        # (cache_key, profile, B, Q, K) -> (graph, static inputs, outputs, binding), or None
        self._graphs: dict = {}
        self.capture_failures: list[str] = []  # shapes whose capture failed (they run without graphs)
        self.captures = 0  # graphs captured so far (a recapture counts again: the GPU check reads it)
        self._applied: dict[int, dict | None] = {}  # per profile: the graph binding its context holds now
        self._input_names = set(StepIO(self.config.num_hidden_layers).input_names)
        self.caps = Capabilities(
            max_context=engine_max_context(m),
            max_step=max(p["q_len"]["max"] for p in m["profiles"]),
            max_verify=int(m["profiles"][0]["q_len"]["max"]),  # the verify profile: root + draft nodes
            max_cache=int(m["profiles"][0]["past_len"]["max"]),  # pooled caches must still fit the profiles
            max_batch=min(int(p["batch"]["max"]) for p in m["profiles"]),
            cache_device=str(self.device),
            reuse_cache=cuda_graphs,  # pooled caches, so graphs (ours or TensorRT-RTX's) outlive one generation
            cache_align=CACHE_ALIGN,  # every layer's and row's slice bound at a 256-byte aligned address
            hidden_layers=tuple(m["hidden_layers"]),
            checkpoint_hash=m["checkpoint"]["hash"],
            vocab_size=self.config.vocab_size,
        )
        graphs = ", CUDA graphs (TensorRT-RTX built-in)" if rtx_graphs else ", CUDA graphs" if cuda_graphs else ""
        self.description = f"{m['flavour']} {m['tensorrt_version']} ({self.device}{graphs})"

    def _check_io(self, engine) -> dict[str, str]:
        """{tensor name: torch dtype name}; refuses an engine whose I/O is not the step graph's."""
        io = StepIO(self.config.num_hidden_layers)
        past, present = io.past_names, io.present_names
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        expected = {*io.input_names, *io.output_names}
        if set(names) != expected:
            missing, extra = sorted(expected - set(names)), sorted(set(names) - expected)
            raise ManifestMismatchError(
                f"engine {self.engine_dir} does not have the step graph's I/O (missing {missing[:4]}, unexpected "
                f"{extra[:4]}); "
                "rebuild it from a current export: specrt build-engines --force"
            )
        dtypes = {n: _dtype_name(engine.get_tensor_dtype(n)) for n in names}
        kv = {dtypes[n] for n in past + present}
        if kv != {"float32"}:
            raise SpecrtError(
                f"engine {self.engine_dir} keeps its KV cache in {sorted(kv)}; this runtime's cache is float32."
            )
        return dtypes

    # -- one step -------------------------------------------------------------------------------

    def step(self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index=None, want_logits=True):
        import torch

        B, Q = input_ids.shape
        profile = select_profile(self.manifest, B, Q, cache.capacity)
        arrays = dict(zip(STEP_INPUTS, (input_ids, position_ids, attention_mask, logits_index)))
        caller = (
            torch.cuda.current_stream(self.device) if self._stream is not None else None
        )  # where the cache is appended to
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream:
            if caller is not None:
                self._stream.wait_stream(caller)  # the cache's last appends come first
            if graphable(self.cuda_graphs, Q, arrays[STEP_INPUTS[3]].shape[1], self.max_graph_q):
                out = self._replay(profile, arrays, cache)
            else:
                out = self._run(profile, self._inputs(arrays), cache)
            logits, top1 = device_logits(out[LOGITS], want_logits)  # waits for the step on this stream
            hidden = None if hidden_index is None else gather_rows(out[HIDDEN], hidden_index).float().cpu().numpy()
        if caller is not None:
            caller.wait_stream(self._stream)  # the caller's appends of `present` wait for the step
        io = StepIO(self.config.num_hidden_layers)
        present = [tuple(out[n] for n in io.present(i)) for i in range(self.config.num_hidden_layers)]
        return StepOutput(logits, hidden, present, top1=top1)

    def _inputs(self, arrays: dict) -> dict:
        import torch

        return {n: to_device(a, self.device, getattr(torch, self._io_dtypes[n])) for n, a in arrays.items()}

    def _bind(self, profile: int, inputs: dict, cache) -> dict:
        """Set the input shapes and every tensor address on the profile's context; returns the outputs."""
        import torch

        ctx = self._contexts[profile]
        self._applied[profile] = None  # bound anew: no captured graph's binding any more
        bound = self._with_cache(inputs, cache)
        self._apply(profile, _binding(bound))
        out = {}
        for name, dtype in self._io_dtypes.items():
            if name in bound:
                continue
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise SpecrtError(
                    f"TensorRT could not infer the shape of {name} ({shape}) for this step; check the engine's "
                    "profiles."
                )
            out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._address(ctx, name, shape, out[name].data_ptr())
        return out

    @staticmethod
    def _with_cache(inputs: dict, cache) -> dict:
        """The step's inputs with the cache's per-layer slices (bound in place)."""
        bound, io = dict(inputs), StepIO(cache.num_layers)
        for i in range(cache.num_layers):
            bound.update(zip(io.past(i), cache.past(i)))
        return bound

    def _apply(self, profile: int, binding: dict) -> None:
        """Bind on the profile's context {name: (shape, address)}: the shape of each input, the
        address of each tensor."""
        ctx = self._contexts[profile]
        for name, (shape, address) in binding.items():
            if name in self._input_names:
                self._shape(ctx, profile, name, shape)
            self._address(ctx, name, shape, address)

    def _shape(self, ctx, profile: int, name: str, shape: tuple) -> None:
        if not ctx.set_input_shape(name, shape):
            raise SpecrtError(
                f"TensorRT refused shape {shape} for {name} in profile {profile} of {self.engine_dir}; "
                "its manifest does not describe the engine, rebuild it."
            )

    def _address(self, ctx, name: str, shape: tuple, address: int) -> None:
        """Bind a tensor's address; TensorRT refuses an address that is not 256-byte aligned (and
        says so only through the return value)."""
        if not ctx.set_tensor_address(name, address):
            misaligned = address % 256
            why = (
                f"its address is {misaligned} bytes past a 256-byte boundary (a KV cache whose capacity is not a "
                f"multiple of {CACHE_ALIGN} positions: make caches through StepSession.new_cache, which rounds them)"
                if misaligned
                else "see the TensorRT log above"
            )
            raise SpecrtError(f"TensorRT refused the address of {name} ({shape}): {why}")

    def _execute(self, profile: int) -> None:
        if not self._contexts[profile].execute_async_v3(self._handle):
            raise SpecrtError(f"TensorRT failed to run a step of {self.engine_dir} (its reason is in the log above).")

    def _run(self, profile: int, inputs: dict, cache) -> dict:
        out = self._bind(profile, inputs, cache)
        self._execute(profile)
        return out

    def _replay(self, profile: int, arrays: dict, cache) -> dict:
        """Run the step through a CUDA graph captured for this (profile, batch, Q, K) and cache."""
        # a graph is bound to the cache buffers' address and shape; pooled caches (reuse_cache) keep both
        ids, _, _, index = STEP_INPUTS
        key = (*cache_key(cache), profile, *arrays[ids].shape, arrays[index].shape[1])
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.clear()
                self._applied.clear()
            static_in = self._inputs(arrays)
            out = self._run(profile, static_in, cache)  # plain run first: flushes deferred shape updates
            try:
                replay = self._capture(profile)
                self.captures += 1
                # what the graph baked in: every tensor bound when it was captured, as shapes and
                # addresses (no tensors: the entry must not keep the cache alive)
                self._graphs[key] = (replay, static_in, out, _binding(dict(self._with_cache(static_in, cache), **out)))
            except Exception as e:  # noqa: BLE001 - any capture failure is recoverable: run without graphs
                self._graphs[key] = None
                self.capture_failures.append(f"profile {profile}, batch {arrays[ids].shape[0]}, Q "
                                             f"{arrays[ids].shape[1]}: {type(e).__name__}: {e}")  # fmt: skip
                self._sync()  # the capture's stream must be idle before the next plain run
            return out
        entry = self._graphs[key]
        if entry is None:  # this context cannot be captured: run it plainly
            return self._run(profile, self._inputs(arrays), cache)
        replay, static_in, out, snapshot = entry
        for name, a in arrays.items():
            copy_into(static_in[name], a)  # asynchronous (pinned staging)
        self._rebind(profile, snapshot)
        replay()
        return out

    def _rebind(self, profile: int, snapshot: dict) -> None:
        """Before a graph replays, its context gets back the exact binding it was captured with
        (TensorRT promises nothing for a graph whose context was since bound to other shapes or
        addresses, as it is after any other step of that profile); skipped when it still has it."""
        if self._applied.get(profile) is not snapshot:
            self._apply(profile, snapshot)
            self._applied[profile] = snapshot

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _capture(self, profile: int):
        """Capture the profile's context, as bound now, as a CUDA graph; returns its replay. The one
        seam the CPU tests replace with an emulation."""
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            self._execute(profile)
        return graph.replay


def _binding(tensors: dict) -> dict:
    """{name: (shape, address)} of bound tensors: what a context needs, holding no tensor."""
    return {name: (tuple(t.shape), t.data_ptr()) for name, t in tensors.items()}
