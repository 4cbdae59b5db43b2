"""Rotary position embeddings: the cos/sin tables, Llama 3.1's frequency scaling, the rotation.

Rotary embeddings use the "rotate half" pairing (dimension ``j`` with ``j + head_dim/2``),
as Hugging Face checkpoints do. Their cos/sin tables are built once per process (per stage)
and shared by every block (:func:`shared_rotary_tables`), not stored in each block.
"""
from __future__ import annotations

import math
import threading

import torch

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rotary_tables(head_dim: int, max_seq_len: int, theta: float,
                  scaling: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape (max_seq_len, head_dim // 2), fp32.

    Position ``t`` rotates the pair (j, j + head_dim/2) by ``t * theta**(-2j/head_dim)``,
    the frequencies rescaled as Llama 3.1 does when ``scaling`` is given.
    """
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rotary_frequencies(head_dim, theta, scaling))
    return angles.cos(), angles.sin()


def rotary_frequencies(head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> torch.Tensor:
    """The (head_dim // 2,) fp32 rotation frequencies ``theta**(-2j/head_dim)``, Llama 3.1-scaled when asked."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return inv_freq if scaling is None else llama3_frequencies(inv_freq, scaling)


_shared_frequencies: dict[tuple, torch.Tensor] = {}


def rotary_at_positions(positions: torch.Tensor, head_dim: int, theta: float,
                        scaling: dict[str, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, T, head_dim // 2), fp32, of per-token ``positions`` (batch, T): packed
    documents, each at its own positions, which may run past any table (a continuation piece
    goes on from where its document's previous piece ended). The angle is the table's one
    product ``position * frequency`` in fp32, as Hugging Face computes it from position ids."""
    scaling_key = None if scaling is None else tuple(sorted((k, float(v)) for k, v in scaling.items()))
    key = (head_dim, float(theta), scaling_key, positions.device)
    frequencies = _shared_frequencies.get(key)
    if frequencies is None:
        with torch.device("cpu"), torch.inference_mode(False), torch.no_grad():
            frequencies = rotary_frequencies(head_dim, theta, scaling)
        frequencies = _shared_frequencies[key] = frequencies.to(positions.device)
    angles = positions.to(torch.float32)[..., None] * frequencies
    return angles.cos(), angles.sin()


_shared_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_shared_tables_lock = threading.Lock()


def shared_rotary_tables(head_dim: int, max_positions: int, theta: float, scaling: dict[str, float] | None,
                         device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_tables` on ``device``, built once per process and shared by every caller.

    Every block of a stage asks for the same tables, so a stage holds one pair whatever its
    number of blocks (a checkpoint's ``max_position_embeddings`` can be 131072: 32 MiB per
    table at head_dim 128). Computed on the CPU in fp32 and then copied, as a module's
    buffers were, so the values are bitwise those of a per-block table. Not module buffers:
    they stay out of state dicts and checkpoints, and ``module.to()`` cannot split them.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    scaling_key = None if scaling is None else tuple(sorted((k, float(v)) for k, v in scaling.items()))
    key = (head_dim, max_positions, float(theta), scaling_key, torch.float32, device)
    tables = _shared_tables.get(key)
    if tables is None:
        with _shared_tables_lock:  # stage threads may run blocks concurrently: still one build
            tables = _shared_tables.get(key)
            if tables is None:
                # CPU math whatever the caller's default device, as the buffers had; normal tensors
                # even when the first caller runs under inference_mode (training reuses them)
                with torch.device("cpu"), torch.inference_mode(False), torch.no_grad():
                    cos, sin = rotary_tables(head_dim, max_positions, theta, scaling)
                    tables = _shared_tables[key] = (cos.to(device), sin.to(device))
    return tables


def clear_shared_rotary_tables() -> None:
    """Forget the shared tables (their memory is freed once no tensor refers to them)."""
    with _shared_tables_lock:
        _shared_tables.clear()
        _shared_frequencies.clear()


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths longer than the original context / low_freq_factor
    are stretched by ``factor``, shorter than context / high_freq_factor kept, those between blended."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(wavelength > context / low, inv_freq / factor,
                       torch.where(wavelength < context / high, inv_freq, scaled))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, heads, head_dim) by the angles of its positions; cos/sin are (T, head_dim/2),
    or (B, T, head_dim/2) when every sequence has positions of its own (packed documents)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
