"""A request's acceptance reported with its answer, with vLLM's per-request fields: the counts
against the decoder's own metrics on the tiny model, and the server's `metrics` object."""

import json

import pytest

from specrt.errors import SpecrtError
from specrt.runtime.acceptance_report import RequestAcceptance
from specrt.runtime.batching import BatchEngine
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.row import Request
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

COPYING = [5, 6, 7, 8, 9] * 6  # a prompt the suffix draft copies from


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


def test_the_counts_make_vllms_fields():
    """vLLM's documented example (k = 3, 43 steps: 39 accepted nothing, 1 one token, 3 all three)
    gives its documented figures; a step that verified nothing is left out."""
    report = RequestAcceptance(3, detailed=True)
    for accepted in [0] * 39 + [1] + [3] * 3:
        report.observe(3, accepted)
    report.observe(0, 0)
    got = report.to_dict()
    assert got["acceptance_histogram"] == [39, 1, 0, 3] and got["acceptance_histogram_by_draft_length"] == {
        "3": [39, 1, 0, 3]
    }
    assert (got["num_spec_steps"], got["num_draft_tokens"], got["num_accepted_draft_tokens"]) == (43, 129, 10)
    assert got["num_spec_tokens"] == 3 and got["mean_acceptance_length"] == pytest.approx(1.2325581395348837)
    assert got["draft_acceptance_rate"] == pytest.approx(0.07751937984496124)
    assert got["per_step_drafted"] == [3] * 43 and got["per_step_accepted"][-4:] == [1, 3, 3, 3]
    summary = RequestAcceptance(3)
    summary.observe(2, 1)
    assert "per_step_accepted" not in summary.to_dict()
    assert summary.to_dict()["acceptance_histogram"] == [0, 1, 0, 0]


def run(decoder, requests):
    return BatchEngine(decoder, max_batch=len(requests)).run(requests)


def test_a_request_that_asks_gets_its_own_counts(gen):
    """In a batch of three, the rows that ask get their acceptance with their result, equal to
    their own SpecMetrics (drafts and the floor's guesses together); the tokens are those of a
    request that does not ask; plain decoding reports none."""
    decoder = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy("auto"))
    prompts = [COPYING, [9, 8, 7, 6] * 5, COPYING[3:]]
    plain = run(decoder, [Request(p, 40) for p in prompts])
    levels = ["detailed", None, "summary"]
    asked = run(decoder, [Request(p, 40, acceptance=a) for p, a in zip(prompts, levels)])
    assert [r.token_ids for r in asked] == [r.token_ids for r in plain]
    assert asked[1].acceptance is None
    for r in (asked[0], asked[2]):
        got, m = r.acceptance, r.metrics
        assert got["num_draft_tokens"] == m.drafted_tokens + m.guessed_tokens > 0
        assert got["num_accepted_draft_tokens"] == m.accepted_tokens + m.guessed_accepted > 0
        assert got["num_spec_tokens"] == 16 and sum(got["acceptance_histogram"]) == got["num_spec_steps"] <= m.steps
    detail = asked[0].acceptance
    assert len(detail["per_step_drafted"]) == detail["num_spec_steps"]
    assert sum(detail["per_step_accepted"]) == detail["num_accepted_draft_tokens"]
    assert "per_step_drafted" not in asked[2].acceptance
    capped = run(decoder, [Request(COPYING, 20, max_draft=2, acceptance="summary")])[0].acceptance
    assert capped["num_spec_tokens"] == 2 and max(map(int, capped["acceptance_histogram_by_draft_length"])) <= 2
    assert run(gen.decoder, [Request(COPYING, 8, acceptance="summary")])[0].acceptance is None


def test_the_server_reports_it_as_vllm_does(gen):
    """`--per-request-spec-decode-metrics`: the response's `metrics.speculative_decoding` (on the
    usage chunk when streamed), null for n > 1; no `metrics` when it is off. (Each answer's
    counts are its own: the suffix draft also copies the server's earlier answers.)"""
    pytest.importorskip("fastapi", reason="fastapi is not installed (the server extra; make setup installs it)")
    pytest.importorskip("httpx", reason="httpx is not installed (the test extra)")
    from fastapi.testclient import TestClient

    from specrt.server import CompletionService, ServerLimits, create_app

    decoder = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4))

    def client(level):
        return TestClient(create_app(CompletionService(decoder, "tiny", ServerLimits(spec_decode_metrics=level))))

    body = {"model": "tiny", "prompt": "w5 w6 w7 w8 w9 " * 6, "max_tokens": 24, "temperature": 0}
    on = client("detailed")
    r = on.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["metrics"]["speculative_decoding"]
    assert got["num_spec_tokens"] == 4 and got["num_draft_tokens"] > 0 and "per_step_drafted" in got
    assert on.post("/v1/completions", json=body | {"n": 2}).json()["metrics"] == {"speculative_decoding": None}
    streamed = on.post("/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in streamed.text.split("\n") if e.startswith("data: {")]
    last = events[-1]["metrics"]["speculative_decoding"]
    assert events[-1]["usage"] and set(last) == set(got) and last["num_accepted_draft_tokens"] > 0
    assert "metrics" not in client("none").post("/v1/completions", json=body).json()
    with pytest.raises(SpecrtError, match="none, summary, detailed"):
        ServerLimits(spec_decode_metrics="full")
