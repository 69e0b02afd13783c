"""The OpenAI-compatible server, through FastAPI's test client, on the tiny model's ORT engine.

Outputs are checked against the generator itself (greedy: the same tokens; streaming: the same
text as the non-streamed answer); every refusal is checked for its status and OpenAI error body.
"""

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed (the server extra; make setup installs it)")
pytest.importorskip("httpx", reason="httpx is not installed (the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from specrt.runtime.drafts import make_proposer  # noqa: E402
from specrt.runtime.generator import Generator  # noqa: E402
from specrt.runtime.sampling import SamplingParams  # noqa: E402
from specrt.runtime.speculative import SpeculativeDecoder, make_policy  # noqa: E402
from specrt.server import CompletionService, ServerLimits, create_app  # noqa: E402

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w5 w6 w7 w5 w6 w7 w5"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


def client(runner, **limits):
    return TestClient(create_app(CompletionService(runner, "tiny", ServerLimits(**limits))))


def expected_chat(gen, n):
    tok = gen.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    r = gen.generate_ids([ids], n, SamplingParams())[0]
    return ids, r


def sse(response) -> list:
    events = [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("speculative", [False, True])
def test_chat_completion_equals_the_generator(gen, speculative):
    runner = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)) if speculative else gen
    c = client(runner)
    r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids, ref = expected_chat(gen, 24)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": gen.decode(ref.token_ids)}
    assert body["choices"][0]["finish_reason"] == ref.finish_reason
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(ref.token_ids),
        "total_tokens": len(ids) + len(ref.token_ids),
    }
    assert (
        body["specrt"]["backend"].startswith("onnxruntime")
        and ("mean_accepted_length" in body["specrt"]) == speculative
    )


def test_a_request_sets_its_own_speculation(gen):
    """`speculation`: a request runs with no draft, or caps the draft tokens a step verifies,
    beside others on the server's settings; every answer is the greedy text, the `specrt` object
    echoes the settings, and one that cannot be honoured is a 400 naming its key."""
    c = client(SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)))
    _, ref = expected_chat(gen, 24)
    base = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    for spec, echo in [
        (None, {"draft": "suffix", "num_draft": 4}),
        ({"draft": "none"}, {"draft": "none", "num_draft": 0}),
        ({"num_draft": 1}, {"draft": "suffix", "num_draft": 1}),
        ({"draft": "suffix", "num_draft": 0}, {"draft": "none", "num_draft": 0}),
    ]:
        body = c.post("/v1/chat/completions", json=base | ({"speculation": spec} if spec else {})).json()
        assert body["choices"][0]["message"]["content"] == gen.decode(ref.token_ids)
        assert body["specrt"]["speculation"] == echo
        if echo["num_draft"] == 0:  # nothing drafted: every step brought one token
            assert body["specrt"]["mean_accepted_length"] == 1.0
    drafted = c.post("/v1/chat/completions", json=base).json()["specrt"]["mean_accepted_length"]
    assert drafted > 1.0  # the prompt repeats: the server's own setting drafts and is accepted
    for spec, param, message in [
        ({"draft": "ngram"}, "speculation.draft", "this server drafts with 'suffix'; give 'suffix' or 'none'"),
        ({"num_draft": 5}, "speculation.num_draft", "an integer in [0, 4], got 5"),
        ({"num_draft": True}, "speculation.num_draft", "got true"),
    ]:
        r = c.post("/v1/chat/completions", json=base | {"speculation": spec})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert message in r.json()["error"]["message"]


