"""PipelineConfig: every knob of a pipeline run, validated before any actor starts."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raypipe.core.ops import BOUNDARY_SHAPES, worker_and_chunk
from raypipe.core.schedule import NATURAL_CHUNKS, PLACEMENT, SCHEDULES, check_chunks, check_interleaved_micro_batches
from raypipe.core.validation import (check_bool, check_choice, check_int, check_number, check_positive_int,
                                     check_positive_number, check_renamed, from_mapping)
from raypipe.errors import ConfigError

CHECKPOINT_MODES = ("never", "always", "except_last")
PRECISIONS = ("fp32", "bf16", "fp16")
NONFINITE_POLICIES = ("skip", "raise")
TRANSPORTS = ("object_store", "gloo", "nccl", "p2p")
STEP_CALLS = ("connections", "tasks")
ON_SLOW = ("report", "replace", "rebalance")  # what a worker found slow does (raypipe/control/stragglers.py)
BALANCE_MODES = ("parameters", "time")  # PipelineConfig.balance other than a list: what the stages balance
# Old keywords of activation recomputation -> the new name (and why): "checkpoint" means saved training state now.
_RENAMED: dict[str, str] = {
    "checkpoint": 'activation_checkpoint ("checkpoint" now means saved training state)',
    "checkpoint_segments": "activation_checkpoint_segments",
    "offload": "offload_activations",
}
# Old values of a field -> the new one, accepted with a DeprecationWarning: "direct" names Ray Direct
# Transport only, so the driver's calls over its connections to the workers are "connections".
_RENAMED_VALUES: dict[tuple[str, str], str] = {("step_calls", "direct"): "connections"}


@dataclass
class PipelineConfig:
    """How the model is pipelined, its activations recomputed, and the run scaled and observed.

    ``validate(num_layers)`` is called by :class:`~raypipe.PipelineTrainer`
    before any actor starts; each error names the field, its value and what
    is allowed.
    """

    num_stages: int = 1
    num_micro_batches: int = 1  # per replica: a step has num_micro_batches x num_replicas micro-batches
    # data-parallel copies of the pipeline: an int, or (min, max) for an elastic run
    num_replicas: int | tuple[int, int] = 1
    shard_optimizer: bool = False  # ZeRO-1: each replica of a stage keeps the optimizer state of its own parameters
    # workers per stage splitting its layers with their tensor-parallel plans (LayerSpec(..., tp_plan=...)): t; a
    # run has num_replicas x num_stages x tensor_parallel workers, a stage's t on one node
    tensor_parallel: int = 1
    # with tensor_parallel > 1, activations sharded along the sequence between the planned layers and across stage
    # boundaries; None (the default): on when tensor_parallel > 1, resolved here, and again for a replace(...)
    sequence_parallel: bool | None = None
    schedule: str = "gpipe"
    # model chunks per worker (v): interleaved_1f1b takes v >= 2, zbv v = 2, gpipe, 1f1b and zb_h1 v = 1; None (the
    # default): the schedule's own (NATURAL_CHUNKS: 2 for interleaved_1f1b and zbv, 1 for the others), resolved
    # here to that int, and again for the new schedule of a replace(schedule=...)
    virtual_stages: int | None = None
    activation_checkpoint: str = "never"  # recompute activations in backward: "never" | "always" | "except_last"
    activation_checkpoint_segments: int | None = None  # keep every k-th layer input inside a stage
    offload_activations: bool = False  # kept stage inputs live in Ray's object store
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    precision: str = "fp32"
    # layers per stage (a list; per virtual stage, in model order, with virtual_stages > 1), or how to
    # choose them: "parameters" (None: the same) balances
    # parameter counts, "time" the layers' costs (LayerSpec(..., cost=LayerCost(...)); llama_layers has them)
    balance: list[int] | str | None = None
    # "p2p": one call per worker per step, direct sends; "object_store", "gloo", "nccl": a task per op
    transport: str = "p2p"
    # how the driver starts each step of transport="p2p": "connections" (over a connection from the driver to
    # each worker, ~0.1 ms for two) or "tasks" (an actor task per worker, ~1 ms each); "direct" is the old name
    step_calls: str = "connections"
    nonfinite: str = "skip"  # a non-finite loss or gradient norm: "skip" the update everywhere, or "raise"
    p2p_timeout_s: float = 300.0  # a p2p receive waiting longer than this fails the step
    # how an activation's dtype and shape reach the next stage (transport="p2p"): "learned", in a header the first
    # time each message key crosses and the payload alone after (a shape that then changes fails the step, which
    # is retried with headers on that key); "headers", a header before every activation (docs/guide.md)
    boundary_shapes: str = "learned"
    use_gpu: bool | None = None  # None: use a GPU per stage when the cluster has GPUs
    cpus_per_stage: int = 1
    placement_timeout_s: float = 60.0
    seed: int = 0
    # fault tolerance (see docs/deploy.md, "What survives what")
    max_failures: int | None = 3  # failure events healed over the trainer's life; None: unlimited
    snapshot_every: int = 1  # steps between in-memory snapshots of every worker; 0: none (a failure is fatal)
    replace_timeout_s: float = 60.0  # how long to wait for resources to place a replacement worker
    # idle stage processes kept started (a worker bundle each): a heal hands one the failed worker's spec
    # instead of starting a process (see raypipe/runtime/spares.py); they never add a replica. At tensor_parallel
    # t > 1 a multiple of t: spares come in groups of t on one node, each taking a whole stage's place (its t
    # ranks). It counts processes, not groups, so that it means one thing at every t, as the resources it asks
    # for (a CPU or GPU share each, the Helm chart's worker pods) are counted
    spare_workers: int = 0
    hang_timeout_s: float = 30.0  # a worker that does not answer a heartbeat for this long is hung
    # slow workers (docs/guide.md, "Slow workers"): a worker whose own compute (its F, B, I, W ops) stays at least
    # slow_factor x its baseline, the same stage in the other replicas and its tensor-parallel peers, for slow_steps
    # steps in a row, is found slow: a WARNING line names it, its node and the factor (the gauge
    # raypipe_worker_slowdown has every worker's ratio); on_slow="replace" (needs spare_workers) then swaps it for
    # a warm spare between steps, its state moved from it, nothing replayed; "rebalance" splits the layers again
    # between steps, away from its stage in every replica (the same stages; not at tensor_parallel > 1 nor with
    # model chunks), its state moved, nothing replayed; "report": nothing more
    slow_factor: float = 1.3
    slow_steps: int = 10
    on_slow: str = "report"
    # fp16 dynamic loss scaling
    initial_loss_scale: float = 2.0**16
    min_loss_scale: float = 1.0
    growth_interval: int = 2000
    # observability
    metrics_port: int | None = None  # None: no exporter; 0: any free port
    metrics_host: str = "127.0.0.1"
    peak_flops_per_second: float | None = None  # per device; None: known GPUs only
    ray_address: str | None = None  # None: connected cluster, RAY_ADDRESS, or a local one

    def __post_init__(self) -> None:
        for (name, old), new in _RENAMED_VALUES.items():
            if getattr(self, name) == old:
                warnings.warn(f'{name}="{old}" is renamed {name}="{new}"; "{old}" will be refused in a later release',
                              DeprecationWarning, stacklevel=3)
                setattr(self, name, new)
        # whether virtual_stages was given: one left to the schedule follows a schedule changed later
        self._virtual_stages_given = self.virtual_stages is not None
        self._sequence_parallel_given = self.sequence_parallel is not None
        self._resolve_virtual_stages()

    def _resolve_virtual_stages(self) -> None:
        """``virtual_stages`` not given: the schedule's natural value (1 for a schedule it does not know,
        which :meth:`validate` then names); ``sequence_parallel`` not given: on when ``tensor_parallel > 1``."""
        if not self._virtual_stages_given:
            self.virtual_stages = NATURAL_CHUNKS.get(self.schedule, 1)
        if not self._sequence_parallel_given:
            self.sequence_parallel = not isinstance(self.tensor_parallel, int) or self.tensor_parallel > 1

    def validate(self, num_layers: int | None = None) -> None:
        """Raise :class:`ConfigError` on the first invalid field (``virtual_stages`` left unset is
        first resolved for the schedule set now)."""
        self._resolve_virtual_stages()
        check_positive_int("num_stages", self.num_stages)
        check_positive_int("num_micro_batches", self.num_micro_batches)
        check_replicas(self.num_replicas)
        check_bool("shard_optimizer", self.shard_optimizer)
        check_positive_int("tensor_parallel", self.tensor_parallel)
        check_bool("sequence_parallel", self.sequence_parallel)
        check_choice("schedule", self.schedule, SCHEDULES)
        self._validate_chunks()
        check_choice("activation_checkpoint", self.activation_checkpoint, CHECKPOINT_MODES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("transport", self.transport, TRANSPORTS)
        if self.max_replicas > 1 and self.transport != "p2p":
            raise ConfigError("transport", self.transport, f"num_replicas={self.num_replicas} runs on the per-step "
                              "executor only (its gradient reduction is a collective inside the group): use "
                              "transport='p2p'")
        check_choice("step_calls", self.step_calls, STEP_CALLS)
        check_choice("boundary_shapes", self.boundary_shapes, BOUNDARY_SHAPES)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_balance(self.balance)
        if self.activation_checkpoint_segments is not None:
            check_positive_int("activation_checkpoint_segments", self.activation_checkpoint_segments)
        check_offload_activations(self.offload_activations, self.activation_checkpoint)
        for name in ("clip_grad_norm", "clip_grad_value"):
            if getattr(self, name) is not None:
                check_positive_number(name, getattr(self, name), "must be a number > 0, or None to disable")
        check_positive_int("cpus_per_stage", self.cpus_per_stage)
        check_positive_number("placement_timeout_s", self.placement_timeout_s, "must be a number of seconds > 0")
        if self.max_failures is not None:
            check_int("max_failures", self.max_failures, 0, None, "must be an int >= 0, or None for unlimited")
        check_int("snapshot_every", self.snapshot_every, 0, None, "must be an int >= 0 (0: no snapshots)")
        check_int("spare_workers", self.spare_workers, 0, None, "must be an int >= 0 (0: no warm spares)")
        for name in ("replace_timeout_s", "hang_timeout_s"):
            check_positive_number(name, getattr(self, name), "must be a number of seconds > 0")
        self._validate_slow_workers()
        check_positive_number("initial_loss_scale", self.initial_loss_scale)
        check_number("min_loss_scale", self.min_loss_scale, lambda scale: 0 < scale <= self.initial_loss_scale,
                     "must be a number > 0 and <= initial_loss_scale")
        check_positive_int("growth_interval", self.growth_interval)
        if self.metrics_port is not None:
            check_int("metrics_port", self.metrics_port, 0, 65535,
                      "must be an int in 0..65535 (0 picks a free port) or None")
        self._validate_tensor_parallel()
        if num_layers is not None:
            self._validate_against_layers(num_layers)

    def _validate_slow_workers(self) -> None:
        """``slow_factor`` > 1, ``slow_steps`` >= 1, and ``on_slow`` one of "report", "replace" (with warm
        spares to swap a slow worker for) and "rebalance" (one chunk of layers per worker: it moves whole
        layers between stages, as a re-partition does)."""
        check_number("slow_factor", self.slow_factor, lambda factor: factor > 1,
                     "must be a number > 1 (a worker this many times slower than its baseline is slow)")
        check_positive_int("slow_steps", self.slow_steps)
        check_choice("on_slow", self.on_slow, ON_SLOW)
        if self.on_slow == "rebalance" and self.virtual_stages > 1:
            raise ConfigError("on_slow", self.on_slow, f"moves the layers of whole stages, not of model chunks "
                              f"(virtual_stages={self.virtual_stages}): use 'report' or 'replace'")
        if self.on_slow == "replace" and self.spare_workers == 0:
            raise ConfigError("on_slow", self.on_slow, "swaps a slow worker for a warm spare: set spare_workers >= 1")

    def _validate_tensor_parallel(self) -> None:
        """What runs with ``tensor_parallel > 1`` so far: every schedule, precision, recompute mode and
        ZeRO-1, activation offload, snapshots and the heals from them, elastic replicas, warm spares,
        on the per-step executor. ``spare_workers`` must be a multiple of t: a spare is a group of t
        processes in one bundle (one node) that takes a whole stage's place, as one rank alone would
        sit on another node than its peers; it still counts processes, as every resource count does.
        ``on_slow="replace"`` swaps a slow rank's whole stage for a spare group. A re-partition onto
        fewer stages is not chosen at t > 1 (the failure policy raises instead)."""
        t = self.tensor_parallel
        if t == 1:
            return
        refused = [
            ("transport", self.transport, self.transport != "p2p", "the per-step executor (transport='p2p')"),
        ]
        for name, value, wrong, runs in refused:
            if wrong:
                raise ConfigError(name, value, f"tensor_parallel={t} runs only with {runs} so far")
        if self.spare_workers % t:
            raise ConfigError("spare_workers", self.spare_workers,
                              f"must be a multiple of tensor_parallel={t}: a spare is a group of {t} processes on one "
                              f"node that takes a whole stage's place (e.g. {t * max(1, self.spare_workers // t)})")

    def _validate_chunks(self) -> None:
        """``virtual_stages`` against the schedule, the transport and the micro-batches."""
        check_positive_int("virtual_stages", self.virtual_stages)
        try:
            check_chunks(self.schedule, self.virtual_stages)
        except ValueError as error:
            raise ConfigError("virtual_stages", self.virtual_stages, f"{error} (leave virtual_stages unset, None, "
                              f"for the schedule's own: {NATURAL_CHUNKS[self.schedule]})") from None
        if self.virtual_stages == 1:
            return
        if self.transport != "p2p":
            raise ConfigError("transport", self.transport, f"schedule {self.schedule!r} (virtual_stages="
                              f"{self.virtual_stages}) runs on the per-step executor only: use transport='p2p'")
        if self.schedule == "interleaved_1f1b":
            try:
                check_interleaved_micro_batches(self.num_stages, self.num_micro_batches)
            except ValueError as error:
                raise ConfigError("num_micro_batches", self.num_micro_batches, f"per replica: {error}") from None
            if self.elastic:
                raise ConfigError("num_replicas", self.num_replicas, "interleaved_1f1b runs a fixed number of "
                                  "replicas: an elastic run splits the step unevenly, and not every replica's share "
                                  "splits into equal rounds (m % max(1, m // num_stages) == 0; use zbv, or a fixed "
                                  "num_replicas)")

    @property
    def num_virtual_stages(self) -> int:
        """The pieces the model is cut into: ``num_stages x virtual_stages`` (``balance`` has one entry each)."""
        return self.num_stages * self.virtual_stages

    @property
    def placement(self) -> str:
        """Where the schedule puts each worker's chunks (:data:`raypipe.core.schedule.PLACEMENT`)."""
        return PLACEMENT[self.schedule]

    @property
    def loss_stage(self) -> int:
        """The stage (worker) that holds the model's last virtual stage: it reads targets and
        computes the loss (the last stage, or stage 0 under zbv's V)."""
        return worker_and_chunk(self.num_virtual_stages - 1, self.num_stages, self.placement)[0]

    def _validate_against_layers(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ConfigError("model", num_layers, "the model needs at least one layer")
        if self.num_virtual_stages > num_layers:
            if self.virtual_stages == 1:
                raise ConfigError("num_stages", self.num_stages, f"must be <= the number of layers ({num_layers})")
            raise ConfigError("virtual_stages", self.virtual_stages, f"num_stages x virtual_stages = "
                              f"{self.num_virtual_stages} chunks need at least as many layers, the model has "
                              f"{num_layers}")
        if self.balance is None or isinstance(self.balance, str):
            return
        balance = list(self.balance)
        if len(balance) != self.num_virtual_stages:
            if self.virtual_stages == 1:
                raise ConfigError("balance", balance, f"needs one entry per stage (num_stages={self.num_stages})")
            raise ConfigError("balance", balance, f"needs one entry per virtual stage, in model order "
                              f"(num_stages x virtual_stages = {self.num_virtual_stages})")
        if any(not isinstance(size, int) or size < 1 for size in balance):
            raise ConfigError("balance", balance, "every stage needs at least one layer (positive ints)")
        if sum(balance) != num_layers:
            raise ConfigError("balance", balance, f"must sum to the number of layers ({num_layers}), sums to {sum(balance)}")

    @property
    def elastic(self) -> bool:
        """Whether the number of replicas may change during the run (``num_replicas=(min, max)``)."""
        return not isinstance(self.num_replicas, int)

    @property
    def min_replicas(self) -> int:
        """The fewest replicas the run goes on with."""
        return self.num_replicas if isinstance(self.num_replicas, int) else int(self.num_replicas[0])

    @property
    def max_replicas(self) -> int:
        """The most replicas the run uses; a step has ``num_micro_batches x max_replicas``
        micro-batches whatever the number running."""
        return max_replicas(self.num_replicas)

    @property
    def micro_batches_per_step(self) -> int:
        """A step's micro-batches, ``num_micro_batches x max_replicas``, whatever the number running."""
        return self.num_micro_batches * self.max_replicas

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with some fields changed. A ``virtual_stages`` left unset stays so: a new ``schedule``
        brings its own natural value; one given is kept as given. So does ``sequence_parallel``: left unset, it
        follows a new ``tensor_parallel``."""
        if not self._virtual_stages_given:
            changes.setdefault("virtual_stages", None)
        if not self._sequence_parallel_given:
            changes.setdefault("sequence_parallel", None)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PipelineConfig:
        """Build from a mapping; unknown and renamed keys raise a ConfigError naming them."""
        return from_mapping(cls, values, "pipeline", _RENAMED)


_dataclass_init = PipelineConfig.__init__


@functools.wraps(_dataclass_init)
def _init_rejecting_renamed(self: PipelineConfig, *args: Any, **kwargs: Any) -> None:
    check_renamed(kwargs, _RENAMED)  # before the generated __init__'s TypeError on unknown keywords
    _dataclass_init(self, *args, **kwargs)


PipelineConfig.__init__ = _init_rejecting_renamed  # type: ignore[method-assign]


def check_balance(balance: Any) -> None:
    """None, one of :data:`BALANCE_MODES`, or a list of ints (checked against the layers later)."""
    if isinstance(balance, str):
        check_choice("balance", balance, BALANCE_MODES)
    elif balance is not None and not isinstance(balance, (list, tuple)):
        raise ConfigError("balance", balance, f"must be a list of layers per stage or one of {BALANCE_MODES}")


def parse_balance(text: str) -> str | list[int]:
    """``--balance``'s type: "parameters", "time", or layers per stage as "3,3,2"."""
    if text in BALANCE_MODES:
        return text
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid balance {text!r}: one of {', '.join(BALANCE_MODES)}, or layers "
                                         "per stage as a comma list like 3,3,2") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"invalid balance {text!r}: every stage needs at least one layer")
    return sizes


