"""Warm spares at tensor_parallel t > 1: a spare is a group of t idle processes in one bundle (one
node), and takes the place of a whole stage, never of one rank, which would sit on another node
than its peers. A failed rank's stage is swapped whole: its survivors are released, every worker
of the spare group becomes its tp_rank's spec and restores that rank's snapshot, as every
replacement does, and the failed step runs again -- bitwise the run without the failure."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import raypipe
from raypipe.control.policy import SpareStages, spare_stages
from raypipe.control.view import FailedWorker, LayoutView
from raypipe.core.topology import Topology
from raypipe.errors import ConfigError
from raypipe.models.llama import llama_layers, llama_loss
from tests.executor.test_tensor_parallel_steps import _batches, adamw
from tests.gloo_pipeline import GlooPipeline


def _view(failed: list[int], spares_up: int, replicas: int = 1, tensor_parallel: int = 2) -> LayoutView:
    """A heal of the workers ``failed`` (ranks) of ``replicas`` x 2 stages x ``tensor_parallel``."""
    topology = Topology(2, replicas, tensor_parallel)
    return LayoutView(num_stages=2, replicas=replicas, tensor_parallel=tensor_parallel, spares_up=spares_up,
                      failed=tuple(FailedWorker(rank, *topology.coordinates(rank)[:2], "died") for rank in failed))


def test_a_spare_group_takes_a_whole_stage_and_a_lost_nodes_stage_first():
    # (1, 2, 2): stage 1's tp_rank 1 (rank 3) killed, one spare group up: stage 1 is swapped whole, rank 2 released
    assert spare_stages(_view([3], spares_up=1)) == SpareStages(stages=(2,), released=(2,))
    # no spare up: only the killed rank is replaced (a new process in its stage's bundle), nothing released
    assert spare_stages(_view([3], spares_up=0)) == SpareStages(stages=(), released=())
    # a node lost with stage 0 (ranks 0, 1) and stage 1's rank 3 killed, one group up: the lost stage takes it
    # (its bundle need not be placed again), stage 1's survivor stays
    assert spare_stages(_view([0, 1, 3], spares_up=1)) == SpareStages(stages=(0,), released=())
    assert spare_stages(_view([0, 1, 3], spares_up=2)) == SpareStages(stages=(0, 2), released=(2,))
    # (2, 2, 2): two stages hit by one rank each, one group up: the first in rank order
    assert spare_stages(_view([1, 6], spares_up=1, replicas=2)) == SpareStages(stages=(0,), released=(0,))
    # t = 1: a spare is one worker, whose place is its stage's: nothing is ever released
    assert spare_stages(_view([1, 2], spares_up=1, replicas=2, tensor_parallel=1)) == SpareStages((1,), released=())


def test_spare_workers_at_t2_count_processes_in_whole_groups():
    raypipe.PipelineConfig(tensor_parallel=2, spare_workers=4).validate()  # two spare groups
    with pytest.raises(ConfigError) as error:
        raypipe.PipelineConfig(tensor_parallel=2, spare_workers=3).validate()
    first_line = str(error.value).splitlines()[0]
    assert error.value.field == "spare_workers" and "must be a multiple of tensor_parallel=2" in first_line


@pytest.mark.cluster  # kills a worker process
def test_a_killed_tensor_parallel_rank_is_healed_by_a_spare_group_taking_its_whole_stage(ray_cluster):
    """(1, 2, 2) and one spare group of 2 (the session's 6 CPUs: 4 workers + 2 spares): stage 1's
    tp_rank 1 SIGKILLed inside step 1. The heal releases stage 1's tp_rank 0 and the spare group's
    two processes become stage 1's two ranks, each restoring its rank's snapshot (the survivors of
    stage 0 theirs); the step runs again on re-formed groups. Every step's loss and norm and the
    final state are bitwise the uninterrupted run's (the same workers in processes over gloo), and a
    new spare group starts in the bundle stage 1 left (the spare's own is stage 1's now)."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="1f1b", tensor_parallel=2,
                                    clip_grad_norm=0.5, max_failures=None)
    batches = _batches()
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        expected = [pipeline.step(x, y) for x, y in batches]
        expected_state = pipeline.state_dict()
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw,
                                 config.replace(spare_workers=2)) as trainer:
        pool = trainer.spares
        assert pool.count == 1 and pool.wait_until_up(120)  # up before the kill (the machine may be slow)
        (spare_bundle,) = [spare.location for spare in pool.spares]
        results = []
        for step, (x, y) in enumerate(batches):
            if step == 1:
                stage_1 = {worker.tp_rank: worker.pid for worker in trainer.workers if worker.stage == 1}
                stage_0 = {worker.pid for worker in trainer.workers if worker.stage == 0}
                threading.Timer(0.01, os.kill, (stage_1[1], signal.SIGKILL)).start()
            results.append(trainer.step(x, y))
        state = trainer.state_dict()
        assert [(r.loss, r.grad_norm) for r in results] == [(e.loss, e.grad_norm) for e in expected]
        assert results[1].recovered and any("replica 0 stage 1 tp_rank 1 died" in failure
                                            for failure in results[1].failures)
        source = trainer.recoveries[-1].source
        assert source.startswith("snapshot of step") and source.endswith(" (replaced by spare 0)"), source
        now = {(worker.stage, worker.tp_rank): worker.pid for worker in trainer.workers}
        assert not set(stage_1.values()) & set(now.values())  # the killed rank and the released one are gone
        assert {now[(0, 0)], now[(0, 1)]} == stage_0  # the other stage's workers stayed
        deadline = time.monotonic() + 60  # a new group starts in the freed bundle, a little after the heal
        while not pool.spares and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [spare.name for spare in pool.spares] == ["spare 1"] and pool.spares[0].location != spare_bundle
    for name, tensor in expected_state.items():
        assert torch.equal(tensor, state[name]), name
