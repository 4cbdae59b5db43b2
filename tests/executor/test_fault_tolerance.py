"""A killed or stopped worker costs no step, no sample and no bit of the result.

Real failures, injected from the test: SIGKILL or SIGSTOP of a worker process
(found by pid in ``trainer.workers``) at a seeded-random moment inside a step.
Each run is compared with the uninterrupted run of the same layout: every
step's loss and gradient norm, and at the end every parameter, optimizer and
LR-scheduler state, bitwise. The uninterrupted run is the step runner's in
process (:class:`tests.reference.InterpretedTrainer`: the workers' own
``StepRunner`` over an in-memory channel), whose arithmetic a Ray run of every
layout here repeats bit for bit, so no uninterrupted run starts a worker.

Each fault class keeps a real-process cell here; what the controller decides and
does around them, fault by fault and in compound faults, is checked without Ray
by the fault-injection harness (tests/control/test_compound_faults.py,
tests/control/test_controller.py) and the policy's own tests
(tests/control/test_policy.py).
"""
import contextlib
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe.errors import TooManyFailures
from tests.executor.test_nonfinite import halving
from tests.processes import seconds_until_gone, stop
from tests.reference import adamw, assert_bitwise_equal, checkpoint_state, in_process, make_mlp, random_batches

STEPS, BATCH = 7, 12
NUM_LAYERS = len(make_mlp())
KILL, STOP = signal.SIGKILL, signal.SIGSTOP
FOUND = {KILL: "died", STOP: "hung"}  # what the failure event says of a killed or a stopped worker


def config(**overrides):
    values = dict(num_stages=2, num_micro_batches=3, clip_grad_norm=1.0, hang_timeout_s=3.0, max_failures=None)
    return raypipe.PipelineConfig(**{**values, **overrides})


@dataclass
class Run:
    results: list  # per step (loss, grad norm)
    state: dict  # final parameters, optimizer and LR-scheduler state
    failures: list  # the failure events healed
    healed_seconds: list  # per step with a failure, its step time
    sources: list  # per heal, where the replacements' state came from
    step_seconds: list  # every step's time
    replayed: list  # per heal, the committed steps it ran again


def train(cfg, root, failures: Mapping[int, int] | None = None, seed=0, inside_the_step=True,
          before: Callable[[raypipe.PipelineTrainer, int], None] = lambda trainer, step: None) -> Run:
    """STEPS steps; before each step in ``failures`` (step: signal) a timer sends that
    signal to a seeded-random worker at a seeded-random moment of that step, and
    ``before(trainer, step)`` runs ahead of every step (a fault or a save the test places itself)."""
    chooser, failures = random.Random(seed), failures or {}
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, cfg, lr_scheduler=halving) as trainer:
        results, step_seconds, victims, seen = [], [], [], []
        for step, (x, y) in enumerate(random_batches(BATCH, STEPS)):
            before(trainer, step)
            if step in failures:
                victim = chooser.choice(trainer.workers)
                victims.append(victim.pid)
                delay = chooser.uniform(0.0, 0.02)
                if inside_the_step:
                    threading.Timer(delay, os.kill, (victim.pid, failures[step])).start()
                else:  # before the step: no survivor can end it
                    os.kill(victim.pid, failures[step])
            start = time.monotonic()
            result = trainer.step(x, y)
            step_seconds.append(time.monotonic() - start)
            results.append((result.loss, result.grad_norm))
            seen += result.failures
            assert result.recovered == bool(result.failures)
        assert not {pid for pid in victims} & {w.pid for w in trainer.workers}, "a victim was not replaced"
        assert seen == trainer.failures  # each failure is reported by the step that healed it
        return Run(results, checkpoint_state(trainer, root, NUM_LAYERS), list(trainer.failures),
                   [step_seconds[step] for step in sorted(failures)],
                   [recovered.source for recovered in trainer.recoveries], step_seconds,
                   [recovered.replayed_steps for recovered in trainer.recoveries])


_UNINTERRUPTED = {}


