"""Tokenizers: a small interface, the default byte-level tokenizer and Hugging Face ``tokenizer.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What ``raypipe.data`` needs from a tokenizer.

    ``name`` identifies it in a dataset manifest, so a reader can tell which
    tokenizer produced the ids; ``vocab_size`` bounds every id it returns.
    """

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (without bos/eos)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 <bos>, 257 <eos>, 258 <pad>.

    Needs no vocabulary file and covers any text, which makes it the default
    for the embedded corpus and for tests.
    """

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        for position, token in enumerate(ids):
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(
                    f"token id {int(token)} at position {position} is outside the byte "
                    f"tokenizer's vocabulary [0, {self.vocab_size})"
                )
        data = bytes(int(token) for token in ids if int(token) < 256)
        # Rows cut a document at arbitrary byte offsets, so a multi-byte
        # character may be split: show it as U+FFFD rather than failing.
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer directory (``tokenizer.json``, read with the ``tokenizers`` package:
    the ``hf`` extra). Special tokens come from ``tokenizer_config.json`` when present (``bos_token``,
    ``eos_token``, ``pad_token``), else from the usual names; padding falls back to the eos token.
    """

    _BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
    _EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
    _PAD = ("<pad>", "<|finetune_right_pad_id|>", "[PAD]")

    def __init__(self, directory: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as error:
            raise ImportError("a Hugging Face tokenizer needs the tokenizers package: "
                              "pip install 'raypipe[hf]'") from error

        self.directory = Path(directory).expanduser().resolve()
        file = self.directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: a Hugging Face tokenizer directory holds tokenizer.json")
        self._tokenizer = _Tokenizer.from_file(str(file))
        self.name = f"hf:{self.directory}"
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        declared = self._declared_special_tokens()
        self.eos_id = self._special_id("eos", declared.get("eos_token"), self._EOS)
        self.bos_id = self._special_id("bos", declared.get("bos_token"), self._BOS, default=self.eos_id)
        self.pad_id = self._special_id("pad", declared.get("pad_token"), self._PAD, default=self.eos_id)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(token) for token in ids], skip_special_tokens=True)

    def _declared_special_tokens(self) -> dict[str, str]:
        path = self.directory / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        tokens = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
        return tokens

    def _special_id(self, kind: str, declared: str | None, usual: tuple[str, ...], default: int | None = None) -> int:
        for token in ([declared] if declared else []) + list(usual):
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
            if token == declared:
                raise ValueError(f"{self.directory}: tokenizer_config.json names {kind}_token {declared!r}, "
                                 "which tokenizer.json does not know")
        if default is None:
            raise ValueError(f"{self.directory}: no {kind} token found (tried {', '.join(usual)}); "
                             f"declare {kind}_token in tokenizer_config.json")
        return default

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r})"


_TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer registered under ``name`` (as recorded in a dataset manifest): ``byte``, or
    ``hf:DIR`` for a Hugging Face tokenizer directory."""
    if name.startswith("hf:"):
        return HFTokenizer(name[len("hf:"):])
    try:
        return _TOKENIZERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tokenizer {name!r}; known tokenizers: {sorted(_TOKENIZERS)}"
        ) from None


def tokenizer_name(tokenizer: Tokenizer) -> str:
    """The name a manifest records for ``tokenizer`` (its ``name`` or class name)."""
    return str(getattr(tokenizer, "name", type(tokenizer).__name__))