def check_replicas(num_replicas: Any) -> None:
    """An int >= 1, or an elastic ``(min, max)`` pair with ``1 <= min <= max``."""
    if isinstance(num_replicas, (tuple, list)):
        if (len(num_replicas) != 2 or any(isinstance(n, bool) or not isinstance(n, int) for n in num_replicas)
                or not 1 <= num_replicas[0] <= num_replicas[1]):
            raise ConfigError("num_replicas", num_replicas, "an elastic range must be a pair of ints (min, max) "
                              "with 1 <= min <= max")
        return
    check_positive_int("num_replicas", num_replicas)


def check_offload_activations(offload_activations: bool, activation_checkpoint: str) -> None:
    """Offloading keeps the inputs of recomputed stages, so it needs activation checkpointing."""
    if offload_activations and activation_checkpoint == "never":
        raise ConfigError("offload_activations", True, "offloading keeps the inputs of recomputed stages: use "
                          'activation_checkpoint="always" or "except_last"')


class _RenamedFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        old = self.dest  # the old keyword: "checkpoint", "checkpoint_segments" or "offload"
        new = _RENAMED[old].replace("_", "-")
        error = ConfigError(f"--{old.replace('_', '-')}", True if values == [] else values, f"renamed to --{new}")
        parser.error(str(error))  # a usage error (exit 2), not a traceback


