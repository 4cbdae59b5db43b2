"""The time a tensor-parallel rank spends in its stage's collectives inside an op, measured on the host.

With tensor parallelism every rank of a stage runs the same collectives inside its F and B
(DTensor's redistributions: all-gathers, reduce-scatters, all-reduces), so a rank whose own
kernels are slow makes its peers wait for it there: their F and B take as long as its. What
tells them apart is where the time goes: the slow rank computes, its peers wait in the
collectives. :class:`CollectiveWait` adds up the seconds spent in them, and the op's own
compute is its time less that wait (:func:`raypipe.control.stragglers.own_compute`).

How: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` active around the op sees every
ATen op; it times the ones of the collective namespaces (``torch.ops._c10d_functional.*``, the
functional collectives DTensor issues, with their ``wait_tensor``; the autograd and legacy ones
too). Ops on a DTensor or an ``AsyncCollectiveTensor`` are handed back (``NotImplemented``, as
torch's own ``CommDebugMode`` does), so that the subclass runs with the mode still active and
its collectives (a redistribution inside an op's sharding, an async result's wait on first
use) are seen and timed too; every other op runs straight through. It is a host measurement,
so it holds where the host blocks in the collectives: on CPU over gloo, where a collective or
its ``wait_tensor`` returns once every rank has arrived. The time in a collective also counts
its transfer, which is communication, not the rank's own compute either.

On CUDA the host does not wait in collectives (their kernels are queued), so nothing is
measured there (:func:`raypipe.stage.stage_op.collective_waits` gives no meter): an op's time
is the device timer's, collectives included, and a slow rank's peers look as slow as it (its
stage is then named whole; :mod:`raypipe.control.stragglers`).

The mode costs a Python call per ATen op of the op it is around (10-30% of the tiny LLaMA's F
and B CPU time, less on larger ops): it is entered only where there is a collective to wait in
(a stage of several tensor-parallel ranks), and only at one step in
:data:`~raypipe.stage.stage_op.COLLECTIVE_WAIT_EVERY` (:func:`~raypipe.stage.stage_op.collective_waits`).
"""
from __future__ import annotations

import time
from typing import Any

from torch._ops import HigherOrderOperator
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# the ATen op namespaces of collectives: the functional ones DTensor issues (and their wait_tensor),
# their autograd variants, the legacy functional ones and c10d's own
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"})
_COLLECTIVE_SUBCLASSES = (DTensor, AsyncCollectiveTensor)  # subclasses whose ops issue or wait on collectives


class CollectiveWait(TorchDispatchMode):
    """While active (``with meter:``), adds to :attr:`seconds` the host's time in collectives
    (the module's docstring). Enter it around one op at a time; it is per thread, as dispatch
    modes are."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True  # they are run through, not timed
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(kind, _COLLECTIVE_SUBCLASSES) for kind in types):
            return NotImplemented  # the subclass runs, this mode still active: its collectives are seen
        if func.namespace not in COLLECTIVE_NAMESPACES:
            return func(*args, **kwargs)
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


__all__ = ["COLLECTIVE_NAMESPACES", "CollectiveWait"]
