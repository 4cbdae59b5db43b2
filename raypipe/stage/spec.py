"""WorkerSpec: everything a stage worker is built from, frozen, so that a
replacement worker can be built from exactly the same description."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

from raypipe.config import PipelineConfig
from raypipe.core import lowering
from raypipe.core.ops import I, W, LoweredOp, Op, worker_and_chunk
from raypipe.core.schedule import PLACEMENT, make_schedule
from raypipe.models.layers import LayerSpec


@dataclass(frozen=True)
class WorkerSpec:
    """One stage worker: its place, its layers and how it trains them.

    ``layers`` are modules or :class:`~raypipe.LayerSpec` (built inside the
    worker); ``layer_indices`` their global indices. A worker of a schedule with
    ``config.virtual_stages`` (v) > 1 holds v model chunks (each one virtual stage,
    placed as :data:`~raypipe.core.schedule.PLACEMENT` says): ``layers`` are its
    chunks' layers one chunk after the other, ``chunk_sizes`` how many each has. ``ops`` the stage's part
    of the schedule the driver built and dry-ran (empty: the config's schedule), and ``lowered`` the same
    stage's lowered ops (:meth:`lowered_ops`), lowered once by the driver for every worker of a layout
    (:meth:`for_layout`) rather than by each worker as it starts. ``loss_fn`` is given to the
    last stage only. ``use_gpu`` is what the runtime resolved for this cluster
    (the config's ``use_gpu`` may say "decide for me").
    """

    stage: int
    num_stages: int
    layers: tuple[nn.Module | LayerSpec, ...]
    layer_indices: tuple[int, ...]
    config: PipelineConfig
    ops: tuple[Op, ...] = ()  # this stage's F/B ops of the (driver-checked) schedule
    use_gpu: bool = False
    replica: int = 0
    num_replicas: int | None = None  # None: the config's (fixed) number
    micro_batches: range | None = None
    optimizer_factory: Callable | None = None
    loss_fn: Callable | None = None
    loss_count_fn: Callable | None = None
    scheduler_factory: Callable | None = None
    chunk_sizes: tuple[int, ...] = ()  # layers per chunk, in chunk order; empty: one chunk of every layer
    tp_rank: int = 0  # which of the stage's config.tensor_parallel workers (its shard of the planned layers)
    # this stage's lowered ops of a step (empty: lowered from ops when asked); long, and ops says what they run
    lowered: tuple[LoweredOp, ...] = field(default=(), repr=False)

    @property
    def bundle_index(self) -> int:
        """The bundle of its replica's placement group this worker runs in: its stage's, which
        the stage's ``tensor_parallel`` workers share (so they run on one node)."""
        return self.stage

    @property
    def block(self) -> range:
        """The step's micro-batches this worker's replica runs (global indices)."""
        if self.micro_batches is not None:
            return self.micro_batches
        count = self.config.num_micro_batches
        return range(self.replica * count, (self.replica + 1) * count)

    @property
    def running_replicas(self) -> int:
        """How many replicas run a step together with this one."""
        return self.num_replicas if self.num_replicas is not None else self.config.max_replicas

    def stage_ops(self) -> tuple[Op, ...]:
        """This stage's F/B ops, in the order it runs them."""
        if self.ops:
            return self.ops
        schedule, _ = _lowered_schedule(self.config.schedule, self.num_stages, len(self.block), self.num_chunks)
        return schedule[self.stage]

    def for_layout(self, replica: int, num_replicas: int, micro_batches: range) -> WorkerSpec:
        """This stage as replica ``replica`` of ``num_replicas`` running ``micro_batches``, with
        its ops and their lowering (each distinct schedule lowered once in this process, so a
        layout of many workers costs one lowering, and the workers none)."""
        schedule, lowered = _lowered_schedule(self.config.schedule, self.num_stages, len(micro_batches),
                                              self.num_chunks)
        return replace(self, replica=replica, num_replicas=num_replicas, micro_batches=micro_batches,
                       ops=schedule[self.stage], lowered=lowered[self.stage])

    def lowered_ops(self) -> list[LoweredOp]:
        """This stage's lowered ops of a step: :attr:`lowered` where the driver gave them,
        else lowered here. A split backward (I, W) or several chunks place each receive after its
        peer's send, so the whole schedule is lowered (alike on every worker)."""
        if self.lowered:
            return list(self.lowered)
        stage_ops = self.stage_ops()
        if self.num_chunks == 1 and not any(op.kind in (I, W) for op in stage_ops):
            return lowering.lower_stage(self.stage, stage_ops, self.num_stages)
        schedule, lowered = _lowered_schedule(self.config.schedule, self.num_stages, len(self.block), self.num_chunks)
        if schedule[self.stage] != tuple(stage_ops):
            raise ValueError(f"stage {self.stage}: its ops are not those of schedule {self.config.schedule!r}, "
                             "which the other workers lower")
        return list(lowered[self.stage])

    @property
    def num_chunks(self) -> int:
        """The model chunks this worker holds (v, ``config.virtual_stages``)."""
        return self.config.virtual_stages

    def chunk_positions(self, chunk: int) -> range:
        """Where ``chunk``'s layers are in :attr:`layers`."""
        sizes = self.chunk_sizes or (len(self.layers),)
        return range(sum(sizes[:chunk]), sum(sizes[:chunk + 1]))

    @property
    def is_first(self) -> bool:
        """Whether this worker holds the first virtual stage (its chunk 0, in every placement): it reads inputs."""
        return self.stage == 0

    @property
    def last_chunk(self) -> int | None:
        """This worker's chunk that holds the model's last virtual stage (it computes the loss), or None."""
        worker, chunk = worker_and_chunk(self.num_stages * self.num_chunks - 1, self.num_stages,
                                         PLACEMENT[self.config.schedule])
        return chunk if worker == self.stage else None

    @property
    def is_last(self) -> bool:
        """Whether this worker holds the last virtual stage: it reads targets and computes the loss."""
        return self.last_chunk is not None


@functools.lru_cache(maxsize=32)
def _lowered_schedule(name: str, num_stages: int, num_micro_batches: int, num_chunks: int
                      ) -> tuple[tuple[tuple[Op, ...], ...], tuple[tuple[LoweredOp, ...], ...]]:
    """Schedule ``name``'s ops (built and dry-run) and their lowering, per worker: once per
    distinct schedule in a process (the driver asks for every worker of a layout)."""
    schedule = make_schedule(name, num_stages, num_micro_batches, num_chunks)
    return (tuple(map(tuple, schedule)),
            tuple(map(tuple, lowering.lower(schedule, PLACEMENT[name]))))
