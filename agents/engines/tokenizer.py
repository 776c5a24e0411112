"""Text <-> token ids for the torch engine's models.

Two implementations of one ``TextTokenizer`` protocol: ``HFTokenizer`` loads a
checkpoint folder's ``tokenizer.json`` through Hugging Face ``tokenizers``
(special tokens and chat template from ``tokenizer_config.json``);
``ByteTokenizer`` is built in code for random presets: ids 0..255 are the raw
bytes of the UTF-8 text, so any text round-trips. ``load_tokenizer`` takes the
same model spec as the engine (a preset name or a folder). Incremental
detokenization is the frontend's job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from agents.engines.torch_engine.config import BYTE_VOCAB_SIZE, PRESETS, preset

__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "load_tokenizer", "render_chat"]

_BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")

#: Used when a checkpoint has no chat template, and for random presets.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TextTokenizer(Protocol):
    """What the frontend and the engine need from a tokenizer."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


def render_chat(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for chat ``messages``, rendered with the tokenizer's Jinja chat template.

    As transformers' ``apply_chat_template``: ``tools`` (OpenAI function tools, ``{"type": "function",
    "function": {...}}``; None: the template sees none) and messages' ``tool_calls`` and
    ``tool_call_id`` go to the template as they are, ``tojson`` keeps non-ASCII text and takes
    ``indent``, and a template may ``raise_exception(message)``.
    """
    import jinja2.sandbox

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    template = environment.from_string(tokenizer.chat_template)

    def text_of(token_id: int | None) -> str:
        return "" if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

    return template.render(
        messages=list(messages),
        tools=None if tools is None else list(tools),
        add_generation_prompt=add_generation_prompt,
        bos_token=text_of(tokenizer.bos_token_id),
        eos_token=text_of(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
    )


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` for chat templates (Jinja's own escapes ``<``, ``>``, ``&`` and ``'``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format_: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(format_)


class ByteTokenizer:
    """Byte-level tokenizer of random presets, built in code.

    Ids 0..255 are the bytes of the UTF-8 encoding, so every text round-trips
    and no text can produce a special id; 256 is BOS, 257 EOS, 258 PAD and ids
    up to ``vocab_size`` are reserved specials (rendered ``<|reserved_k|>``
    unless skipped). Invalid UTF-8 (a random model's output) decodes with U+FFFD.
    """

    def __init__(self, vocab_size: int) -> None:
        minimum = BYTE_VOCAB_SIZE + len(_BYTE_SPECIALS)
        if vocab_size < minimum:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= {minimum}, got {vocab_size}")
        self._vocab_size = vocab_size
        self.bos_token_id: int | None = BYTE_VOCAB_SIZE
        self.eos_token_ids: tuple[int, ...] = (BYTE_VOCAB_SIZE + 1,)
        self.chat_template = FALLBACK_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        run = bytearray()
        for token in token_ids:
            if 0 <= token < BYTE_VOCAB_SIZE:
                run.append(token)
                continue
            if not 0 <= token < self._vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self._vocab_size})")
            if not skip_special_tokens:
                pieces.append(run.decode("utf-8", errors="replace"))
                run.clear()
                pieces.append(self.special_token(token))
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    @staticmethod
    def special_token(token_id: int) -> str:
        index = token_id - BYTE_VOCAB_SIZE
        return _BYTE_SPECIALS[index] if index < len(_BYTE_SPECIALS) else f"<|reserved_{index - 3}|>"


class HFTokenizer:
    """A checkpoint's fast tokenizer (``tokenizer.json``) with its special tokens and chat template."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        self._tokenizer = Tokenizer.from_file(str(path))
        settings = _read_json(folder / "tokenizer_config.json")
        model = _read_json(folder / "config.json")

        def token_id(key: str) -> int | None:
            token = settings.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            found = self._tokenizer.token_to_id(token) if isinstance(token, str) else None
            return int(found) if found is not None else None

        bos = token_id("bos_token")
        if bos is None and isinstance(model.get("bos_token_id"), int):
            bos = model["bos_token_id"]
        eos_ids: list[int] = []
        raw_eos = model.get("eos_token_id")
        for candidate in [token_id("eos_token"), *(raw_eos if isinstance(raw_eos, list) else [raw_eos])]:
            if isinstance(candidate, int) and candidate not in eos_ids:
                eos_ids.append(candidate)
        template = settings.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.bos_token_id = bos
        self.eos_token_ids = tuple(eos_ids)
        self.chat_template = template if isinstance(template, str) else FALLBACK_CHAT_TEMPLATE
        self._add_bos = bool(settings.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the checkpoint's rules apply (often a BOS)."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self._add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        data = json.load(file)
    return data if isinstance(data, dict) else {}


def load_tokenizer(model: str) -> TextTokenizer:
    """The tokenizer for ``model``: a preset name (byte-level) or a checkpoint folder path."""
    if model in PRESETS:
        return ByteTokenizer(preset(model).vocab_size)
    if Path(model).is_dir():
        return HFTokenizer(model)
    raise ValueError(f"{model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint folder")
