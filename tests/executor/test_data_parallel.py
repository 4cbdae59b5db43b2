"""Data parallelism: ``num_replicas`` copies of the pipeline train as one process
on the whole global batch (AdamW, global clipping, uneven splits), every replica
evaluates, and a skip or a failure in one replica holds for all."""
import copy
import math

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe import ConfigError, StageError
from tests.reference import InterpretedTrainer
from tests.executor.test_nonfinite import OverflowOnMarker, halving
from tests.reference import (adamw, assert_bitwise_equal, assert_parameters_match, in_process, make_mlp, on_ray,
                             random_batches, reference_step)

STEPS = 3
BATCH = 11  # uneven over 2, 4 and 6 micro-batches


def batches(seed=1):
    return random_batches(BATCH, STEPS, seed)


def reference_loss(model, x, y, count):
    with torch.no_grad():
        return sum(nn.functional.mse_loss(model(xm), ym).item() * xm.shape[0] / x.shape[0]
                   for xm, ym in zip(torch.tensor_split(x, count), torch.tensor_split(y, count)))


# (replicas, stages, micro-batches per replica) on Ray: more micro-batches than stages (BATCH split unevenly,
# clipped), replicated (the all-reduce over the replicas' group); ZeRO-1's reduce-scatter and gather on Ray:
# test_a_sharded_checkpoint_loads_into_any_replicas_and_stages below (three replicas of one stage train,
# save, load back and train on, against one process). A lone stage with ZeRO-1 and three replicas run the
# same step runner in one process (the in-process test below, with the same assertions but the Ray workers'
# processes, placement groups and evaluate, which the Ray cell checks); every case of this matrix (fewer
# micro-batches than stages too), each with ZeRO-1 and replicated, runs in one process in
# tests/testing/test_op_interpreter.py.
CASES = [(2, 2, 3, False)]


def _ids(value):
    return {True: "zero1", False: "replicated"}.get(value) if isinstance(value, bool) else None


def _config(num_replicas, num_stages, num_micro_batches, shard_optimizer):
    clip = 0.05 if num_micro_batches != 2 else None
    return raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=num_micro_batches,
                                  num_replicas=num_replicas, clip_grad_norm=clip, shard_optimizer=shard_optimizer)


def _assert_steps_match_one_process(trainer, reference, config):
    """STEPS steps of ``trainer`` against one process on the global batch; the last result."""
    reference_optimizer = adamw(reference.parameters())
    count, clip = config.num_replicas * config.num_micro_batches, config.clip_grad_norm
    for x, y in batches():
        result = trainer.step(x, y)
        loss, norm = reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, count, clip)
        assert (result.loss, result.grad_norm) == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5))
        if clip is not None:
            assert result.clip_coefficient < 1.0  # the clip really bites
    every = [(r, s) for r in range(config.num_replicas) for s in range(config.num_stages)]
    assert result.num_replicas == config.num_replicas
    assert [(s.replica, s.stage) for s in result.stages] == every
    assert {(e.replica, e.stage) for e in result.timeline if e.op == "F"} == set(every)
    assert_parameters_match(trainer.state_dict(), reference.state_dict())
    return result


@pytest.mark.parametrize("num_replicas,num_stages,num_micro_batches,shard_optimizer", CASES, ids=_ids)
def test_replicas_match_one_process_on_the_global_batch(ray_cluster, num_replicas, num_stages, num_micro_batches,
                                                        shard_optimizer):
    config = _config(num_replicas, num_stages, num_micro_batches, shard_optimizer)
    layers = [FailOnMarker(), *make_mlp()]  # the identity, but for a marked row: a failure in one replica
    reference = nn.Sequential(*copy.deepcopy(layers))
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, adamw, config) as trainer:
        assert trainer.num_replicas == num_replicas
        assert [(w.replica, w.stage) for w in trainer.workers] == [
            (r, s) for r in range(num_replicas) for s in range(num_stages)]
        assert len({w.pid for w in trainer.workers}) == num_replicas * num_stages
        # each replica has its own PACK placement group
        live = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
        assert sorted((pg["strategy"], len(pg["bundles"])) for pg in live) == [("PACK", num_stages)] * num_replicas
        # a global batch smaller than the step's micro-batches (of every replica) is refused, changing nothing
        count = num_replicas * num_micro_batches
        with pytest.raises(ValueError, match=f"smaller than the step's {count} micro-batches"):
            trainer.step(torch.ones(count - 1, 8), torch.ones(count - 1, 4))
        _assert_a_failure_in_one_replica_names_it_and_no_worker_steps(trainer)
        # the group was re-formed: the next steps train as one process that never saw the failed batch
        _assert_steps_match_one_process(trainer, reference, config)
        # every replica evaluates its block with its own weights: equal only if all replicas stepped alike
        x, y = batches(seed=9)[0]
        assert trainer.evaluate(x, y) == pytest.approx(reference_loss(reference, x, y, count), rel=1e-5)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.parametrize("num_replicas,num_stages,num_micro_batches,shard_optimizer",
                         [(2, 1, 2, True), (3, 2, 2, True)], ids=_ids)
