"""An in-process harness of the step runner: p stage workers per replica in one process, no Ray.

It runs what the per-step executor runs — every worker's lowered op list of the
config's schedule, by the same :class:`~raypipe.stage.step_runner.StepRunner` over
:class:`~raypipe.stage.worker.StageWorker` stages, the replicas' gradient reduction,
the statistics all-reduce, the commit and ZeRO-1's gather included — over an
in-memory channel (:mod:`raypipe.testing.memory_channel`): one thread per worker,
taking turns, tensors handed over as they are, messages matched in per-pair FIFO
order (as on NCCL), the collectives combined in rank order.

So a schedule's numerics (which ops, in which order, on which tensors) can be
checked against one process in seconds, for every schedule × activation
checkpointing × precision × replicas, before anything runs on Ray.

A worker may hold several model chunks (``virtual_stages``), as the executors' do:
one :class:`~raypipe.stage.worker.StageWorker` holds them all.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from raypipe.config import PipelineConfig
from raypipe.core import ops
from raypipe.core.micro_batches import count_samples, loss_weights, replica_blocks, split_micro_batches
from raypipe.core.partition import partition_by_cost, worker_chunks
from raypipe.core.result import StageReport
from raypipe.core.schedule import make_schedule
from raypipe.core.step_decision import StepDecision
from raypipe.core.topology import Topology
from raypipe.errors import StepAborted
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.step_runner import StepRunner
from raypipe.stage.worker import StageWorker
from raypipe.testing.memory_channel import MemoryChannel, MemoryGroup

# The workers' threads, kept between steps and harnesses: a thread's first torch ops cost
# milliseconds (its thread-local state), more than a small model's step. A thread is made
# only when none is idle, so this holds as many as the largest harness has workers.
_MAX_WORKERS = 256
_THREADS = ThreadPoolExecutor(max_workers=_MAX_WORKERS, thread_name_prefix="raypipe-interpreter")


@dataclass
class _Replica:
    """One replica's pipeline: its ``p`` workers (each holding its ``v`` chunks), the lowered
    ops of each, and its block of the step's micro-batches."""

    workers: list[StageWorker]
    runners: list[StepRunner]
    block: range

    @property
    def lowered(self) -> list[list[ops.LoweredOp]]:
        return [runner.ops for runner in self.runners]


