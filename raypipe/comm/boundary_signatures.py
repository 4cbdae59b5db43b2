"""Learned boundary signatures: what crossed each message key, recorded the first time it
crossed, so that later steps send the payload only (``boundary_shapes="learned"``, the
default of :class:`~raypipe.config.PipelineConfig`).

A message key (:func:`raypipe.core.ops.message_key`: a micro-batch and the boundary between
virtual stages it crosses, the same on both ends) carries, step after step, the activation
of the same micro-batch across the same boundary; in most models its dtype and shape (or,
for a tree, its structure: :mod:`raypipe.comm.tree_messages`) never change. So the first time
a key crosses, its header goes as it always has and both ends record the signature
(:class:`BoundarySignature`); from then on the sender sends the payload only, and the
receiver posts its receive ahead into a buffer of the recorded signature, on every
transport, NCCL's in-order matching included (:mod:`raypipe.comm.matching`). The sender
compares every outgoing activation with the recorded signature before sending anything of
it: a model whose boundary shape depends on the data fails the step with
:class:`~raypipe.errors.BoundaryShapeChanged`, which names the keys to mark dynamic
(:meth:`LearnedSignatures.mark_dynamic`): those keep headers for the rest of the run, on
both ends. ``boundary_shapes="headers"`` sends headers on every key, as before.

Recorded signatures are dropped whenever the group is joined or left (heal, resize,
re-partition), as gloo's receive predictions are: every member leaves before a group
re-forms, so both ends of every key forget together. Keys marked dynamic are kept: they
are a property of the model's data, not of the group.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from raypipe.comm.headers import DTYPES, MessageSignature
from raypipe.comm.tree_messages import TreeStructure
from raypipe.core.ops import BOUNDARY_SHAPES, HEADERS, LEARNED

__all__ = ["BOUNDARY_SHAPES", "HEADERS", "LEARNED", "BoundarySignature", "LearnedSignatures", "changed"]


@dataclass(frozen=True)
class BoundarySignature:
    """What one message key carried: each part's dtype code and shape (a single tensor is a message
    of one part), and a tree's structure (None for a single tensor; with a structure, the parts are
    the tree's: :func:`raypipe.comm.tree_messages.part_signatures`)."""

    payload: MessageSignature
    structure: TreeStructure | None = None

    def describe(self) -> str:
        """The signature as a person reads it: ``float32[4, 16, 64]``, or a tree's leaves."""
        if self.structure is None:
            return _tensor(*self.payload[0])
        leaves = [_tensor(leaf.dtype, leaf.shape) if leaf.kind == "tensor" else
                  ("None" if leaf.kind == "none" else repr(leaf.value)) for leaf in self.structure.leaves]
        return f"a tree of ({', '.join(leaves)})"


def _tensor(code: int, shape: tuple[int, ...]) -> str:
    return f"{str(DTYPES[code]).removeprefix('torch.')}{list(shape)}"


def changed(before: BoundarySignature, after: BoundarySignature) -> tuple[str, str]:
    """``before`` and ``after`` as text that shows what differs (a tree's structure, when
    only that did)."""
    old, new = before.describe(), after.describe()
    if old == new and before.structure is not None and after.structure is not None:
        return f"the structure {before.structure.spec}", f"{after.structure.spec}"
    return old, new


@dataclass
class LearnedSignatures:
    """One channel's record of each message key's signature, and of the keys marked dynamic.

    ``mode``: :data:`LEARNED` (a key with a recorded signature goes without a header) or
    :data:`HEADERS` (nothing is recorded: every key has a header). ``sent`` and ``received``:
    the signatures recorded as this worker sent and received them; ``dynamic``: the keys that
    keep headers."""

    mode: str = LEARNED
    sent: dict[int, BoundarySignature] = field(default_factory=dict)
    received: dict[int, BoundarySignature] = field(default_factory=dict)
    dynamic: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.mode not in BOUNDARY_SHAPES:
            raise ValueError(f"boundary_shapes={self.mode!r}: expected one of {', '.join(BOUNDARY_SHAPES)}")

    def learns(self, key: int) -> bool:
        """Whether ``key``'s signature is recorded when it crosses with a header."""
        return self.mode == LEARNED and key not in self.dynamic

    def to_send(self, key: int) -> BoundarySignature | None:
        """The signature ``key``'s activation must have to go without a header; None: it goes with one."""
        return self.sent.get(key) if self.learns(key) else None

    def to_receive(self, key: int) -> BoundarySignature | None:
        """The signature of ``key``'s activation, which comes without a header; None: it comes with one."""
        return self.received.get(key) if self.learns(key) else None

    def mark_dynamic(self, keys: Iterable[int]) -> None:
        """Keep headers on ``keys`` from now on (their recorded signatures are dropped)."""
        for key in keys:
            self.dynamic.add(key)
            self.sent.pop(key, None)
            self.received.pop(key, None)

    def forget(self) -> None:
        """Drop every recorded signature (the group is joined or left); the dynamic keys stay."""
        self.sent.clear()
        self.received.clear()
