"""The per-step executor with its calls sent over a connection to each worker
(step_calls="connections", the default): a step runs on the worker beside its other calls. The
snapshot of the state a step starts from is copied once that step first waits for a
neighbour (stage 0 after its forwards, the last stage before its first activation); one
still being copied out when the step reaches its commit holds that commit back (its first
forward too when the stage saves buffers), and is the state of its own step; a worker
killed while its snapshot is being copied out leaves the snapshot before it to heal from.
The tests that only read a run share it: where a snapshot is copied, and a slow one holding back
a stage that saves no buffer, are one run's."""
import copy
import os
import signal
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe.control.snapshots import Snapshots
from tests.reference import adamw, assert_parameters_match, random_batches, reference_step

SNAPSHOT_SECONDS = 1.0


class SlowToCopy(nn.Linear):
    """A Linear whose state_dict takes a second: a snapshot of its stage is still
    being taken while the next step runs."""

    def state_dict(self, *args, **kwargs):
        time.sleep(SNAPSHOT_SECONDS)
        return super().state_dict(*args, **kwargs)


class SlowToPickle:
    """A value that takes a second to pickle, as Ray does to ship a task's result, and none to copy."""

    def __deepcopy__(self, memo: dict) -> "SlowToPickle":
        return SlowToPickle()

    def __reduce__(self) -> tuple:
        time.sleep(SNAPSHOT_SECONDS)
        return SlowToPickle, ()


def adamw_slow_to_ship(out_features: int):
    """AdamW, whose state ships a second after it is copied on the stage whose Linear has
    ``out_features`` outputs (a hyper-parameter that pickles slowly): a snapshot of that stage
    lets the step commit, and is stored a second later."""
    def make(parameters):
        parameters = list(parameters)
        optimizer = adamw(parameters)
        if any(parameter.shape[0] == out_features for parameter in parameters if parameter.dim() == 2):
            optimizer.param_groups[0]["shipped_slowly"] = SlowToPickle()
        return optimizer

    return make


class Stamped(nn.Linear):
    """A Linear whose state dict carries the time its copy began: when a snapshot was copied."""

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        copied_at = time.time()
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        state[prefix + "copied_at"] = torch.tensor(copied_at, dtype=torch.float64)
        return state


class StampedSlowToCopy(Stamped, SlowToCopy):
    """Stamped with the time its copy began, then a second to copy."""


