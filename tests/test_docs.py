"""The README and docs/ cannot drift from the code: every `specrt` command line they show names a
command and options that exist, and the README's Python snippet runs on the tiny model.
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