def add_activation_arguments(parser: argparse.ArgumentParser, default: str | None = "never") -> None:
    """``--activation-checkpoint`` (default ``default``), ``--activation-checkpoint-segments`` and
    ``--offload-activations``; the old ``--checkpoint``, ``--checkpoint-segments`` and ``--offload``
    are hidden flags that raise a ConfigError naming the new flag (``--checkpoint-dir`` and
    ``--checkpoint-every``, about saved training state, are not touched)."""
    shown = default or "the preset's"
    parser.add_argument("--activation-checkpoint", default=default, choices=CHECKPOINT_MODES,
                        help=f"recompute activations in backward (default: {shown})")
    parser.add_argument("--activation-checkpoint-segments", type=int, default=None, metavar="K",
                        help="inside a stage keep the input of every K layers")
    parser.add_argument("--offload-activations", action="store_true",
                        help="kept stage inputs live off the device (needs --activation-checkpoint)")
    for old in _RENAMED:
        parser.add_argument(f"--{old.replace('_', '-')}", dest=old, action=_RenamedFlag, default=argparse.SUPPRESS,
                            nargs=0 if old == "offload" else None, help=argparse.SUPPRESS)


def add_tensor_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel`` and ``--sequence-parallel``/``--no-sequence-parallel`` (the jobs' flags of
    ``tensor_parallel`` and ``sequence_parallel``)."""
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="workers per stage, splitting its layers by their tensor-parallel plans (the LLaMA's "
                             "attention and MLP); stages x replicas x T workers, a stage's T on one node (default: 1)")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="with --tensor-parallel > 1, activations sharded along the sequence between the split "
                             "layers and across stage boundaries (default: on when --tensor-parallel > 1)")


def tensor_parallel_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The PipelineConfig fields of :func:`add_tensor_parallel_arguments`' flags."""
    return {"tensor_parallel": args.tensor_parallel, "sequence_parallel": args.sequence_parallel}


