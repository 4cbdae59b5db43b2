"""WorkerSpec: everything a stage worker is built from, frozen, so that a
replacement worker can be built from exactly the same description."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from raypipe.config import PipelineConfig
from raypipe.core.ops import Op, worker_and_chunk
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
    of the schedule the driver built and dry-ran (empty: the config's schedule). ``loss_fn`` is given to the
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
        return self._schedule_ops(len(self.block))

    def for_layout(self, replica: int, num_replicas: int, micro_batches: range) -> WorkerSpec:
        """This stage as replica ``replica`` of ``num_replicas`` running ``micro_batches``."""
        return replace(self, replica=replica, num_replicas=num_replicas, micro_batches=micro_batches,
                       ops=self._schedule_ops(len(micro_batches)))

    def _schedule_ops(self, num_micro_batches: int) -> tuple[Op, ...]:
        config = self.config
        return tuple(make_schedule(config.schedule, self.num_stages, num_micro_batches,
                                   config.virtual_stages)[self.stage])

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
