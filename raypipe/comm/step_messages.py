"""What one stage's channel has in flight during a step, and remembers of each message key
between steps (:class:`~raypipe.comm.p2p.P2PChannel`'s bookkeeping)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from raypipe.comm.headers import MessageSignature
from raypipe.comm.tree_messages import TreeStructure


@dataclass(frozen=True)
class DeferredReceive:
    """A receive an EXCHANGE posted (or will post) and did not wait for: :meth:`result` waits for
    it and returns what came, once the op that uses it runs. Where a channel may leave a receive
    so (gloo: messages match by tag and no send waits for its receive), the exchange blocks on
    none of its receives, and an op waits only for what it uses: an interleaved step's forward
    does not wait behind the gradient that came in the same exchange for the backward after it."""

    receive: Callable[[], Any]

    def result(self) -> Any:
        """What the receive got, once it came."""
        return self.receive()


@dataclass
class StepMessages:
    """Per message key (a key names one message of the step, whichever peer it is with).

    ``sends``: the running step's unfinished sends (Work and buffer, one per part of a message);
    ``headers``, ``payloads`` and ``gradients``: its posted receives (Work, and the header, or each
    part's buffer: :mod:`raypipe.comm.tree_messages`); ``statistics``: the posted receives of its
    statistics reduction (:meth:`~raypipe.comm.p2p.P2PChannel.expect_statistics`). A pending
    operation keeps the group's connections open, so leaving drops them all. ``sent`` and
    ``received``: the shape each key's activation had last step, as sent and as received, the same
    on both ends of a message, as its key is. ``sent_structures`` and ``received_structures``: the
    running step's trees (:mod:`raypipe.comm.tree_messages`): a sent one gives its gradient's parts,
    a received one the parts of the gradient sent back."""

    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    headers: dict[int, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    payloads: dict[int, tuple[Any, tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    gradients: dict[int, tuple[Any, tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    statistics: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    sent: dict[int, MessageSignature] = field(default_factory=dict)
    received: dict[int, MessageSignature] = field(default_factory=dict)
    sent_structures: dict[int, TreeStructure] = field(default_factory=dict)
    received_structures: dict[int, TreeStructure] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        """Whether an operation was started and not finished."""
        return any((self.sends, self.headers, self.payloads, self.gradients, self.statistics))

    def clear(self) -> None:
        """Forget everything (leaving the group: every member leaves before a group re-forms)."""
        for kept in fields(self):
            getattr(self, kept.name).clear()
