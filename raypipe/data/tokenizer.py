"""Tokenizers: a small interface and the default byte-level tokenizer."""
from __future__ import annotations

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


_TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer registered under ``name`` (as recorded in a dataset manifest)."""
    try:
        return _TOKENIZERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tokenizer {name!r}; known tokenizers: {sorted(_TOKENIZERS)}"
        ) from None


def tokenizer_name(tokenizer: Tokenizer) -> str:
    """The name a manifest records for ``tokenizer`` (its ``name`` or class name)."""
    return str(getattr(tokenizer, "name", type(tokenizer).__name__))