def add_slow_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """``--slow-factor``, ``--slow-steps`` and ``--on-slow`` (the jobs' flags of ``slow_factor``, ``slow_steps``
    and ``on_slow``)."""
    parser.add_argument("--slow-factor", type=float, default=PipelineConfig.slow_factor, metavar="F",
                        help="a worker whose own compute (its forward and backward ops, not its waits) stays F x its "
                             "baseline, the same stage in the other replicas and its tensor-parallel peers for "
                             f"--slow-steps steps is slow (default: {PipelineConfig.slow_factor})")
    parser.add_argument("--slow-steps", type=int, default=PipelineConfig.slow_steps, metavar="N",
                        help="steps in a row a worker must stay --slow-factor behind to be found slow "
                             f"(default: {PipelineConfig.slow_steps})")
    parser.add_argument("--on-slow", type=_on_slow_flag, default=PipelineConfig.on_slow,
                        metavar="report|replace|rebalance",
                        help="what a slow worker found does: 'report', a WARNING line naming it, its node and its "
                             "factor (every worker's ratio is the gauge raypipe_worker_slowdown), or 'replace': that, "
                             "then it is swapped for a warm spare between steps (needs --spare-workers; its state "
                             "moved from it, nothing replayed), or 'rebalance': that, then the layers are split again "
                             "away from its stage in every replica, by the stages' measured times (not with "
                             f"--tensor-parallel > 1; nothing replayed) (default: {PipelineConfig.on_slow})")


