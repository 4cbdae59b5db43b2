"""PipelineConfig: every knob of a pipeline run, validated before any actor starts."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raypipe.errors import ConfigError
from raypipe.core.schedule import SCHEDULES

CHECKPOINT_MODES = ("never", "always", "except_last")
PRECISIONS = ("fp32", "bf16", "fp16")
TRANSPORTS = ("object_store", "gloo", "nccl", "p2p")


@dataclass
class PipelineConfig:
    """How the model is pipelined, checkpointed, scaled and observed.

    ``validate(num_layers)`` is called by :class:`~raypipe.PipelineTrainer`
    before any actor starts; each error names the field, its value and what
    is allowed.
    """

    num_stages: int = 1
    num_micro_batches: int = 1
    schedule: str = "gpipe"
    checkpoint: str = "never"
    checkpoint_segments: int | None = None  # keep every k-th layer input inside a stage
    offload: bool = False  # kept stage inputs live in Ray's object store
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    precision: str = "fp32"
    balance: list[int] | None = None  # layers per stage; None = balanced by parameters
    transport: str = "object_store"  # "p2p": one task per stage per step, direct sends (see raypipe.comm.p2p)
    p2p_timeout_s: float = 300.0  # a p2p receive waiting longer than this fails the step
    use_gpu: bool | None = None  # None: use a GPU per stage when the cluster has GPUs
    cpus_per_stage: int = 1
    placement_timeout_s: float = 60.0
    seed: int = 0
    # fp16 dynamic loss scaling
    initial_loss_scale: float = 2.0**16
    min_loss_scale: float = 1.0
    growth_interval: int = 2000
    # observability
    metrics_port: int | None = None  # None: no exporter; 0: any free port
    metrics_host: str = "127.0.0.1"
    peak_flops_per_second: float | None = None  # per device; None: known GPUs only
    ray_address: str | None = None  # None: connected cluster, RAY_ADDRESS, or a local one
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, num_layers: int | None = None) -> None:
        """Raise :class:`ConfigError` on the first invalid field."""
        _positive_int("num_stages", self.num_stages)
        _positive_int("num_micro_batches", self.num_micro_batches)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("transport", self.transport, TRANSPORTS)
        if self.checkpoint_segments is not None:
            _positive_int("checkpoint_segments", self.checkpoint_segments)
        if self.offload and self.checkpoint == "never":
            raise ConfigError("offload", True, 'offload keeps checkpointed stage inputs: use checkpoint="always" or "except_last"')
        for name in ("clip_grad_norm", "clip_grad_value"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise ConfigError(name, value, "must be a number > 0, or None to disable")
        _positive_int("cpus_per_stage", self.cpus_per_stage)
        if not (_is_number(self.placement_timeout_s) and self.placement_timeout_s > 0):
            raise ConfigError("placement_timeout_s", self.placement_timeout_s, "must be a number of seconds > 0")
        self._validate_loss_scaling()
        if self.metrics_port is not None and not (isinstance(self.metrics_port, int) and 0 <= self.metrics_port <= 65535):
            raise ConfigError("metrics_port", self.metrics_port, "must be an int in 0..65535 (0 picks a free port) or None")
        if num_layers is not None:
            self._validate_against_layers(num_layers)

    def _validate_loss_scaling(self) -> None:
        if not (_is_number(self.initial_loss_scale) and self.initial_loss_scale > 0):
            raise ConfigError("initial_loss_scale", self.initial_loss_scale, "must be > 0")
        if not (_is_number(self.min_loss_scale) and 0 < self.min_loss_scale <= self.initial_loss_scale):
            raise ConfigError("min_loss_scale", self.min_loss_scale, "must be > 0 and <= initial_loss_scale")
        _positive_int("growth_interval", self.growth_interval)

    def _validate_against_layers(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ConfigError("model", num_layers, "the model needs at least one layer")
        if self.num_stages > num_layers:
            raise ConfigError("num_stages", self.num_stages, f"must be <= the number of layers ({num_layers})")
        if self.balance is None:
            return
        balance = list(self.balance)
        if len(balance) != self.num_stages:
            raise ConfigError("balance", balance, f"needs one entry per stage (num_stages={self.num_stages})")
        if any(not isinstance(size, int) or size < 1 for size in balance):
            raise ConfigError("balance", balance, "every stage needs at least one layer (positive ints)")
        if sum(balance) != num_layers:
            raise ConfigError("balance", balance, f"must sum to the number of layers ({num_layers}), sums to {sum(balance)}")

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PipelineConfig:
        """Build from a mapping; unknown keys raise a ConfigError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError("pipeline", unknown, f"unknown keys; known: {sorted(known)}")
        return cls(**values)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML run config into a dict (clear error on a missing file or bad YAML)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", str(path), "file not found")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError("config", str(path), f"is not valid YAML: {error}") from error
    if not isinstance(values, dict):
        raise ConfigError("config", str(path), "must be a YAML mapping")
    return values


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, value, "must be an int >= 1")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"must be one of {list(allowed)}")
