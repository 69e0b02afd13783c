"""Structured output: a grammar every emitted token must keep valid (a JSON schema, any JSON
object, a regular expression or a Lark grammar), through llguidance.

    grammar = Grammar.json_schema({"type": "object", "properties": {...}})
    result = spec.generate("Extract the fields ...", 128, grammar=grammar)

What constrained decoding means here: at every position the target's logits of the tokens the
grammar does not allow after the tokens so far become -inf, and the row's sampling (greedy,
temperature, top-k, top-p) runs on what is left. The grammar's state is a `Matcher` per request.

Under speculation (runtime/speculative.py) every node of a draft tree is verified against the
target masked by the grammar state after that node's path: the matcher advances along each
path of the tree and rolls back (`Matcher.tree_masks`), so the acceptance rule sees exactly the
distributions constrained plain decoding draws from. Greedy output therefore equals constrained
greedy plain output, and sampled output follows the masked target. A draft node the grammar
forbids has probability 0 under the masked target and is never accepted; for point-mass drafts
and greedy rows the tree is cut before it (it would cost a verified position for nothing). A
sampled draft with a real q keeps such nodes: cutting on the drawn token's value would change
the distribution the kept tokens were drawn from, and the rule is exact only for that q.

Grammar drafts (jump-forward): where the grammar allows only one continuation (a key of the
schema, `": "`, a closing brace), llguidance names the tokens it forces (`Matcher.forced`); they
are drafted in front of the draft method's own tree (a copy draft then continues after them),
so a step verifies them at the cost of a position each and they are accepted unless the
tokenization the target prefers differs.

Why llguidance and not xgrammar (both on PyPI, both maintained, both fast): xgrammar's wheel
requires torch, transformers and triton, so a CPU deployment would carry a second copy of
PyTorch and a GPU compiler it never uses; llguidance's requires nothing. On the default
tokenizer (49,152 tokens) llguidance reads the tokenizer in 0.43 s (once per target), compiles
a three-field schema in 0.8 ms and computes a mask in 8-1,200 us (the first mask of a grammar
is the slowest). JSON is compiled with fixed separators (", " and ": ", no other whitespace,
as Python's json.dumps writes it): with free whitespace nothing is ever forced (a space could
always come next) and a small model may pad its answer with newlines until the budget ends; a
schema's own "x-guidance" options override these.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.verification import DraftTree

# json.dumps' separators and no other whitespace (the module docstring says why)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOO_DEEP = "the JSON schema nests too deeply to read; flatten it (use $defs)"
PROBE = 8  # tokens Vocabulary.matcher follows to try a new grammar (its first mask and steps)
COMPILED = 64  # compiled grammars a Vocabulary keeps (a server sees the same schemas again and again)
NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "lark": "Lark grammar"}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise SpecrtError(
            "structured output needs llguidance; install it with `pip install llguidance` (or `pip install "
            "-e .[serve]`)"
        ) from None
    return llguidance


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A constraint on a request's output: `kind` (one of NAMES) and its llguidance grammar.
    Make one with the class methods; `Vocabulary.matcher` compiles it for a target."""

    kind: str
    source: str  # llguidance's grammar (a JSON document)

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        """Output that is one JSON value valid under `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SpecrtError(f"the JSON schema is not valid JSON ({e}); pass a JSON object") from None
            except RecursionError:
                raise SpecrtError(TOO_DEEP) from None
        if not isinstance(schema, dict):
            raise SpecrtError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        try:
            source = _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise SpecrtError(f"the JSON schema cannot be read: {_short(e)}") from None
        except RecursionError:
            raise SpecrtError(TOO_DEEP) from None
        return cls("json_schema", source)

    @classmethod
    def json_object(cls) -> "Grammar":
        """Output that is one JSON object (OpenAI's JSON mode)."""
        source = _llguidance().LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        return cls("json_object", source)

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Output that matches `pattern` in full (Rust regex syntax: no lookaround, no backreferences)."""
        if not isinstance(pattern, str) or not pattern:
            raise SpecrtError("a regex constraint must be a non-empty string")
        return cls("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """Output that the Lark grammar `text` derives from its `start` rule (llguidance's dialect)."""
        if not isinstance(text, str) or not text.strip():
            raise SpecrtError("a Lark grammar must be a non-empty string")
        return cls("lark", _llguidance().LLMatcher.grammar_from_lark(text))


class Vocabulary:
    """The target's tokenizer as llguidance reads it (built once per target: ~0.4 s for a 49k
    vocabulary); it compiles grammars into matchers, and keeps the last COMPILED grammars
    compiled: a request's matcher is then a copy (13 us against 0.6 ms for a compile and first
    mask of an eight-field schema here), so the server's check of a request's grammar and the
    engine's matcher per choice compile it once."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        llg = _llguidance()
        if tokenizer is None:
            raise SpecrtError("structured output needs the target's tokenizer; load the target with its checkpoint")
        eos = sorted(eos_ids)
        try:
            self.ll = llg.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
        except ValueError:  # a decoder llguidance cannot read (word-level): each token as its own text
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Tokens(tokenizer, vocab_size, eos)), n_vocab=vocab_size)
        self.vocab_size, self.eos = vocab_size, eos
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()  # source -> matcher
        self._lock = threading.Lock()  # the server checks grammars on its request threads, the engine thread copies

    def matcher(self, grammar: Grammar) -> "Matcher":
        """A fresh matcher for one request; a grammar the engine cannot compile is a SpecrtError
        that names the problem."""
        with self._lock:
            compiled = self._compiled.get(grammar.source)
            if compiled is not None:
                self._compiled.move_to_end(grammar.source)
        if compiled is None:
            llg = _llguidance()
            # terse errors: llguidance's verbose ones carry the parser's state and the whole grammar
            limits = llg.LLParserLimits(verbose_errors=False)
            compiled = llg.LLMatcher(self.ll, grammar.source, log_level=0, limits=limits)
            if compiled.is_error():
                raise SpecrtError(f"the {NAMES[grammar.kind]} cannot be compiled: {_short(compiled.get_error())}")
            self._probe(compiled, grammar.kind)
            with self._lock:
                self._compiled[grammar.source] = compiled
                if len(self._compiled) > COMPILED:
                    self._compiled.popitem(last=False)
        return Matcher(compiled.deep_copy(), self.vocab_size, self.eos)

    def _probe(self, compiled, kind: str) -> None:
        """Follow a fresh grammar's first PROBE tokens (the highest allowed id each time: a merged
        token of a BPE vocabulary, where low ids hold the special and unknown tokens): a
        grammar beyond llguidance's limits (a row of thousands of items, a regex of too many
        states) compiles, then fails on its first tokens; refused here, before it is queued."""
        m = Matcher(compiled.deep_copy(), self.vocab_size, self.eos)
        for _ in range(PROBE):
            allowed = m.mask()
            allowed[self.eos] = False
            if m.error is not None or not allowed.any():
                break
            m.advance([int(np.flatnonzero(allowed)[-1])])
        if m.error is not None:
            raise SpecrtError(
                f"the {NAMES[kind]} cannot be used: {m.error} (a limit of the grammar engine, llguidance); "
                "make it smaller or simpler (fewer properties or alternatives, smaller repetition counts)"
            )


class _Tokens:
    """A tokenizer given to llguidance token by token (TokenizerWrapper's protocol): each token's
    bytes are its decoded text, and text is split into the longest tokens first (how llguidance
    tokenizes what a grammar forces; a word-level tokenizer cannot split glued words itself)."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        self.eos_token_id, self.bos_token_id = eos[0], None
        texts = [tokenizer.decode([i]) for i in range(vocab_size)]
        plain = [tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
        specials = set(eos) | {i for i, t in enumerate(texts) if not t}
        # llguidance's mark of a special token: its name after a 0xff byte (no text matches it)
        self.tokens = [b"\xff" + plain[i].encode() if i in specials else texts[i].encode() for i in range(vocab_size)]
        self.special_token_ids = sorted(specials)
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens))) if i not in specials}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        ids, i = [], 0
        while i < len(data):
            n = next((n for n in range(min(self._longest, len(data) - i), 0, -1) if data[i : i + n] in self._ids), 0)
            if not n:  # a byte no token starts with: this text has no tokenization
                return ids
            ids.append(self._ids[data[i : i + n]])
            i += n
        return ids


