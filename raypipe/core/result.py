"""What one training step reports: plain dataclasses, no Ray, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # an annotation only: step_decision imports torch, which `import raypipe` (this module) does not
    from raypipe.core.step_decision import StepDecision


@dataclass
class OpEvent:
    """One timed op on one stage (wall-clock seconds from ``time.time()``)."""

    stage: int
    op: str  # "F", "B", "I", "W", "recv", "reduce", "gate" (waiting for a snapshot or checkpoint copy), "optimizer"
    micro_batch: int | None  # the replica's own index (0..num_micro_batches-1)
    start: float
    end: float
    replica: int = 0
    chunk: int = 0  # which of the worker's model chunks the op ran on or received for (0 with one chunk)
    tp_rank: int = 0  # which of the stage's tensor-parallel workers ran it
    # seconds of it the host spent in the stage's tensor-parallel collectives (waiting for its peers): measured
    # in the compute ops at t > 1 on CPU at one step in 10 (None at the others), 0 elsewhere (stage/stage_op.py)
    collective_wait: float | None = 0.0


@dataclass(frozen=True)
class TimelineMark:
    """A moment on one worker's row of a step's timeline and what happened then (a worker found slow:
    "slow 2.00x"), at a wall-clock time in ``time.time()`` seconds, as :class:`OpEvent`'s."""

    replica: int
    stage: int
    tp_rank: int
    time: float
    what: str


@dataclass
class StageStats:
    """Per-stage measurements of one step."""

    stage: int
    busy_seconds: float = 0.0
    # peak bytes kept for backward in this step (metered on a worker's first step, every 100th and at a
    # new input shape; the figure is reused between: stage/measure.py's SavedBytes)
    held_for_backward_bytes: int = 0
    offloaded_bytes: int = 0  # peak bytes of kept inputs living in the object store
    device_allocated_bytes: int | None = None  # CUDA only
    device_peak_bytes: int | None = None  # CUDA only
    device_reserved_bytes: int | None = None  # CUDA only: held by the caching allocator (what an OOM meets)
    rss_bytes: int = 0
    learning_rate: float | None = None  # of the stage's first parameter group, after this step
    task_seconds: float | None = None  # per-step executor: the worker's whole step task
    replica: int = 0
    optimizer_bytes: int | None = None  # tensors of this worker's optimizer state (ZeRO-1: its shard)
    # the stage's weights: parameters (fp32 mains, or ZeRO-1's bf16-only ones) and bf16 compute copies
    weights_bytes: int | None = None
    tp_rank: int = 0  # which of the stage's tensor-parallel workers measured these
    # payload bytes this worker sent to other stages in the step (activations and gradients, headers aside;
    # under sequence parallelism each tensor-parallel rank sends its 1/t); None: a transport that does not count
    sent_bytes: int | None = None


class StageReport(NamedTuple):
    """What one stage reports when it ends a step."""

    events: list[OpEvent]
    stats: StageStats
    decision: StepDecision
    commits: int = 0  # the steps the stage's state has ended, this one included


@dataclass
class StepResult:
    """The outcome of one optimizer step over one global batch."""

    step: int
    loss: float  # exact mean over the global batch
    grad_norm: float  # global norm before clipping (unscaled, fp32)
    step_time: float  # seconds, wall clock on the driver
    clip_coefficient: float = 1.0
    skipped: bool = False  # no stage stepped (see skip_reason)
    skip_reason: str | None = None  # "overflow" (fp16, the loss scale was lowered) or "nonfinite"
    loss_scale: float | None = None
    num_samples: int = 0
    num_tokens: int = 0
    tokens_per_second: float = 0.0
    mfu: float | None = None
    eval_loss: float | None = None  # set by fit() on the steps it evaluates
    learning_rate: float | None = None  # after this step (first stage's first parameter group)
    stages: list[StageStats] = field(default_factory=list)  # one per worker, in (replica, stage, tp_rank) order
    timeline: list[OpEvent] = field(default_factory=list)
    marks: list[TimelineMark] = field(default_factory=list)  # moments on the timeline: a worker found slow
    bubble_fraction: list[float] = field(default_factory=list)  # measured, per stage (mean over replicas)
    num_replicas: int = 1  # pipeline replicas that ran this step
    recovered: bool = False  # workers failed during this step; they were healed and the step redone
    failures: list[str] = field(default_factory=list)  # the failure events healed during this step
