"""Sizes in bytes as people write them (``80GB``, ``141GiB``) and as raypipe prints them."""
from __future__ import annotations

import re

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30; a unit is required (ValueError naming ``text`` otherwise)."""
    match = _SIZE.match(str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a number and a unit, e.g. 80GB or 141GiB "
            f"(units: B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(count: int | None) -> str:
    """Decimal units, as GPU memory and disks are usually quoted."""
    if count is None:
        return "-"
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"
