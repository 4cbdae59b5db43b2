"""Packed micro-batches: documents back to back in fixed rows, as one tensor.

A packed dataset (``raypipe prepare --pack``) gives the first stage, per
micro-batch, ONE int64 tensor of shape ``(batch, 3, seq_len)``:

- ``[:, 0]`` (:data:`TOKENS`): the token ids, as an unpacked micro-batch holds them;
- ``[:, 1]`` (:data:`POSITIONS`): each token's position inside its document (a
  continuation piece of a split document goes on from where the piece before it
  ended, so it rotates as it would in the whole document);
- ``[:, 2]`` (:data:`DOCUMENT_IDS`): which piece of the row the token belongs to,
  numbered from 0 in each row (the padding at the end of the corpus's last row is
  a piece of its own, whose targets are all ignored).

One tensor, not a tuple, because a stage's input is one tensor (the stage moves it
to its device and counts its bytes like any other); the LLaMA's embedding splits
it (:func:`split_packed`) and its blocks carry ``(hidden, positions, document_ids)``
to each other inside the stage. Targets are the row shifted by one with every
target that crosses into another piece set to ``IGNORE_INDEX`` (-100), so the
loss and ``loss_count_fn`` (which counts targets that are not -100) need nothing
else to average exactly over the tokens that are predicted.
"""
from __future__ import annotations

import torch

TOKENS, POSITIONS, DOCUMENT_IDS = 0, 1, 2
PACKED_FIELDS = 3
IGNORE_INDEX = -100  # the LLaMA loss's ignore_index; a target with it is neither in the loss nor counted


def is_packed(inputs: torch.Tensor) -> bool:
    """Whether ``inputs`` is a packed micro-batch ``(batch, 3, seq_len)`` of integers."""
    return (isinstance(inputs, torch.Tensor) and inputs.dim() == 3 and inputs.size(1) == PACKED_FIELDS
            and not inputs.is_floating_point())


def make_packed(tokens: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """The packed micro-batch of three ``(batch, seq_len)`` integer tensors."""
    if not (tokens.shape == positions.shape == document_ids.shape) or tokens.dim() != 2:
        raise ValueError(f"tokens, positions and document ids must be (batch, seq_len) of one shape, got "
                         f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(document_ids.shape)}")
    return torch.stack([tokens, positions, document_ids], dim=1).to(torch.int64)


def split_packed(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, positions, document_ids)`` of a packed micro-batch, each ``(batch, seq_len)``."""
    if not is_packed(inputs):
        raise ValueError(f"a packed micro-batch is an integer tensor (batch, {PACKED_FIELDS}, seq_len), "
                         f"got {tuple(inputs.shape)} {inputs.dtype}")
    return inputs[:, TOKENS], inputs[:, POSITIONS], inputs[:, DOCUMENT_IDS]


def document_targets(rows: torch.Tensor, document_ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """The targets of packed rows: ``rows[:, 1:]``, with ``IGNORE_INDEX`` where the target is
    another piece's token (a document's last token does not predict the next one's first)
    or padding. All three are ``(batch, seq_len + 1)``: whole rows, ``padding`` bool."""
    targets = rows[:, 1:].clone()
    targets[(document_ids[:, 1:] != document_ids[:, :-1]) | padding[:, 1:]] = IGNORE_INDEX
    return targets