def uninterrupted(cfg, tmp_path) -> Run:
    """The run without failures, on the step runner in process (no worker to start): a
    Ray run of each layout here gives its every bit (its transport and step calls, its
    snapshots and failure settings change no number), so layouts that differ only in
    them share one."""
    numerics = (cfg.num_stages, cfg.num_replicas, cfg.num_micro_batches, cfg.shard_optimizer, cfg.precision,
                cfg.schedule, cfg.virtual_stages)
    if numerics not in _UNINTERRUPTED:
        with in_process(make_mlp(), nn.functional.mse_loss, adamw, cfg, lr_scheduler=halving) as trainer:
            results = [(result.loss, result.grad_norm)
                       for result in (trainer.step(x, y) for x, y in random_batches(BATCH, STEPS))]
            state = checkpoint_state(trainer, tmp_path / "uninterrupted", NUM_LAYERS)
        _UNINTERRUPTED[numerics] = Run(results, state, [], [], [], [], [])
    return _UNINTERRUPTED[numerics]


# name: (config, {step: the signal sent inside it}, where healed state comes from): 6 kills and 2 stops in all,
# one real-process cell for each fault class (the name's length seeds which worker and when)
LAYOUTS = {
    # the per-step executor over connections: a kill, then a stop, found by the heartbeat
    "p2p-2-stages": (config(), {1: KILL, 4: STOP}, "snapshot"),
    # a middle worker of 3 killed, then a stop, with the steps started by actor tasks (whose hang the driver
    # sees on task results, not connections) and a zero-bubble schedule of model chunks (zbv: two chunks a
    # worker in a V, I and W ops; zb_h1 on Ray: tests/executor/test_equivalence.py)
    "p2p-3-stages-tasks-zbv-v2": (config(num_stages=3, step_calls="tasks", schedule="zbv", virtual_stages=2),
                                  {2: KILL, 4: STOP}, "snapshot"),
    # the per-op executor (the path of the object store, gloo and NCCL transports): the first step, a middle stage
    "object-store-3-stages": (config(num_stages=3, transport="object_store"), {0: KILL, 3: KILL}, "snapshot"),
    # inside a step with replicas, ZeRO-1 in bf16: each worker alone holds its optimizer shard and fp32 main
    # weights, so every worker goes back to the snapshot
    "p2p-2-replicas-zero1-bf16": (config(num_replicas=2, num_micro_batches=2, shard_optimizer=True, precision="bf16"),
                                  {2: KILL}, "snapshot"),
    # without snapshots the replacement copies the same stage of the other replica; killed before
    # the step, since a kill landing after the survivors ended it needs a snapshot to roll them back
    # (which of the two a kill inside a step with replicas and snapshots takes is the policy's,
    # tests/control/test_policy.py; the heal from a sibling with snapshots on, tests/control/test_controller.py)
    "p2p-2-replicas-from-sibling": (config(num_replicas=2, num_micro_batches=2, snapshot_every=0), {1: KILL},
                                    "replica"),
}


@pytest.mark.cluster
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_random_worker_killed_or_stopped_inside_a_step_is_replaced_and_changes_no_bit(
        ray_cluster, tmp_path, layout, caplog):
    cfg, failures, source = LAYOUTS[layout]
    expected = uninterrupted(cfg, tmp_path)
    caplog.set_level(logging.INFO, logger="raypipe")
    caplog.clear()
    killed = train(cfg, tmp_path / "killed", failures, seed=len(layout), inside_the_step=source != "replica")
    # the controller went into healing and back to running once per failure event, and said so
    transitions = [record.getMessage() for record in caplog.records if record.getMessage().startswith("controller ")]
    assert [message.split(" (")[0] for message in transitions] == [
        "controller starting -> running",
        *["controller running -> healing", "controller healing -> running"] * len(failures),
        "controller running -> stopped"], transitions
    # one failure event per signal (one landing just after a step is found by the next one): a killed
    # worker died, a stopped one is declared hung
    assert len(killed.failures) == len(failures), killed.failures
    sent = [failures[step] for step in sorted(failures)]
    assert all(FOUND[each] in failure for each, failure in zip(sent, killed.failures)), killed.failures
    assert all(healed_from.startswith(source) for healed_from in killed.sources), killed.sources
    assert killed.results == expected.results  # every step returned, with the same loss and norm
    assert_bitwise_equal(expected.state, killed.state)
    if STOP in failures.values():  # a stopped worker is not waited for p2p_timeout_s (300 s)
        assert max(killed.step_seconds) < 120, killed.step_seconds
    print(f"{layout}: signal to step done {[round(s, 1) for s in killed.healed_seconds]} s")