def add_heal_arguments(parser: argparse.ArgumentParser) -> None:
    """``--snapshot-every`` and ``--spare-workers`` (the jobs' flags of ``snapshot_every`` and ``spare_workers``:
    what a failed worker's heal starts from, and what takes its place)."""
    parser.add_argument("--snapshot-every", type=int, default=PipelineConfig.snapshot_every, metavar="N",
                        help="steps between in-memory snapshots that failures heal from; 0: none, a failure is healed "
                             f"from the newest checkpoint or ends the run (default: {PipelineConfig.snapshot_every})")
    parser.add_argument("--spare-workers", type=int, default=PipelineConfig.spare_workers, metavar="K",
                        help="warm spares: idle stage processes, one worker's resources each; a failed worker's "
                             "place is taken by one instead of a process started then (a faster heal); never an "
                             "extra replica. With --tensor-parallel T a multiple of T: spares come in groups of T "
                             "on one node, each taking a whole stage's place "
                             f"(default: {PipelineConfig.spare_workers})")


def heal_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The PipelineConfig fields of :func:`add_heal_arguments`' flags."""
    return {"snapshot_every": args.snapshot_every, "spare_workers": args.spare_workers}


def _on_slow_flag(text: str) -> str:
    if text not in ON_SLOW:
        raise argparse.ArgumentTypeError(f"{text!r}: must be one of {list(ON_SLOW)}")
    return text


