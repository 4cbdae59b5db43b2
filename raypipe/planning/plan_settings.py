"""The knobs a ``raypipe plan`` is evaluated with (:class:`PlanSettings`) and the largest
stage total of an estimate."""
from __future__ import annotations

from dataclasses import dataclass

from raypipe.models.llama import LlamaConfig
from raypipe.planning.memory import StageMemory, estimate_pipeline


@dataclass(frozen=True)
class PlanSettings:
    """The knobs a plan (and each suggestion) is evaluated with."""

    num_stages: int
    num_micro_batches: int
    micro_batch_size: int
    seq_len: int
    precision: str
    activation_checkpoint: str
    activation_checkpoint_segments: int | None
    offload_activations: bool
    fused_attention: bool
    schedule: str
    amp: str | None  # None: the style raypipe runs for the precision
    optimizer_shards: int = 1
    virtual_stages: int = 1  # model chunks per worker (interleaved_1f1b, zbv)

    def estimate(self, config: LlamaConfig, gpu_memory_bytes: int | None,
                 balance: list[int] | None = None) -> list[StageMemory]:
        return estimate_pipeline(
            config, self.num_stages, self.num_micro_batches, self.micro_batch_size, self.seq_len,
            self.precision, self.activation_checkpoint, self.offload_activations, self.fused_attention,
            balance=balance, gpu_memory_bytes=gpu_memory_bytes,
            activation_checkpoint_segments=self.activation_checkpoint_segments,
            schedule=self.schedule, amp=self.amp, optimizer_shards=self.optimizer_shards,
            virtual_stages=self.virtual_stages)


def largest_stage_bytes(stages: list[StageMemory]) -> int:
    """The largest stage total of an estimate."""
    return max(stage.total_bytes for stage in stages)
