"""Deterministic randomness: every seed derives from (seed, step, micro-batch, layer)."""
from __future__ import annotations

import hashlib


def derive_seed(*keys: object) -> int:
    """A 63-bit seed from a tuple of keys, identical in every process."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