@pytest.mark.cluster
def test_under_nccls_emulation_a_killed_or_stopped_worker_is_healed_by_aborting_the_survivor(
        ray_cluster, tmp_path, monkeypatch):
    """Under NCCL's emulation (RAYPIPE_EMULATE_NCCL=1, raypipe.comm.nccl_emulation) no
    transfer raises when a peer goes: only the driver's abort releases the survivor,
    within seconds, and the run still matches the uninterrupted one (on gloo) bitwise."""
    cfg = config()
    expected = uninterrupted(cfg, tmp_path)
    monkeypatch.setenv("RAYPIPE_EMULATE_NCCL", "1")
    run = train(cfg, tmp_path / "emulated", failures={2: KILL, 4: STOP}, seed=3)
    assert len(run.failures) == 2 and "died" in run.failures[0] and "hung" in run.failures[1], run.failures
    assert run.results == expected.results
    assert_bitwise_equal(expected.state, run.state)
    # without the abort: p2p_timeout_s (300 s) at least
    assert all(seconds < 60 < cfg.p2p_timeout_s for seconds in run.healed_seconds), run.healed_seconds
    print(f"emulated NCCL, died then hung: failure to step done {[round(s, 1) for s in run.healed_seconds]} s")


@pytest.mark.cluster
def test_more_failures_than_allowed_stop_with_every_failure_listed(ray_cluster, tmp_path):
    x, y = random_batches(BATCH, 1)[0]
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config(max_failures=1)) as trainer:
        trainer.step(x, y)
        saved = trainer.save_checkpoint(tmp_path)
        os.kill(trainer.workers[1].pid, signal.SIGKILL)
        trainer.step(x, y)  # healed: the first failure is allowed
        os.kill(trainer.workers[1].pid, signal.SIGKILL)
        with pytest.raises(TooManyFailures) as error:
            trainer.step(x, y)
        raised = error.value
        assert raised.max_failures == 1 and len(raised.failures) == 2
        assert all("replica 0 stage 1 died" in failure for failure in raised.failures)
        assert "max_failures=1" in str(raised) and "2." in str(raised)
        with pytest.raises(raypipe.RaypipeError, match="cannot be made whole"):
            trainer.step(x, y)
    # the persisted checkpoint is intact and a new trainer resumes from it (the step runner in process: its
    # workers load the files the Ray workers wrote as a Ray worker does, without starting two more)
    with in_process(make_mlp(), nn.functional.mse_loss, adamw, config()) as resumed:
        resumed.load_checkpoint(tmp_path)
        assert resumed.step_count == saved == 1
        assert resumed.step(x, y).loss > 0


@pytest.mark.cluster
def test_with_snapshots_every_few_steps_the_steps_since_are_replayed(ray_cluster, tmp_path):
    cfg = config(snapshot_every=3)
    expected = uninterrupted(cfg, tmp_path)

    def before(trainer: raypipe.PipelineTrainer, step: int) -> None:
        if step == 5:  # snapshots at steps 0 and 3: steps 3 and 4 are replayed
            os.kill(trainer.workers[0].pid, signal.SIGKILL)

    run = train(cfg, tmp_path / "replayed", before=before)
    assert len(run.failures) == 1 and run.replayed == [2]
    assert run.results == expected.results
    assert_bitwise_equal(expected.state, run.state)