def engine_logprobs(gen, ids, n, top):
    """The runtime's own TokenLogprobs of a greedy answer (checked against transformers in
    tests/test_batching.py): per token (logprob, the alternatives' logprobs)."""
    from specrt.runtime.batching import BatchEngine, Request

    engine = BatchEngine(gen, max_batch=1)
    engine.submit(Request(ids, n, logprobs=top))
    got = []
    while not engine.idle:
        got += [lp for ev in engine.step() for lp in ev.logprobs or []]
    return [(g.logprob, [x for _, x in g.top]) for g in got]


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_chat_and_completions_streamed_or_not(gen, speculative):
    """logprobs / top_logprobs: every token of the answer with the target's log probability and
    its alternatives (those of a plain run of the engine, under speculation too), in OpenAI's
    chat and completions shapes; the streamed chunks carry the same entries as the whole answer."""
    runner = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)) if speculative else gen
    c = client(runner)
    ids, ref = expected_chat(gen, 24)
    want = engine_logprobs(gen, ids, 24, 2)
    req = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    body = c.post("/v1/chat/completions", json=req).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx([lp for lp, _ in want], abs=1e-4)
    assert [[a["logprob"] for a in e["top_logprobs"]] for e in content] == [
        pytest.approx(top, abs=1e-4) for _, top in want
    ]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    chunks = sse(c.post("/v1/chat/completions", json=req | {"stream": True}))
    streamed = [
        e
        for ch in chunks
        if ch["choices"] and ch["choices"][0]["logprobs"]
        for e in ch["choices"][0]["logprobs"]["content"]
    ]
    # the same tokens; the values to float32's noise (the suffix draft learnt from the first
    # answer, so the second verifies other positions together)
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    plain = c.post("/v1/chat/completions", json=req | {"logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None
    text = c.post(
        "/v1/completions", json={"prompt": "w5 w6 w7 w5 w6", "max_tokens": 12, "temperature": 0, "logprobs": 1}
    )
    lp = text.json()["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == text.json()["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(
        len(top) == 1 and max(top.values()) >= x - 1e-9 for top, x in zip(lp["top_logprobs"], lp["token_logprobs"])
    )


def choice_entries(body_or_chunks, n: int, stream: bool) -> tuple[list[list[dict]], list[str], list[str], dict]:
    """Per choice: its logprobs entries, its text and its finish reason; and the usage."""
    entries, texts, finishes = [[] for _ in range(n)], [""] * n, [""] * n
    if not stream:
        for ch in body_or_chunks["choices"]:
            entries[ch["index"]] = ch["logprobs"]["content"]
            texts[ch["index"]], finishes[ch["index"]] = ch["message"]["content"], ch["finish_reason"]
        return entries, texts, finishes, body_or_chunks["usage"]
    for chunk in body_or_chunks[:-1]:
        for ch in chunk["choices"]:
            i = ch["index"]
            entries[i] += (ch["logprobs"] or {}).get("content", [])
            texts[i] += ch["delta"].get("content", "")
            finishes[i] = ch["finish_reason"] or finishes[i]
    return entries, texts, finishes, body_or_chunks[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", [None, " w7"])
def test_every_counted_token_has_its_logprob(tiny_artifacts, stop, stream):
    """n = 1..4 with logprobs: the usage's completion tokens are the entries the choices report,
    the end-of-sequence token an answer ends on included (its entry adds no text, as in vLLM);
    a stop sequence ends the tokens and the entries at the one that completed it, also where a
    speculative step emitted more."""
    ends = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    ends.eos_ids = frozenset(range(2, 128, 9))  # one token in nine ends an answer: most end within 12 tokens
    c = client(SpeculativeDecoder(ends, make_proposer("suffix"), make_policy(4)))
    ended, stopped = 0, 0
    for n in (1, 2, 3, 4):
        req = {"messages": MESSAGES, "max_tokens": 12, "temperature": 1, "seed": 42, "n": n, "logprobs": True}
        req |= {"top_logprobs": 2, "stop": stop}
        if stream:
            req |= {"stream": True, "stream_options": {"include_usage": True}}
        r = c.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        entries, texts, finishes, usage = choice_entries(sse(r) if stream else r.json(), n, stream)
        assert usage["completion_tokens"] == sum(len(e) for e in entries)
        for e, text, finish in zip(entries, texts, finishes):
            joined = "".join(x["token"] for x in e)
            if stop is not None and stop in joined:  # the last entry completed the stop sequence
                assert finish == "stop" and joined.startswith(text) and stop not in "".join(x["token"] for x in e[:-1])
                stopped += 1
                continue
            assert joined == text
            if finish == "stop":  # its last token is the end of sequence
                assert e[-1]["token"] == "" and e[-1]["bytes"] == [] and e[-1]["logprob"] <= 0
                ended += 1
    assert ended > 0 and (stop is None or stopped > 0)  # both endings were met


@pytest.mark.parametrize("speculative", [False, True])
def test_n_answers_are_rows_with_their_own_seeds(gen, speculative):
    """n = 3: three choices generated as rows of the batch; seeded, the answer is reproducible,
    choice 0 is the request's answer with n = 1 and the choices differ from each other (each its
    own random stream); greedy, all three are the greedy answer; streamed, each index gets the
    text of the whole answer's choice and its own finish; usage counts every choice."""

    def fresh():  # a new server: the suffix draft learns from earlier answers, and what it drafts
        # decides how many random numbers a sampled step draws (the distribution is the same)
        return client(SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(3)) if speculative else gen)

    req = {"messages": MESSAGES, "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 3}
    first, again = (fresh().post("/v1/chat/completions", json=req).json() for _ in range(2))
    texts = [ch["message"]["content"] for ch in first["choices"]]
    assert [ch["index"] for ch in first["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    assert texts == [ch["message"]["content"] for ch in again["choices"]]
    one = fresh().post("/v1/chat/completions", json=req | {"n": 1}).json()
    assert one["choices"][0]["message"]["content"] == texts[0]
    assert one["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]  # the prompt counts once
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = sse(fresh().post("/v1/chat/completions", json=req | opts))
    streamed = ["", "", ""]
    finishes = {}
    for ch in chunks:
        for choice in ch["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert streamed == texts and sorted(finishes) == [0, 1, 2]
    assert chunks[-1]["usage"] == first["usage"]
    greedy = fresh().post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "n": 3}
    )
    _, ref = expected_chat(gen, 16)
    assert [ch["message"]["content"] for ch in greedy.json()["choices"]] == [gen.decode(ref.token_ids)] * 3


def test_streaming_gives_the_same_text(gen):
    c = client(gen)
    req = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = c.post("/v1/chat/completions", json=req).json()
    r = c.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert (
        len([ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")]) > 1
    )  # really streamed


def test_text_completion_and_stop_sequence(gen):
    c = client(gen)
    ids = gen.tokenizer.encode("w5 w6 w7")
    ref = gen.decode(gen.generate_ids([ids], 30)[0].token_ids)
    r = c.post("/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 30, "temperature": 0}).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == ref
    words = ref.split()
    stop = " ".join(words[3:5])  # two words in the middle of the answer
    cut = ref[: ref.index(stop)]
    for stream in (False, True):
        req = {"prompt": "w5 w6 w7", "max_tokens": 30, "temperature": 0, "stop": [stop, "never"], "stream": stream}
        r = c.post("/v1/completions", json=req)
        if stream:
            chunks = sse(r)
            assert (
                "".join(ch["choices"][0]["text"] for ch in chunks) == cut
                and chunks[-1]["choices"][0]["finish_reason"] == "stop"
            )
        else:
            assert r.json()["choices"][0] == {"index": 0, "text": cut, "finish_reason": "stop", "logprobs": None}
    for stream in (False, True):  # echo: the prompt, then the completion
        req = {"prompt": "w5 w6 w7", "max_tokens": 30, "temperature": 0, "echo": True, "stream": stream}
        r = c.post("/v1/completions", json=req)
        text = "".join(ch["choices"][0]["text"] for ch in sse(r)) if stream else r.json()["choices"][0]["text"]
        assert text == "w5 w6 w7" + ref


def test_sampling_is_seeded(gen):
    c = client(gen)
    req = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a, b = (c.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"] for _ in range(2))
    assert a == b


def test_models_health_metrics(gen):
    c = client(gen)
    assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert c.get("/health").json()["status"] == "ok"
    c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 3})
    m = c.get("/stats").json()
    assert m["requests"] == 1 and m["completion_tokens"] >= 1


def prometheus(c) -> dict:
    """{(sample name, labels as a sorted tuple): value} of GET /metrics, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


@pytest.mark.parametrize("speculative", [False, True])
def test_prometheus_metrics(gen, speculative):
    """Requests, tokens, time to first token and inter-token latency (one observation per output
    token after the first), and for a speculative server its draft method's counters."""
    # Lookahead drafts every step (its Jacobi window), so the draft counters move whatever the text
    runner = SpeculativeDecoder(gen, make_proposer("lookahead"), make_policy(3)) if speculative else gen
    c = client(runner)
    before = prometheus(c)
    assert before[("specrt_requests_total", (("outcome", "ok"),))] == 0
    assert before[("specrt_queue_depth", ())] == 0 and before[("specrt_batch_size", ())] == 0
    tokens = 0
    for prompt in ("w5 w6 w7 w5 w6 w7 w5 w6", "w9 w10"):
        body = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12}).json()
        tokens += body["usage"]["completion_tokens"]
    m = prometheus(c)
    assert m[("specrt_requests_total", (("outcome", "ok"),))] == 2
    assert m[("specrt_completion_tokens_total", ())] == tokens
    assert m[("specrt_time_to_first_token_seconds_count", ())] == 2
    assert m[("specrt_inter_token_latency_seconds_count", ())] == tokens - 2
    assert (
        0 < m[("specrt_inter_token_latency_seconds_sum", ())] < m[("specrt_time_to_first_token_seconds_sum", ())] * 50
    )
    drafted = m.get(("specrt_draft_tokens_total", (("method", "lookahead"),)))
    if speculative:
        steps = m[("specrt_speculative_steps_total", (("method", "lookahead"),))]
        accepted = m[("specrt_draft_accepted_tokens_total", (("method", "lookahead"),))]
        # every step emits its accepted drafts and one token of the target's (the budget may cut the last)
        assert drafted >= steps > 0 and 0 <= accepted <= drafted and accepted + steps >= tokens - 2
    else:
        assert drafted is None


# a schema of 4,000 optional properties: a row of 16,007 parser items after "{" (llguidance stops at 2,000)
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(4000)}}


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "must be a JSON object"),
        ({"messages": []}, 400, "messages", "non-empty list"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            400,
            "messages[0]",
            "role 'system', 'user' or 'assistant'",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content",
            "only text parts",
        ),
        ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", "must be in [1, 1024]"),
        ({"messages": MESSAGES, "max_tokens": 5000}, 400, "max_tokens", "must be in [1, 1024]"),
        ({"messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens", "must be an integer"),
        ({"messages": MESSAGES, "temperature": 3}, 400, "temperature", "must be in [0.0, 2.0]"),
        ({"messages": MESSAGES, "top_p": 0}, 400, "top_p", "must be in (0.0, 1.0]"),
        ({"messages": MESSAGES, "n": 9}, 400, "n", "'n' = 9: this server generates at most 8 answers at once"),
        ({"messages": MESSAGES, "n": 0}, 400, "n", "'n' must be in [1, "),
        ({"messages": MESSAGES, "stop": ["a", ""]}, 400, "stop", "non-empty strings"),
        ({"messages": MESSAGES, "stream": "yes"}, 400, "stream", "true or false"),
        ({"messages": MESSAGES, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
        ({"messages": MESSAGES, "model": "gpt-4"}, 404, "model", "is not served here; this server serves 'tiny'"),
        ({"messages": [{"role": "user", "content": "w5 " * 400}]}, 400, "messages", "context holds 256"),
        # NaN and infinity: Python's JSON reader takes them, and every range check with NaN is False
        ({"messages": MESSAGES, "top_p": float("nan")}, 400, "top_p", "must be a finite number, got nan"),
        ({"messages": MESSAGES, "temperature": float("nan")}, 400, "temperature", "must be a finite number, got nan"),
        ({"messages": MESSAGES, "temperature": float("-inf")}, 400, "temperature", "must be a finite number, got -inf"),
        ({"messages": MESSAGES, "seed": -1}, 400, "seed", "must be in [0, 9223372036854775807], got -1"),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "nests JSON too deeply"),
        # fields the server does not implement: a 400 naming them, never a 200 that ignored them
        ({"messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs", "needs 'logprobs': true"),
        ({"messages": MESSAGES, "logprobs": 1}, 400, "logprobs", "must be true or false, got 1"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "in [0, 20], got 21"),
        (
            {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"},
            400,
            "tool_choice",
            "tool calls are not implemented",
        ),
        ({"messages": MESSAGES, "tools": [TOOL]}, 400, "tools", 'tools with tool_choice "none"'),
        (
            {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format",
            "with the JSON schema under 'schema'",
        ),
        (
            {
                "messages": MESSAGES,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
            },
            400,
            "response_format",
            "JSON schema cannot be compiled: Invalid type: x",
        ),
        ({"messages": MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format", "type is one of text"),
        ({"messages": MESSAGES, "response_format": {"type": "regex", "regex": "(a"}}, 400, "response_format", "regex"),
        # grammars that compile but pass llguidance's limits on their first tokens: refused before queueing
        (
            {"messages": MESSAGES, "response_format": {"type": "regex", "regex": "(a{1000}){1000}"}},
            400,
            "response_format",
            "regex cannot be used: the grammar",
        ),
        (
            {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"schema": WIDE}}},
            400,
            "response_format",
            "JSON schema cannot be used",
        ),
        ({"messages": MESSAGES, "logit_bias": {"5": 100}}, 400, "logit_bias", "only {} (no bias)"),
        ({"messages": MESSAGES, "store": True}, 400, "store", "nothing is stored"),
        ({"messages": MESSAGES, "max_tokenz": 5}, 400, "max_tokenz", "not a chat completion field"),
        # specrt's speculation field, on a server that runs without a draft
        ({"messages": MESSAGES, "speculation": "fast"}, 400, "speculation", "must be an object"),
        ({"messages": MESSAGES, "speculation": {"n": 1}}, 400, "speculation.n", "not a speculation setting"),
        ({"messages": MESSAGES, "speculation": {"draft": "suffix"}}, 400, "speculation.draft", "drafts with 'none'"),
        (
            {"messages": MESSAGES, "speculation": {"num_draft": 2}},
            400,
            "speculation.num_draft",
            "0 (the server runs without a draft)",
        ),
        ({"messages": MESSAGES, "best_of": 1}, 400, "best_of", "not a chat completion field"),
    ],
)
def test_bad_requests_get_openai_errors(gen, body, status, param, message):
    c = client(gen)
    r = c.post(
        "/v1/chat/completions",
        content=body if isinstance(body, bytes) else json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"
    assert len(err["message"]) < 1000  # the problem and the fix, not llguidance's state or the grammar


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"best_of": 3}, "best_of", "only 1"),
        ({"echo": 1}, "echo", "must be true or false"),
        ({"echo": True, "logprobs": 1}, "echo", "'echo' with 'logprobs' is not supported"),
        ({"logprobs": 6}, "logprobs", "must be in [0, 5], got 6"),
        ({"suffix": "def f():"}, "suffix", 'only null or ""'),
        ({"messages": MESSAGES}, "messages", "not a completion field"),
    ],
)
def test_completions_fields_not_implemented_are_refused(gen, body, param, message):
    r = client(gen).post("/v1/completions", json={"prompt": "w5", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param


def test_openai_defaults_and_ids_are_accepted(gen):
    """Fields whose values ask nothing of this server (OpenAI's defaults, ids, tags, hints) are
    taken, and the answer is the one without them."""
    c = client(gen)
    plain = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    extra = {
        "tools": [TOOL],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "n": 1,
        "logprobs": False,
        "logit_bias": {},
        "parallel_tool_calls": True,
        "service_tier": "auto",
        "prompt_cache_key": "k",
    }
    want = c.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]
    r = c.post("/v1/chat/completions", json={**plain, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    r = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2, "best_of": 1, "echo": False, "user": "u"})
    assert r.status_code == 200, r.text


def test_docs_list_the_request_fields_the_server_follows():
    """docs/server.md's table of request fields is the server's own (server/fields.field_table)."""
    from pathlib import Path

    from specrt.server.fields import field_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    head = "| field | endpoint | taken |"
    assert head in text, "docs/server.md: the table of OpenAI request fields is missing"
    rows = text[text.index(head) :].split("\n\n")[0].splitlines()[2:]
    got = [tuple(c.strip() for c in row.strip("|").split("|")) for row in rows]
    assert got == [(f"`{n}`", ep, what) for n, ep, what in field_table()]


class SlowBackend:
    """The tiny engine with a pause in every step: a long generation a test can interrupt."""

    def __init__(self, backend, seconds: float):
        self.backend, self.seconds = backend, seconds

    def step(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.backend.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


class Flaky(SlowBackend):
    """The slow tiny engine whose steps raise while `Flaky.fail` is set (a backend error)."""

    fail = False

    def step(self, *args, **kwargs):
        if Flaky.fail:
            raise RuntimeError("device lost")
        return super().step(*args, **kwargs)


def flaky_generator(gen, seconds: float) -> Generator:
    flaky = Generator(Flaky(gen.backend, seconds), gen.tokenizer)
    flaky.eos_ids = frozenset()
    return flaky


def slow_generator(gen, seconds=0.04):
    """A generator that never meets EOS and takes `seconds` per step."""
    slow = Generator(SlowBackend(gen.backend, seconds), gen.tokenizer)
    slow.eos_ids = frozenset()
    return slow


def wait_until(condition, seconds=5.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_body_too_large_and_busy(gen):
    c = client(gen, max_body_bytes=200)
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5 " * 100}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    service = CompletionService(slow_generator(gen), "tiny", ServerLimits(max_queue=0, max_batch=1))
    c = TestClient(create_app(service))
    assert c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200  # idle: served
    long = service.run(
        service.parse(json.dumps({"prompt": "w5", "max_tokens": 200, "temperature": 0}).encode(), chat=False)
    )
    next(long)  # the engine is busy with it
    r = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    long.close()
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy" and r.headers["retry-after"] == "1"
    assert wait_until(lambda: not service.busy)
    assert c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200
    m = prometheus(c)
    assert m[("specrt_requests_total", (("outcome", "refused"),))] == 1
    assert m[("specrt_requests_total", (("outcome", "cancelled"),))] == 1  # the long one, closed
    assert m[("specrt_requests_total", (("outcome", "ok"),))] == 2
    service.close()


def test_closing_the_stream_frees_the_engine(gen):
    """A consumer that stops reading ends its generation within a step (no garbage collector
    involved): the engine thread takes the next request and the cache comes back."""
    service = CompletionService(slow_generator(gen), "tiny")
    job = service.parse(
        json.dumps({"prompt": "w5 w6", "max_tokens": 200, "stream": True, "temperature": 0}).encode(), chat=False
    )
    pieces = service.run(job)
    next(pieces)
    assert service.busy
    held = pieces  # a live reference: only the explicit close may end the generation
    t0 = time.monotonic()
    pieces.close()
    assert wait_until(lambda: not service.busy, 2.0), "the generation went on after its consumer closed the stream"
    assert time.monotonic() - t0 < 1.0 and held is pieces
    assert service.stats["cancelled"] == 1 and service.stats["completion_tokens"] < 50
    job = service.parse(json.dumps({"prompt": "w5 w6", "max_tokens": 5, "temperature": 0}).encode(), chat=False)
    expected = gen.generate_ids([gen.tokenizer.encode("w5 w6")], 5)[0]
    assert service.response(job, service.run(job))["choices"][0]["finish_reason"] == expected.finish_reason
    assert not any(c.in_use for c in service.gen.session.pooled_caches)
    service.close()


def test_a_cancelled_ticket_in_the_queue_never_runs(gen):
    service = CompletionService(slow_generator(gen), "tiny")

    def parse(n):
        return service.parse(json.dumps({"prompt": "w5", "max_tokens": n, "temperature": 0}).encode(), chat=False)

    first = service.run(parse(200))
    next(first)
    queued = service.submit(parse(200))
    queued.cancel()
    first.close()
    assert wait_until(queued.done.is_set)
    assert list(queued) == [] and service.stats["requests"] == 1
    service.close()


@contextlib.contextmanager
def serving(service: CompletionService):
    """A real uvicorn server of `service` on a free loopback port: yields the port."""
    import uvicorn

    from specrt.server import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        service.close()


@pytest.fixture(params=["plain", "suffix"])
def live_server(gen, request):
    """A real uvicorn server on a free loopback port over the slow tiny engine, plain or with
    speculative decoding (whose generator objects hold reference cycles: before the engine
    thread, an abandoned one was only closed by the garbage collector): (service, port)."""
    if request.param == "plain":
        runner = slow_generator(gen)
    else:  # up to 5 tokens a step: a slower step keeps the generation as long
        runner = SpeculativeDecoder(slow_generator(gen, 0.2), make_proposer("suffix"), make_policy(4))
    service = CompletionService(runner, "tiny", ServerLimits(max_batch=1))  # one at a time: others queue
    with serving(service) as port:
        yield service, port


def test_speculation_and_logprobs_through_the_openai_client(gen):
    """The `openai` client on loopback: `speculation` in extra_body runs the request without a
    draft or with a capped one, the text stays the greedy text, the settings come back under
    `specrt`, and a setting the server cannot honour raises the client's BadRequestError;
    logprobs under speculation parse into the client's models and spell the answer."""
    openai = pytest.importorskip("openai", reason="openai is not installed (the test extra)")
    service = CompletionService(SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4)), "tiny")
    _, ref = expected_chat(gen, 24)
    with serving(service) as port:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for spec, echo in [
            ({"draft": "none"}, {"draft": "none", "num_draft": 0}),
            ({"num_draft": 2}, {"draft": "suffix", "num_draft": 2}),
        ]:
            r = c.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"speculation": spec}
            )
            assert r.choices[0].message.content == gen.decode(ref.token_ids)
            assert r.model_extra["specrt"]["speculation"] == echo
        with pytest.raises(openai.BadRequestError, match="speculation.num_draft"):
            c.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"speculation": {"num_draft": 9}}
            )
        # logprobs, parsed by the client's own models
        r = c.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2
        )
        content = r.choices[0].logprobs.content
        assert "".join(t.token for t in content) == r.choices[0].message.content == gen.decode(ref.token_ids)
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-9 for t in content)