def slow_worker_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The PipelineConfig fields of :func:`add_slow_worker_arguments`' flags."""
    return {"slow_factor": args.slow_factor, "slow_steps": args.slow_steps, "on_slow": args.on_slow}


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """``--schedule`` and ``--virtual-stages`` (the jobs' flags of ``schedule`` and ``virtual_stages``)."""
    parser.add_argument("--schedule", default=PipelineConfig.schedule, choices=SCHEDULES,
                        help="pipeline schedule: gpipe, 1f1b, zb_h1 (1F1B's memory, the backward split into "
                             "input and weight gradients, the weight gradients deferred into the drain's bubble), "
                             "interleaved_1f1b (--virtual-stages >= 2 model chunks per worker: 1/v of 1F1B's bubble; "
                             "micro-batches in equal rounds, m %% max(1, m // stages) == 0) or zbv (two chunks per "
                             "worker in a V, zero bubble with equal F, I and W) (default: gpipe)")
    parser.add_argument("--virtual-stages", type=int, default=PipelineConfig.virtual_stages, metavar="V",
                        help="model chunks per worker (PipelineConfig.virtual_stages): >= 2 for interleaved_1f1b, "
                             "exactly 2 for zbv, 1 for the others (default: the schedule's own, 2 for "
                             "interleaved_1f1b and zbv, 1 for the others)")


