"""ZeRO-1 in bf16 shards the fp32 main weights with the optimizer state: each
replica of a stage keeps the main weights of the parameters it owns and bf16
compute weights of all, gradients are reduce-scattered onto their owners and the
owners' new compute weights all-gathered. The run, its state dict, checkpoints
and exports are bitwise those of the unsharded run, and each worker holds what
the memory model predicts."""
import pytest
import torch
from safetensors.torch import load_file

import raypipe
from raypipe.checkpoint.hf_export import export_checkpoint
from raypipe.core.partition import stage_layer_ranges
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
from raypipe.planning.memory import estimate_stage
from tests.reference import adamw, assert_bitwise_equal, assert_parameters_match, in_process

LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
STEPS, SAVED_AT = 3, 2


def token_batches(batch=9):  # 9 sequences: uneven over the step's 4 micro-batches
    generator = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, LLAMA.vocab_size, (batch, LLAMA.max_seq_len + 1), generator=generator)
              for _ in range(STEPS + 1)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def config(num_replicas=2, num_stages=1, shard=False):
    return raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=4 // num_replicas, precision="bf16",
                                  num_replicas=num_replicas, shard_optimizer=shard, use_gpu=False)


def exported(directory):
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def run(shard, tmp_path):
    """Train STEPS steps at d=2, p=1, saving a checkpoint after SAVED_AT; what the run gives. (One stage:
    ZeRO-1 shards each stage over its replicas alone, so a stage's sharding is the same with others beside
    it; replicas of two stages under ZeRO-1 on Ray: tests/executor/test_equivalence.py's zbv cell and
    tests/executor/test_elastic.py's run.)"""
    batches, name = token_batches(), "sharded" if shard else "replicated"
    with raypipe.PipelineTrainer(llama_layers(LLAMA), llama_loss, adamw, config(shard=shard)) as trainer:
        results = []
        for step, (x, y) in enumerate(batches[:STEPS]):
            if step == SAVED_AT:
                trainer.save_checkpoint(tmp_path / f"{name}-ckpt")
            results.append(trainer.step(x, y))
        trainer.export_hf(tmp_path / f"{name}-hf", dtype="fp32")
        return {"losses": [r.loss for r in results], "stats": results[-1].stages, "state": trainer.state_dict(),
                "eval": trainer.evaluate(*batches[STEPS]), "hf": exported(tmp_path / f"{name}-hf"),
                "balance": trainer.balance}


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """The replicated run and the sharded one (each read, never changed, by the tests below), and the
    folder that holds their checkpoints and exports."""
    root = tmp_path_factory.mktemp("zero1")
    return run(False, root), run(True, root), root


@pytest.mark.timeout(300)
def test_bf16_zero1_shards_main_weights_and_changes_no_bit(runs):
    replicated, sharded, tmp_path = runs
    # two replicas sum each gradient in one addition either way: every bit the same
    assert sharded["losses"] == replicated["losses"]
    assert_bitwise_equal(replicated["state"], sharded["state"])
    assert {value.dtype for value in sharded["state"].values()} == {torch.float32}  # whole fp32 main weights
    assert sharded["eval"] == replicated["eval"]  # every replica computes with the owners' new weights
    assert_bitwise_equal(replicated["hf"], sharded["hf"])
    for name in ("replicated", "sharded"):
        export_checkpoint(str(tmp_path / f"{name}-ckpt"), SAVED_AT, str(tmp_path / f"{name}-ckpt-hf"), dtype="fp32")
    assert_bitwise_equal(exported(tmp_path / "replicated-ckpt-hf"), exported(tmp_path / "sharded-ckpt-hf"))

    # per worker: bf16 compute weights of every parameter, fp32 main weights and Adam moments of its own
    ranges = stage_layer_ranges(sharded["balance"])
    for result, shards in ((replicated, 1), (sharded, 2)):
        for stats in result["stats"]:
            predicted = estimate_stage(LLAMA, ranges[stats.stage], num_micro_batches=2, micro_batch_size=3,
                                       seq_len=LLAMA.max_seq_len, precision="bf16", optimizer="adamw",
                                       optimizer_shards=shards)
            where = (shards, stats.replica, stats.stage)
            assert stats.weights_bytes == pytest.approx(predicted.parameters_bytes + predicted.master_bytes,
                                                        rel=0.10), where
            assert stats.optimizer_bytes == pytest.approx(predicted.optimizer_bytes, rel=0.10), where
    for stage in range(len(sharded["balance"])):
        whole = [s.weights_bytes for s in replicated["stats"] if s.stage == stage]
        parts = [s.weights_bytes for s in sharded["stats"] if s.stage == stage]
        assert all(part < whole[0] for part in parts)
        # together the replicas hold each main weight once, each compute weight twice: 2 x 2 + 4 B/param
        assert sum(parts) == pytest.approx(whole[0] * 8 / 6, rel=1e-6)


# the checkpoint the Ray workers wrote (the second replica's main weights and optimizer state in its parts),
# loaded by one stage worker through the step runner in one process, as a Ray worker loads it
@pytest.mark.timeout(240)
def test_a_bf16_zero1_checkpoint_loads_into_one_worker(runs):
    # the sharded run saved after SAVED_AT steps and trained on uninterrupted to STEPS
    _, sharded, root = runs
    batches, uninterrupted = token_batches(), sharded["state"]
    with in_process(llama_layers(LLAMA), llama_loss, adamw, config(num_replicas=1, num_stages=1)) as trainer:
        trainer.load_checkpoint(root / "sharded-ckpt")
        assert trainer.step_count == SAVED_AT
        for x, y in batches[SAVED_AT:STEPS]:
            trainer.step(x, y)
        resumed = trainer.state_dict()
    # the same micro-batches, their gradients summed in another order: close, not bitwise
    assert_parameters_match(resumed, uninterrupted, rtol=1e-5, atol=1e-6)