class Matcher:
    """One request's grammar state: what it allows next, what it forces, and the masks along a
    draft tree's paths.

    A grammar llguidance cannot follow past some token (a limit of its parser or lexer: a row of
    too many items, a regex of too many states) sets `error` and never raises mid-step: the mask
    becomes EOS only, nothing is forced, and the engine ends that row with the error (the other
    rows of the step go on). `Vocabulary.matcher` tries a grammar's first tokens when it compiles
    one, so most such grammars are refused before they are queued."""

    def __init__(self, ll, vocab_size: int, eos: list[int]):
        self.ll, self.V, self.eos = ll, vocab_size, eos
        self.error: str | None = None

    def _fail(self, what: str) -> None:
        if self.error is None:
            self.error = _short(f"{what}: {self.ll.get_error() or 'the parser stopped'}")

    def _eos_only(self) -> np.ndarray:
        mask = np.zeros(self.V, dtype=bool)
        mask[self.eos] = True
        return mask

    def mask(self) -> np.ndarray:
        """(V,) bool: the tokens allowed next (EOS only once the grammar is complete; EOS too
        when nothing is, so a row the grammar cannot continue ends rather than emit garbage)."""
        if self.error is not None:  # every failure of the parser sets it (_fail)
            return self._eos_only()
        bits = np.unpackbits(np.frombuffer(self.ll.compute_bitmask(), np.uint8), bitorder="little")
        if self.ll.is_error():
            self._fail("the grammar parser failed")
            return self._eos_only()
        mask = bits[: self.V].astype(bool)
        if not mask.any():
            mask[self.eos] = True
        return mask

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """logits (..., V) with the tokens not allowed next at -inf."""
        return np.where(self.mask(), logits, -np.inf)

    def advance(self, tokens) -> None:
        """The row emitted `tokens` (each allowed: they came from masked distributions; an EOS
        ends the row, so the matcher need not see it). A token the parser cannot take sets
        `error`."""
        for t in tokens:
            if int(t) in self.eos or self.error is not None:
                break
            if not self.ll.consume_token(int(t)):
                self._fail(f"the grammar could not follow token {int(t)}")

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the grammar forces next (none when it allows a choice)."""
        if most <= 0 or self.error is not None:
            return []
        forced = self.ll.compute_ff_tokens()
        if self.ll.is_error():
            self._fail("the grammar parser failed")
            return []
        return forced[:most]

    def tree_masks(self, tree: DraftTree, cut: bool) -> tuple[DraftTree, np.ndarray]:
        """The masks at the root and at every node of `tree`, each after its node's path: (the
        tree, (n + 1, V) bool). A node the grammar forbids, or one after an EOS, gets its parent's
        mask (it is never accepted, or what follows it is dropped, so its row is never used); with
        `cut` the tree ends before the first such node
        (point masses and greedy rows: see the module docstring). The matcher ends where it began.
        Where the parser fails along the tree, the tree is cut to nothing and the root's mask is
        EOS only (`error` says why)."""
        n = len(tree)
        masks = np.empty((n + 1, self.V), dtype=bool)
        masks[0] = self.mask()
        valid = np.ones(n, dtype=bool)
        path: list[int] = []  # the nodes the matcher has consumed, root first
        try:
            for i in range(n):
                if self.error is not None:
                    break
                p = int(tree.parents[i])
                t = int(tree.tokens[i])
                # nothing follows an EOS (the row ends there), and llguidance does not roll one back
                if (p >= 0 and (not valid[p] or int(tree.tokens[p]) in self.eos)) or not masks[p + 1, t]:
                    valid[i] = False
                    if cut:
                        return tree.truncate(i), masks[: i + 1]
                    masks[i + 1] = masks[p + 1]
                    continue
                chain = _ancestors(tree.parents, p)
                keep = 0
                while keep < min(len(path), len(chain)) and path[keep] == chain[keep]:
                    keep += 1
                if len(path) > keep:
                    self.ll.rollback(len(path) - keep)
                    del path[keep:]
                for node in chain[keep:]:  # back down to the parent (a tree in breadth-first order)
                    if not self._consume(int(tree.tokens[node])):
                        break
                    path.append(node)
                if self.error is not None:
                    break
                if t in self.eos:  # allowed, and the last of its path
                    masks[i + 1] = masks[p + 1]
                    continue
                if not self._consume(t):
                    break
                path.append(i)
                masks[i + 1] = self.mask()
            if self.error is not None:
                return tree.truncate(0), self._eos_only()[None]
            return tree, masks
        finally:
            if path and not self.ll.is_error():
                self.ll.rollback(len(path))

    def _consume(self, token: int) -> bool:
        if self.ll.consume_token(token):
            return True
        self._fail(f"the grammar could not follow token {token}")
        return False


def _short(text: str, most: int = 300) -> str:
    """An llguidance error on one line, cut to `most` characters (its messages can carry the
    parser's state or the whole grammar)."""
    text = " ".join(str(text).replace("<non-verbose/>", "").split())
    return text if len(text) <= most else text[: most - 3] + "..."


def _ancestors(parents: np.ndarray, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root, -1)."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = int(parents[node])
    return chain[::-1]
