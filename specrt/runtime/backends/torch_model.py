"""Our PyTorch model as a step backend: the reference on CPU, and the PyTorch-CUDA path."""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError
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
from specrt.runtime.backends.row_blocks import row_block_mode
from specrt.runtime.transfer import to_device
from specrt.schema.step_io import STEP_ROOM, in_place


class TorchBackend(StepBackend):
    """Our PyTorch model as a step backend.

    device="cpu" (default) is the reference: the KV cache stays in numpy and is shared without a
    copy. On another device (cuda) the cache is allocated there (`cache_device`), inputs go over
    once per step and only logits and hidden states come back. With cuda_graphs=True every
    fixed-shape step (batch, Q <= max_graph_q, cache buffers) is captured once as a CUDA graph, into
    one memory pool shared by all graphs, and replayed with its inputs copied into static buffers;
    prefill chunks run eagerly (`graphable`). The generator
    then pools its caches (`reuse_cache`), so a shape is captured once, not once per generation.

    A step writes its new positions into the cache's buffers in place and attends over the
    buffers alone (LlamaModel.forward's `slots`; caches get STEP_ROOM slots of slack for a
    step's padding), as the fused ONNX graph does: every position's attention sums over the same
    slots in the same order whatever the step's shape. On the CPU every product runs in blocks
    of a fixed row count (row_blocks.py), so no step shape changes a row's kernel either.
    """

    def __init__(
        self,
        model,
        device: str = "cpu",
        cuda_graphs: bool = False,
        max_graph_q: int = 32,
        checkpoint_hash: str | None = None,
        in_place: bool = True,
    ):
        """in_place=False: the traced form (new keys appended after the past, `present`
        returned), what the ONNX export traces; the export's tests compare the two with it."""
        import torch

        if cuda_graphs and not str(device).startswith("cuda"):
            raise SpecrtError("CUDA graphs need a CUDA device: pass device='cuda' (or drop cuda_graphs).")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise SpecrtError(
                "device 'cuda' asked for, but torch sees no CUDA GPU (torch.cuda.is_available() is False)."
            )
        self.device = torch.device(device)
        self.model = model.eval().to(self.device)
        self.config = model.cfg
        self.cuda_graphs, self.max_graph_q = cuda_graphs, max_graph_q
        self.in_place = in_place
        self._graphs: dict = {}  # (cache_key, (B, Q), (B, K)) -> (graph, static inputs, static outputs)
        self._pool = None  # the memory pool every graph is captured into (one, shared)
        self._stream = None  # the side stream graphs are captured on
        self.captures = 0  # graphs captured so far (a recapture counts again: the GPU check reads it)
        # a graph is bound to its cache: pooled caches (reuse_cache) let graphs outlive one generation
        self.caps = Capabilities(
            cache_device=None if self.device.type == "cpu" else str(self.device),
            reuse_cache=cuda_graphs,
            cache_slack=STEP_ROOM if in_place else 0,
            max_verify=STEP_ROOM if in_place else None,
            hidden_layers=tuple(model.hidden_layers),
            checkpoint_hash=checkpoint_hash,
            vocab_size=self.config.vocab_size,
        )
        kind = (
            "reference, cpu" if self.device.type == "cpu" else f"{self.device}{', CUDA graphs' if cuda_graphs else ''}"
        )
        self.description = f"torch {torch.__version__} ({kind})"

    def _past(self, cache):
        import torch

        if cache.device is None:
            return [tuple(torch.from_numpy(t) for t in cache.past(i)) for i in range(cache.num_layers)]
        return [cache.past(i) for i in range(cache.num_layers)]

    def _forward(self, ids, pos, mask, index, slots, past):
        if self.device.type == "cpu" and self.in_place:  # the reference: bitwise by construction
            with row_block_mode():
                return self._run(ids, pos, mask, index, slots, past)
        return self._run(ids, pos, mask, index, slots, past)

    def _run(self, ids, pos, mask, index, slots, past):
        if not self.in_place:
            logits, hidden, present = self.model(ids, pos, mask, past, index)
            return [logits, hidden, *[t for kv in present for t in kv]]
        logits, hidden, _ = self.model(ids, pos, mask, past, index, slots=slots)
        return [logits, hidden]

    def device_inputs(self, input_ids, position_ids, attention_mask, logits_index, cache) -> list:
        """A step's inputs (StepSession.step_inputs) on the device: ids, positions, the mask over
        the cache's buffers, the logits index and the slots the new positions go to."""
        if not self.in_place:
            arrays = (input_ids, position_ids, attention_mask, logits_index, np.zeros((1, 1), np.int64))
            return [to_device(a, self.device) for a in arrays]
        Q, width = input_ids.shape[1], cache.keys.shape[3]
        if int(cache.lengths.max()) + Q > width:
            raise ValueError(
                f"a step of {Q} positions does not fit the cache's buffers ({width} slots) after "
                f"{int(cache.lengths.max())} committed positions; give the cache room for it (Capabilities.cache_slack)"
            )
        mask, slots = in_place(cache.lengths, attention_mask)
        arrays = (input_ids, position_ids, mask, logits_index, np.ascontiguousarray(slots))
        return [to_device(a, self.device) for a in arrays]  # asynchronous copies (pinned staging)

    def step(self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index=None, want_logits=True):
        import torch

        inputs = self.device_inputs(input_ids, position_ids, attention_mask, logits_index, cache)
        with torch.inference_mode():
            logits, hidden, *flat = self.enqueue(inputs, cache)
        present = list(zip(flat[0::2], flat[1::2])) if flat else None  # the traced form's new keys
        hidden = None if hidden_index is None else gather_rows(hidden, hidden_index).float().cpu().numpy()
        if cache.device is None:  # the reference: host tensors, nothing to save
            host = None if present is None else [(k.numpy(), v.numpy()) for k, v in present]
            return StepOutput(logits.float().numpy(), hidden, host)
        logits, top1 = device_logits(logits, want_logits)
        return StepOutput(logits, hidden, present, top1=top1)

    def enqueue(self, inputs, cache) -> list:
        """The step on inputs already on the device (`device_inputs`), through its CUDA graph
        where it has one, else eagerly: the new keys and values are written into the cache and
        the output tensors (logits, hidden) returned without reading anything back to the host,
        so on a GPU the work is only enqueued (the GPU check times steps back to back this way)."""
        if graphable(self.cuda_graphs, inputs[0].shape[1], inputs[3].shape[1], self.max_graph_q):
            return self._replay(inputs, cache)
        return self._forward(*inputs, self._past(cache))

    def _replay(self, inputs, cache):
        """Run the step through a CUDA graph captured for this (batch, Q, cache)."""
        # a graph is bound to the cache buffers' address and shape; pooled caches (reuse_cache) keep both
        # every buffer the graph reads or writes is in the key: both cache tensors, not the keys alone
        key = (*cache_key(cache), tuple(inputs[0].shape), tuple(inputs[3].shape))
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.clear()
                self._pool = None  # the old pool goes with its graphs
            static_in = [t.clone() for t in inputs]
            past = self._past(cache)
            replay, static_out = self._capture(lambda: self._forward(*static_in, past))
            self.captures += 1
            self._graphs[key] = (replay, static_in, static_out)
        replay, static_in, static_out = self._graphs[key]
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        replay()
        return static_out

    def _capture(self, fn):
        """Capture `fn` (which reads and writes only fixed buffers) as a CUDA graph; returns
        (replay, the outputs it writes). The one seam the CPU tests replace with an emulation."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture, as torch.cuda.graphs requires
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # every graph in one memory pool (captured on one stream, as sharing asks): their
        # temporaries overlap, which is safe because graphs replay one at a time and a step's
        # outputs are read (logits to the host, keys and values into the cache) before the next
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = fn()
        return graph.replay, out