def test_replicas_match_one_process_on_the_global_batch_in_process(num_replicas, num_stages, num_micro_batches,
                                                                   shard_optimizer):
    config = _config(num_replicas, num_stages, num_micro_batches, shard_optimizer)
    model = make_mlp()
    reference = copy.deepcopy(model)
    trainer = InterpretedTrainer(model, nn.functional.mse_loss, adamw, config)
    assert [(w.spec.replica, w.spec.stage) for w in trainer.pipeline.workers] == [
        (r, s) for r in range(num_replicas) for s in range(num_stages)]
    _assert_steps_match_one_process(trainer, reference, config)
    for replica in trainer.pipeline.replicas[1:]:  # every replica stepped alike: each evaluates with its own
        for ours, theirs in zip(trainer.pipeline.replicas[0].workers, replica.workers):
            assert_bitwise_equal(ours.layers.state_dict(), theirs.layers.state_dict())


# the replicas' statistics are summed over the real group each step on Ray (every cell above, clipping or
# not); which decision every worker takes from them is arithmetic: through the step runner in one process
def test_an_overflow_in_one_replica_skips_the_step_on_every_worker():
    layers = [OverflowOnMarker(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=2, precision="fp16",
                                    initial_loss_scale=4.0, balance=[2, 2])
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)
    marked = x.clone()
    marked[6, 0] = 1e4  # micro-batch 3 of 4: replica 1's second
    trainer = InterpretedTrainer(layers, nn.functional.mse_loss, adamw, config)
    before = trainer.state_dict()
    every_before = [copy.deepcopy(worker.layers.state_dict()) for worker in trainer.pipeline.workers]
    result = trainer.step(marked, y)
    assert (result.skipped, result.skip_reason, result.loss_scale) == (True, "overflow", 4.0)
    assert trainer.scaler.scale == 2.0 and math.isfinite(result.loss)
    assert_bitwise_equal(before, trainer.state_dict())
    # replica 1 did not step either (on Ray: its evaluation, with its own weights, is as before)
    assert_bitwise_equal(every_before, [worker.layers.state_dict() for worker in trainer.pipeline.workers])
    assert not trainer.step(x, y).skipped


class FailOnMarker(nn.Module):
    def forward(self, x):
        if bool((x[:, 0] > 1e3).any()):
            raise ValueError("a marked row")
        return x


def _assert_a_failure_in_one_replica_names_it_and_no_worker_steps(trainer) -> None:
    """On the Ray trainer of test_replicas_match_one_process_on_the_global_batch (two replicas of two
    stages, three micro-batches each; its first layer a FailOnMarker): a failure in replica 1 is raised
    naming it, and no worker of either replica steps (the next step, there, trains as one process)."""
    x, y = batches()[0]
    marked = x.clone()
    marked[9, 0] = 1e4  # micro-batch 5 of 6 (rows 8, 9): replica 1's second
    before, before_eval = trainer.state_dict(), trainer.evaluate(x, y)
    with pytest.raises(StageError, match="replica 1, stage 0, op F, micro-batch 1: ValueError: a marked row"):
        trainer.step(marked, y)
    assert_bitwise_equal(before, trainer.state_dict())
    assert trainer.evaluate(x, y) == before_eval
    assert trainer.step_count == 0


# (each replica's own PACK placement group, and a global batch smaller than the step's micro-batches of
# every replica: test_replicas_match_one_process_on_the_global_batch, on the trainers it starts)
def test_replicas_need_the_per_step_executor():
    with pytest.raises(ConfigError, match="num_replicas=2 runs on the per-step executor only"):
        raypipe.PipelineConfig(num_stages=1, num_replicas=2, transport="object_store").validate()
    with pytest.raises(ConfigError, match="invalid num_replicas=0"):
        raypipe.PipelineConfig(num_replicas=0).validate()


def _resumed(config, steps, root):
    """Load the newest checkpoint under ``root`` through the step runner in one process, train ``steps``
    steps; the final state and step count."""
    with in_process(make_mlp(), nn.functional.mse_loss, adamw, config, lr_scheduler=halving) as trainer:
        trainer.load_checkpoint(root)
        for x, y in steps:
            trainer.step(x, y)
        return trainer.state_dict(), trainer.step_count


