"""Tokenizer, chat template and UTF-8-safe incremental detokenization (no torch, no transformers)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .errors import InvalidRequest


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: plain ``json.dumps`` in the given key order (Jinja's own escapes
    HTML characters and sorts keys, which changes the tool definitions and calls a template renders)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token: object) -> str:
    """A special token of ``tokenizer_config.json``: its text, or an ``AddedToken``'s as older files store it."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


class ChatTokenizer:
    """``tokenizer.json`` (HF tokenizers) + the chat template from ``chat_template.jinja`` (where recent
    transformers save it) or else ``tokenizer_config.json`` (a list of named templates: its ``default``).

    Rendering follows transformers' ``apply_chat_template`` (sandboxed Jinja, trim/lstrip blocks, ``break`` and
    ``continue``, its ``tojson``, ``raise_exception`` and ``strftime_now``).
    """

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        jinja = Path(model_dir) / "chat_template.jinja"  # transformers' own file, first when present (as it reads)
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: transformers' default one
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        self.chat_template: str | None = template
        self.bos_token, self.eos_token = (_token_text(config.get(key)) for key in ("bos_token", "eos_token"))
        # what transformers gives every template: tools and documents (None unless given), the special tokens
        self._defaults = {"tools": None, "documents": None, "bos_token": self.bos_token, "eos_token": self.eos_token,
                          **{key: _token_text(config[key]) for key in ("unk_token", "pad_token") if config.get(key)}}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are parsed as special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **variables: object) -> str:
        """Prompt text for OpenAI-style ``messages``; ``variables``: more for the template (``tools=``, as
        transformers' ``apply_chat_template`` passes them). Raises ``InvalidRequest`` if the template
        rejects them."""
        if self._template is None:
            raise InvalidRequest("this model has no chat template (a GGUF without tokenizer.chat_template whose "
                                 "vocabulary shows no chat format fleet knows): send a prompt to /v1/completions "
                                 "instead",
                                 param="messages")
        try:
            return self._template.render({**self._defaults, **variables, "messages": messages,
                                          "add_generation_prompt": add_generation_prompt})
        except TemplateError as exc:
            raise InvalidRequest(f"chat template rejected the messages: {exc}", param="messages") from exc

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a UTF-8 character.

    Byte-level BPE tokens can end inside a multi-byte character; such text decodes to U+FFFD, so a
    delta is held back until the character completes (the prefix/read-offset scheme of HF's
    ``TextStreamer`` and vLLM's detokenizer).
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(token)
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read])
        full_text = self._tok.decode(self.ids[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full_text[len(prefix_text):]
        return ""