def as_plain(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` for the one-process reference: a Linear (stamped or slow) as a plain one."""
    if not isinstance(layer, nn.Linear):
        return copy.deepcopy(layer)
    plain = nn.Linear(layer.in_features, layer.out_features)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        plain.bias.copy_(layer.bias)
    return plain


@pytest.fixture
def snapshots_taken(monkeypatch) -> list:
    """Every snapshot the driver takes from now on, in order (each new newest one of its :class:`Snapshots`)."""
    return record_snapshots(monkeypatch)


def record_snapshots(monkeypatch) -> list:
    """Every snapshot the driver takes from now on, in order (each new newest one of its :class:`Snapshots`)."""
    taken = []
    for name in ("take", "keep_due"):
        def recording(self, *args, _original=getattr(Snapshots, name), **kwargs):
            _original(self, *args, **kwargs)
            if self.held and all(snapshot is not self.held[-1] for snapshot in taken):
                taken.append(self.held[-1])
        monkeypatch.setattr(Snapshots, name, recording)
    return taken


def snapshot_of_step(taken: list, step: int, stage: int) -> dict:
    [snapshot] = [snapshot for snapshot in taken if snapshot.step == step]
    return ray.get(snapshot.refs[stage])


@pytest.mark.cluster
def test_a_worker_killed_while_its_snapshot_is_copied_out_heals_from_the_snapshot_before(ray_cluster):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), SlowToCopy(16, 4)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    reference_optimizer = adamw(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, balance=[2, 1], hang_timeout_s=5.0)
    batches = random_batches(8, steps=4)
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, adamw, config) as trainer:
        losses = [trainer.step(x, y).loss for x, y in batches[:2]]
        # the third step starts, and stage 1 copies out its snapshot of step 2 as it waits for stage 0
        threading.Timer(SNAPSHOT_SECONDS / 4, os.kill, (trainer.workers[1].pid, signal.SIGKILL)).start()
        healed = trainer.step(*batches[2])
        losses += [healed.loss, trainer.step(*batches[3]).loss]
        assert healed.recovered and len(trainer.failures) == 1, trainer.failures
        assert [recovered.source for recovered in trainer.recoveries] == ["snapshot of step 1"]
        assert trainer.recoveries[0].replayed_steps == 1  # step 2, redone on the snapshot of step 1
        state = trainer.state_dict()
    expected = [reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, 2)[0]
                for x, y in batches]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_parameters_match(state, reference.state_dict())


@pytest.mark.cluster
def test_a_worker_killed_after_its_step_committed_while_its_snapshot_is_stored_heals_from_the_one_before(
        ray_cluster):
    """The snapshot of step 1 lets step 1 commit once copied and ships for a second after; the next
    snapshot is taken as step 2 starts, and the worker dies in step 2 before either is stored: the
    snapshot of step 0 is still held (neither newer one was known stored), and step 2 heals from it."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    reference_optimizer = adamw(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, balance=[2, 1], hang_timeout_s=5.0)
    batches = random_batches(8, steps=3)
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, adamw_slow_to_ship(4), config) as trainer:
        losses = [trainer.step(x, y).loss for x, y in batches[:2]]
        threading.Timer(SNAPSHOT_SECONDS / 4, os.kill, (trainer.workers[1].pid, signal.SIGKILL)).start()
        healed = trainer.step(*batches[2])
        losses.append(healed.loss)
        assert healed.recovered and len(trainer.failures) == 1, trainer.failures
        assert [recovered.source for recovered in trainer.recoveries] == ["snapshot of step 0"]
        assert trainer.recoveries[0].replayed_steps == 2  # steps 0 and 1, redone on the snapshot of step 0
        state = trainer.state_dict()
    expected = [reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, 2)[0]
                for x, y in batches]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_parameters_match(state, reference.state_dict())


@dataclass
class SlowSnapshotRun:
    """Three steps of two stages (layers 0-1 and 2-4) whose last stage takes a second to copy."""

    initial: list[nn.Module]  # the layers before training, plain (for the reference)
    batches: list
    results: list  # each step's StepResult
    third_submitted: float  # when the driver sent the third step (stamped: after idling half a second)
    snapshots: list[dict]  # each stage's snapshot of step 2, copied during the third step


def run_with_a_slow_snapshot(last: nn.Module, taken: list, stamped: bool = False) -> SlowSnapshotRun:
    """Layers Linear, Tanh | slow-to-copy Linear, Tanh, ``last`` on two stages of two micro-batches,
    three steps; ``stamped``: each stage's first Linear stamps when its copy began, and the driver idles
    half a second before the third step (a snapshot taken at the commit would be copied then)."""
    torch.manual_seed(0)
    # a forward updates BatchNorm's running statistics, which a snapshot copies: it must wait
    layers = [(Stamped if stamped else nn.Linear)(8, 16), nn.Tanh(),
              (StampedSlowToCopy if stamped else SlowToCopy)(16, 4), nn.Tanh(), last]  # (a bias right before
    # BatchNorm has no gradient but rounding noise, which AdamW would blow up)
    initial = [as_plain(layer) for layer in layers]
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, balance=[2, 3])
    assert config.snapshot_every == 1 and config.step_calls == "connections"
    batches = random_batches(8, steps=3)
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, adamw, config) as trainer:
        results = [trainer.step(x, y) for x, y in batches[:2]]
        if stamped:
            time.sleep(0.5)  # the driver idles between steps
        third_submitted = time.time()
        results.append(trainer.step(*batches[2]))
        snapshots = [snapshot_of_step(taken, 2, stage) for stage in (0, 1)]
    return SlowSnapshotRun(initial, batches, results, third_submitted, snapshots)


@pytest.fixture(scope="module")
def stamped_run(ray_cluster) -> SlowSnapshotRun:
    """The run of the tests that only read it: the last stage saves no buffer, every stage's first
    Linear is stamped."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_with_a_slow_snapshot(Scaled(4), record_snapshots(monkeypatch), stamped=True)


def test_a_snapshot_is_copied_while_its_stage_first_waits_in_the_next_step(stamped_run):
    reference = nn.Sequential(*copy.deepcopy(stamped_run.initial))
    reference_optimizer = adamw(reference.parameters())
    third, third_submitted = stamped_run.results[2], stamped_run.third_submitted
    stamps = [float(snapshot["layers"]["0.copied_at"]) for snapshot in stamped_run.snapshots]
    events = {stage: [event for event in third.timeline if event.stage == stage] for stage in (0, 1)}
    last_forward = max(event.end for event in events[0] if event.op == "F")
    commits = [next(event.start for event in events[stage] if event.op == "optimizer") for stage in (0, 1)]
    # stage 0 copies in its bubble (after its forwards, waiting for the first gradient), not beside them
    assert last_forward <= stamps[0] <= commits[0], (stamps, events[0])
    # the last stage copies as the step starts, while it waits for the first activation
    assert third_submitted <= stamps[1] <= commits[1], (stamps, third_submitted, events[1])
    expected = [reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, 2)[0]
                for x, y in stamped_run.batches]
    assert [result.loss for result in stamped_run.results] == pytest.approx(expected, rel=1e-5)


def test_the_first_wait_is_the_first_receive_and_never_after_the_gated_op():
    from raypipe.core import lowering, ops
    from raypipe.core.schedule import make_schedule
    from raypipe.executor.per_step_worker import first_wait

    for name in ("gpipe", "1f1b"):
        stages = make_schedule(name, num_stages=3, num_micro_batches=4)
        for stage, stage_ops in enumerate(stages):
            lowered = lowering.lower_stage(stage, stage_ops, 3)
            commit = next(index for index, op in enumerate(lowered) if op.kind == ops.OPTIMIZER_STEP)
            waits = first_wait(lowered, commit)
            expected = ops.RECV_GRAD if stage == 0 else ops.RECV_ACT
            receives = [part.kind for part in lowered[waits].unbatched() if part.kind in ops.RECEIVES]
            assert receives == [expected] and all(op.kind in (ops.F, ops.SEND_ACT) for op in lowered[:waits])
            assert first_wait(lowered, 0) == 0  # a forward that changes saved state comes first
    lone = lowering.lower_stage(0, make_schedule("gpipe", num_stages=1, num_micro_batches=2)[0], 1)
    assert first_wait(lone, len(lone) - 1) == 0  # one stage never waits: as the step starts


def test_a_snapshot_is_its_workers_gate_call_one_task_a_worker_a_step(monkeypatch):
    """The driver's side, no Ray: a snapshot taken with a step is submitted after that step is sent
    (the driver's tasks do not hold its start), takes each worker's next gate number and is the only
    call it submits for it; the step waits for that number. Each task's second result says when its
    state is stored (the step may commit before)."""
    from raypipe.executor.step_dispatch import ActorTasks, Connections

    submitted = []  # (worker, method, args) of each call, and ("step", gates) when a step is sent

    class Actor:  # records each call submitted to it; its results are named for the call
        def __getattr__(self, method: str) -> SimpleNamespace:
            def remote(*args):
                submitted.append((actors.index(self), method, args))
                return (f"{method} {args} state", f"{method} {args} stored")
            return SimpleNamespace(remote=remote)

    actors = [Actor(), Actor()]
    step_sent = lambda gated: submitted.append(("step", [gate for gate, _ in gated]))  # noqa: E731
    monkeypatch.setattr(Connections, "_connected", lambda self: SimpleNamespace(call=step_sent))
    dispatch = Connections(SimpleNamespace(group=SimpleNamespace(actors=actors)))
    dispatch.before_next_step(actors[:1])  # e.g. a checkpoint's copy on worker 0: its gate call 1
    _, tasks = dispatch.start_step(3, [("worker 0's arguments",), ("worker 1's arguments",)], snapshot=True)
    assert submitted == [(0, "open_step_gate", (1,)), ("step", [2, 1]), (0, "snapshot_at_first_wait", (2,)),
                         (1, "snapshot_at_first_wait", (1,))]
    assert tasks.states == ["snapshot_at_first_wait (2,) state", "snapshot_at_first_wait (1,) state"]
    assert tasks.stored == ["snapshot_at_first_wait (2,) stored", "snapshot_at_first_wait (1,) stored"]
    _, tasks = dispatch.start_step(4, [("worker 0's arguments",), ("worker 1's arguments",)], snapshot=False)
    assert tasks is None and submitted[-1] == ("step", [2, 1])  # no snapshot: the same numbers
    # as actor tasks, which run in submission order, the snapshot goes first (the executor's, then the step)
    del submitted[:]
    executor = SimpleNamespace(group=SimpleNamespace(actors=actors),
                               snapshot_workers=lambda workers: submitted.append("snapshot") or "tasks")
    assert ActorTasks(executor).start_step(5, [(), ()], snapshot=True)[1] == "tasks"
    assert submitted == ["snapshot", (0, "run_step", ()), (1, "run_step", ())]


@pytest.mark.parametrize("copy_fails", [False, True])
def test_a_snapshot_at_first_wait_opens_its_gate_once_copied_or_when_it_failed(copy_fails):
    """The worker's side: the gate opens when the state is copied (before it is shipped), and a
    snapshot that failed opens it too, so the step it holds does not wait p2p_timeout_s."""
    from raypipe.executor.per_step_worker import PerStepWorker
    from raypipe.stage.step_gate import StepGate

    class Worker:  # what snapshot_at_first_wait uses of a PerStepWorker
        config, stage_index = SimpleNamespace(p2p_timeout_s=1.0), 0

        def __init__(self) -> None:
            self._first_waits, self._step_gate, self.open_while_copying = StepGate(), StepGate(), None
            self._first_waits.open(7)  # the step that follows gate call 7 reached its first wait

        def snapshot(self, copied) -> dict:
            self.open_while_copying = opened(self._step_gate)
            if copy_fails:
                raise RuntimeError("the copy failed")
            copied()
            return {"copied": True}

    def opened(gate: StepGate) -> bool:
        try:
            gate.wait(7, 0.0)
            return True
        except raypipe.RaypipeError:
            return False

    worker = Worker()
    if copy_fails:
        with pytest.raises(RuntimeError, match="the copy failed"):
            PerStepWorker.snapshot_at_first_wait(worker, 7)
    else:
        assert PerStepWorker.snapshot_at_first_wait(worker, 7) == ({"copied": True}, True)
    assert worker.open_while_copying is False and opened(worker._step_gate)


class Scaled(nn.Module):
    """Multiplies by a constant table kept out of the state dict (as LLaMA's RoPE tables are)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table


@pytest.mark.parametrize("buffer", ["saved", "not saved"])
def test_a_snapshot_slower_than_the_next_step_holds_its_commit_and_only_saved_buffers_its_first_forward(
        request, buffer):
    """The snapshot of step 2 on the slow stage is still being copied out when step 3 reaches its
    commit: the commit waits for it, and it is the state after step 2 (not a mix with step 3).
    Without a saved buffer: the stamped run the test above reads."""
    if buffer == "saved":
        request.getfixturevalue("ray_cluster")
        run = run_with_a_slow_snapshot(nn.BatchNorm1d(4), request.getfixturevalue("snapshots_taken"))
    else:
        run = request.getfixturevalue("stamped_run")
    reference = nn.Sequential(*copy.deepcopy(run.initial))
    reference_optimizer = adamw(reference.parameters())
    results, snapshot = run.results, run.snapshots[1]
    for x, y in run.batches[:2]:
        reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, 2)
    expected = {name[2:]: value for name, value in reference.state_dict().items() if name[0] in "234"}
    # stage 1 holds layers 2-4 at its positions 0-2: the state after step 2, not a mix with step 3
    # (a stamp is when the copy began, no state)
    assert_parameters_match({name.split(".", 1)[1]: value for name, value in snapshot["layers"].items()
                             if not name.endswith(".copied_at")}, expected)
    assert snapshot["commits"] == 2
    events = [event for event in results[2].timeline if event.stage == 1]
    [gate] = [event for event in events if event.op == "gate"]
    # the third step's commit on stage 1 waited for the snapshot of the second
    assert gate.end - gate.start > SNAPSHOT_SECONDS / 4, events
    commit = next(event for event in events if event.op == "optimizer")
    assert commit.start >= gate.end
    first_forward = next(event for event in events if event.op.startswith("F"))
    if buffer == "saved":
        assert first_forward.start >= gate.end, events
    else:  # the forwards and backwards ran while the snapshot was copied out
        assert first_forward.end <= gate.start + SNAPSHOT_SECONDS / 2, events


@pytest.mark.parametrize("step_calls", raypipe.config.STEP_CALLS)
def test_step_calls_is_checked(step_calls):
    raypipe.PipelineConfig(step_calls=step_calls).validate()
    with pytest.raises(raypipe.ConfigError, match="step_calls"):
        raypipe.PipelineConfig(step_calls="compiled").validate()  # removed: see benchmarks/RESULTS.md