class OpInterpreter:
    """``config.num_stages`` workers of ``layers`` (split by ``config.balance``, or evenly) per
    replica (``config.num_replicas``, fixed; ZeRO-1 with ``shard_optimizer``), each running the
    lowered ``config.schedule`` on its block of the step: :meth:`step` is one training step.
    ``loss_count_fn`` counts each micro-batch's targets for the loss weights, as the trainer's does.
    ``lr_scheduler(optimizer)`` builds each worker's scheduler, stepped with its optimizer, as the trainer's.
    What passes between stages (a tensor or a tree of them) is handed over as it is.

    ``schedule`` (one of :data:`~raypipe.core.schedule.SCHEDULES`) with ``virtual_stages``
    chunks per worker runs instead of the config's; with v > 1 and no balance list the layers are
    cut into ``num_stages * virtual_stages`` virtual stages evenly, placed as the schedule places
    them. :attr:`workers` has every replica's workers, in rank order."""

    def __init__(self, layers: Sequence[Callable[[], nn.Module]] | Sequence[nn.Module], loss_fn: Callable,
                 optimizer_factory: Callable, config: PipelineConfig, loss_scale: float | None = None,
                 loss_count_fn: Callable[[torch.Tensor], int] = count_samples, *, schedule: str | None = None,
                 virtual_stages: int | None = None, lr_scheduler: Callable | None = None) -> None:
        if schedule is not None or virtual_stages is not None:
            config = config.replace(schedule=config.schedule if schedule is None else schedule,
                                    virtual_stages=virtual_stages or config.virtual_stages)
            if config.virtual_stages > 1 and not isinstance(config.balance, list):
                config = config.replace(balance=partition_by_cost([1.0] * len(layers), config.num_virtual_stages))
        config.validate(len(layers))
        if config.elastic:
            raise ValueError("the interpreter runs a fixed number of replicas")
        if config.tensor_parallel > 1:
            raise ValueError(f"the interpreter runs tensor_parallel=1 only, not {config.tensor_parallel}: "
                             "tensor-parallel steps run on Ray (a stage's ranks form a gloo group)")
        if config.num_stages * config.max_replicas > _MAX_WORKERS:
            raise ValueError(f"the interpreter runs at most {_MAX_WORKERS} workers, each in a thread of its own, "
                             f"not {config.num_stages * config.max_replicas}")
        self.schedule = config.schedule
        # what weights each micro-batch's mean loss, as the trainer's loss_count_fn (packed rows: predicted tokens)
        self.config, self.loss_scale, self.loss_count_fn = config, loss_scale, loss_count_fn
        p, v, count = config.num_stages, config.virtual_stages, config.max_replicas
        self.num_workers, self.num_chunks, self.placement = p, v, config.placement
        balance = (config.balance if isinstance(config.balance, list)
                   else partition_by_cost([1.0] * len(layers), p * v))
        self.replicas: list[_Replica] = []
        self._group = MemoryGroup(Topology(p, count, config.tensor_parallel))
        for replica, block in enumerate(replica_blocks(config.num_micro_batches * count, count)):
            schedule_ops = make_schedule(self.schedule, p, len(block), v)
            workers = []
            for stage, chunks in enumerate(worker_chunks(balance, p, self.placement)):
                indices = [index for chunk in chunks for index in chunk]
                workers.append(StageWorker(WorkerSpec(
                    stage, p, tuple(_layer(layers[i], count) for i in indices), tuple(indices), config,
                    ops=tuple(schedule_ops[stage]), replica=replica, num_replicas=count, micro_batches=block,
                    optimizer_factory=optimizer_factory, loss_fn=loss_fn if stage == config.loss_stage else None,
                    loss_count_fn=loss_count_fn, scheduler_factory=lr_scheduler,
                    chunk_sizes=tuple(map(len, chunks)))))
            runners = [StepRunner(worker, MemoryChannel(self._group, replica, stage, p * v))
                       for stage, worker in enumerate(workers)]
            self.replicas.append(_Replica(workers, runners, block))
        self.workers = [worker for replica in self.replicas for worker in replica.workers]
        self.lowered = self.replicas[0].lowered
        self.reports: list[StageReport] = []  # every worker's, of the last step

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepDecision:
        """One step on the global batch (split as the trainer splits it): every worker's step
        runner in a thread of its own (the threads take turns); the decision every worker took (loss, grad norm, skipped
        or not). A worker's failure is raised here (the first, not a released worker's
        :class:`~raypipe.errors.StepAborted`); a schedule that cannot go on raises a RuntimeError."""
        inputs, targets = split_micro_batches(inputs, targets, self.config.micro_batches_per_step)
        weights = loss_weights([self.loss_count_fn(t) for t in targets])
        group = self._group
        group.begin()
        reports: list[StageReport | None] = [None] * len(self.workers)
        failures: list[BaseException] = []  # in the order they happened: one worker runs at a time

        def run(rank: int, runner: StepRunner, block: range) -> None:
            with group.turn():
                try:
                    reports[rank] = runner.run(step, inputs[block.start:block.stop], targets[block.start:block.stop],
                                               weights[block.start:block.stop], self.loss_scale)
                except BaseException as error:  # noqa: BLE001 - raised by the caller's thread
                    failures.append(error)

        running = [_THREADS.submit(run, len(replica.runners) * index + stage, runner, replica.block)
                   for index, replica in enumerate(self.replicas) for stage, runner in enumerate(replica.runners)]
        for worker in running:
            worker.result()
        cause = next((failure for failure in failures if not isinstance(failure, StepAborted)), None)
        if cause is not None:
            raise cause
        if group.stuck is not None:
            raise RuntimeError(group.stuck)
        if failures:
            raise failures[0]
        self.reports = reports
        decisions = {repr(report.decision) for report in reports}  # a NaN norm is no equal of itself
        if len(decisions) != 1:
            raise RuntimeError(f"the workers decided differently: {decisions}")
        return reports[0].decision

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters, named as in one ``nn.Sequential`` of the layers (replica 0's:
        every replica's, after ZeRO-1's gather, unless bf16 keeps a main weight on its owner only)."""
        state = {}
        for worker in self.replicas[0].workers:
            for index, layer in zip(worker.layer_indices, worker.layers):
                state.update({f"{index}.{name}": value.detach().clone() for name, value in layer.state_dict().items()})
        return state


def _layer(layer, num_replicas: int) -> nn.Module:
    """A layer for one replica's worker: a module is copied when several replicas build from it."""
    return copy.deepcopy(layer) if num_replicas > 1 and isinstance(layer, nn.Module) else layer

