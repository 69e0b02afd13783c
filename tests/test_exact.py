"""Exact by construction: with the step floor (every step computes at least two positions per
row, runtime/session.py), a position's logits are the same bits whatever step computes them:
one token at a time, a verification step of any size, a split step, a batch beside other rows, a
prefix-cache hit, a cache of another capacity. Checked with np.array_equal on every scheme of
ORT's fused graph (float32, the GGUF's blocks with float32 and with int8 activations, the
weight-only int8-a8 and int4-a8) and on PyTorch (in-place attention, products in blocks of a
fixed row count); the traced graph (portable ORT) is exact up to near-ties and says so. End to end: a request's
greedy tokens and log probabilities are bitwise the same alone, beside others, with any draft and
from a prefix-cache hit. Without the floor the one-position steps fall into the other numeric
class: the test of that must see a difference, so the rule is what makes the equality."""

import contextlib
import json

import numpy as np
import pytest

from specrt.engines.build import BuildSpec, build_all
from specrt.engines.ort_measure import floor_of
from specrt.export.checkpoint import load_model
from specrt.layout import ArtifactLayout
from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.prefix_cache import PrefixCache
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from conftest import random_model, save_checkpoint, tiny_hf_config
from self_draft import SelfDraftProposer
from test_gguf_blocks import TYPES
from tiny_gguf import write_gguf

