"""A graph's weight products, each run alone on ONNX Runtime as a graph of that one node.

How a product's kernel treats a row alone against the same row beside others, or what it
computes at another accuracy level, is a fact of the kernel on the CPU at hand rather than of
the step graph around it. The tests ask it (can a one-position step be exact here?) and so does
bench/bench_row_kernels.py (how far is each kernel from the float64 product?), one product at a
time.
"""

from __future__ import annotations

from collections.abc import Iterator

# the weight products: a float weight's, a weight of packed 4- or 8-bit blocks' (with their scales)
PRODUCTS = ("MatMul", "MatMulNBits")


def weight_products(model, ops: tuple[str, ...] = PRODUCTS) -> Iterator[tuple]:
    """(node, its weight initializers, K, N) for each product of `model` (an onnx ModelProto)
    whose every other input is an initializer: a MatMul of a 2-D float weight, a MatMulNBits of
    its packed blocks."""
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        weights = [inits.get(name) for name in node.input[1:] if name]
        if node.op_type not in ops or not weights or None in weights:
            continue
        if node.op_type == "MatMul":
            if len(weights[0].dims) != 2:
                continue
            K, N = weights[0].dims
        else:
            attrs = {a.name: a.i for a in node.attribute}
            K, N = attrs["K"], attrs["N"]
        yield node, weights, K, N


def one_node_session(node, weights: list, K: int, N: int, accuracy_level: int | None = None):
    """An ORT CPU session of `node` alone: input `x` (rows x K), output `y` (rows x N); for a
    MatMulNBits, `accuracy_level` replaces the node's own where given."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    one = helper.make_node(node.op_type, ["x", *node.input[1:]], ["y"], domain=node.domain)
    if accuracy_level is None:
        one.attribute.extend(node.attribute)
    else:
        one.attribute.extend(a for a in node.attribute if a.name != "accuracy_level")
        one.attribute.append(helper.make_attribute("accuracy_level", accuracy_level))
    graph = helper.make_graph(
        [one],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        weights,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
