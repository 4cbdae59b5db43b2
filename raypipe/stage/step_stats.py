"""What a stage reports about its step (:class:`~raypipe.core.result.StageStats`): busy
time, the memory it held (for backward, offloaded, on the device, the process's RSS,
optimizer state, weights) and its learning rate."""
from __future__ import annotations

import torch

from raypipe.core.result import OpEvent, StageStats
from raypipe.stage.activations import ActivationStore
from raypipe.stage.measure import device_memory_bytes, rss_bytes


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """The bytes of the tensors in ``optimizer``'s state (0 without one)."""
    if optimizer is None:
        return 0
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def stage_stats(events: list[OpEvent], stage: int, replica: int, store: ActivationStore, device: torch.device,
                optimizer: torch.optim.Optimizer | None, weights_bytes: int, tp_rank: int = 0) -> StageStats:
    """The statistics of the step whose timeline is ``events``, measured now."""
    busy = sum(e.end - e.start for e in events if e.op in ("F", "B", "I", "W"))  # compute ops
    return StageStats(
        stage=stage, replica=replica, tp_rank=tp_rank, busy_seconds=busy,
        held_for_backward_bytes=store.peak_held_bytes,
        offloaded_bytes=store.peak_offloaded_bytes,
        **device_memory_bytes(device),  # allocated, peak and reserved (None each on a CPU)
        rss_bytes=rss_bytes(), optimizer_bytes=optimizer_state_bytes(optimizer), weights_bytes=weights_bytes,
        learning_rate=optimizer.param_groups[0]["lr"] if optimizer is not None else None)