def schedule_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The PipelineConfig fields of :func:`add_schedule_arguments`' flags."""
    return {"schedule": args.schedule, "virtual_stages": args.virtual_stages}


def activation_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The PipelineConfig fields of :func:`add_activation_arguments`' flags."""
    return {"activation_checkpoint": args.activation_checkpoint,
            "activation_checkpoint_segments": args.activation_checkpoint_segments,
            "offload_activations": args.offload_activations}


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



def parse_replicas(text: str) -> int | tuple[int, int]:
    """``--replicas``: ``N`` (a fixed run) or ``MIN:MAX`` (elastic, between MIN and MAX replicas).

    Raises :class:`argparse.ArgumentTypeError` (argparse's usage error, naming the text) otherwise.
    """
    parts = text.strip().split(":")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or MIN:MAX (e.g. 2 or 1:4)")
    try:
        counts = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: replicas must be whole numbers, N or MIN:MAX "
                                         "(e.g. 2 or 1:4)") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: replicas must be >= 1")
    if len(counts) == 1:
        return counts[0]
    low, high = counts
    if low > high:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN {low} is above MAX {high}")
    return low, high


def max_replicas(num_replicas: int | tuple[int, int] | list[int]) -> int:
    """The most replicas a run uses: ``num_replicas`` itself, or MAX of an elastic (MIN, MAX).

    An elastic run's global batch is sized for MAX replicas and stays the same whatever runs.
    """
    return num_replicas[1] if isinstance(num_replicas, (tuple, list)) else num_replicas


def replicas_for_config(replicas: int | tuple[int, int]) -> int | list[int]:
    """``num_replicas`` of a run config's pipeline from :func:`parse_replicas`: N, or [MIN, MAX] as YAML writes it."""
    return list(replicas) if isinstance(replicas, tuple) else replicas
