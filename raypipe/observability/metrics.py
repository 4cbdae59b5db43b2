"""Prometheus exporter for the driver.

The exporter serves a snapshot of the latest step: every scrape reports the
values of the most recent :class:`~raypipe.core.result.StepResult` plus running
counters. Building the metrics in a custom collector (rather than keeping
``Gauge`` objects around) means a value that is not known (no eval yet, no MFU,
CPU-only memory fields) is absent instead of a misleading 0, and stages that
disappear after an elastic resize stop being reported.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from raypipe.core.result import StageStats, StepResult
from raypipe.core.step_decision import NONFINITE, OVERFLOW

# Every stage-labelled metric also carries ``replica`` and ``tp_rank`` labels so data-parallel
# replicas of a stage, and a stage's tensor-parallel workers, can be told apart without changing
# metric names or the dashboard. The bubble gauge is per stage, averaged over replicas (replica
# "0", tp_rank "0").
STAGE_LABELS = ("stage", "replica", "tp_rank")
SKIP_REASONS = (OVERFLOW, NONFINITE)
DEFAULT_REPLICA = "0"

RESTART_REASONS = ("died", "hung", "unreachable")  # why a worker was replaced (raypipe.runtime.health)
# an elastic run dropped replicas or added them; a run went on with fewer stages (no whole pipeline fit),
# and went back to its configured stages (there was room again)
RESIZE_DIRECTIONS = ("shrink", "grow", "repartition", "restore")
# (kind label, StageStats field) for raypipe_stage_memory_bytes.
MEMORY_KINDS = (
    ("held_for_backward", "held_for_backward_bytes"),
    ("offloaded", "offloaded_bytes"),
    ("device_allocated", "device_allocated_bytes"),
    ("device_peak", "device_peak_bytes"),
    ("device_reserved", "device_reserved_bytes"),
    ("rss", "rss_bytes"),
    ("optimizer", "optimizer_bytes"),
    ("weights", "weights_bytes"),
)
METRIC_NAMES = frozenset({
    "raypipe_steps_total", "raypipe_skipped_steps_total", "raypipe_restarts_total", "raypipe_replayed_steps_total",
    "raypipe_recovery_seconds", "raypipe_resizes_total", "raypipe_replicas", "raypipe_controller_state",
    "raypipe_eval_loss", "raypipe_loss", "raypipe_grad_norm", "raypipe_clip_coefficient", "raypipe_step_seconds",
    "raypipe_tokens_per_second", "raypipe_loss_scale", "raypipe_mfu", "raypipe_bubble_fraction",
    "raypipe_stage_busy_seconds", "raypipe_stage_memory_bytes", "raypipe_worker_slowdown",
})
"""Every metric family the exporter publishes once all its values are known (a step, an eval, a
controller state recorded): the one list the dashboard and its tests check against."""


class _TrainingCollector(Collector):
    """Yields the metric families of the latest step; thread-safe snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: StepResult | None = None
        self._eval_loss: float | None = None
        self._steps = 0
        self._skipped = {reason: 0 for reason in SKIP_REASONS}
        self._restarts: dict[str, int] = {}  # per reason: died, hung, unreachable
        self._recovery_seconds = 0.0  # the latest recovery's (0 until one happened)
        self._replayed_steps = 0
        self._resizes = {direction: 0 for direction in RESIZE_DIRECTIONS}
        self._replicas: int | None = None  # unknown until the first step or resize
        self._controller_state: tuple[str, tuple[str, ...]] | None = None  # (current, every state); None: no controller
        self._slowdowns: dict[tuple[int, int, int], float] = {}  # (replica, stage, tp_rank): own compute / baseline

    def record_step(self, result: StepResult) -> None:
        with self._lock:
            self._last = result
            self._steps += 1
            if result.skip_reason is not None:
                self._skipped[result.skip_reason] += 1
            self._replicas = result.num_replicas

    def record_eval(self, loss: float) -> None:
        with self._lock:
            self._eval_loss = float(loss)

    def record_recovery(self, reasons: list[str], seconds: float, replayed_steps: int) -> None:
        with self._lock:
            for reason in reasons:
                self._restarts[reason] = self._restarts.get(reason, 0) + 1
            self._recovery_seconds = seconds
            self._replayed_steps += replayed_steps

    def record_resize(self, direction: str, num_replicas: int) -> None:
        if direction not in RESIZE_DIRECTIONS:
            raise ValueError(f"resize direction must be one of {RESIZE_DIRECTIONS}, got {direction!r}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"replicas after a resize must be an int >= 1, got {num_replicas!r}")
        with self._lock:
            self._resizes[direction] += 1
            self._replicas = num_replicas

    def record_controller_state(self, state: str, states: tuple[str, ...]) -> None:
        if state not in states:
            raise ValueError(f"controller state {state!r} is not one of {states}")
        with self._lock:
            self._controller_state = (state, tuple(states))

    def record_slowdowns(self, slowdowns: dict[tuple[int, int, int], float]) -> None:
        with self._lock:
            self._slowdowns = dict(slowdowns)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            controller_state, slowdowns = self._controller_state, dict(self._slowdowns)
            last, eval_loss = self._last, self._eval_loss
            steps, skipped, restarts = self._steps, dict(self._skipped), dict(self._restarts)
            recovery_seconds, replayed = self._recovery_seconds, self._replayed_steps
            resizes, replicas = dict(self._resizes), self._replicas
        yield CounterMetricFamily(
            "raypipe_steps_total", "Optimizer steps run (skipped ones included).", value=steps
        )
        skipped_family = CounterMetricFamily(
            "raypipe_skipped_steps_total",
            "Steps whose optimizer update was skipped everywhere, by reason (fp16 overflow, non-finite).",
            labels=["reason"],
        )
        for reason, count in skipped.items():
            skipped_family.add_metric([reason], count)
        yield skipped_family
        restarts_family = CounterMetricFamily(
            "raypipe_restarts_total",
            "Failure events healed (workers replaced, state restored, step redone), by reason.",
            labels=["reason"],
        )
        for reason in RESTART_REASONS:
            restarts_family.add_metric([reason], restarts.get(reason, 0))
        yield restarts_family
        yield CounterMetricFamily(
            "raypipe_replayed_steps_total",
            "Committed steps run again from a snapshot while healing a failure (snapshot_every > 1).",
            value=replayed,
        )
        yield _gauge("raypipe_recovery_seconds",
                     "Seconds from the latest failure's detection to training again (0 before any).", recovery_seconds)
        resizes_family = CounterMetricFamily(
            "raypipe_resizes_total",
            "Resizes, by direction: shrink (replicas dropped), grow (replicas added), repartition "
            "(fewer stages), restore (back to the configured stages).",
            labels=["direction"],
        )
        for direction in RESIZE_DIRECTIONS:
            resizes_family.add_metric([direction], resizes[direction])
        yield resizes_family
        if replicas is not None:
            yield _gauge("raypipe_replicas",
                         "Data-parallel pipeline replicas running (of the latest step or resize).", replicas)
        if controller_state is not None:
            yield _controller_state_family(*controller_state)
        if eval_loss is not None:
            yield _gauge("raypipe_eval_loss", "Latest evaluation loss.", eval_loss)
        if last is not None:
            yield from _step_families(last)
        if slowdowns:
            yield _slowdown_family(slowdowns)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


def _controller_state_family(current: str, states: tuple[str, ...]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "raypipe_controller_state",
        "The layout controller's state: 1 for the current one (starting, running, healing, resizing, "
        "repartitioned, failed, stopped), 0 for the others.",
        labels=["state"],
    )
    for state in states:
        family.add_metric([state], 1.0 if state == current else 0.0)
    return family


def _slowdown_family(slowdowns: dict[tuple[int, int, int], float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "raypipe_worker_slowdown",
        "Each worker's own compute (its F, B, I and W ops) over its baseline, the median of the last slow_steps "
        "steps (1: as fast as when well; a worker found slow at >= slow_factor is also named in a WARNING line).",
        labels=STAGE_LABELS,
    )
    for (replica, stage, tp_rank), ratio in sorted(slowdowns.items()):
        family.add_metric(_stage_labels(stage, replica, tp_rank), float(ratio))
    return family


def _stage_labels(stage: int, replica: int | str = DEFAULT_REPLICA, tp_rank: int = 0) -> list[str]:
    return [str(stage), str(replica), str(tp_rank)]


def _step_families(result: StepResult) -> Iterator[Metric]:
    """The gauges describing one step."""
    yield _gauge("raypipe_loss", "Training loss of the latest step (global-batch mean).", result.loss)
    yield _gauge(
        "raypipe_grad_norm", "Global gradient L2 norm of the latest step, before clipping.",
        result.grad_norm,
    )
    yield _gauge(
        "raypipe_clip_coefficient",
        "Factor the gradients were scaled by when clipping (1 = not clipped).",
        result.clip_coefficient,
    )
    yield _gauge("raypipe_step_seconds", "Wall-clock duration of the latest step.", result.step_time)
    yield _gauge(
        "raypipe_tokens_per_second", "Training throughput of the latest step.",
        result.tokens_per_second,
    )
    # No loss scaling (fp32/bf16) means the gradients were scaled by 1.
    scale = 1.0 if result.loss_scale is None else result.loss_scale
    yield _gauge("raypipe_loss_scale", "Loss scale in effect (1 without fp16 scaling).", scale)
    if result.mfu is not None:
        yield _gauge(
            "raypipe_mfu",
            "Model FLOPs utilization of the latest step (6*N FLOPs per token / peak).",
            result.mfu,
        )
    yield _bubble_family(result.bubble_fraction)
    yield _busy_family(result.stages)
    yield _memory_family(result.stages)


def _bubble_family(bubble_fraction: list[float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "raypipe_bubble_fraction",
        "Measured idle share of the step per stage: 1 - busy time / step wall time.",
        labels=STAGE_LABELS,
    )
    for stage, fraction in enumerate(bubble_fraction):
        family.add_metric(_stage_labels(stage), float(fraction))
    return family


def _busy_family(stages: list[StageStats]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "raypipe_stage_busy_seconds",
        "Seconds the stage spent running ops during the latest step.",
        labels=STAGE_LABELS,
    )
    for stats in stages:
        family.add_metric(_stage_labels(stats.stage, stats.replica, stats.tp_rank), float(stats.busy_seconds))
    return family


def _memory_family(stages: list[StageStats]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "raypipe_stage_memory_bytes",
        "Per-stage memory of the latest step by kind: held_for_backward and offloaded "
        "(peak bytes kept for backward, in device memory / object store), device_allocated, "
        "device_peak and device_reserved (CUDA; reserved: held by the caching allocator, what an "
        "out-of-memory compares with the card), rss (process resident set), optimizer (its "
        "state's tensors; a shard with shard_optimizer).",
        labels=(*STAGE_LABELS, "kind"),
    )
    for stats in stages:
        for kind, attribute in MEMORY_KINDS:
            value = getattr(stats, attribute, None)  # a report from a worker without the field: absent
            if value is not None:  # None = not measurable here (CUDA fields on CPU)
                family.add_metric([*_stage_labels(stats.stage, stats.replica, stats.tp_rank), kind], float(value))
    return family


class MetricsExporter:
    """Serves raypipe's training metrics over HTTP for Prometheus to scrape.

    Each exporter has its own :class:`CollectorRegistry` (unless one is passed),
    so several trainers in one process do not clash. It listens on loopback by
    default; ``port=0`` picks a free port (read it back from :attr:`port`).
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, registry: CollectorRegistry | None = None
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be an int in 0..65535 (0 = any free port), got {port!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = _TrainingCollector()
        self.registry.register(self._collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            self.registry.unregister(self._collector)
            raise OSError(error.errno, f"cannot serve metrics on {host}:{port}: {error.strerror}") from error
        self.host = host

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server socket is actually bound to."""
        host, port = self._server.server_address[:2]
        return host, port

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        """Scrape address, e.g. ``http://127.0.0.1:9100/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def record_step(self, result: StepResult) -> None:
        """Publish one step's measurements and count it."""
        self._collector.record_step(result)

    def record_eval(self, loss: float) -> None:
        """Publish the latest evaluation loss."""
        self._collector.record_eval(loss)

    def record_recovery(self, reasons: list[str], seconds: float, replayed_steps: int) -> None:
        """Count one healed failure event (by the reasons its workers failed), and publish
        how long healing took and how many steps it replayed."""
        self._collector.record_recovery(reasons, seconds, replayed_steps)

    def record_resize(self, direction: str, num_replicas: int) -> None:
        """Count one resize (``direction`` "shrink", "grow", "repartition" or "restore") and publish the replicas
        running after it; raises ValueError on another direction or fewer than 1 replica."""
        self._collector.record_resize(direction, num_replicas)

    def record_controller_state(self, state: str, states: tuple[str, ...]) -> None:
        """Publish the controller's ``state`` (1) among all its ``states`` (0); raises
        ValueError when ``state`` is not one of them."""
        self._collector.record_controller_state(state, states)

    def record_slowdowns(self, slowdowns: dict[tuple[int, int, int], float]) -> None:
        """Publish each worker's slowdown, by (replica, stage, tp_rank): its own compute over its baseline
        (:func:`raypipe.control.stragglers.slowdowns`); workers left out are no longer reported."""
        self._collector.record_slowdowns(slowdowns)

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.registry.unregister(self._collector)
        self._server = None

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
