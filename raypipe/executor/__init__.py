"""Who drives a step: one :class:`~raypipe.executor.base.Executor` interface,
a per-op implementation (a Ray task per op, over the object store or Ray Direct
Transport) and a per-step one (a Ray task per worker, direct sends). Both
interpret the same lowered schedule (:mod:`raypipe.core.lowering`)."""
from __future__ import annotations

from raypipe.config import PipelineConfig
from raypipe.core.ops import Op
from raypipe.executor.base import Executor


def make_executor(config: PipelineConfig, schedule: list[list[Op]]) -> Executor:
    """The executor for ``config.transport``: "p2p" runs per step (its calls sent over
    a connection to each worker or as actor tasks, per ``config.step_calls``);
    "object_store", "gloo" and "nccl" run per op over that transport."""
    if config.transport == "p2p":
        from raypipe.executor.per_step import PerStepExecutor

        return PerStepExecutor(config, schedule)
    from raypipe.executor.per_op import PerOpExecutor

    if config.transport == "object_store":
        from raypipe.comm.object_store import ObjectStoreTransport

        return PerOpExecutor(config, schedule, ObjectStoreTransport())
    from raypipe.comm.direct import DirectTransport

    return PerOpExecutor(config, schedule, DirectTransport(config.transport))