def raw_request(port: int, body: dict) -> socket.socket:
    """Send a POST /v1/completions by hand, so the test decides when the connection closes."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_disconnects_does_not_hold_the_server(live_server, stream):
    """A client leaves in the middle of a long generation (240 tokens at 40 ms a step: ~10 s);
    the next request is answered within a few seconds, not after the abandoned generation."""
    import httpx

    service, port = live_server
    s = raw_request(port, {"prompt": "w5 w6", "max_tokens": 240, "temperature": 0, "stream": stream})
    if stream:
        got = b""
        while got.count(b"data: ") < 3:  # a couple of chunks have arrived
            got += s.recv(4096)
    else:
        assert wait_until(lambda: service.busy and service.stats["requests"] == 1)
        time.sleep(0.3)
    s.close()
    t0 = time.monotonic()
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "w9", "max_tokens": 3, "temperature": 0}, timeout=30
    )
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert elapsed < 3.0, f"the next request waited {elapsed:.1f} s behind an abandoned generation"
    assert service.stats["cancelled"] == 1 and service.stats["completion_tokens"] < 100


def test_client_that_leaves_while_queued_is_never_run(live_server):
    import httpx

    service, port = live_server
    running = raw_request(port, {"prompt": "w5 w6", "max_tokens": 240, "temperature": 0})
    assert wait_until(lambda: service.busy)
    queued = raw_request(port, {"prompt": "w7", "max_tokens": 240, "temperature": 0, "stream": True})
    assert wait_until(lambda: service.waiting == 1)
    queued.close()
    time.sleep(0.3)  # the server reads the disconnect
    running.close()
    t0 = time.monotonic()
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "w9", "max_tokens": 3, "temperature": 0}, timeout=30
    )
    assert r.status_code == 200 and time.monotonic() - t0 < 3.0
    assert service.stats["requests"] == 2 and service.stats["cancelled"] == 2  # the queued one never started


def test_a_burst_fills_the_slots_and_the_queue_before_any_refusal(gen):
    """12 requests at once into an idle server of 2 slots and 2 queue places (a real server on
    loopback): exactly 4 are admitted and answered (before, requests about to take a free slot
    counted as waiting: 2 were), the 8 others get 503 with Retry-After; once a place is free again
    a request is answered."""
    import httpx
    import uvicorn

    from specrt.server import bind_socket

    service = CompletionService(slow_generator(gen, 0.04), "tiny", ServerLimits(max_batch=2, max_queue=2))
    depths = []  # every value the queue gauge takes (it read 4 and 3: requests about to take a free slot)
    gauge_set = service.metrics.queue_depth.set
    service.metrics.queue_depth.set = lambda v: (depths.append(v), gauge_set(v))
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    start = threading.Barrier(12)

    def ask(i):
        start.wait()  # all at once
        return httpx.post(url, json={"prompt": f"w{5 + i}", "max_tokens": 30, "temperature": 0}, timeout=60)

    try:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        codes = sorted(r.status_code for r in answers)
        assert codes == [200] * 4 + [503] * 8, codes
        refused = [r for r in answers if r.status_code == 503]
        assert all(r.headers["retry-after"] == "1" and "server is busy" in r.text for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == 30 for r in answers if r.status_code == 200)
        assert service.stats["refused"] == 8 and service.stats["requests"] == 4
        assert max(depths) == 2 and depths[-1] == 0, depths  # the 2 queued, never the 2 in slots too
        r = httpx.post(url, json={"prompt": "w5", "max_tokens": 2}, timeout=60)  # all answered: room again
        assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
        service.close()


@pytest.mark.real_model
def test_default_model_served_with_speculation(real_artifacts):
    """The default model behind the server with the suffix draft answers exactly what plain
    greedy generation gives, streamed and not."""
    gen = Generator.from_engine(real_artifacts / "engines" / "ort-cpu")
    c = client(SpeculativeDecoder(gen, make_proposer("suffix"), make_policy("auto")))
    messages = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    tok = gen.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    expected = gen.decode(gen.generate_ids([ids], 48)[0].token_ids)
    req = {"messages": messages, "max_tokens": 48, "temperature": 0}
    assert c.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"] == expected
    chunks = sse(c.post("/v1/chat/completions", json={**req, "stream": True}))
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == expected


@pytest.mark.parametrize("max_batch", [1, 3])
def test_concurrent_requests_each_get_their_own_answer(gen, max_batch):
    """Requests arriving together wait for a slot (max_batch 1) or generate together (3); each
    gets the answer it gets alone."""
    c = client(gen, max_batch=max_batch)
    prompts = ["w5 w6 w7", "w9 w10", "w20 w21 w22 w23"]
    expected = [gen.decode(gen.generate_ids([gen.tokenizer.encode(p)], 16)[0].token_ids) for p in prompts]

    def ask(p):
        return c.post(
            "/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0, "stream": p.startswith("w9")}
        )

    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(ask, prompts))
    texts = [
        "".join(ch["choices"][0]["text"] for ch in sse(r)) if p.startswith("w9") else r.json()["choices"][0]["text"]
        for p, r in zip(prompts, responses)
    ]
    assert texts == expected


def test_port_in_use_is_refused_before_serving(tiny_artifacts):
    """`serve` binds its port before it says "serving on": a taken port is one line naming the
    process that holds it and the option to change."""
    import os
    import subprocess
    import sys

    from specrt.errors import SpecrtError
    from specrt.server import bind_socket

    held = bind_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    with pytest.raises(
        SpecrtError, match=rf"port {port} on 127.0.0.1 is already in use by process .*\(pid {os.getpid()}\); .*--port"
    ):
        bind_socket("127.0.0.1", port)
    r = subprocess.run(
        [sys.executable, "-m", "specrt.cli", "serve", "--artifacts", str(tiny_artifacts), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    held.close()
    assert r.returncode == 1 and "serving" not in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"Error: port {port} on 127.0.0.1 is already in use")


def test_requests_join_a_running_batch_and_a_gone_client_frees_its_slot(gen):
    """Continuous batching behind the API: three long requests in two slots (the third waits);
    one client leaves and the waiting request takes its slot at once; the answers of the others
    equal their answers alone, and the engine took fewer steps than tokens (it batched)."""
    service = CompletionService(slow_generator(gen, 0.02), "tiny", ServerLimits(max_batch=2))

    def parse(prompt, n, **extra):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **extra}
        return service.parse(json.dumps(body).encode(), chat=False)

    first = service.run(parse("w5 w6", 60))
    second = service.run(parse("w9", 200, stream=True))
    head = next(first).text
    next(second)
    third = service.run(parse("w20 w21 w22", 40))
    assert wait_until(lambda: service.running == 2 and service.waiting == 1)
    second.close()  # the client left
    assert wait_until(lambda: service.waiting == 0 and service.running == 2, 2.0), "the slot was not handed on"
    texts = [head + "".join(p.text for p in first), "".join(p.text for p in third)]
    solo = slow_generator(gen, 0)
    expected = [
        solo.decode(solo.generate_ids([gen.tokenizer.encode(p)], n)[0].token_ids)
        for p, n in (("w5 w6", 60), ("w20 w21 w22", 40))
    ]
    assert texts == expected
    assert service.stats["cancelled"] == 1 and service.engine.steps < service.stats["completion_tokens"]
    assert wait_until(lambda: not service.busy) and service.engine.idle
    service.close()


def test_a_request_past_the_time_limit_gets_504(gen):
    c = client(slow_generator(gen, 0.05), request_timeout=0.3)
    r = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 200})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    r = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 200, "n": 2})  # both choices end
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    chunks = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 200, "stream": True}).text
    assert '"code": "timeout"' in chunks and chunks.rstrip().endswith("data: [DONE]")


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(gen):
    """A step that raises (a backend error) ends every request in the batch with a 500 that says
    what failed; their slots are free and the next request is answered."""

    service = CompletionService(flaky_generator(gen, 0.0), "tiny", ServerLimits(max_batch=2))
    c = TestClient(create_app(service))
    Flaky.fail = True
    for n in (1, 2):  # with n = 2, both choices fail with the one error
        r = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 4, "n": n})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
    Flaky.fail = False
    assert wait_until(lambda: service.engine.idle)
    r = c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 4, "n": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert service.stats["requests"] == 3 and service.engine.idle
    service.close()


def test_every_outcome_is_counted_once_and_both_views_agree(gen):
    """ok, 400/404/413 (invalid), a client gone (cancelled), 503 (refused), 504 (timed_out) and
    500 (error) each land in one outcome, and /stats reads what /metrics says."""

    flaky = flaky_generator(gen, 0.05)
    limits = ServerLimits(max_batch=1, max_queue=0, request_timeout=0.5, max_body_bytes=400)
    service = CompletionService(flaky, "tiny", limits)
    c = TestClient(create_app(service))
    post = lambda body: c.post("/v1/completions", json=body).status_code  # noqa: E731
    assert post({"prompt": "w5", "max_tokens": 2}) == 200
    assert post({"prompt": ""}) == 400 and post({"prompt": "w5", "model": "other"}) == 404
    assert post({"prompt": "w5 " * 200}) == 413
    long = service.run(service.parse(json.dumps({"prompt": "w5", "max_tokens": 200}).encode(), chat=False))
    next(long)  # the one slot is taken
    assert post({"prompt": "w5", "max_tokens": 2}) == 503
    long.close()  # the client is gone
    assert wait_until(lambda: service.engine.idle)
    assert post({"prompt": "w5", "max_tokens": 200}) == 504
    Flaky.fail = True
    assert post({"prompt": "w5", "max_tokens": 2}) == 500
    Flaky.fail = False
    stats, m = c.get("/stats").json(), prometheus(c)
    want = {"ok": 1, "invalid": 3, "cancelled": 1, "refused": 1, "timed_out": 1, "error": 1}
    assert {o: stats[o] for o in want} == want
    assert all(m[("specrt_requests_total", (("outcome", o),))] == n for o, n in want.items())
    assert stats["requests"] == m[("specrt_requests_started_total", ())] == 4  # ok, cancelled, 504, 500
    for name in ("prompt_tokens", "completion_tokens"):
        assert stats[name] == m[(f"specrt_{name}_total", ())] > 0
    service.close()


def test_a_grammar_that_fails_mid_answer_is_a_400_and_the_server_goes_on(gen, monkeypatch):
    """docs/server.md: a grammar that reaches the grammar engine's limit later in the answer ends
    that request with a 400 naming response_format (the engine freed its slot); the next
    request is answered. The matcher's failure is planted after the answer's first token, as
    llguidance's lexer limit would set it (the compile-time probe is skipped: the tiny model's
    word-level vocabulary is not one llguidance follows)."""
    from specrt.runtime.grammar import Matcher, Vocabulary

    advance = Matcher.advance

    def failing(self, tokens):
        advance(self, tokens)
        self.error = "lexer error: too many expressions constructed"

    monkeypatch.setattr(Vocabulary, "_probe", lambda self, compiled, kind: None)
    monkeypatch.setattr(Matcher, "advance", failing)
    service = CompletionService(gen, "tiny", ServerLimits())
    c = TestClient(create_app(service))
    body = {"prompt": "w5", "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "could not be followed to the end of the answer" in err["message"]
    assert "too many expressions" in err["message"]
    monkeypatch.setattr(Matcher, "advance", advance)
    assert c.post("/v1/completions", json={"prompt": "w5", "max_tokens": 3}).status_code == 200
    assert service.engine.running == 0
    service.close()
