"""Turn the stages' reports of one step into a StepResult (measured bubble, MFU)."""
from __future__ import annotations

from raypipe.core.result import OpEvent, StageReport, StepResult


def clip_coefficient(grad_norm: float, max_norm: float | None) -> float:
    """The factor gradients were scaled by (as ``torch.nn.utils.clip_grad_norm_``)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


def measured_bubble(timeline: list[OpEvent], num_stages: int, num_replicas: int = 1) -> list[float]:
    """Per stage, 1 - busy/window over its replica's compute phase (first F start to
    last B, or W of a split backward, end), averaged over the replicas."""
    bubbles = [0.0] * num_stages
    for replica in range(num_replicas):
        compute = [e for e in timeline if e.op in ("F", "B", "I", "W") and e.replica == replica]
        if not compute:
            continue
        window = max(e.end for e in compute) - min(e.start for e in compute)
        if window <= 0:
            continue
        busy = [0.0] * num_stages
        for event in compute:
            busy[event.stage] += event.end - event.start
        for stage in range(num_stages):
            bubbles[stage] += max(0.0, 1.0 - busy[stage] / window) / num_replicas
    return bubbles


def build_step_result(*, step: int, loss: float, grad_norm: float, max_norm: float | None,
                      skip_reason: str | None, loss_scale: float | None, step_time: float, num_samples: int,
                      num_tokens: int, reports: list[StageReport], num_parameters: int,
                      peak_flops: float | None, num_devices: int) -> StepResult:
    timeline = sorted((event for report in reports for event in report.events),
                      key=lambda e: (e.replica, e.stage, e.start))
    stages = [report.stats for report in reports]
    num_replicas = 1 + max(stats.replica for stats in stages)
    num_stages = len(stages) // num_replicas
    skipped = skip_reason is not None
    mfu = None
    if peak_flops:
        from raypipe.observability.mfu import mfu as model_flops_utilization

        mfu = model_flops_utilization(num_parameters, num_tokens, step_time, peak_flops, num_devices)
    return StepResult(
        step=step, loss=loss, grad_norm=grad_norm, step_time=step_time,
        clip_coefficient=1.0 if skipped else clip_coefficient(grad_norm, max_norm),
        skipped=skipped, skip_reason=skip_reason, loss_scale=loss_scale, num_samples=num_samples, num_tokens=num_tokens,
        tokens_per_second=num_tokens / step_time if step_time > 0 else 0.0, mfu=mfu,
        learning_rate=next((s.learning_rate for s in stages if s.learning_rate is not None), None),
        stages=stages, timeline=timeline, bubble_fraction=measured_bubble(timeline, num_stages, num_replicas),
        num_replicas=num_replicas)
