"""Prefix caching (runtime/prefix_cache.py): requests that share a prefix get the answers they
get without the cache, with the shared blocks copied rather than prefilled, under continuous
batching and speculation; the pool never holds more than its bound; the server counts hits."""

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.prefix_cache import BLOCK, PrefixCache
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

from self_draft import SelfDraftProposer

SHARED = [5 + (i * 7) % 50 for i in range(100)]  # a 100-token "system prompt"
PROMPTS = [SHARED + [60, 61, 62], SHARED + [70, 71], SHARED + [60, 61, 62, 63, 64], [9, 10, 11] + SHARED[:40]]


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


class Counting:
    """Counts the prompt positions the engine prefills (one-row forward calls of the prefill)."""

    def __init__(self, session):
        self.session, self.prefilled = session, 0
        self._forward = session.forward

    def __enter__(self):
        def forward(cache, feed, *a, last_only=False, **kw):
            if last_only:
                self.prefilled += sum(len(f) for f in feed)
            return self._forward(cache, feed, *a, last_only=last_only, **kw)

        self.session.forward = forward
        return self

    def __exit__(self, *exc):
        del self.session.forward


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("max_batch", [1, 3])
def test_shared_prefixes_give_the_same_answers_and_are_not_prefilled_again(ort_gen, speculative, max_batch):
    runner = SpeculativeDecoder(ort_gen, make_proposer("suffix"), make_policy(4)) if speculative else ort_gen
    requests = [Request(p, 24) for p in PROMPTS]
    without = BatchEngine(runner, max_batch=max_batch).run(requests, arrivals=[0, 3, 6, 9])
    pool = PrefixCache(64 << 20)
    with Counting(ort_gen.session) as counted:
        got = BatchEngine(runner, max_batch=max_batch, prefix_cache=pool).run(requests, arrivals=[0, 3, 6, 9])
    assert [r.token_ids for r in got] == [r.token_ids for r in without]
    # the first prompt is prefilled whole; the next two reuse its 96 shared tokens (3 blocks),
    # the last starts elsewhere and reuses nothing
    shared = (len(SHARED) // BLOCK) * BLOCK
    assert pool.hit == 2 * shared
    assert counted.prefilled == sum(map(len, PROMPTS)) - 2 * shared
    assert pool.looked_up == sum(map(len, PROMPTS))


def test_the_next_turn_of_a_chat_reuses_the_answer(ort_gen):
    """A finished request leaves its prompt and its answer in the pool: the next turn, which
    starts with both, prefills only what is new."""
    pool = PrefixCache(64 << 20)
    engine = BatchEngine(ort_gen, max_batch=2, prefix_cache=pool)
    first = engine.run([Request(SHARED, 40)])[0]
    turn = SHARED + first.token_ids[:-1] + [80, 81, 82]  # the answer's last token was never fed
    with Counting(ort_gen.session) as counted:
        again = engine.run([Request(turn, 8)])[0]
    cached = ((len(SHARED) + len(first.token_ids) - 1) // BLOCK) * BLOCK
    assert counted.prefilled == len(turn) - min(cached, ((len(turn) - 1) // BLOCK) * BLOCK)
    assert again.token_ids == BatchEngine(ort_gen, max_batch=1).run([Request(turn, 8)])[0].token_ids


def test_eviction_keeps_the_pool_under_its_bound(ort_gen):
    probe = PrefixCache(1 << 30)
    BatchEngine(ort_gen, max_batch=1, prefix_cache=probe).run([Request(SHARED, 2)])
    block = probe.bytes // len(probe.blocks)
    pool = PrefixCache(5 * block)  # room for five blocks
    engine = BatchEngine(ort_gen, max_batch=2, prefix_cache=pool)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 120, size=int(rng.integers(40, 140)))] for _ in range(8)]
    for p in prompts:
        alone = BatchEngine(ort_gen, max_batch=1).run([Request(p, 6)])[0].token_ids
        assert engine.run([Request(p, 6)])[0].token_ids == alone
        assert pool.bytes <= pool.max_bytes and len(pool.blocks) <= 5
        assert pool.bytes == sum(b.nbytes for b in pool.blocks.values())
        for key, b in pool.blocks.items():  # every kept block's parent is kept (a reachable chain)
            assert b.parent is None or b.parent in pool.blocks
            assert b.children == sum(c.parent == key for c in pool.blocks.values())
    assert pool.evicted > 0
    # the last prompt's blocks are reachable: it is served from the pool again
    hit = pool.hit
    engine.run([Request(prompts[-1], 2)])
    assert pool.hit > hit


def test_a_zero_bound_keeps_nothing_and_features_turn_it_off(ort_gen):
    pool = PrefixCache(0)
    BatchEngine(ort_gen, max_batch=1, prefix_cache=pool).run([Request(SHARED, 2), Request(SHARED, 2)])
    assert pool.hit == 0 and not pool.blocks

    # a draft that reads the target's features needs every prompt position's: refused by name
    # (it was dropped without a word), and the server starts without one and says so
    spec = SpeculativeDecoder(ort_gen, SelfDraftProposer(ort_gen.backend, check_features=True), make_policy(2))
    with pytest.raises(SpecrtError, match="a prefix cache cannot serve draft 'self': it reads the target's features"):
        BatchEngine(spec, max_batch=1, prefix_cache=PrefixCache(1 << 20))
    pytest.importorskip("fastapi", reason="the server needs fastapi")
    from specrt.server import CompletionService, ServerLimits

    service = CompletionService(spec, "tiny", ServerLimits(prefix_cache_mb=16))
    assert service.engine.prefix is None and "prefix cache off: draft 'self'" in service.notes[0]


def test_the_server_counts_prefix_hits(ort_gen):
    pytest.importorskip("fastapi", reason="the server needs fastapi")
    from fastapi.testclient import TestClient

    from specrt.server import CompletionService, ServerLimits, create_app

    service = CompletionService(ort_gen, "tiny", ServerLimits(prefix_cache_mb=16))
    c = TestClient(create_app(service))
    prompt = " ".join(f"w{t}" for t in SHARED)
    answers = [
        c.post("/v1/completions", json={"prompt": prompt + s, "max_tokens": 4, "temperature": 0}) for s in ("", " w9")
    ]
    assert all(a.status_code == 200 for a in answers), answers[0].text
    text = c.get("/metrics").text
    metric = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("specrt_prefix_cache")
    }
    assert metric["specrt_prefix_cache_hit_tokens_total"] == 96
    assert metric["specrt_prefix_cache_lookup_tokens_total"] == 2 * len(SHARED) + 1
    assert 0 < metric["specrt_prefix_cache_bytes"] <= 16 << 20
    off = CompletionService(ort_gen, "tiny", ServerLimits(prefix_cache_mb=0))
    assert off.engine.prefix is None and "prefix_cache" not in TestClient(create_app(off)).get("/metrics").text
