"""A prompt set for training draft heads, built on any machine from text it already has.

Draft heads learn from the target's own answers (self-distillation), and a head accepts well only
on requests like the ones it learned from, so the set covers the requests a server gets: the four
classes of bench/prompts.jsonl (chat, code editing, summarization, JSON output). No data set can be
downloaded here, so every prompt is assembled on the machine from

- topics: a list of everyday subjects in this file (chat on open-ended themes),
- Python's own documentation: the docstrings of the public functions and classes of a fixed list
  of standard-library modules (about 600 on Python 3.11),
- Python's own source: the standard library's short functions (6 to 40 lines), to be edited and
  returned whole, as a user asks of an assistant,
- synthetic records: names, places, items and numbers drawn from the seed, to be turned into JSON.

The benchmark (bench/prompts.jsonl) is held out: none of its prompts, and none of its texts,
subjects or records, is in these lists; the classes and the kind of request are shared.

Reproducible: the same Python version and seed give the same prompts in the same order (prompt i
does not depend on how many are asked for), and `prompt_set_hash` names the set.
`PROMPT_SET_VERSION` changes whenever the templates or sources do, so training data made from an
older set is refused rather than mixed.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import textwrap
import warnings
from pathlib import Path

import numpy as np

from specrt.artifacts import atomic_write_text, read_json_lines
from specrt.errors import SpecrtError

PROMPT_SET_VERSION = 2

# documented public API of these modules is the raw text; a module missing from a Python build is skipped
SOURCE_MODULES = (
    "abc argparse array base64 bisect bz2 calendar cmath collections configparser contextlib copy csv dataclasses "
    "datetime decimal difflib doctest email.utils enum fnmatch fractions functools gettext glob graphlib gzip hashlib "
    "heapq html io ipaddress itertools json locale logging lzma math mimetypes numbers operator pathlib pprint queue "
    "random re sched secrets shlex shutil sqlite3 statistics string struct subprocess tarfile tempfile textwrap "
    "threading timeit typing unicodedata unittest urllib.parse uuid zipfile zlib"
).split()

CLASSES = ("chat", "code_edit", "summarization", "json")

TOPICS = tuple(
    line.strip()
    for line in """
    learning a new language; keeping a vegetable garden; saving money each month; volcanoes; the moon's phases
    bees and pollination; the history of bicycles; training a puppy; making bread at home; rainbows
    how airplanes fly; recycling plastic; the water cycle; chess openings; public libraries
    the invention of the printing press; coffee; tea ceremonies; sleeping well; running a first marathon
    electric cars; solar panels; the Roman Empire; ancient Egypt; dinosaurs; photosynthesis; earthquakes
    the human heart; vaccines; friendship; moving to a new city; job interviews; writing a resume
    public speaking; time management; meditation; camping in the mountains; desert animals; penguins
    owls; the first computers; the internet; email etiquette; video games; board games; playing the guitar
    learning to paint; photography; baking cookies; cooking rice; a balanced breakfast; drinking enough water
    stretching after exercise; riding a bicycle in the city; traffic lights; trains; lighthouses; bridges
    castles; the Olympic Games; football; swimming lessons; snow; thunderstorms; hurricanes; autumn leaves
    spring flowers; the desert at night; stars and constellations; black holes; Mars; the International
    Space Station; satellites; maps and navigation; compasses; clocks; calendars; the metric system
    fractions; prime numbers; the Pythagorean theorem; probability; budgeting for a trip; packing a suitcase
    learning to swim; first aid; fire safety; household cleaning; organizing a closet; minimalism
    houseplants; cats; horses; whales; coral reefs; rivers; glaciers; rain forests; mushrooms; honey
    chocolate; cheese making; pizza; soup on a cold day; street food; table manners; birthday parties
    wedding speeches; writing a thank-you note; keeping a diary; reading more books; poetry; fairy tales
    museums; theatre; jazz; classical music; learning piano; dancing; knitting; woodworking; pottery
    repairing a flat tire; changing a light bulb; saving energy at home; composting; bird watching
    hiking safety; sunscreen; the immune system; dreams; memory; routines; motivation; kindness; teamwork
    leadership; starting a small business; online shopping safety; strong passwords; backing up files
    learning to code; spreadsheets; robots; artificial intelligence; 3D printing; the telephone
    radio; newspapers; the postal service; elections; volunteering; grandparents; siblings; school lunches
    homework; exams; studying with friends; summer holidays; winter sports; skiing; ice skating; sailing
    kites; paper airplanes; magnets; electricity; batteries; light; sound; colours; mirrors; shadows
    """.replace("\n", ";").split(";")
    if line.strip()
)

# names, places and items for synthetic records (JSON prompts)
NAMES = (
    "Amir Beatriz Chen Dmitri Elena Farah Gustav Hana Ines Jonas Kofi Lena Mateo Nadia Oskar Priya Quentin Rosa "
    "Sami Tara Ugo Vera Wim Ximena Yusuf Zoe"
).split()
CITIES = (
    "Oslo Prague Dublin Warsaw Athens Helsinki Lyon Porto Zurich Krakow Seville Bergen Ghent Turin Split Tallinn "
    "Riga Bordeaux Munich Naples"
).split()
ITEMS = {
    "vegetable": "carrot potato onion leek spinach pepper cucumber celery radish pumpkin".split(),
    "tool": "hammer wrench screwdriver saw drill pliers chisel ladder tape glue".split(),
    "book": "atlas dictionary novel cookbook diary notebook journal manual almanac comic".split(),
    "colour": "red orange yellow green blue indigo violet brown grey white".split(),
}
SEQUENCES = {
    "month": "January February March April May June July August September October November December".split(),
    "planet": "Mercury Venus Earth Mars Jupiter Saturn Uranus Neptune".split(),
    "season": "spring summer autumn winter".split(),
    "letter": list("ABCDEFGHIJ"),
}

MAX_DOC_CHARS = 700  # documentation quoted in a prompt: its first paragraphs, cut at a sentence


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: int
    kind: str  # one of CLASSES
    prompt: str
    source: str  # what it was made from: "textwrap.dedent", "topic:bees and pollination", "records:name-age-city"


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


@dataclasses.dataclass(frozen=True)
class Function:
    """A short standard-library function, as its source file spells it (dedented)."""

    qualname: str  # module.function or module.Class.method
    name: str
    source: str
    params: tuple[str, ...]  # its parameters other than self/cls
    numbers: tuple[int, ...]  # integer literals in its body (2 or more)
    strings: tuple[str, ...]  # short one-line string literals in its body (not the docstring)


def short_functions(modules: tuple[str, ...] = SOURCE_MODULES, lines: tuple[int, int] = (6, 40)) -> list[Function]:
    """The public functions and methods of the modules' Python sources with `lines` lines, sorted."""
    out = {}
    for name in modules:
        try:
            path = getattr(importlib.import_module(name), "__file__", None) or ""
        except ImportError:
            continue
        if not path.endswith(".py"):
            continue  # a C module has no source to edit
        text = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(text)
        nodes = [(n, f"{name}.{n.name}") for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in tree.body:
            if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_"):
                nodes += [(n, f"{name}.{cls.name}.{n.name}") for n in cls.body if isinstance(n, ast.FunctionDef)]
        for node, qualname in nodes:
            if node.name.startswith("_") or node.decorator_list:
                continue
            source = ast.get_source_segment(text, node, padded=True)
            if source is None or not lines[0] <= source.count("\n") + 1 <= lines[1]:
                continue
            doc = ast.get_docstring(node, clean=False)
            out[qualname] = Function(
                qualname,
                node.name,
                textwrap.dedent(source),
                tuple(a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1),
                tuple(sorted({c.value for c in ast.walk(node) if _is_int(c) and c.value >= 2})),
                tuple(
                    sorted(
                        {
                            c.value
                            for c in ast.walk(node)
                            if isinstance(c, ast.Constant)
                            and isinstance(c.value, str)
                            and c.value != doc
                            and 3 <= len(c.value) <= 40
                            and c.value.isprintable()
                            and '"' not in c.value
                        }
                    )
                ),
            )
    return [out[k] for k in sorted(out)]


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


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


class _Sources:
    """What prompts are made from, and one maker per request kind: each takes the seeded
    generator and returns (prompt text, source name)."""

    def __init__(self):
        self.docs = documented_objects()
        self.long_docs = [d for d in self.docs if len(d[2].split()) >= 40]
        self.functions = short_functions()
        if not self.docs:
            raise SpecrtError(
                "no documented standard-library objects found; this Python build ships no docstrings (python -OO?)"
            )
        self.makers = {
            "chat": [(self.topic_chat, 3), (self.python_chat, 1)],
            "code_edit": [(self.edit_function, 3), (self.write_code, 1)],
            "summarization": [(self.summarize, 1)],
            "json": [(self.records, 2), (self.sequence, 1), (self.describe_json, 1)],
        }

    def make(self, kind: str, rng: np.random.Generator) -> tuple[str, str]:
        makers = [m for m, w in self.makers[kind] for _ in range(w)]
        return makers[int(rng.integers(len(makers)))](rng)

    @staticmethod
    def pick(rng, seq):
        return seq[int(rng.integers(len(seq)))]

    def topic_chat(self, rng):
        topic = self.pick(rng, TOPICS)
        template = self.pick(
            rng,
            (
                "Tell me something interesting about {t}.",
                "Give me some practical advice about {t}.",
                "Describe {t} to a ten-year-old.",
                "Write a few lines of verse about {t}.",
                "What are the pros and cons of {t}?",
                "Why does {t} matter? Answer in a short paragraph.",
                "List four tips about {t}, one sentence each.",
                "Write a short story, under 150 words, that involves {t}.",
                "I am curious about {t}. Where should I start?",
                "What do most people get wrong about {t}?",
                "Write a friendly paragraph for a newsletter about {t}.",
                "Explain {t} as if I were hearing about it for the first time.",
            ),
        )
        return template.format(t=topic), f"topic:{topic}"

    def python_chat(self, rng):
        module, qualname, doc = self.pick(rng, self.docs)
        template = self.pick(
            rng,
            (
                "Explain in simple words what `{q}` in Python does.",
                "When would I use `{q}` in Python? Give one everyday example.",
                "What is a common mistake people make with `{q}`, and how do I avoid it?",
                "Here is what the Python docs say about `{q}`: {s} Can you explain that to a beginner?",
            ),
        )
        return template.format(q=qualname, s=_summary(doc)), qualname

    def edit_function(self, rng):
        f = self.pick(rng, self.functions)
        edits = [
            f"Rename the function `{f.name}` to `{f.name}_new`.",
            "Add a short comment above the first line of the body that says what the function does.",
            "Add type hints to the parameters of this function.",
        ]
        edits += [f"Rename the parameter `{p}` to `{p}_value` everywhere in this function." for p in f.params[:2]]
        edits += [f"Change the number {n} to {n * 2} everywhere in this function." for n in f.numbers[:2]]
        edits += [f'Change the string "{s}" to "{s.upper()}" in this function.' for s in f.strings[:2]]
        edit = self.pick(rng, edits)
        ask = self.pick(rng, ("Return the complete updated function.", "Return the whole function with the change."))
        return f"{edit} {ask}\n\n```python\n{f.source.rstrip()}\n```", f.qualname

    def write_code(self, rng):
        module, qualname, doc = self.pick(rng, self.docs)
        template = self.pick(
            rng,
            (
                "Write a short Python function that uses `{q}` and explain each line.",
                "Write a Python function that does the following, without importing `{m}`: {s}",
                "Write a unit test with the unittest module for `{q}`.",
            ),
        )
        return template.format(q=qualname, m=module, s=_summary(doc)), qualname

    def summarize(self, rng):
        module, qualname, doc = self.pick(rng, self.long_docs)
        template = self.pick(
            rng,
            (
                "Summarize the following documentation in two sentences:\n\n{d}",
                "Rewrite this documentation as three short bullet points:\n\n{d}",
                "Give this documentation a one-line title and a one-sentence summary:\n\n{d}",
                "Summarize this passage, quoting its first sentence word for word:\n\n{d}",
                "Quote the two most important sentences of this text exactly, then explain them:\n\n{d}",
                "Summarize this text in a short paragraph, quoting its key phrase:\n\n{d}",
            ),
        )
        return template.format(d=_excerpt(doc)), qualname

    def records(self, rng):
        n = int(rng.integers(3, 8))
        schema = int(rng.integers(3))
        if schema == 0:
            keys = ("name", "age", "city")
            rows = [f"{self.pick(rng, NAMES)}, {int(rng.integers(18, 80))}, {self.pick(rng, CITIES)}" for _ in range(n)]
        elif schema == 1:
            keys = ("item", "price", "quantity")
            kind = self.pick(rng, sorted(ITEMS))
            rows = [
                f"{self.pick(rng, ITEMS[kind])}, {int(rng.integers(1, 5000)) / 100:.2f}, {int(rng.integers(1, 40))}"
                for _ in range(n)
            ]
        else:
            keys = ("employee", "department", "start_year")
            depts = ("sales", "research", "support", "finance", "design")
            rows = [
                f"{self.pick(rng, NAMES)}, {self.pick(rng, depts)}, {int(rng.integers(1995, 2026))}" for _ in range(n)
            ]
        body = "\n".join(rows)
        template = self.pick(
            rng,
            (
                "Turn these rows into a JSON list of objects with the keys {a}, {b} and {c}:\n\n{rows}",
                "Here is a CSV without a header (columns {a}, {b}, {c}). Convert it to JSON:\n\n{rows}",
                "Return only a JSON array, one object per line below, keys {a}, {b}, {c}:\n\n{rows}",
            ),
        )
        return template.format(a=keys[0], b=keys[1], c=keys[2], rows=body), "records:" + "-".join(keys)

    def sequence(self, rng):
        kind = self.pick(rng, sorted(SEQUENCES))
        values = SEQUENCES[kind]
        n = int(rng.integers(3, len(values) + 1))
        extra = self.pick(rng, ("position", "is_first_half", "length", "note"))
        template = self.pick(
            rng,
            (
                "Write a JSON array of {n} objects, one per {k} starting from {first}, each with the keys {k}, "
                "index and {x}.",
                "Make a JSON object whose keys are the first {n} {k}s (from {first}) and whose values give each "
                "one's {x}.",
            ),
        )
        return template.format(n=n, k=kind, first=values[0], x=extra), f"sequence:{kind}"

    def describe_json(self, rng):
        if rng.integers(2):
            topic = self.pick(rng, TOPICS)
            text = (
                f'Return a JSON object about {topic} with the keys "title", "summary" (one sentence) and '
                '"facts" (a list of three short strings). Return only the JSON.'
            )
            return text, f"topic:{topic}"
        module, qualname, doc = self.pick(rng, self.docs)
        template = self.pick(
            rng,
            (
                'Describe `{q}` as a JSON object with the keys "name", "module", "purpose" and "arguments". '
                "Return only the JSON.",
                "Read this documentation and return a JSON list of the arguments it mentions, each as an "
                'object with "name" and "meaning":\n\n{d}',
            ),
        )
        return template.format(q=qualname, d=_excerpt(doc)), qualname


@functools.lru_cache(maxsize=1)
def _sources() -> _Sources:
    return _Sources()  # parsing the library's sources takes seconds: once per process


SPENT_AFTER = 500  # draws in a row that repeat a prompt: the class has given what it can


def build_prompt_set(n: int, seed: int = 0, exclude: tuple[str, ...] = ()) -> list[Prompt]:
    """`n` distinct prompts, classes in turn (chat, code_edit, summarization, json, chat, ...),
    none equal to a prompt in `exclude` (the held-out benchmark). A class whose draws repeat
    earlier prompts SPENT_AFTER times in a row is spent, and later prompts take the others in
    turn: summarization is spent after its 1,443rd prompt (the 5,773rd of the set, Python
    3.11), and the set goes on with the other three. Its first 5,773 prompts are those of the
    earlier rule, under which a spent class stopped the whole set."""
    sources = _sources()
    rng = np.random.default_rng(seed)
    seen, out = set(exclude), []
    live, turn, misses = list(CLASSES), 0, 0  # turn is len(out) until a class is spent
    while len(out) < n:
        kind = live[turn % len(live)]
        text, source = sources.make(kind, rng)
        if text in seen:
            misses += 1
            if misses == SPENT_AFTER:  # the next class in turn takes its place
                turn, misses = live.index(kind), 0
                live.remove(kind)
                if not live:
                    raise SpecrtError(f"only {len(out)} distinct prompts can be made here; ask for at most that many")
            continue
        misses = 0
        seen.add(text)
        out.append(Prompt(len(out), kind, text, source))
        turn += 1
    return out


HELD_OUT_ONE_IN = 20  # 5 % of the sources
HELD_OUT_LEAST = 4


def source_unit(p: Prompt) -> str:
    """What a held-out split keeps together: the text a prompt was made from (a documented
    object, a function, a topic, a sequence), which other prompts of any class may share. Drawn
    records are the exception: their rows are drawn afresh for each prompt, so two share only
    the template, and each prompt is its own unit."""
    return f"{p.source}#{p.id}" if p.source.startswith("records:") else p.source


def held_out_prompts(prompts: list[Prompt]) -> list[int]:
    """The ids of the prompts kept out of training: every prompt whose source unit hashes into
    one bucket of HELD_OUT_ONE_IN, so the held-out figure is measured on texts the head never
    saw in any form (a split by prompt held out one rewording of a docstring and trained on the
    other three). A prompt's side never changes as the set grows: a corpus extended later keeps
    its split. A small set (under about 80 prompts) whose bucket holds fewer than HELD_OUT_LEAST
    prompts adds the units of the smallest hashes until it does; never every prompt."""

    def bucket(unit: str) -> int:
        return int.from_bytes(hashlib.sha256(unit.encode()).digest()[:8], "big")

    units = {p.id: source_unit(p) for p in prompts}
    chosen = {u for u in units.values() if bucket(u) % HELD_OUT_ONE_IN == 0}
    for u in sorted(set(units.values()), key=bucket):
        if sum(units[p.id] in chosen for p in prompts) >= min(HELD_OUT_LEAST, len(prompts) // 2):
            break
        chosen.add(u)
    held = [p.id for p in prompts if units[p.id] in chosen]
    return held if len(held) < len(prompts) else held[:-1]


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
    fix = "give --hold-out a JSON-lines file with a 'prompt' on each line, like bench/prompts.jsonl"
    rows = read_json_lines(path, SpecrtError, fix, fields=("prompt",))
    bad = next((i for i, r in enumerate(rows) if not isinstance(r["prompt"], str)), None)
    if bad is not None:
        raise SpecrtError(f"{path}: prompt {bad + 1} is not a string; {fix}.")
    return tuple(r["prompt"] for r in rows)
