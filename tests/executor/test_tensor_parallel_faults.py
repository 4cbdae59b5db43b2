"""Tensor-parallel stages past a failure: snapshots of local shards, the groups re-formed, a
lost tensor-parallel rank replaced -- each bitwise the run without it.

Split over a stage's tensor-parallel mesh, the parameters, their optimizer state and the layers'
hooks are bound to that mesh's process group. Every heal and every retried step re-forms all
groups, so each worker moves its state onto the new mesh from its own local shards, and a
replacement restores the lost rank's snapshot (its local shards) once its layers are split.
The reference is :class:`tests.gloo_pipeline.GlooPipeline` (the per-step workers in forked
processes over real gloo groups, no Ray) without the failure: the same steps, with and without
it, must agree bit for bit. There the heal's parts run one by one; on Ray (tp_kills_run.py) a
trainer of (1, 2, 2) and one of (2, 2, 2) each take six SIGKILLs of seeded ranks at seeded
moments inside steps, and a SIGSTOP. A node lost with a whole stage's two ranks:
tests/executor/test_lost_nodes.py."""
from __future__ import annotations

import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from torch import nn

import raypipe
from raypipe.models.layers import build_layer
from raypipe.models.llama import llama_layers, llama_loss
from tests.executor import tp_kills_run
from tests.executor.cluster_run import run_in_subprocess
from tests.executor.test_tensor_parallel_steps import _batches, adamw
from tests.gloo_pipeline import GlooPipeline, uninterrupted_run
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
def test_a_shrink_at_t2_moves_each_survivors_state_onto_the_smaller_layouts_meshes():
    """(2, 2, 2) -> (1, 2, 2) as an elastic run shrinks when a node goes with no room to replace its
    workers: replica 1's four workers killed, the survivors take the smaller layout, re-form the
    groups (fewer of them than before, so the new ones are named otherwise: a parameter left on an
    old mesh finds no group) and restore the snapshot before; every step, before and after, equals
    one process on the same global batches within 1e-5 (the reduction order differs)."""
    config = tp_kills_run.config(2)
    data = tp_kills_run.batches(4)
    with GlooPipeline(llama_layers("tiny"), llama_loss, tp_kills_run.adamw, config) as pipeline:
        steps = [pipeline.step(x, y) for x, y in data[:2]]
        pipeline.shrink(1, pipeline.snapshots())
        steps += [pipeline.step(x, y) for x, y in data[2:]]
        state = pipeline.state_dict()
    expected_steps, expected_state = tp_kills_run.one_process(config, data)
    for step, (loss, norm) in zip(steps, expected_steps, strict=True):
        assert (step.loss, step.grad_norm) == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5))
    for name, expected in expected_state.items():
        assert float((state[name] - expected).norm()) <= 1e-5 * float(expected.norm()), name


def _assert_bitwise_the_uninterrupted_run(config: raypipe.PipelineConfig, faults: list[tp_kills_run.Fault],
                                          run: dict) -> None:
    """``run`` (tp_kills_run's record of ``config`` with ``faults``): each step's loss and norm and the
    final state bitwise the same layout's run without them (the same workers in processes over gloo);
    each fault healed in its step or the next (a late one lands after its step's end), its worker gone."""
    steps, state = uninterrupted_run(llama_layers("tiny"), llama_loss, tp_kills_run.adamw, config,
                                     tp_kills_run.batches(tp_kills_run.steps_of(faults)))
    for fault, hit in zip(faults, run["hits"], strict=True):
        print(f"step {fault.step}: {fault.signal_name} of replica {fault.place[0]} stage {fault.place[1]} "
              f"tp_rank {fault.place[2]} {hit['delay_s']:.3f} s in (a step: {run['step_seconds'][1]:.3f} s); "
              f"healed: {hit['failures'] or 'in the next step'}")
    assert run["steps"] == steps
    assert run["state"].keys() == state.keys()
    for name, values in state.items():
        assert run["state"][name] == values, name  # floats compared exactly
    for fault in faults:
        # (a loaded machine may add a heal of its own: a busy worker's heartbeat late; the bits stay)
        named = "replica {} stage {} tp_rank {} ".format(*fault.place) + (
            "hung" if fault.signal_name == "SIGSTOP" else "died")
        assert any(failure.startswith((f"step {fault.step}: ", f"step {fault.step + 1}: ")) and named in failure
                   for failure in run["failures"]), (fault, run["failures"])
    assert not {hit["pid"] for hit in run["hits"]} & set(run["pids_at_end"])
    for source in run["sources"]:  # a copy from another replica names it
        if source.startswith("replica "):
            assert {int(replica) for replica in source.removeprefix("replica ").split(", ")} <= set(
                range(config.num_replicas)), run["sources"]


