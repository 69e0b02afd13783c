"""Structured output through the real `openai` client on loopback, on the default model: every
answer under a JSON schema parses and validates (greedy and seeded sampling, n = 3), greedy
answers are the same with and without speculation, JSON mode and the regex extension hold, and a
schema the engine cannot compile is the client's BadRequestError naming the field."""

import json
import re

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install -e .[server])")
openai = pytest.importorskip("openai", reason="openai is not installed (the test extra)")

from specrt.runtime.drafts import make_proposer  # noqa: E402
from specrt.runtime.generator import Generator  # noqa: E402
from specrt.runtime.speculative import SpeculativeDecoder, make_policy  # noqa: E402
from specrt.server import CompletionService, ServerLimits  # noqa: E402

from test_server import serving  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [
    {
        "role": "user",
        "content": "Maria Lopez is a 34 year old engineer from Madrid who knows Python, Rust and SQL. "
        "Give her as JSON.",
    }
]


def valid_person(text: str) -> dict:
    d = json.loads(text)
    assert set(d) == set(PERSON["required"]), d
    assert isinstance(d["name"], str) and len(d["name"]) <= 24 and isinstance(d["city"], str)
    assert isinstance(d["age"], int) and 0 <= d["age"] <= 150
    assert isinstance(d["skills"], list) and len(d["skills"]) <= 3 and all(isinstance(s, str) for s in d["skills"])
    return d


@pytest.fixture(scope="module")
def real_gen(real_artifacts):
    return Generator.from_engine(real_artifacts / "engines" / "ort-cpu")


@pytest.mark.real_model
def test_json_schema_answers_validate_and_speculation_changes_no_token(real_gen):
    answers = {}
    for name, runner in [
        ("plain", real_gen),
        ("suffix", SpeculativeDecoder(real_gen, make_proposer("suffix"), make_policy("auto"))),
        ("grammar", SpeculativeDecoder(real_gen, make_proposer("grammar"), make_policy(8))),
    ]:
        with serving(CompletionService(runner, "smol")) as port:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            r = c.chat.completions.create(
                model="smol", messages=MESSAGES, max_tokens=120, temperature=0, response_format=FORMAT
            )
            answers[name] = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
            if name == "grammar":  # the forced tokens were drafted and taken
                assert r.model_extra["specrt"]["mean_accepted_length"] > 1.2
                # seeded sampling, three choices: each one a valid person
                r = c.chat.completions.create(
                    model="smol",
                    messages=MESSAGES,
                    max_tokens=120,
                    temperature=1.0,
                    seed=7,
                    n=3,
                    response_format=FORMAT,
                )
                assert len({ch.message.content for ch in r.choices}) > 1, "three samples, one answer"
                for ch in r.choices:
                    assert ch.finish_reason == "stop", ch.message.content
                    valid_person(ch.message.content)
                # JSON mode and the regex extension (completions, through extra_body)
                r = c.chat.completions.create(
                    model="smol",
                    messages=MESSAGES,
                    max_tokens=80,
                    temperature=0,
                    response_format={"type": "json_object"},
                )
                assert isinstance(json.loads(r.choices[0].message.content), dict)
                r = c.completions.create(
                    model="smol",
                    prompt="The first moon landing was on",
                    max_tokens=12,
                    temperature=0,
                    extra_body={"response_format": {"type": "regex", "regex": r" \d{4}-\d{2}-\d{2}"}},
                )
                assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", r.choices[0].text), r.choices[0].text
                with pytest.raises(openai.BadRequestError, match="response_format.*cannot be compiled"):
                    c.chat.completions.create(
                        model="smol",
                        messages=MESSAGES,
                        max_tokens=8,
                        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "y"}}},
                    )
    assert answers["plain"] == answers["suffix"] == answers["grammar"]
    person = valid_person(answers["plain"])
    assert person["name"] == "Maria Lopez" and person["age"] == 34


@pytest.mark.real_model
def test_the_readme_serving_snippet_runs(real_gen, capsys):
    """The README's `openai` client example against the default model served with `auto`
    drafts, as `specrt serve` runs it; what it prints in its comments is what it prints."""
    from pathlib import Path

    from test_docs import code_blocks

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (snippet,) = code_blocks(text[text.index("## Serving") :].split("\n## ")[0], "python")
    with serving(
        CompletionService(SpeculativeDecoder(real_gen, make_proposer("auto"), make_policy("auto")), "smol")
    ) as port:
        code = snippet.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/v1")
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == '{"name": "Maria Lopez", "age": 34}'
    assert out[3].startswith("{'draft': 'auto', 'num_draft': 4}")


@pytest.mark.real_model
def test_a_shared_500_token_prefix_comes_from_the_cache(real_gen):
    """Two questions about one ~500-token document through the openai client: the second one's
    document comes from the prefix cache (the hit counter says so) and both answers are the
    ones a server without the cache gives."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()[:2400]
    system = {"role": "system", "content": "Answer from this document.\n\n" + doc}
    questions = ["What does the step graph serve?", "Which engines are built?"]
    answers = {}
    for mb in (0, 64):
        service = CompletionService(real_gen, "smol", ServerLimits(prefix_cache_mb=mb))
        with serving(service) as port:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            answers[mb] = [
                c.chat.completions.create(
                    model="smol", messages=[system, {"role": "user", "content": q}], max_tokens=24, temperature=0
                )
                .choices[0]
                .message.content
                for q in questions
            ]
        if mb:
            prompt = real_gen.tokenizer.encode(
                real_gen.tokenizer.apply_chat_template([system, {"role": "user", "content": questions[1]}])
            )
            assert len(prompt) > 500
            assert service.prefix_cache.hit >= 480  # the document's blocks, 32 tokens each
    assert answers[0] == answers[64]


@pytest.mark.real_model
def test_the_server_page_runs(real_gen, capsys):
    """docs/server.md's `openai` client blocks, in order, against the default model served with
    `auto` drafts and per-request acceptance (its speculation field, the acceptance object,
    logprobs, a JSON schema and a regex)."""
    from pathlib import Path

    from test_docs import code_blocks

    text = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    code = "\n".join(code_blocks(text, "python"))
    spec = SpeculativeDecoder(real_gen, make_proposer("auto"), make_policy("auto"))
    limits = ServerLimits(spec_decode_metrics="summary")  # as the page starts it for its second block
    with serving(CompletionService(spec, "SmolLM2-135M-Instruct", limits)) as port:
        code = code.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/v1")
        exec(compile(code, "server.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert "'speculation': {'draft': 'auto', 'num_draft': 2}" in out[0], out[0]
    assert float(out[1]) >= 1.0, out[1]  # the answer's mean acceptance length
    assert json.loads(out[-2].replace("'", '"')) == {"name": "Maria Lopez", "age": 34, "city": "Madrid"}, out[-2]
    assert re.fullmatch(r"' \d{4}-\d{2}-\d{2}'", out[-1]), out[-1]
