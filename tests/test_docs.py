"""The README and docs/ cannot drift from the code: every `specrt` command line they show names a
command and options that exist, and every Python block runs (the README's and docs/python-api.md's
on the tiny model here; the server pages' `openai` clients against the default model served, in
tests/test_server_structured.py).
"""

import re
from pathlib import Path

import pytest

from specrt.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(r"```" + lang + r"[a-z]*\n(.*?)```", text, flags=re.S)


def command_lines(text: str) -> list[tuple[str, list[str]]]:
    """(command, options) of each `specrt COMMAND ...` in the page's code blocks and inline code;
    a line that starts with spaces and `[` continues the command above it (the README's table of
    commands)."""
    out: list[tuple[str, list[str]]] = []
    inline = re.findall(r"`((?:\S*/)?specrt [a-z][^`]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in [*code_blocks(text), "\n".join(inline)]:
        for line in block.replace("\\\n", " ").splitlines():
            m = re.match(r"\s*(?:\$\(SPECRT\)|\S*/)?specrt\s+([a-z][a-z-]*)(.*)", line)
            if m:
                out.append((m.group(1), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(2))))
            elif out and re.match(r"\s+\[--", line):
                out[-1][1].extend(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line.split("  ")[0] + line))
    return out


def options_of(command) -> set[str]:
    names = {"--help"}
    for p in command.params:
        names.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_line_names_real_commands_and_options(page):
    lines = command_lines(page.read_text())
    for command, options in lines:
        assert command in main.commands, f"{page.name}: `specrt {command}` is not a command"
        unknown = set(options) - options_of(main.commands[command])
        assert not unknown, f"{page.name}: `specrt {command}` has no option {sorted(unknown)}"


def test_the_readme_shows_its_commands():
    assert {c for c, _ in command_lines((ROOT / "README.md").read_text())} >= {"generate", "build-engines", "serve"}


def test_the_readme_python_snippet_runs(tiny_artifacts, capsys):
    """The README's Python API, on the tiny model: its artifact directory for the default
    model's, and without `quantize="gguf"` (the tiny artifacts have no GGUF)."""
    text = (ROOT / "README.md").read_text()
    (snippet,) = code_blocks(text[text.index("## Python API") : text.index("## Serving")], "python")
    code = snippet.replace("artifacts/SmolLM2-135M-Instruct", str(tiny_artifacts)).replace('quantize="gguf", ', "")
    exec(compile(code, "README.md", "exec"), {})
    assert "acceptance" in capsys.readouterr().out


# every page with Python blocks, and the test that runs them (a block on another page fails here
# until a test runs it)
RUN_BY = {
    "README.md": "test_the_readme_python_snippet_runs, test_server_structured.py (its openai client)",
    "python-api.md": "test_the_python_api_page_runs",
    "server.md": "test_server_structured.py::test_the_server_page_runs",
}


def test_every_python_block_is_run_by_a_test():
    with_blocks = {p.name for p in PAGES if code_blocks(p.read_text(), "python")}
    assert with_blocks == set(RUN_BY), f"run these pages' Python blocks in a test: {with_blocks - set(RUN_BY)}"


@pytest.mark.real_model
def test_the_python_api_page_runs(real_artifacts, tmp_path, capsys):
    """docs/python-api.md's blocks, in order, in one namespace, on the default model (its
    structured output needs a real tokenizer): the test's artifacts (without `quantize="gguf"`:
    they hold no GGUF engine) and Medusa heads made for it (untrained: `make drafts` is not run
    here) where the page names `make drafts`'. Its writing-a-draft example failed on its first
    step: the runtime reads a third declared fact, `lookup`."""
    from test_medusa import make_medusa_dir

    from specrt.runtime.generator import Generator

    gen = Generator.from_engine(real_artifacts / "engines" / "ort-cpu")
    heads, _ = make_medusa_dir(gen.checkpoint, tmp_path / "medusa", num_heads=2, draft_vocab=512)
    code = "\n".join(code_blocks((ROOT / "docs" / "python-api.md").read_text(), "python"))
    code = code.replace("drafts/SmolLM2-135M-Instruct/medusa", str(heads.root))
    code = code.replace("artifacts/SmolLM2-135M-Instruct", str(real_artifacts)).replace(', quantize="gguf"', "")
    namespace: dict = {}
    exec(compile(code, "python-api.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "acceptance" in out and "length" in out  # the draft example's summary, and the batch's finish
    spec, gen = namespace["spec"], namespace["gen"]
    assert type(spec.proposer).__name__ == "RepeatLast"
    prompt = gen.encode_prompt("Count: one one one one")
    assert spec.generate_ids([prompt], 16)[0].token_ids == gen.generate_ids([prompt], 16)[0].token_ids