@pytest.mark.cluster  # kills worker processes
def test_six_seeded_kills_and_a_hang_of_tensor_parallel_ranks_at_1_2_2_on_ray_cost_no_step_and_no_bit(
        ray_cluster):
    """(1, 2, 2) on Ray, the default per-step snapshot, recompute with the kept inputs offloaded (to
    Ray's object store: the same arithmetic): in each of six steps a seeded worker SIGKILLed a seeded
    moment into the step, then stage 0's tp_rank 0 (which holds the group's rendezvous) SIGSTOPped.
    Each time the controller replaces the worker, every worker restores its snapshot of the step
    before (the replacement its lost rank's local shards; a snapshot lost with its worker, the
    keeper's copy of the one before, and the step between replayed), the groups re-form with every
    worker's state moved onto the new meshes, and the step runs again: each step's loss and norm and
    the final state are bitwise the uninterrupted run's."""
    config = tp_kills_run.config(1, activation_checkpoint="always")
    faults = tp_kills_run.seeded_faults(1, stopped=(0, 0, 0))
    run = tp_kills_run.train(config.replace(offload_activations=True), faults)
    _assert_bitwise_the_uninterrupted_run(config, faults, run)


@pytest.mark.cluster  # kills worker processes
def test_six_seeded_kills_and_a_hang_of_tensor_parallel_ranks_at_2_2_2_on_ray_cost_no_step_and_no_bit(tmp_path):
    """(2, 2, 2): eight workers, more than the session's Ray instance has CPUs for, so on a Ray
    instance of its own, in a process of its own (tp_kills_run.py). Six seeded kills as at
    (1, 2, 2), then replica 1's stage 0 tp_rank 1 SIGSTOPped: every heal also re-forms the
    replicas' groups of each (stage, tp_rank), and the other replica restores its snapshot too."""
    stopped = (1, 0, 1)
    run = run_in_subprocess("tests.executor.tp_kills_run", tmp_path / "kills.json", timeout_s=540,
                            arguments=("2", ",".join(map(str, stopped))))
    _assert_bitwise_the_uninterrupted_run(tp_kills_run.config(2), tp_kills_run.seeded_faults(2, stopped), run)


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
    keeps the reduction-order noise well below the tolerance), each replica in a placement group of
    its own. A shrink at t = 2 (its ZeRO-1 re-sharding) runs through the same adoption:
    tests/control/test_compound_faults.py drives it."""
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2, num_replicas=(1, 2), tensor_parallel=2,
                                    clip_grad_norm=0.5, shard_optimizer=True)
    generator = torch.Generator().manual_seed(6)
    model = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(llama_layers("tiny"))))
    optimizer = sgd_momentum(model.parameters())
    before = set(ray.util.placement_group_table())
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
        # a placement group per replica, its one stage's t workers in one bundle (a bundle never spans nodes)
        groups = [group for key, group in ray.util.placement_group_table().items()
                  if key not in before and group["state"] == "CREATED"]
        assert [list(group["bundles"].values()) for group in groups] == [[{"CPU": 2.0}]] * 2, groups
        state = trainer.state_dict()
    for name, expected in model.state_dict().items():
        assert float((state[name] - expected).norm()) <= 1e-5 * float(expected.norm()), name
