"""The per-step workers without Ray: every worker of a (d, p, t) layout is the class the Ray
actors run (:class:`~raypipe.executor.per_step_worker.PerStepWorker`: the step runner over
:class:`~raypipe.comm.p2p.P2PChannel`), in a process of its own, joined in real gloo groups
(the pipeline's, the replicas' per (stage, tp_rank) and each stage's tensor-parallel group
with its ``DeviceMesh``) exactly as on Ray. What Ray adds (placement, the driver's calls,
the controller) is left out; what it computes is all there.

The tensor-parallel exactness matrix runs here: DTensor needs a process group per rank, so
the in-process harness (threads over an in-memory channel) cannot run ``t > 1``. The
processes are forked from a forkserver that has imported torch and raypipe once (tests/forked.py),
so a layout of 8 workers starts in well under a second of CPU instead of eight imports of torch
(a Ray actor's start)."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ray import cloudpickle
from torch import nn

import raypipe
from raypipe.checkpoint.store import read_manifest, write_manifest
from raypipe.control.elastic import replica_specs
from raypipe.core.micro_batches import count_samples, loss_weights, split_micro_batches
from raypipe.core.partition import partition_by_cost, worker_chunks
from raypipe.core.result import StepResult
from raypipe.core.step_decision import OVERFLOW
from raypipe.stage.spec import WorkerSpec
from tests.forked import CONTEXT
from tests.reference import trainer_loss_scaler, trainer_step_result

JOIN_TIMEOUT_S = 60.0


def _send(connection: multiprocessing.connection.Connection, value: Any) -> None:
    """``value`` through ``connection`` by value, as Ray ships a call's arguments and result: a
    connection's own pickler would share a tensor's storage between the processes, so what a
    worker returned (a state dict of its live parameters) would change with its next step."""
    connection.send_bytes(cloudpickle.dumps(value))


def _receive(connection: multiprocessing.connection.Connection) -> Any:
    return cloudpickle.loads(connection.recv_bytes())


def _worker_main(spec_bytes: bytes, connection: multiprocessing.connection.Connection) -> None:
    """One worker: build it from its spec, then answer ``(method, arguments)`` calls until ``None``."""
    from raypipe.executor.per_step_worker import PerStepWorker

    try:
        worker = PerStepWorker(cloudpickle.loads(spec_bytes))
        _send(connection, (True, None))
    except BaseException:  # noqa: BLE001 - the parent raises it with the worker's traceback
        _send(connection, (False, traceback.format_exc()))
        return
    while (call := _receive(connection)) is not None:
        method, arguments = call
        try:  # a function (run_in) takes the worker first, as a Ray actor's __ray_call__ does
            _send(connection, (True, method(worker, *arguments) if callable(method)
                               else getattr(worker, method)(*arguments)))
        except BaseException:  # noqa: BLE001
            _send(connection, (False, traceback.format_exc()))


class GlooPipeline:
    """The ``config``'s layout of per-step workers of ``layers`` (modules or
    :class:`~raypipe.LayerSpec`), each in a forked process, over gloo: :meth:`step` is one
    training step on the global batch, split and weighted as the trainer splits it, and gives
    the trainer's :class:`~raypipe.StepResult`; :meth:`state_dict` the whole model (tensor-parallel
    layers gathered). A context manager: leaving it ends the processes."""

    def __init__(self, layers: Sequence[nn.Module | raypipe.LayerSpec], loss_fn: Callable,
                 optimizer_factory: Callable, config: raypipe.PipelineConfig,
                 loss_count_fn: Callable[[torch.Tensor], int] = count_samples) -> None:
        config.validate(len(layers))
        if config.elastic:
            raise ValueError("the gloo pipeline runs a fixed number of replicas")
        self.config, self.loss_count_fn, self.step_count = config, loss_count_fn, 0
        self.scaler = trainer_loss_scaler(config)
        p, v = config.num_stages, config.virtual_stages
        balance = (config.balance if isinstance(config.balance, list)
                   else partition_by_cost([1.0] * len(layers), p * v))
        stages = []
        for stage, chunks in enumerate(worker_chunks(balance, p, config.placement)):
            indices = [index for chunk in chunks for index in chunk]
            stages.append(WorkerSpec(
                stage=stage, num_stages=p, layers=tuple(layers[i] for i in indices), layer_indices=tuple(indices),
                config=config, optimizer_factory=optimizer_factory,
                loss_fn=loss_fn if stage == config.loss_stage else None, loss_count_fn=loss_count_fn,
                chunk_sizes=tuple(map(len, chunks))))
        self.specs = replica_specs(stages, config.max_replicas, config.micro_batches_per_step)
        self._connections: list[multiprocessing.connection.Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        try:
            for rank in range(len(self.specs)):
                self._connections.append(None)
                self._processes.append(None)
                self._start_worker(rank)
            self._answers(range(len(self.specs)))  # every worker built
            self._join()
        except BaseException:
            self.close()
            raise

    def _start_worker(self, rank: int) -> None:
        """Worker ``rank``'s process, started (its answer, once built, is read by the caller)."""
        ours, theirs = CONTEXT.Pipe()
        process = CONTEXT.Process(target=_worker_main, args=(cloudpickle.dumps(self.specs[rank]), theirs),
                                   daemon=True)
        process.start()
        theirs.close()
        self._connections[rank], self._processes[rank] = ours, process

    def _join(self) -> None:
        address, port = self.call(0, "rendezvous_address")
        self._calls(lambda rank: ("join_group", (address, port, JOIN_TIMEOUT_S)))

    def reform_groups(self) -> None:
        """Every worker leaves the group and all join a new one, as the executor re-forms them
        after a failed step or a heal."""
        self._calls(lambda rank: ("leave_group", ()))
        self._join()

    def snapshots(self) -> list[dict[str, Any]]:
        """Every worker's in-memory snapshot, by rank."""
        return self._calls(lambda rank: ("snapshot", ()))

    def restore(self, snapshots: Sequence[dict[str, Any]]) -> None:
        """Every worker back to its snapshot (of :meth:`snapshots`)."""
        self._calls(lambda rank: ("restore", (snapshots[rank],)))

    def replace_workers(self, ranks: Sequence[int], snapshots: Sequence[dict[str, Any]]) -> None:
        """What a heal from a snapshot does for lost workers (a node lost takes a whole stage's
        tensor-parallel ranks): their processes killed (SIGKILL), the others leave the group and
        restore their ``snapshots`` (by rank), a new process of each lost one's spec restores its
        snapshot, and all join a new group."""
        for rank in ranks:
            self._processes[rank].kill()
            self._processes[rank].join()
            self._connections[rank].close()
        survivors = [other for other in range(len(self.specs)) if other not in ranks]
        self._calls(lambda other: ("leave_group", ()), survivors)
        self._calls(lambda other: ("restore", (snapshots[other],)), survivors)
        for rank in ranks:
            self._start_worker(rank)
        self._answers(ranks)
        self._calls(lambda rank: ("restore", (snapshots[rank],)), ranks)
        self._join()

    def shrink(self, replicas: int, snapshots: Sequence[dict[str, Any]]) -> None:
        """What an elastic run's shrink to its first ``replicas`` replicas does (a node lost with a
        worker of each other one, no room to replace it): the other replicas' processes killed
        (SIGKILL), the survivors leave the group, take the smaller layout's specs (the step's
        micro-batches over fewer replicas), join a new group (fewer groups than before: their
        names move) and restore their ``snapshots`` (by rank), in the controller's order."""
        kept = replicas * self.config.num_stages * self.config.tensor_parallel
        for rank in range(kept, len(self.specs)):
            self._processes[rank].kill()
            self._processes[rank].join()
            self._connections[rank].close()
        stages = [spec for spec in self.specs[:kept] if spec.replica == 0 and spec.tp_rank == 0]
        self.specs = replica_specs(stages, replicas, self.config.micro_batches_per_step)
        self._processes, self._connections = self._processes[:kept], self._connections[:kept]
        self._calls(lambda rank: ("leave_group", ()))
        self._calls(lambda rank: ("take_layout", (self.specs[rank],)))
        self._join()
        self.restore(snapshots[:kept])

    def call(self, rank: int, method: str, *arguments: Any) -> Any:
        """Worker ``rank``'s ``method(*arguments)``."""
        _send(self._connections[rank], (method, arguments))
        return self._answers([rank])[0]

    def run_in(self, rank: int, function: Callable, *arguments: Any) -> Any:
        """``function(worker, *arguments)`` in worker ``rank``'s process (what Ray's ``__ray_call__`` runs
        in an actor: e.g. :func:`raypipe.testing.timed_layers.slow_down` there alone)."""
        _send(self._connections[rank], (function, arguments))
        return self._answers([rank])[0]

    def _calls(self, call_of: Callable[[int], tuple[str, tuple]], ranks: Sequence[int] | None = None) -> list[Any]:
        """``call_of(rank)`` on every one of ``ranks`` (all by default) at once; their answers."""
        ranks = range(len(self.specs)) if ranks is None else ranks
        for rank in ranks:
            _send(self._connections[rank], call_of(rank))
        return self._answers(ranks)

    def _answers(self, ranks: Sequence[int]) -> list[Any]:
        answers, failures = [], []
        for rank in ranks:
            ok, value = _receive(self._connections[rank])
            answers.append(value)
            if not ok:
                failures.append(f"worker {rank} ({self._name(rank)}):\n{value}")
        if failures:
            raise RuntimeError("\n".join(failures))
        return answers

    def _name(self, rank: int) -> str:
        spec = self.specs[rank]
        return f"replica {spec.replica} stage {spec.stage} tp_rank {spec.tp_rank}"

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One training step on the global batch, as the trainer's."""
        inputs, targets = split_micro_batches(inputs, targets, self.config.micro_batches_per_step)
        weights = loss_weights([self.loss_count_fn(t) for t in targets])
        last = self.config.loss_stage
        loss_scale = None if self.scaler is None else self.scaler.scale

        def arguments(rank: int) -> tuple[str, tuple]:
            spec = self.specs[rank]
            own = slice(spec.block.start, spec.block.stop)
            return "run_step", (self.step_count, inputs[own] if spec.stage == 0 else None,
                                targets[own] if spec.stage == last else None,
                                weights[own] if spec.stage == last else None, loss_scale)

        reports = self._calls(arguments)
        decisions = {repr(report.decision) for report in reports}  # a NaN norm is no equal of itself
        if len(decisions) != 1:
            raise RuntimeError(f"the workers decided differently: {decisions}")
        decision = reports[0].decision
        if self.scaler is not None:
            self.scaler.update(decision.skip_reason == OVERFLOW)
        self.step_count += 1
        return trainer_step_result(self.step_count - 1, decision, self.config, loss_scale, reports)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, named as one ``nn.Sequential`` of the layers (replica 0's: a stage's
        tensor-parallel ranks gather its split layers together, so all of them are asked)."""
        ranks = [rank for rank, spec in enumerate(self.specs) if spec.replica == 0]
        state = {}
        for layers in self._calls(lambda rank: ("state_dict", ()), ranks):
            for index, layer_state in layers.items():
                state.update({f"{index}.{name}": value for name, value in layer_state.items()})
        return state

    def save_checkpoint(self, root_uri) -> int:
        """The trainer's checkpoint of the state now, written by the workers as on Ray (replica 0's,
        with ZeRO-1 every replica's; a stage's tensor-parallel ranks gather together, tp_rank 0
        writes), and its manifest; returns the step saved."""
        parts = self.config.max_replicas if self.config.shard_optimizer else 1
        writers = [rank for rank, spec in enumerate(self.specs) if parts > 1 or spec.replica == 0]
        started = self._calls(lambda rank: ("start_checkpoint", (str(root_uri), self.step_count)), writers)
        written = self._calls(lambda rank: ("checkpoint_files", (self.step_count, started[writers.index(rank)])),
                              writers)
        layer_files = {index: file for files in written for index, file in files.layers.items()}
        extra = {"step_count": self.step_count, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "optimizer_parts": parts}
        blobs = [blob for files in written for blob in files.blobs]
        write_manifest(root_uri, self.step_count, layer_files, extra, blobs)
        return self.step_count

    def load_checkpoint(self, root_uri, step: int) -> None:
        """Checkpoint ``step`` (written by any layout, on Ray or here) loaded by every worker, as on Ray."""
        extra = read_manifest(str(root_uri), step).get("extra", {})
        self._calls(lambda rank: ("load_checkpoint", (str(root_uri), step, extra.get("optimizer_parts", 1))))
        self.step_count = extra.get("step_count", step)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])

    def close(self) -> None:
        """End every worker process (idempotent)."""
        connections = [connection for connection in self._connections if connection is not None]
        for connection in connections:
            try:
                _send(connection, None)
            except OSError:
                pass
        for process in filter(None, self._processes):
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in connections:
            connection.close()
        self._connections, self._processes = [], []

    def __enter__(self) -> GlooPipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def uninterrupted_run(layers: Sequence[nn.Module | raypipe.LayerSpec], loss_fn: Callable,
                      optimizer_factory: Callable, config: raypipe.PipelineConfig,
                      batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[list[list[float]], dict[str, list]]:
    """The steps of ``batches`` in a :class:`GlooPipeline`, as a run with faults on Ray records them
    (tests/executor/cluster_run.py's ``as_lists``): each step's ``[loss, grad_norm]`` and the final
    state's tensors as lists (floats compare exactly)."""
    with GlooPipeline(layers, loss_fn, optimizer_factory, config) as pipeline:
        steps = [[result.loss, result.grad_norm] for result in (pipeline.step(x, y) for x, y in batches)]
        return steps, {name: tensor.tolist() for name, tensor in pipeline.state_dict().items()}