PREFIX, STEPS = 12, 17


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(checkpoint, artifacts) of a tiny GGUF's conversion with its float32, gguf and gguf-a8
    engines (fused graphs)."""
    d = tmp_path_factory.mktemp("exact")
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=21), hf, d / "tiny.gguf", TYPES)
    ckpt = save_checkpoint(load_model(d / "tiny.gguf"), hf, d / "ckpt")
    for scheme in ("gguf", "gguf-a8", "int8-a8", "int4-a8"):
        list(
            build_all(BuildSpec(checkpoint=ckpt, out=d / "art", quantize=scheme, gguf=d / "tiny.gguf", tensorrt="off"))
        )
    return ckpt, d / "art"


ENGINES = ["float32", "gguf", "gguf-a8", "int8-a8", "int4-a8"]  # ORT's fused graphs


def open_target(name, built, tiny_portable_artifacts, exact="bitwise"):
    ckpt, art = built
    if name == "torch":
        return Generator.from_checkpoint(ckpt, exact=exact)
    if name == "portable":
        return Generator.from_engine(ArtifactLayout(tiny_portable_artifacts).ort_engine("cpu"), exact=exact)
    scheme = "none" if name == "float32" else name
    return Generator.from_engine(ArtifactLayout(art).ort_engine("cpu", scheme), exact=exact)


def ids(seed=0, n=PREFIX + STEPS):
    return np.random.default_rng(seed).integers(3, 128, n).tolist()


def step_logits(gen, splits, capacity=64, beside=None):
    """The logits of ids()[PREFIX:] computed in steps of `splits` positions after the prefix (a
    list: each step's size), the row alone or beside another row stepping 3 tokens at a time
    (`beside` an int: that many)."""
    s = gen.session
    mine, other = ids(), ids(1)
    cache = s.new_cache(2 if beside else 1, capacity)
    s.forward(cache, [mine[:PREFIX], other[:PREFIX]] if beside else [mine[:PREFIX]])
    out, at = [], PREFIX
    for k, n in enumerate(splits):
        m = 3 if beside is True else beside
        rows = [mine[at : at + n]] + ([other[PREFIX + m * k : PREFIX + m * (k + 1)]] if beside else [])
        out.append(s.forward(cache, rows).logits[0, :n])
        at += n
    return np.concatenate(out)


@pytest.mark.parametrize("name", [*ENGINES, "torch"])
def test_every_step_shape_gives_the_same_bits(name, built, tiny_portable_artifacts):
    gen = open_target(name, built, tiny_portable_artifacts)
    # the session keeps the floor its engine's build measured it needs: the fused graphs pad a
    # one-position step's attention themselves, and where their products give a row the same
    # bits alone (float32 and the int8-activation schemes on the CPUs measured) they need none;
    # gguf's level-0 4-bit products compute one row in another order, and PyTorch keeps its own
    measured = gen.backend.caps.batch_invariance
    assert gen.session.floor == (2 if name == "torch" else floor_of(measured))
    assert name != "gguf" or gen.session.floor == 2
    multi = step_logits(gen, [STEPS])
    assert np.array_equal(step_logits(gen, [1] * STEPS), multi)  # plain decoding
    assert np.array_equal(step_logits(gen, [8, 9]), multi)  # a split verification
    assert np.array_equal(step_logits(gen, [1] * 5, beside=True), multi[:5])  # continuous batching
    assert np.array_equal(step_logits(gen, [1] * 5, beside=1), multi[:5])  # two rows decoding
    assert np.array_equal(step_logits(gen, [STEPS], capacity=256), multi)  # another capacity


def test_the_traced_graph_is_exact_up_to_near_ties_and_says_so(built, tiny_portable_artifacts):
    """The traced graph (portable ORT) attends over the whole past buffer and the new positions
    (capacity + Q keys), so a step's length changes the reduction and its rounding: no step
    shape is bitwise another. Its build measures that, and the session says near-ties with the
    bound."""
    gen = open_target("portable", built, tiny_portable_artifacts)
    assert not np.array_equal(step_logits(gen, [1] * STEPS), step_logits(gen, [STEPS]))
    measured = gen.backend.caps.batch_invariance
    assert not any(measured["bitwise"].values()) and 0 < measured["relative"] < 1e-5
    assert 0 < measured["padded_relative"] < 1e-5
    assert gen.session.exactness() == {
        "exact": "near-ties",
        "bound": measured["padded_relative"],
        "floor": 2,
        "bitwise": measured["bitwise"],
    }


@pytest.mark.parametrize("pad", [True, False])
def test_the_attention_pad_is_what_makes_one_position_steps_exact(pad, monkeypatch):
    """ORT's attention computes a one-row query in another order than two or more rows: the
    fused graph gives it a copy of the position after (export/fused_graph.py ATTENTION_ROWS).
    Without that pad a one-position step differs from the multi-position step's row, and the
    build's measurement says so (the engine then keeps the step floor)."""
    import onnxruntime as ort

    from specrt.engines.ort_measure import batch_invariance
    from specrt.export import fused_graph

    monkeypatch.setattr(fused_graph, "ATTENTION_ROWS", 2 if pad else 1)
    hf = tiny_hf_config()
    model = random_model(hf, seed=3)
    graph = fused_graph.build_fused_graph(model)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    measured = batch_invariance(session, model.cfg.to_dict(), "fused")
    assert measured["bitwise"]["padded"] and measured["bitwise"]["split"]
    # the float products must keep a row's bits alone too (they did on the CPUs measured); where
    # a CPU's do not, the engine keeps the floor, and the test says so rather than failing
    exact = pad and one_row_products_agree(graph)
    assert measured["bitwise"]["unpadded"] is exact and (measured["relative"] == 0) is exact
    assert floor_of(measured) == (1 if exact else 2)


def one_row_products_agree(graph) -> bool:
    """Whether ORT gives row 0 of each weight product of `graph` (a MatMul of a 2-D float
    initializer, a MatMulNBits of its packed blocks) the same bits alone as beside a second row:
    each product run on its own, as a graph of that one node. On an Intel Xeon every product of
    the fused graphs but the level-0 4-bit ones did; on an AMD EPYC the 4-bit products with int8
    activations do not either."""
    from specrt.engines.ort_products import one_node_session, weight_products

    for node, weights, K, N in weight_products(graph):
        s = one_node_session(node, weights, K, N)
        x = np.random.default_rng(0).standard_normal((2, K)).astype(np.float32)
        if not np.array_equal(s.run(None, {"x": x[:1]})[0][0], s.run(None, {"x": x})[0][0]):
            return False
    return True


def test_pytorch_is_bitwise_by_its_row_blocks_not_by_a_step_rule(built, monkeypatch):
    """The PyTorch backend writes a step's keys in place and attends over the cache's slots alone
    (no step shape changes a reduction), and on the CPU runs every product in blocks of a fixed
    row count (row_blocks.py): every step shape is bitwise, even one-token steps without the
    floor. Without the blocks the CPU library picks its kernel by the product's row count, and
    one-token steps compute in another class (on every CPU measured: AMD EPYC, Intel Xeon)."""
    from specrt.runtime.backends import torch_model
    from specrt.runtime.step_shapes import measure

    gen = Generator.from_checkpoint(built[0])
    assert (gen.session.floor, gen.session.multiple) == (2, 1)
    got = measure(gen.backend, rules=((1, 1),))
    assert all(got["bitwise"].values()) and got["relative"] == 0 == got["padded_relative"]
    assert all(got["rules"]["floor 1, multiple 1"]["bitwise"].values())
    assert gen.session.exactness() == {"exact": "unmeasured", "floor": 2}  # measured here, not at load

    monkeypatch.setattr(torch_model, "row_block_mode", contextlib.nullcontext)
    assert 0 < measure(gen.backend)["relative"] < 1e-5  # one token per step, unpadded: the other class


def test_a_rows_product_does_not_depend_on_its_place_in_the_block():
    """What the row blocks rest on, checked on the machine that runs the suite: in a product of
    a fixed shape, a row gets the same bits wherever it sits and whatever rows are beside it."""
    import torch

    from specrt.runtime.backends.row_blocks import ROWS, row_block_mode

    torch.manual_seed(0)
    for k, n in [(64, 128), (576, 1536), (1536, 576), (640, 2048)]:
        weight, x = torch.randn(n, k), torch.randn(k)
        with row_block_mode():
            alone = torch.nn.functional.linear(x[None], weight)[0]
            for m in (2, ROWS - 1, ROWS, 3 * ROWS + 5):
                rows = torch.randn(m, k)
                rows[m // 2] = x
                assert torch.equal(torch.nn.functional.linear(rows, weight)[m // 2], alone)
                folded = torch.matmul(rows.expand(3, m, k), weight.T)  # one product of 3m rows
                batched = torch.matmul(rows.expand(3, m, k), weight.T.expand(3, k, n))  # three
                assert torch.equal(folded[1, m // 2], alone) and torch.equal(batched[2, m // 2], alone)


def test_an_unknown_exactness_setting_is_refused_by_name(built, tiny_portable_artifacts):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="exact must be one of bitwise, near-ties, got 'loose'"):
        open_target("float32", built, tiny_portable_artifacts, exact="loose")


def answers(runner, prompts, max_batch=1, arrivals=None, prefix=None, budget=24):
    """Each request's tokens and log probabilities (3 alternatives: the values are the logits'
    bits, through a log-softmax) run through the batching engine."""
    engine = BatchEngine(runner, max_batch=max_batch, prefill_budget=5, prefix_cache=prefix)
    arrivals = arrivals or [0] * len(prompts)
    got: dict[int, list] = {}
    order, step = {}, 0
    while len(order) < len(prompts) or not engine.idle:
        for i, p in enumerate(prompts):
            if arrivals[i] == step:
                order[engine.submit(Request(p, budget, logprobs=3))] = i
        for e in engine.step():
            got.setdefault(order[e.rid], []).extend(e.logprobs)
        step += 1
    return [got[i] for i in range(len(prompts))]


def spec(gen, draft, n="auto"):
    return SpeculativeDecoder(gen, make_proposer(draft), make_policy(n))


@pytest.mark.parametrize("name", ["gguf-a8", "float32"])
def test_a_requests_tokens_and_logprobs_never_depend_on_what_else_runs(name, built, tiny_portable_artifacts):
    gen = open_target(name, built, tiny_portable_artifacts)
    gen.eos_ids = frozenset()
    base = ids(3, 40)
    prompts = [base[:30], base[5:35] * 2, ids(4, 9)]  # the second repeats itself: copy drafts fire
    alone = [answers(gen, [p])[0] for p in prompts]
    assert answers(gen, prompts, max_batch=3, arrivals=[0, 2, 5]) == alone  # continuous batching
    for draft in ("ngram", "suffix", "lookahead", "auto"):
        assert answers(spec(gen, draft), prompts, max_batch=2, arrivals=[0, 1, 3]) == alone, draft
    assert answers(spec(gen, "suffix", 4), prompts[1:2]) == alone[1:2]  # a fixed N
    # a draft with weights (the target drafting for itself): chains and EAGLE-2 dynamic trees
    for tree in (None, (2, 3)):
        runner = SpeculativeDecoder(gen, SelfDraftProposer(gen.backend, tree=tree), make_policy(3))
        assert answers(runner, prompts, max_batch=2, arrivals=[0, 1, 3]) == alone, tree
    # a prefix-cache hit: the first request's blocks serve the second's prompt
    pool = PrefixCache(64 << 20)
    shared, longer = ids(6, 45), ids(6, 45)[:33] + ids(7, 8)  # one block of 32 in common
    first, second = answers(gen, [shared, longer], arrivals=[0, 40], prefix=pool)
    assert pool.hit == 32 and second == answers(gen, [longer])[0] and first == answers(gen, [shared])[0]


def test_plain_decoding_guesses_for_free_and_equals_itself(built, tiny_portable_artifacts):
    """Under a step floor (PyTorch's), plain decoding's floor position carries a one-token copy
    (SpeculativeDecoder.guess): a right guess is a token more from the same step; the tokens
    are those of near-ties decoding, one position per step, wherever that backend computes the
    same argmax."""
    gen = open_target("torch", built, tiny_portable_artifacts)
    gen.eos_ids = frozenset()
    rep = ids(5, 10) * 4
    steps = []
    original = gen.backend.step

    def counted(input_ids, *args, **kw):
        steps.append(input_ids.shape)
        return original(input_ids, *args, **kw)

    gen.backend.step = counted
    out = gen.generate_ids([rep], 30)[0]
    assert all(q >= 2 for _, q in steps)  # no step of one position
    decode_steps = len(steps) - 1  # the prefill's one
    assert decode_steps < len(out.token_ids) - 1  # guesses were accepted: fewer steps than tokens
    loose = open_target("torch", built, tiny_portable_artifacts, exact="near-ties")
    loose.eos_ids = frozenset()
    assert loose.generate_ids([rep], 30)[0].token_ids == out.token_ids


def test_the_manifest_records_the_bitwise_check_and_inspect_shows_it(built):
    import onnx

    from specrt.inspection import inspect_artifact

    _, art = built
    layout = ArtifactLayout(art)
    for scheme in ("none", "gguf", "gguf-a8", "int8-a8", "int4-a8"):
        engine = layout.ort_engine("cpu", scheme)
        m = json.loads((engine / "manifest.json").read_text())
        shapes = dict.fromkeys(("padded", "split", "batch", "capacity", "unpadded", "unpadded_batch"), True)
        # a one-position step is the longer step's bits where every product gives a lone row its
        # bits beside others (the attention is padded): the level-0 4-bit products (gguf) never
        # did; the int8-activation 4-bit ones did on an Intel Xeon, not on an AMD EPYC
        source = layout.source_onnx(scheme, "fused")
        alone = one_row_products_agree(onnx.load(str(source / "model.onnx")))
        assert scheme != "gguf" or not alone
        assert m["batch_invariance"]["bitwise"] == shapes | {"unpadded": alone}, scheme
        text = "\n".join(inspect_artifact(engine).lines)
        assert "every step shape gives the same bits" in text
    q = json.loads((ArtifactLayout(art).source_onnx("gguf-a8", "fused") / "manifest.json").read_text())
    assert q["quantization"]["accuracy_level"] == 4 and q["quantization"]["scheme"] == "gguf-a8"
    m = json.loads((ArtifactLayout(art).ort_engine("cpu", "gguf-a8") / "manifest.json").read_text())
    assert m["precision"] == "gguf-a8"  # its own model: int8 activations
    graph = onnx.load(str(ArtifactLayout(art).source_onnx("gguf-a8", "fused") / "model.onnx"), load_external_data=False)
    levels = {
        a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"
    }
    assert levels == {4}
    bits = [a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
    assert bits.count(8) == 3  # each Q8_0 weight (o twice, the head) one 8-bit product, not two 4-bit ones
    # the weight-only schemes are quantized from the float32 fused graph: a fused graph of their own
    w = json.loads((ArtifactLayout(art).fused_onnx("int8-a8") / "manifest.json").read_text())
    assert w["graph_flavour"] == "fused" and w["quantization"]["scheme"] == "int8-a8"
    assert w["quantization"]["accuracy_level"] == 4 and w["source_onnx"]["path"].endswith("onnx-fused")


def tree_logits(gen, order: str):
    """Logits of the chain [a, b, c] after the prefix, verified as a chain or as a tree whose node
    b sits after a sibling x (`order` "chain", "sibling first", "chain first")."""
    from specrt.runtime.verification import DraftTree

    s, mine = gen.session, ids()
    a, b, c, x = mine[PREFIX : PREFIX + 4]
    cache = s.new_cache(1, 64)
    s.forward(cache, [mine[:PREFIX]])
    if order == "chain":
        return s.forward(cache, [[a, b, c]]).logits[0]
    tree = DraftTree(np.array([x, b, c]), np.array([-1, -1, 1]))  # b and x children of the root
    if order == "chain first":
        tree = DraftTree(np.array([b, c, x]), np.array([-1, 0, -1]))
    depths = np.concatenate([[0], tree.depths()])
    out = s.forward(cache, [[a, *tree.tokens.tolist()]], [(depths, tree.ancestor_mask())]).logits[0]
    return out[[0, 2, 3]] if order == "sibling first" else out[:3]


# int8-a8 and int4-a8 are left out: on the tiny model their int8 activations round the sibling's
# difference away (equal bits by chance there, not by construction)
@pytest.mark.parametrize("name", ["float32", "gguf", "gguf-a8"])
def test_only_the_leading_chain_of_a_tree_is_plain_decodings_bits(name, built, tiny_portable_artifacts):
    """A node whose ancestors are not the slots right before it sees a masked sibling among its
    keys, and the attention's reduction rounds differently: greedy verdicts are cut where the
    path leaves the leading chain (verification.on_leading_chain)."""
    gen = open_target(name, built, tiny_portable_artifacts)
    chain = tree_logits(gen, "chain")
    assert np.array_equal(tree_logits(gen, "chain first"), chain)
    assert not np.array_equal(tree_logits(gen, "sibling first")[1:], chain[1:])
