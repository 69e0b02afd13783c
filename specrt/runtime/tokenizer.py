"""Tokenizer and chat template, read from a checkpoint directory with `tokenizers` and jinja2.

The chat template is rendered the way transformers renders it (sandboxed jinja2, trim_blocks,
lstrip_blocks) and the rendered text is encoded without adding special tokens, so the prompt
ids equal `AutoTokenizer.apply_chat_template(..., add_generation_prompt=True)`.
"""

from __future__ import annotations

import json
from pathlib import Path

from specrt.artifacts import read_json_object
from specrt.errors import CheckpointError, SpecrtError


class Tokenizer:
    def __init__(self, checkpoint_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(checkpoint_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{d} has no tokenizer.json; convert the checkpoint with `specrt convert` or copy its tokenizer files."
            )
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise CheckpointError(
                f"{path} is not a valid tokenizer file ({e}); restore it from the original checkpoint."
            ) from None
        cfg_path = d / "tokenizer_config.json"
        fix = "restore it from the original checkpoint (or delete it to run without a chat template)"
        self.config = read_json_object(cfg_path, CheckpointError, fix) if cfg_path.is_file() else {}
        template_file = d / "chat_template.jinja"
        self.chat_template = self.config.get("chat_template") or (
            template_file.read_text() if template_file.is_file() else None
        )
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            # transformers also allows a list of named templates; the default one is used
            named = (
                {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
                if isinstance(self.chat_template, list)
                else {}
            )
            if not isinstance(named.get("default"), str):
                raise CheckpointError(
                    f"{cfg_path}: chat_template must be a string (or a list with a 'default' template); restore it "
                    "from the original checkpoint."
                )
            self.chat_template = named["default"]
        self.eos_token = _special_token(self.config, "eos_token", cfg_path)
        self.bos_token = _special_token(self.config, "bos_token", cfg_path)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer as its tokenizer.json text (what llguidance reads, runtime/grammar.py)."""
        return self._tok.to_str()

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise SpecrtError("this checkpoint has no chat template; pass --no-chat to feed the prompt as plain text.")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise SpecrtError(f"the chat template rejected the messages: {e}") from None


def _special_token(config: dict, name: str, path: Path) -> str | None:
    """A special token as a string: tokenizer_config.json gives it as a string or {"content": ...}."""
    token = config.get(name)
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise CheckpointError(
            f'{path}: {name} must be a string or {{"content": string}}, got {json.dumps(token)[:40]}; fix the file.'
        )
    return token


class IncrementalDetokenizer:
    """Text pieces for a growing token list, never splitting a multi-byte character.

    Decodes a short window of recent tokens and emits what is new; a window that ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are never decoded again
        self.read_offset = 0  # text of ids[prefix_offset:read_offset] has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""
