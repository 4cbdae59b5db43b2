"""An in-process interpreter of lowered ops: p stage workers in one process, no Ray.

It runs what the executors run — each worker's lowered op list of the config's
schedule (:func:`raypipe.core.lowering.lower`), on :class:`~raypipe.stage.worker.StageWorker`
stages — and ends each step as they do: every stage's gradient statistics, then
one decision and commit on every stage. Tensors pass between stages directly, in
per-channel FIFO order (messages match in issue order, as on NCCL). The order is a
round-robin: each sweep advances every worker through the ops whose inputs are
there; an EXCHANGE posts its sends first and completes once its receives arrive.

So a schedule's numerics (which ops, in which order, on which tensors) can be
checked against one process in seconds, for every schedule × activation
checkpointing × precision, before anything runs on Ray.

A worker may hold several model chunks (``virtual_stages``), as the executors' do:
one :class:`~raypipe.stage.worker.StageWorker` holds them all, and a tensor whose
next virtual stage is on the same worker is handed to it directly, as the lowering
has no message there.
"""
from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from raypipe.config import PipelineConfig
from raypipe.core import ops
from raypipe.core.lowering import lower
from raypipe.core.micro_batches import count_samples, loss_weights, replica_blocks, split_micro_batches
from raypipe.core.partition import partition_by_cost, worker_chunks
from raypipe.core.result import StageReport
from raypipe.core.schedule import make_schedule
from raypipe.core.step_decision import StageGradStats, StepDecision
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker


Key = tuple[int, int]  # (chunk, micro-batch)


@dataclass
class _StageState:
    """One worker's tensors in flight during a step (as the per-step worker's), by (chunk, micro-batch)."""

    activations: dict[Key, torch.Tensor] = field(default_factory=dict)  # received, or from its own chunk
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # to send
    gradients: dict[Key, torch.Tensor] = field(default_factory=dict)  # received, or from its own chunk
    input_gradients: dict[Key, torch.Tensor | None] = field(default_factory=dict)  # to send
    position: int = 0
    exchange_posted: bool = False


@dataclass
class _Replica:
    """One replica's pipeline: its ``p`` workers (each holding its ``v`` chunks), the lowered
    ops of each, and its block of the step's micro-batches."""

    workers: list[StageWorker]
    lowered: list[list[ops.LoweredOp]]
    block: range