# what each worker's optimizer holds is the stage worker's (its report's statistics): measured through the
# step runner in one process (the bf16 case on Ray: tests/executor/test_zero1_main_weights.py)
def test_zero1_keeps_each_parameters_optimizer_state_on_one_replica():
    x, y = batches()[0]
    bytes_of = {}
    for shard in (False, True):
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1, num_replicas=2, shard_optimizer=shard)
        trainer = InterpretedTrainer(make_mlp(width=64), nn.functional.mse_loss, adamw, config)
        bytes_of[shard] = {(s.replica, s.stage): s.optimizer_bytes for s in trainer.step(x, y).stages}
    for stage in range(2):
        whole = bytes_of[False][0, stage]
        assert bytes_of[False][1, stage] == whole  # unsharded: every replica holds it all
        shards = [bytes_of[True][replica, stage] for replica in range(2)]
        # each parameter's state exactly once, and each replica holds a part (whole parameters: as even as
        # their sizes allow)
        assert sum(shards) == whole and all(0 < part < whole for part in shards)


# Saved by three replicas of one stage on Ray (ZeRO-1: the other replicas' optimizer parts as blobs, written
# by the actors) and loaded back on Ray by the same workers (each its part, the manifest's trainer state);
# loaded into one replica of three stages and two sharded replicas of two stages (the parts merged, and
# sharded anew) through the same step runner in one process (the stage workers' load, as on Ray)
def test_a_sharded_checkpoint_loads_into_any_replicas_and_stages(ray_cluster, tmp_path):
    steps = batches() + batches(seed=2)[:1]  # 4 steps, with AdamW state and a schedule to carry over
    model = make_mlp()  # one process on the same 6 micro-batches a step
    optimizer = adamw(model.parameters())
    scheduler = halving(optimizer)
    for x, y in steps:
        reference_step(model, optimizer, nn.functional.mse_loss, x, y, 6, 0.05)
        scheduler.step()
    reference = model.state_dict()
    # 6 micro-batches per step throughout: 3 replicas x 2 (sharded), then 1 x 6 or 2 x 3
    first = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2, num_replicas=3, shard_optimizer=True,
                                   clip_grad_norm=0.05)
    with on_ray(make_mlp(), nn.functional.mse_loss, adamw, first, lr_scheduler=halving) as trainer:
        for x, y in steps[:2]:
            trainer.step(x, y)
        assert trainer.save_checkpoint(tmp_path / "ckpt") == 2
        for x, y in steps[2:]:
            trainer.step(x, y)
        uninterrupted = trainer.state_dict()
        trainer.load_checkpoint(tmp_path / "ckpt")
        assert trainer.step_count == 2
        for x, y in steps[2:]:
            trainer.step(x, y)
        assert trainer.step_count == 4
        assert_bitwise_equal(uninterrupted, trainer.state_dict())  # the same layout: the same arithmetic
        assert_parameters_match(uninterrupted, reference, rtol=1e-5, atol=1e-6)
    for num_replicas, num_stages, shard in ((1, 3, False), (2, 2, True)):
        config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=6 // num_replicas,
                                        num_replicas=num_replicas, shard_optimizer=shard, clip_grad_norm=0.05)
        resumed, count = _resumed(config, steps[2:], tmp_path / "ckpt")
        assert count == 4
        assert_parameters_match(resumed, reference, rtol=1e-5, atol=1e-6)


def test_the_memory_model_predicts_each_workers_optimizer_shard():
    from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
    from raypipe.planning.memory import estimate_stage

    model = LlamaConfig(vocab_size=259, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1, num_replicas=2, shard_optimizer=True)
    tokens = torch.randint(0, 259, (4, 17), generator=torch.Generator().manual_seed(0))
    trainer = InterpretedTrainer(llama_layers(model), llama_loss, adamw, config)  # the stage workers' statistics
    stages = trainer.step(tokens[:, :-1], tokens[:, 1:]).stages
    ranges = {(w.spec.replica, w.spec.stage): range(min(w.layer_indices), max(w.layer_indices) + 1)
              for w in trainer.pipeline.workers}
    for stats in stages:
        predicted = estimate_stage(model, ranges[stats.replica, stats.stage], num_micro_batches=1,
                                   micro_batch_size=2, seq_len=16, optimizer="adamw",
                                   optimizer_shards=2).optimizer_bytes
        assert stats.optimizer_bytes == pytest.approx(predicted, rel=0.10), (stats.replica, stats.stage)
