"""Tensor-parallel stages past a failure: snapshots of local shards, the groups re-formed, a
lost tensor-parallel rank replaced -- each bitwise the run without it.

Split over a stage's tensor-parallel mesh, the parameters, their optimizer state and the layers'
hooks are bound to that mesh's process group. Every heal and every retried step re-forms all
groups, so each worker moves its state onto the new mesh from its own local shards, and a
replacement restores the lost rank's snapshot (its local shards) once its layers are split.
The runs here are :class:`tests.gloo_pipeline.GlooPipeline` (the per-step workers in forked
processes over real gloo groups, no Ray), compared with themselves: the same steps, with and
without the failure, must agree bit for bit."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from torch import nn

import raypipe
from raypipe.models.layers import build_layer
from raypipe.models.llama import llama_layers, llama_loss
from tests.executor.test_tensor_parallel_steps import _batches, adamw
from tests.gloo_pipeline import GlooPipeline
from tests.reference import reference_step


def _assert_same(step, again, state, state_again) -> None:
    assert (again.loss, again.grad_norm) == (step.loss, step.grad_norm)
    assert state.keys() == state_again.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, state_again[name]), name


@pytest.mark.cluster  # kills worker processes
def test_a_retried_step_and_a_replaced_rank_at_t2_repeat_the_step_bitwise():
    """(1, 2, 2), 1f1b, sequence parallel, clipping: a step rolled back to the snapshot before it
    and run again on re-formed groups (every worker's state moved onto the new meshes), then one
    tensor-parallel rank killed and replaced from its snapshot (the survivors rolled back to
    theirs), then both ranks of a stage (what a lost node takes), each repeats the step it lost
    exactly."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="1f1b", tensor_parallel=2,
                                    clip_grad_norm=0.5, snapshot_every=0)
    (x0, y0), (x1, y1), (x2, y2) = _batches()
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        pipeline.step(x0, y0)
        before = pipeline.snapshots()
        first = pipeline.step(x1, y1)
        after_first = pipeline.state_dict()

        pipeline.restore(before)
        pipeline.reform_groups()
        pipeline.step_count -= 1
        _assert_same(first, pipeline.step(x1, y1), after_first, pipeline.state_dict())

        before = pipeline.snapshots()
        second = pipeline.step(x2, y2)
        after_second = pipeline.state_dict()
        pipeline.replace_workers([3], before)  # stage 1, tp_rank 1: holds the loss's vocabulary shard
        pipeline.step_count -= 1
        _assert_same(second, pipeline.step(x2, y2), after_second, pipeline.state_dict())

        pipeline.replace_workers([0, 1], before)  # a node lost with stage 0: both of its ranks
        pipeline.step_count -= 1
        _assert_same(second, pipeline.step(x2, y2), after_second, pipeline.state_dict())


@pytest.mark.cluster  # kills worker processes
def test_a_killed_and_a_stopped_tensor_parallel_rank_on_ray_cost_no_step_and_no_bit(ray_cluster):
    """(1, 2, 2) on Ray, the default per-step snapshot, recompute with the kept inputs offloaded: stage 1's tp_rank 1 SIGKILLed inside step 1,
    stage 0's tp_rank 0 (which holds the group's rendezvous) SIGSTOPped inside step 2. Each time the
    controller replaces the worker, every worker restores its snapshot of the step before (the
    replacement its lost rank's local shards), the groups re-form with every worker's state moved
    onto the new meshes, and the step runs again: each step's loss and norm and the final state are
    bitwise the uninterrupted run's (the same workers in processes over gloo, no failure)."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="1f1b", tensor_parallel=2,
                                    clip_grad_norm=0.5, hang_timeout_s=5.0, max_failures=None,
                                    activation_checkpoint="always")
    batches = _batches()
    # the kept stage inputs go to Ray's object store on Ray (the same arithmetic: recomputed from them)
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        expected = [pipeline.step(x, y) for x, y in batches]
        expected_state = pipeline.state_dict()
    faults = {1: ((1, 1), signal.SIGKILL, "died"), 2: ((0, 0), signal.SIGSTOP, "hung")}
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw,
                                 config.replace(offload_activations=True)) as trainer:
        results, victims = [], []
        for step, (x, y) in enumerate(batches):
            if step in faults:
                place, signal_number, _ = faults[step]
                victim = next(worker for worker in trainer.workers if (worker.stage, worker.tp_rank) == place)
                victims.append(victim.pid)
                threading.Timer(0.01, os.kill, (victim.pid, signal_number)).start()
            results.append(trainer.step(x, y))
        state = trainer.state_dict()
        assert [(r.loss, r.grad_norm) for r in results] == [(e.loss, e.grad_norm) for e in expected]
        for step, ((stage, tp_rank), _, why) in faults.items():
            # (a loaded machine may add a heal of its own: a busy worker's heartbeat late; the bits stay)
            assert results[step].recovered and any(f"replica 0 stage {stage} tp_rank {tp_rank} {why}" in failure
                                                   for failure in results[step].failures)
        assert not set(victims) & {worker.pid for worker in trainer.workers}
    for name, tensor in expected_state.items():
        assert torch.equal(tensor, state[name]), name


def sgd_momentum(params) -> torch.optim.SGD:
    """An optimizer with state (the momentum, split like its parameter) whose step does not amplify the
    reduction-order noise of tensor parallelism over many steps as Adam's division does."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def test_an_elastic_run_at_t2_grows_by_a_whole_replica_under_zero1_as_one_process(ray_cluster):
    """(1, 2) replicas of one stage split over t = 2, ZeRO-1, started where one replica fits (a
    placement group holds the room of the second): once the room is freed the second replica's two
    workers start beside, join at a step boundary, and every worker adopts its tp_rank's optimizer
    parts from the old layout's snapshots (local shards). Every step equals one process's within
    1e-5, before and after the grow (SGD with momentum: its state moves, and over this many steps it
    keeps the reduction-order noise well below the tolerance). A shrink at t = 2 (its ZeRO-1
    re-sharding) runs through the same adoption: tests/control/test_compound_faults.py drives it."""
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2, num_replicas=(1, 2), tensor_parallel=2,
                                    clip_grad_norm=0.5, shard_optimizer=True)
    generator = torch.Generator().manual_seed(6)
    model = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(llama_layers("tiny"))))
    optimizer = sgd_momentum(model.parameters())
    blocker = placement_group([{"CPU": 1.0}] * 4)  # of the session's 6 CPUs: room for one replica of 2 workers
    ray.get(blocker.ready(), timeout=60)
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, sgd_momentum, config) as trainer:
        assert trainer.num_replicas == 1
        replicas, deadline = [], time.monotonic() + 120
        while replicas[-2:] != [2, 2]:
            assert time.monotonic() < deadline, f"the second replica never joined: {replicas}"
            if len(replicas) == 2:
                remove_placement_group(blocker)
            tokens = torch.randint(0, 259, (4, 9), generator=generator)
            x, y = tokens[:, :-1], tokens[:, 1:]
            result = trainer.step(x, y)
            replicas.append(result.num_replicas)
            loss, norm = reference_step(model, optimizer, llama_loss, x, y, 4, 0.5)
            assert (result.loss, result.grad_norm) == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5))
            time.sleep(0.2)  # let the new replica's workers start
        assert replicas[0] == 1 and [direction for _, direction, _ in trainer.resizes] == ["grow"]
        assert [(w.replica, w.tp_rank) for w in trainer.workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        state = trainer.state_dict()
    for name, expected in model.state_dict().items():
        assert float((state[name] - expected).norm()) <= 1e-5 * float(expected.norm()), name