@pytest.mark.cluster
def test_without_snapshots_a_worker_heals_from_the_newest_checkpoint_and_the_steps_since(ray_cluster, tmp_path):
    cfg = config(snapshot_every=0)
    expected = uninterrupted(cfg, tmp_path)

    def before(trainer: raypipe.PipelineTrainer, step: int) -> None:
        if step == 2:
            trainer.save_checkpoint(tmp_path / "saved", wait=False)
        if step == 5:  # every worker loads the checkpoint of step 2; steps 2 to 4 are replayed
            trainer.wait_for_checkpoint()  # on a busy machine it may still be written: a kill then loses it
            os.kill(trainer.workers[1].pid, signal.SIGKILL)

    run = train(cfg, tmp_path / "healed", before=before)
    # steps 2 to 4 replayed: healed in step 5, the one the kill hit
    assert len(run.failures) == 1 and (run.sources, run.replayed) == (["checkpoint of step 2"], [3])
    assert run.results == expected.results
    assert_bitwise_equal(expected.state, run.state)


@pytest.mark.cluster
def test_without_snapshots_a_failure_is_an_error_that_says_why(ray_cluster):
    x, y = random_batches(BATCH, 1)[0]
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config(snapshot_every=0)) as trainer:
        trainer.step(x, y)
        os.kill(trainer.workers[0].pid, signal.SIGKILL)
        with pytest.raises(raypipe.RaypipeError, match="snapshot_every=0"):
            trainer.step(x, y)


def test_fault_tolerance_settings_are_validated():
    for field, value in [("max_failures", -1), ("snapshot_every", 1.5), ("hang_timeout_s", 0),
                         ("replace_timeout_s", "soon")]:
        with pytest.raises(raypipe.ConfigError, match=field):
            raypipe.PipelineConfig(**{field: value}).validate()
    raypipe.PipelineConfig(max_failures=None, snapshot_every=0).validate()


def test_the_workers_heartbeat_while_a_step_runs(ray_cluster):
    """A busy worker answers heartbeats on its own thread: a long step is not a hang."""
    slow = nn.Sequential(nn.Linear(8, 8), Sleep(2.0), nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    cfg = config(hang_timeout_s=1.0, num_micro_batches=1)
    with raypipe.PipelineTrainer(slow, nn.functional.mse_loss, adamw, cfg) as trainer:
        trainer.step(x, y)
        assert trainer.failures == []
        assert ray.get(trainer.layout.actors[0].heartbeat.remote()) > 0


class Sleep(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


@pytest.mark.cluster
def test_a_worker_lost_between_steps_is_healed_before_evaluate_or_its_state_is_read_or_saved(ray_cluster, tmp_path):
    """A worker killed or stopped after a step, before evaluate, then before the state is read
    or saved (the state of the run's last step, bitwise), then before the step that connects
    to the replaced workers afresh, then a hung one at shutdown: one trainer through all of
    them, each loss found by the call that meets it."""
    (x, y), = random_batches(BATCH, 1)
    trainer = raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config(), lr_scheduler=halving)
    hung = None
    try:
        trainer.step(x, y)
        # before evaluate: evaluate answers as before, once healed
        expected = trainer.evaluate(x, y)
        os.kill(trainer.workers[1].pid, signal.SIGKILL)
        assert trainer.evaluate(x, y) == expected
        assert len(trainer.failures) == 1 and "during evaluate" in trainer.failures[0]
        stop(trainer.workers[0].pid)  # a hang is found by the heartbeat
        assert trainer.evaluate(x, y) == expected
        assert len(trainer.failures) == 2 and "stage 0 hung" in trainer.failures[1], trainer.failures
        # stage 1's evaluate waits for stage 0's output inside the call, not as its argument: its
        # heartbeats are not queued behind that argument, so it is not found hung and replaced too
        assert "stage 1" not in trainer.failures[1], trainer.failures
        # after the last step: the state read or saved is that step's, bitwise
        parameters = trainer.state_dict()
        saved = checkpoint_state(trainer, tmp_path / "before", NUM_LAYERS)
        victim = trainer.workers[1].pid
        os.kill(victim, signal.SIGKILL)
        seconds_until_gone(victim)
        assert_bitwise_equal(parameters, trainer.state_dict())
        assert len(trainer.failures) == 3 and "during state_dict" in trainer.failures[2], trainer.failures
        stop(trainer.workers[0].pid)
        assert_bitwise_equal(saved, checkpoint_state(trainer, tmp_path / "after", NUM_LAYERS))
        assert len(trainer.failures) == 4, trainer.failures
        assert "stage 0 hung" in trainer.failures[3] and "before a checkpoint save" in trainer.failures[3]
        assert len(trainer.recoveries) == 4
        # the next step connects to the replaced worker afresh: a worker stopped before it is found
        # hung in hang_timeout_s, not when gRPC's keepalive gives up on its call (~7 minutes)
        stop(trainer.workers[1].pid)
        start = time.monotonic()
        assert trainer.step(x, y).loss > 0
        assert time.monotonic() - start < 3 * config().hang_timeout_s + 30
        assert len(trainer.failures) == 5 and "stage 1 hung" in trainer.failures[4], trainer.failures
        # shutdown does not wait on a hung worker's call or its leaving the group for more than
        # hang_timeout_s (it waited p2p_timeout_s, 300 s, before), and the worker is gone
        hung = trainer.workers[1].pid
        stop(hung)
        start = time.monotonic()
        trainer.shutdown()
        assert time.monotonic() - start < config().hang_timeout_s + 10
        seconds_until_gone(hung)  # SIGKILLed after the raylet's grace (1 s)
    finally:
        trainer.shutdown()
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)