class OpInterpreter:
    """``config.num_stages`` workers of ``layers`` (split by ``config.balance``, or evenly) per
    replica (``config.num_replicas``, fixed; ZeRO-1 with ``shard_optimizer``), each running the
    lowered ``config.schedule`` on its block of the step: :meth:`step` is one training step.
    ``loss_count_fn`` counts each micro-batch's targets for the loss weights, as the trainer's does.
    What passes between stages (a tensor or a tree of them) is handed over as it is.

    ``schedule`` (one of :data:`~raypipe.core.schedule.SCHEDULES`) with ``virtual_stages``
    chunks per worker runs instead of the config's; with v > 1 and no balance list the layers are
    cut into ``num_stages * virtual_stages`` virtual stages evenly, placed as the schedule places
    them. :attr:`workers` has every replica's workers, in rank order."""

    def __init__(self, layers: Sequence[Callable[[], nn.Module]] | Sequence[nn.Module], loss_fn: Callable,
                 optimizer_factory: Callable, config: PipelineConfig, loss_scale: float | None = None,
                 loss_count_fn: Callable[[torch.Tensor], int] = count_samples, *, schedule: str | None = None,
                 virtual_stages: int | None = None) -> None:
        if schedule is not None or virtual_stages is not None:
            config = config.replace(schedule=config.schedule if schedule is None else schedule,
                                    virtual_stages=virtual_stages or config.virtual_stages)
            if config.virtual_stages > 1 and not isinstance(config.balance, list):
                config = config.replace(balance=partition_by_cost([1.0] * len(layers), config.num_virtual_stages))
        config.validate(len(layers))
        if config.elastic:
            raise ValueError("the interpreter runs a fixed number of replicas")
        self.schedule = config.schedule
        # what weights each micro-batch's mean loss, as the trainer's loss_count_fn (packed rows: predicted tokens)
        self.config, self.loss_scale, self.loss_count_fn = config, loss_scale, loss_count_fn
        p, v, count = config.num_stages, config.virtual_stages, config.max_replicas
        self.num_workers, self.num_chunks, self.placement = p, v, config.placement
        balance = (config.balance if isinstance(config.balance, list)
                   else partition_by_cost([1.0] * len(layers), p * v))
        self.replicas: list[_Replica] = []
        for replica, block in enumerate(replica_blocks(config.num_micro_batches * count, count)):
            schedule_ops = make_schedule(self.schedule, p, len(block), v)
            workers = []
            for stage, chunks in enumerate(worker_chunks(balance, p, self.placement)):
                indices = [index for chunk in chunks for index in chunk]
                workers.append(StageWorker(WorkerSpec(
                    stage, p, tuple(_layer(layers[i], count) for i in indices), tuple(indices), config,
                    ops=tuple(schedule_ops[stage]), replica=replica, num_replicas=count, micro_batches=block,
                    optimizer_factory=optimizer_factory, loss_fn=loss_fn if stage == config.loss_stage else None,
                    loss_count_fn=loss_count_fn, chunk_sizes=tuple(map(len, chunks)))))
            self.replicas.append(_Replica(workers, lower(schedule_ops, self.placement), block))
        self.workers = [worker for replica in self.replicas for worker in replica.workers]
        self.lowered = self.replicas[0].lowered
        self.reports: list[StageReport] = []  # every worker's, of the last step

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepDecision:
        """One step on the global batch (split as the trainer splits it); the decision
        every worker took (loss, grad norm, skipped or not)."""
        inputs, targets = split_micro_batches(inputs, targets, self.config.micro_batches_per_step)
        weights = loss_weights([self.loss_count_fn(t) for t in targets])
        for replica in self.replicas:
            block = replica.block
            self._run_replica(replica, step, inputs[block.start:block.stop], targets[block.start:block.stop],
                              weights[block.start:block.stop])
        return self._end_step()

    def _run_replica(self, replica: _Replica, step: int, inputs: list, targets: list, weights: list) -> None:
        """Run one replica's ops up to the step's collectives."""
        lowered = replica.lowered
        states = [_StageState() for _ in lowered]
        channels: dict[tuple[int, int], deque] = {}
        while True:
            progressed = False
            for stage, stage_ops in enumerate(lowered):
                progressed |= self._advance(stage_ops, stage, replica, states, channels, step, inputs, targets,
                                            weights)
            if all(state.position < len(lowered[s]) and lowered[s][state.position].kind == ops.REDUCE_GRAD
                   for s, state in enumerate(states)):
                break
            if not progressed:
                waiting = {stage: lowered[stage][state.position] for stage, state in enumerate(states)}
                raise RuntimeError(f"the lowered schedule is stuck: each stage's next op is {waiting}")
        leftovers = [s for s, state in enumerate(states)
                     if state.activations or state.outputs or state.gradients or state.input_gradients]
        if leftovers:
            raise RuntimeError(f"stages {leftovers} ended the step with tensors never used")

    def _advance(self, stage_ops: list[ops.LoweredOp], stage: int, replica: _Replica, states: list[_StageState],
                 channels: dict, step: int, inputs: list, targets: list, weights: list) -> bool:
        """Run worker ``stage``'s ops until one waits (a message not yet sent, or the collectives)."""
        state = states[stage]
        progressed = False
        while state.position < len(stage_ops):
            op = stage_ops[state.position]
            if op.kind in (ops.REDUCE_GRAD, ops.OPTIMIZER_STEP):
                return progressed
            if op.kind == ops.EXCHANGE:
                if not state.exchange_posted:
                    for part in op.parts:
                        if part.kind in ops.SENDS:
                            self._send(stage, part, state, channels)
                    state.exchange_posted = progressed = True
                receives = [part for part in op.parts if part.kind in ops.RECEIVES]
                if not all(self._arrived(stage, peer, channels, sum(part.peer == peer for part in receives))
                           for peer in {part.peer for part in receives}):
                    return progressed
                for part in receives:
                    self._receive(stage, part, state, channels)
                state.exchange_posted = False
            elif op.kind in ops.RECEIVES:
                if not self._arrived(stage, op.peer, channels):
                    return progressed
                self._receive(stage, op, state, channels)
            elif op.kind in ops.SENDS:
                self._send(stage, op, state, channels)
            else:
                self._compute(replica, stage, op, state, step, inputs, targets, weights)
            state.position += 1
            progressed = True
        return progressed

    def _neighbour(self, stage: int, chunk: int, kind: str) -> tuple[int, int]:
        return ops.neighbour(stage, chunk, kind, self.num_workers, self.num_chunks, self.placement)

    def _compute(self, replica: _Replica, stage: int, op: ops.LoweredOp, state: _StageState, step: int,
                 inputs: list, targets: list, weights: list) -> None:
        mb, chunk = op.micro_batch, op.chunk
        worker = replica.workers[stage]
        first, last = worker.chunks.is_first(chunk), chunk == worker.chunks.last  # the model's first and last
        scale = self.loss_scale if last and self.loss_scale is not None else 1.0
        if op.kind == ops.F:
            hidden = inputs[mb] if first else state.activations.pop((chunk, mb))
            output = worker.forward(mb, hidden, targets[mb] if last else None, weights[mb] if last else None, step,
                                    chunk, read_loss=False)  # as the per-step loop runs it
            if not last:
                self._hand_on(stage, chunk, mb, ops.SEND_ACT, output, state)
        elif op.kind in (ops.B, ops.I):
            backward = worker.backward if op.kind == ops.B else worker.backward_input
            gradient = backward(mb, None if last else state.gradients.pop((chunk, mb)), scale, chunk)
            if not first:  # the first stage has no input gradient to send
                self._hand_on(stage, chunk, mb, ops.SEND_GRAD, gradient, state)
        elif op.kind == ops.W:
            worker.backward_weight(mb, chunk)
        else:
            raise ValueError(f"the interpreter has no handler for {op!r}")

    def _hand_on(self, stage: int, chunk: int, mb: int, kind: str, tensor: torch.Tensor, state: _StageState) -> None:
        """What a compute op made for the next (SEND_ACT) or previous (SEND_GRAD) virtual stage: to send,
        or, where that stage is this worker's other chunk, straight to its input (the lowering has no message)."""
        peer, peer_chunk = self._neighbour(stage, chunk, kind)
        if peer == stage:
            (state.activations if kind == ops.SEND_ACT else state.gradients)[(peer_chunk, mb)] = tensor
        else:
            (state.outputs if kind == ops.SEND_ACT else state.input_gradients)[(chunk, mb)] = tensor

    def _send(self, stage: int, op: ops.LoweredOp, state: _StageState, channels: dict) -> None:
        source = state.outputs if op.kind == ops.SEND_ACT else state.input_gradients
        peer, peer_chunk = self._neighbour(stage, op.chunk, op.kind)
        if peer != op.peer:
            raise RuntimeError(f"stage {stage}: {op!r} goes to worker {peer}, not {op.peer}")
        channels.setdefault((stage, peer), deque()).append(
            (op.kind, op.micro_batch, peer_chunk, source.pop((op.chunk, op.micro_batch))))

    @staticmethod
    def _arrived(stage: int, peer: int, channels: dict, count: int = 1) -> bool:
        """Whether ``count`` messages from ``peer`` wait for ``stage``."""
        return len(channels.get((peer, stage), ())) >= count

    @staticmethod
    def _receive(stage: int, op: ops.LoweredOp, state: _StageState, channels: dict) -> None:
        kind, micro_batch, chunk, tensor = channels[(op.peer, stage)].popleft()
        expected = ops.SEND_ACT if op.kind == ops.RECV_ACT else ops.SEND_GRAD
        if (kind, micro_batch, chunk) != (expected, op.micro_batch, op.chunk):
            raise RuntimeError(f"stage {stage}: {op!r} got {kind}{micro_batch} for chunk {chunk} "
                               f"(messages mis-paired)")
        (state.activations if op.kind == ops.RECV_ACT else state.gradients)[(chunk, micro_batch)] = tensor

    def _end_step(self) -> StepDecision:
        """REDUCE_GRAD then OPTIMIZER_STEP on every worker, as the per-step executor ends a step:
        the replicas' gradients summed (onto each gradient's owner with ZeRO-1), every stage's
        statistics, one decision and commit everywhere, then ZeRO-1's gather of the new weights."""
        scale = 1.0 if self.loss_scale is None else self.loss_scale
        columns = list(zip(*(replica.workers for replica in self.replicas)))  # per stage, its replicas
        for workers in columns:
            _sum_over_replicas([worker.gradients_to_reduce() for worker in workers])
        stats: list[StageGradStats | None] = [None] * (self.num_workers * self.num_chunks)  # per virtual stage
        for stage, workers in enumerate(columns):
            own = [worker.chunk_grad_stats(1.0 / scale, self.config.clip_grad_value) for worker in workers]
            for chunk, parts in enumerate(zip(*own)):
                norm = sum(part.squared_norm for worker, part in zip(workers, parts)
                           if worker.ownership.counts_in_norm())
                loss = sum(part.loss for part in parts) if parts[0].loss is not None else None
                stats[ops.virtual_stage(stage, chunk, self.num_workers, self.placement)] = StageGradStats(
                    norm, any(part.found_inf for part in parts), loss)
        self.reports = [worker.commit(self.loss_scale is not None, *stats) for worker in self.workers]
        for workers in columns:
            _gather_owned_weights(workers)
        decisions = {repr(report.decision) for report in self.reports}  # a NaN norm is no equal of itself
        if len(decisions) != 1:
            raise RuntimeError(f"the workers decided differently: {decisions}")
        return self.reports[0].decision

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


@torch.no_grad()
def _sum_over_replicas(reductions: list[tuple[list[torch.Tensor], tuple[int, ...] | None]]) -> None:
    """The replicas' gradients summed, in replica order, onto every replica (all-reduce) or
    onto each gradient's owner (ZeRO-1's reduce-scatter), in place."""
    owners = reductions[0][1]
    for index, gradients in enumerate(zip(*(gradients for gradients, _ in reductions))):
        total = gradients[0].clone()
        for gradient in gradients[1:]:
            total += gradient
        for replica, gradient in enumerate(gradients):
            if owners is None or owners[index] == replica:
                gradient.copy_(total)


@torch.no_grad()
def _gather_owned_weights(workers: list[StageWorker]) -> None:
    """ZeRO-1, after the owners stepped: every replica's compute weights from their owners."""
    owners = workers[0].ownership.owners
    if owners is None:
        return
    for index, owner in enumerate(owners):
        for replica, worker in enumerate(workers):
            if replica != owner:
                worker._compute_weights[index].copy_(workers[owner]._compute_weights[index])
