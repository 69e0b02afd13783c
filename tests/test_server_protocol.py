"""The server's protocol module on its own: no engine, no HTTP, a stand-in tokenizer."""

import json

import pytest

from specrt.server.limits import ServerLimits
from specrt.server.protocol import (
    OUTCOMES,
    Piece,
    RequestError,
    Served,
    SseWriter,
    completion_response,
    outcome_of,
    parse_request,
)


class Words:
    """A tokenizer of whitespace words: id = the word's length."""

    def encode(self, text, add_special_tokens=False):  # no special tokens to add
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + (
            " <assistant>" if add_generation_prompt else ""
        )


SERVED = Served("m", ServerLimits(max_tokens=50), Words(), max_context=20)


def parse(body, chat=False):
    return parse_request(json.dumps(body).encode(), chat, SERVED)


def test_a_body_becomes_a_checked_job():
    job = parse({"prompt": "a bb ccc", "max_tokens": 30, "temperature": 0, "stop": "x", "stream": True})
    assert job.prompt_ids == [1, 2, 3] and job.max_tokens == 17  # the context's room, not the 30 asked
    assert job.sampling.temperature == 0 and job.stop == ["x"] and job.stream and not job.include_usage
    chat = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, chat=True)
    assert chat.prompt_ids == Words().encode("<user> hi <assistant>") and chat.max_tokens == 17


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "a", "model": "other"}, 404, "model"),
        ({"prompt": "a", "n": 99}, 400, "n"),  # more answers than the batch holds
        ({"prompt": "a", "n": 0}, 400, "n"),
        ({"prompt": "a", "top_p": 0}, 400, "top_p"),
        ({"prompt": "a " * 20}, 400, "prompt"),  # no room left in the context
        ({"prompt": "a", "stop": ["x"] * 5}, 400, "stop"),
    ],
)
def test_refusals_name_the_field(body, status, param):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert e.value.status == status and e.value.param == param and e.value.body()["error"]["param"] == param


def test_outcomes_follow_the_status():
    assert [outcome_of(s) for s in (200, 400, 404, 413, 499, 503, 504, 500)] == [
        "ok", "invalid", "invalid", "invalid", "cancelled", "refused", "timed_out", "error",
    ]  # fmt: skip
    assert set(OUTCOMES) == {outcome_of(s) for s in (200, 400, 499, 503, 504, 500)}


def test_response_and_events_shapes():
    job = parse({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, True)
    pieces = [Piece("he"), Piece("llo", "stop", 4, 2)]
    body = completion_response(job, iter(pieces), "m")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    w = SseWriter(job, "chatcmpl-1", "m")
    events = w.head() + [e for p in pieces for e in w.piece(p)] + w.tail()
    data = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n" and data[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in data if d["choices"]) == "hello"
    assert data[-2]["choices"][0]["finish_reason"] == "stop" and data[-1]["usage"]["total_tokens"] == 6