def healed_with_a_worker_faulted_in_the_heal(cfg, tmp_path, monkeypatch, owner: Any, method: str,
                                             fault: Callable[[int], None], found: str, faulted_stage: int = 1
                                             ) -> list[str]:
    """Stage 0 (of two) killed before step 3; as the heal of that kill first calls ``owner.method``
    (a class's method or a module's function), the worker then at stage ``faulted_stage`` (1: the
    survivor; 0: the killed one's replacement) is faulted by ``fault(pid)``. Both are replaced in one
    heal, the faulted one's failure named ``found``, within a few ``hang_timeout_s`` (not gRPC's
    minutes, nor ``p2p_timeout_s``), and the run is bitwise the uninterrupted one. The run's failure
    events."""
    expected = uninterrupted(cfg, tmp_path)
    original, faulted = getattr(owner, method), []  # the faulted worker's pid, once armed by the kill

    def faulting_a_worker_first(*args, **kwargs):
        if faulted == [None]:  # once: the heal of the first kill
            faulted[0] = trainer.workers[faulted_stage].pid
            fault(faulted[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, method, faulting_a_worker_first)
    try:
        with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, cfg, lr_scheduler=halving) as trainer:
            results = []
            for step, (x, y) in enumerate(random_batches(BATCH, STEPS)):
                if step == 3:
                    first, survivor = trainer.workers[0].pid, trainer.workers[1].pid
                    faulted.append(None)
                    os.kill(first, signal.SIGKILL)
                    seconds_until_gone(first)
                start = time.monotonic()
                result = trainer.step(x, y)
                if step == 3:
                    healed_s = time.monotonic() - start
                results.append((result.loss, result.grad_norm))
            assert faulted[0] not in (None, first)
            assert not {first, survivor, *faulted} & {worker.pid for worker in trainer.workers}, "a victim stayed"
            assert len(trainer.failures) == 2 and len(trainer.recoveries) == 1, trainer.failures
            assert f"replica 0 stage {faulted_stage} {found}" in trainer.failures[1], trainer.failures
            # a step, the first heal's start, hang_timeout_s and the second heal: well below gRPC's ~7 minutes
            assert healed_s < 4 * cfg.hang_timeout_s + 30, healed_s
            state, failures = checkpoint_state(trainer, tmp_path / "healed", NUM_LAYERS), trainer.failures
    finally:
        if faulted and faulted[0] is not None:
            with contextlib.suppress(ProcessLookupError):  # a stopped worker the heal did not kill
                os.kill(faulted[0], signal.SIGKILL)
    assert results == expected.results
    assert_bitwise_equal(expected.state, state)
    return failures


