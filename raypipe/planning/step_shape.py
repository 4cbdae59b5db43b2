"""The shape of one configuration a prediction is made for (:class:`StepShape`: everything
but the layers and the cluster), its checks, and how layers and chunks map onto workers."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raypipe.config import CHECKPOINT_MODES
from raypipe.core.ops import virtual_stage
from raypipe.core.schedule import PLACEMENT, SCHEDULES, check_chunks, check_interleaved_micro_batches


@dataclass(frozen=True)
class StepShape:
    """Everything of a configuration but the layers and the cluster."""

    num_replicas: int = 1
    num_stages: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    activation_checkpoint: str = "never"
    precision: str = "bf16"
    shard_optimizer: bool = False
    micro_batch_size: int = 1
    seq_len: int = 1
    amp: str | None = None
    snapshot_every: int = 1
    virtual_stages: int = 1  # model chunks per worker (v): >= 2 for interleaved_1f1b, 2 for zbv
    tensor_parallel: int = 1  # t: GPUs per stage, splitting its layers (on one node)
    sequence_parallel: bool | None = None  # None: on when tensor_parallel > 1

    @property
    def num_gpus(self) -> int:
        """Replicas x stages x tensor-parallel ranks."""
        return self.num_replicas * self.num_stages * self.tensor_parallel

    @property
    def sequence_sharded(self) -> bool:
        """Whether activations between the split layers and across stage boundaries are sequence shards."""
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def num_virtual_stages(self) -> int:
        """The pieces the model is cut into: ``p * v``."""
        return self.num_stages * self.virtual_stages

    def worker_virtual_stages(self) -> list[list[int]]:
        """Per worker, the virtual stage each of its chunks holds, in chunk order (the schedule's placement)."""
        placement = PLACEMENT[self.schedule]
        return [[virtual_stage(worker, chunk, self.num_stages, placement) for chunk in range(self.virtual_stages)]
                for worker in range(self.num_stages)]


def worker_sums(per_virtual_stage: Sequence[float], shape: StepShape) -> list:
    """Per worker, the sum of ``per_virtual_stage`` over its chunks (the entry itself with one chunk)."""
    if shape.virtual_stages == 1:
        return list(per_virtual_stage)
    return [sum(per_virtual_stage[piece] for piece in pieces) for pieces in shape.worker_virtual_stages()]


def check_shape(shape: StepShape, num_layers: int) -> None:
    for name in ("num_replicas", "num_stages", "num_micro_batches", "micro_batch_size", "seq_len",
                 "virtual_stages", "tensor_parallel"):
        value = getattr(shape, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if shape.sequence_parallel not in (None, True, False):
        raise ValueError(f"sequence_parallel={shape.sequence_parallel!r} must be None, True or False")
    if shape.tensor_parallel > 1 and shape.sequence_sharded and shape.seq_len % shape.tensor_parallel:
        raise ValueError(f"tensor_parallel={shape.tensor_parallel}: sequence parallelism shards the sequence, and "
                         f"seq_len={shape.seq_len} does not divide by it")
    if shape.schedule not in SCHEDULES:
        raise ValueError(f"schedule={shape.schedule!r} must be one of {SCHEDULES}")
    try:
        check_chunks(shape.schedule, shape.virtual_stages)  # the schedule's own rule on v
    except ValueError as error:
        raise ValueError(f"virtual_stages={shape.virtual_stages!r}: {error}") from None
    if shape.schedule == "interleaved_1f1b":
        try:
            check_interleaved_micro_batches(shape.num_stages, shape.num_micro_batches)
        except ValueError as error:
            raise ValueError(f"num_micro_batches={shape.num_micro_batches}: {error}") from None
    if shape.num_virtual_stages > num_layers:
        chunks = f" x {shape.virtual_stages} chunks" if shape.virtual_stages > 1 else ""
        raise ValueError(f"num_stages={shape.num_stages}{chunks}: only {num_layers} layers to split")
    if shape.activation_checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpoint={shape.activation_checkpoint!r} must be one of {CHECKPOINT_MODES}")
    if isinstance(shape.snapshot_every, bool) or not isinstance(shape.snapshot_every, int) or shape.snapshot_every < 0:
        raise ValueError(f"snapshot_every={shape.snapshot_every!r} must be an int >= 0")


def stage_bounds(split: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in split:
        out.append((start, start + size))
        start += size
    return out
