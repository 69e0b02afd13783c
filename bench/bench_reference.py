"""A model's engines against transformers, and what the output head costs of a step.

    .venv/bin/python bench/bench_reference.py --artifacts artifacts/gemma-3-270m \
        --model models/gemma-3-270m [--engines none,gguf,gguf-a8] [--new-tokens 64]

  greedy    each engine's greedy tokens (up to EOS or --new-tokens) on the prompts of
            bench/prompts.jsonl (chat template applied) against transformers' `generate` on the
            same checkpoint (float32, eager attention; --no-chat: the prompts as text, BOS added as the
            tokenizer does): prompts identical, and where one is not,
            the first position that differs
  head      the engine's decode step (one token, the step floor's two positions, context 128)
            and its output head alone (the graph from the final norm's output to the logits,
            cut out of the same step graph with onnx's extractor), medians of --repeats runs
            each, interleaved: the head's share of a step

Table on stdout, JSON in bench/results/reference-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from specrt.benchmark import write_result_json
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from harness import bench_arguments, envelope


def reference_tokens(model_dir: Path, prompts: list[list[int]], new_tokens: int, eos: list[int]) -> list[list[int]]:
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            got = ref.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
            out.append(got[0, len(ids) :].tolist())
    return out


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    first = [
        None if x == y else next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        for x, y in zip(ours, theirs)
    ]
    return {"identical": sum(f is None for f in first), "prompts": len(first), "first_difference": first}


def head_graph(path: Path):
    """The step graph's nodes after the final norm's pick of positions (`head/in`, what the graph
    writer names it) up to the logits, as a graph of their own."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    start = next(i for i, n in enumerate(nodes) if "head/in" in n.output) + 1
    nodes = nodes[start:]
    read = {x for n in nodes for x in n.input}
    inits = [i for i in model.graph.initializer if i.name in read]
    x = helper.make_tensor_value_info("head/in", onnx.TensorProto.FLOAT, [1, None, None])
    y = next(o for o in model.graph.output if o.name == "logits")
    graph = helper.make_graph(nodes, "head", [x], [y], inits)
    return helper.make_model(graph, opset_imports=model.opset_import)


def head_share(layout: ArtifactLayout, scheme: str, gen: Generator, repeats: int) -> dict:
    """Median ms of a one-token decode step and of the output head alone on the same graph."""
    import onnx
    import onnxruntime as ort

    src = layout.source_onnx(scheme, "fused")
    with tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / "head.onnx"
        onnx.save(head_graph(src / "model.onnx"), str(head), save_as_external_data=True, location="head.data")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 0
        sess = ort.InferenceSession(str(head), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((1, 2, gen.session.config.hidden_size)).astype(np.float32)
        session = gen.session
        cache = session.new_cache(1, 512)
        session.prefill(cache, [list(range(3, 131))])
        step_ms, head_ms = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            session.forward(cache, [[7]])
            step_ms.append(1000 * (time.perf_counter() - t0))
            cache.rollback(cache.lengths - 1)
            t0 = time.perf_counter()
            sess.run(["logits"], {"head/in": x})
            head_ms.append(1000 * (time.perf_counter() - t0))
    step, head_only = statistics.median(step_ms), statistics.median(head_ms)
    return {"step_ms": round(step, 3), "head_ms": round(head_only, 3), "head_share": round(head_only / step, 3)}


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=True, model=True, prompts=True)
    ap.add_argument("--engines", default="none,gguf,gguf-a8", help="Schemes, comma-separated (none: float32).")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="Apply the chat template.")
    args = ap.parse_args()
    layout = ArtifactLayout(args.artifacts)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    schemes = args.engines.split(",")
    gens = {s: Generator.from_engine(layout.ort_engine("cpu", s)) for s in schemes}
    first = gens[schemes[0]]
    prompts = [first.encode_prompt(r["prompt"], chat=args.chat) for r in rows]
    eos = sorted(first.eos_ids)  # up to the model's end of text or turn, or --new-tokens
    theirs = reference_tokens(args.model, prompts, args.new_tokens, eos)
    result = {**envelope("onnxruntime", "transformers", "torch"), "model": str(args.model), "chat": args.chat}
    result["engines"] = {}
    print(f"{'engine':10} {'greedy = transformers':>22} {'step ms':>8} {'head ms':>8} {'head share':>10}")
    for s, gen in gens.items():
        ours = [r.token_ids for r in gen.generate_ids(prompts, args.new_tokens)]
        row = {"greedy": compare(ours, theirs), "head": head_share(layout, s, gen, args.repeats)}
        result["engines"][s] = row
        g, h = row["greedy"], row["head"]
        print(
            f"{s:10} {g['identical']:>12}/{g['prompts']} prompts {h['step_ms']:8.2f} {h['head_ms']:8.2f} "
            f"{h['head_share']:10.1%}"
        )
    print(f"wrote {write_result_json(result, args.out, 'reference')}")


if __name__ == "__main__":
    main()