def _killed(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    seconds_until_gone(pid)


@pytest.mark.cluster
@pytest.mark.parametrize("second_fault, replicas", [(KILL, 1), (STOP, 1), (STOP, 2)],
                         ids=["sigkill-snapshot", "sigstop-snapshot", "sigstop-siblings"])
def test_a_second_fault_while_a_heal_restores_state_is_healed_in_the_same_heal(ray_cluster, tmp_path, monkeypatch,
                                                                                second_fault, replicas):
    """Stage 0 is killed before step 3; while the heal gives the replacement its state, the
    survivor (stage 1) is killed or stopped too (the moment is the heal's own, so the test is
    exact), with one replica (the heal restores the snapshot) or two (the replacement copies
    its sibling in the other replica). The second loss is folded into the same heal (both
    replaced, every worker back to the snapshot), never a raw ActorDiedError; a stopped survivor is found hung by its
    heartbeats within ``hang_timeout_s``, not after the minutes gRPC's keepalive takes to give
    up on its call (a heal's every wait on a worker is watched as a step's is). The run is
    bitwise the uninterrupted one."""
    from raypipe.control.state_transfer import StateTransfer

    healed_with_a_worker_faulted_in_the_heal(config(num_replicas=replicas), tmp_path, monkeypatch, StateTransfer,
                                             "transfer_state", _killed if second_fault == KILL else stop,
                                             FOUND[second_fault])


@pytest.mark.cluster
def test_a_survivor_stopped_before_the_heal_forms_the_group_does_not_hold_the_others_in_its_rendezvous(
        ray_cluster, tmp_path, monkeypatch):
    """Stage 0 is killed before step 3; as the heal forms the new group, the survivor (stage 1) is
    stopped before its join arrives, so the replacement (the group's rank 0, which holds the
    rendezvous) waits for it there. The survivor is found hung by its heartbeats and replaced
    in the same heal, and the replacement's join is aborted at once rather than waiting for
    the stopped rank until ``p2p_timeout_s`` (300 s by default): the heal's next call to it
    would queue behind that join. The run is bitwise the uninterrupted one."""
    from raypipe.executor.per_step import PerStepExecutor

    healed_with_a_worker_faulted_in_the_heal(config(num_replicas=2), tmp_path, monkeypatch, PerStepExecutor,
                                             "_join", stop, "hung")


@pytest.mark.cluster
def test_a_survivor_held_in_the_group_formation_by_a_stopped_replacement_is_replaced_too(ray_cluster, tmp_path,
                                                                                        monkeypatch):
    """Stage 0 is killed before step 3; as the heal forms the new group, its replacement (the group's
    rank 0, whose process holds the rendezvous' store) is stopped just after it opened that store, so
    the survivor's join waits on the store inside torch, where nothing interrupts it before
    ``p2p_timeout_s`` (60 s here, 300 s by default), and the heal's next calls to it would queue behind
    that. The replacement is found hung; the survivor, still joining ``hang_timeout_s`` after the others
    were released, is replaced too in the same heal instead of waited for; the run is bitwise the
    uninterrupted one."""
    from raypipe.executor import per_step

    failures = healed_with_a_worker_faulted_in_the_heal(
        config(p2p_timeout_s=60.0), tmp_path, monkeypatch, per_step.nccl_emulation, "requested", stop, "hung",
        faulted_stage=0)
    assert "replica 0 stage 1 hung" in failures[1], failures  # the survivor, held in the join


@pytest.mark.cluster
def test_a_survivor_stopped_as_the_failed_step_ends_is_found_hung_not_waited_for(ray_cluster, tmp_path, monkeypatch):
    """Stage 0 is killed before step 3; as the failed step ends (the driver closes the step's
    connections and waits for the survivors' calls to end), the survivor (stage 1) is stopped, so
    its call never ends. It is found hung by its heartbeats and replaced in the same heal, a
    failure of its own, not waited for until ``p2p_timeout_s`` (60 s here; with the default 300 s
    a (2, 2, 2) run of the suite waited five minutes there). The run is bitwise the uninterrupted one."""
    from raypipe.executor.step_dispatch import Connections

    healed_with_a_worker_faulted_in_the_heal(config(p2p_timeout_s=60.0), tmp_path, monkeypatch, Connections,
                                             "drain", stop, "hung (found as the failed step ended)")
