"""A prompt set for training draft heads, built on any machine from text it already has.

Draft heads learn from the target's own answers (self-distillation), so the prompts matter less
than that they look like the requests a server gets: the four classes of bench/prompts.jsonl
(chat, code editing, summarization, JSON output). That file is the benchmark, so it is held out.
No data set can be downloaded here, so the raw text is the documentation Python itself ships:
the docstrings of the public functions and classes of a fixed list of standard-library modules
(about 600 of them on Python 3.11). Each prompt fills a template of its class with one of them.

Reproducible: the same Python version and seed give the same prompts in the same order, and
`prompt_set_hash` names the set (a training manifest records it). Prompts are spread evenly
over the classes, drawn with a seeded numpy Generator, and never repeat.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import warnings
from pathlib import Path

import numpy as np

from specrt.artifacts import atomic_write_text
from specrt.errors import SpecrtError

# documented public API of these modules is the raw text; a module missing from a Python build is skipped
SOURCE_MODULES = (
    "abc argparse array base64 bisect bz2 calendar cmath collections configparser contextlib copy csv dataclasses "
    "datetime decimal difflib doctest email.utils enum fnmatch fractions functools gettext glob graphlib gzip hashlib "
    "heapq html io ipaddress itertools json locale logging lzma math mimetypes numbers operator pathlib pprint queue "
    "random re sched secrets shlex shutil sqlite3 statistics string struct subprocess tarfile tempfile textwrap "
    "threading timeit typing unicodedata unittest urllib.parse uuid zipfile zlib"
).split()

CLASSES = ("chat", "code_edit", "summarization", "json")

TEMPLATES = {
    "chat": (
        "Explain in simple words what `{qualname}` in Python does.",
        "When would I use `{qualname}` in Python? Give one everyday example.",
        "What is a common mistake people make with `{qualname}`, and how do I avoid it?",
        "Here is what the Python docs say about `{qualname}`: {summary} Can you explain that to a beginner?",
    ),
    "code_edit": (
        "Write a short Python function that uses `{qualname}` and explain each line.",
        "Write a Python function that does the following, without importing `{module}`: {summary}",
        "Write a unit test with the unittest module for `{qualname}`.",
        "Here is some code:\n\n```python\nimport {module}\n\nresult = {qualname}  # TODO\n```\n\n"
        "Finish it so that it calls `{qualname}` correctly, and return the whole code.",
    ),
    "summarization": (
        "Summarize the following documentation in two sentences:\n\n{doc}",
        "Rewrite this documentation as three short bullet points:\n\n{doc}",
        "Give this documentation a one-line title and a one-sentence summary:\n\n{doc}",
    ),
    "json": (
        'Describe `{qualname}` as a JSON object with the keys "name", "module", "purpose" and "arguments". '
        "Return only the JSON.",
        "Read this documentation and return a JSON list of the arguments it mentions, each as an object with "
        '"name" and "meaning":\n\n{doc}',
        'Return a JSON object with the keys "summary" (one sentence) and "keywords" (a list of three words) '
        "for this text:\n\n{doc}",
    ),
}

MAX_DOC_CHARS = 700  # documentation quoted in a prompt: its first paragraphs, cut at a sentence


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: int
    kind: str  # one of CLASSES
    prompt: str
    source: str  # the documented object, e.g. "textwrap.dedent"


def documented_objects(modules: tuple[str, ...] = SOURCE_MODULES) -> list[tuple[str, str, str]]:
    """(module, qualified name, docstring) of the public functions and classes the modules define
    and document (8 words or more), sorted by name."""
    out = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        top = name.split(".")[0]
        with warnings.catch_warnings():  # getmembers touches deprecated aliases (typing.re, ...)
            warnings.simplefilter("ignore", DeprecationWarning)
            members = inspect.getmembers(module)
        for attr, obj in members:
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if (getattr(obj, "__module__", None) or "").split(".")[0] != top:
                continue  # re-exported from elsewhere
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj)
            if doc and len(doc.split()) >= 8:
                out[f"{name}.{attr}"] = (name, f"{name}.{attr}", doc)
    return [out[k] for k in sorted(out)]


def _excerpt(doc: str) -> str:
    """The documentation's first paragraphs, at most MAX_DOC_CHARS, ending at a sentence."""
    text = doc.strip()
    if len(text) <= MAX_DOC_CHARS:
        return text
    cut = text[:MAX_DOC_CHARS]
    end = max(cut.rfind(". "), cut.rfind(".\n"))
    return cut[: end + 1] if end > 100 else cut.rsplit(" ", 1)[0] + " ..."


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    end = first.find(". ")
    return first[: end + 1] if end > 0 else first


def build_prompt_set(n: int, seed: int = 0, exclude: tuple[str, ...] = ()) -> list[Prompt]:
    """`n` distinct prompts, classes in turn (chat, code_edit, summarization, json, chat, ...),
    none equal to a prompt in `exclude` (the held-out benchmark)."""
    objects = documented_objects()
    if not objects:
        raise SpecrtError(
            "no documented standard-library objects found; this Python build ships no docstrings (python -OO?)"
        )
    rng = np.random.default_rng(seed)
    seen, out = set(exclude), []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 20 * n + 1000:
            raise SpecrtError(f"only {len(out)} distinct prompts can be made here; ask for at most that many")
        kind = CLASSES[len(out) % len(CLASSES)]
        module, qualname, doc = objects[int(rng.integers(len(objects)))]
        template = TEMPLATES[kind][int(rng.integers(len(TEMPLATES[kind])))]
        text = template.format(qualname=qualname, module=module, doc=_excerpt(doc), summary=_summary(doc))
        if text in seen:
            continue
        seen.add(text)
        out.append(Prompt(len(out), kind, text, qualname))
    return out


def prompt_set_hash(prompts: list[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(dataclasses.asdict(p), sort_keys=True).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def write_prompt_set(path: str | Path, prompts: list[Prompt]) -> None:
    """JSON lines (id, kind, prompt, source), written atomically."""
    atomic_write_text(path, "".join(json.dumps(dataclasses.asdict(p)) + "\n" for p in prompts))


def read_prompt_set(path: str | Path) -> list[Prompt]:
    path = Path(path)
    try:
        return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError, TypeError) as e:
        raise SpecrtError(
            f"{path} is not a prompt set written by specrt ({e}); make it again with write_prompt_set"
        ) from None


def benchmark_prompts(path: str | Path) -> tuple[str, ...]:
    """The prompts of a benchmark file (JSON lines with 'prompt'), to hold out of training."""
    return tuple(json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip())
