"""Background checkpoint saves: training stalls only for the copy to host memory,
the files are the state at the save's step, a write error is raised naming the
file, and a worker lost mid-write leaves no complete checkpoint but a healed run."""
import json
import logging
import os
import signal

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe.checkpoint.store import list_checkpoints
from tests.reference import adamw, assert_bitwise_equal, make_mlp, random_batches

WIDE = 2048  # about 50 MB of weights and Adam state per wide layer: a write that takes a while


def wide_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDE), nn.Tanh(), nn.Linear(WIDE, WIDE), nn.Tanh(), nn.Linear(WIDE, WIDE),
                         nn.Linear(WIDE, 4))


def two_stages() -> raypipe.PipelineConfig:
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, balance=[3, 3])


def optimizer_states(trainer: raypipe.PipelineTrainer) -> list:
    return [ray.get(actor.optimizer_state.remote()) for actor in trainer.layout.actors]


def checksums(root, step: int) -> dict:
    return json.loads((root / f"step_{step:08d}" / "manifest.json").read_text())["sha256"]


def test_a_background_save_is_the_state_at_its_step_while_the_next_steps_run(ray_cluster, tmp_path):
    batches = random_batches(8, steps=4)
    with raypipe.PipelineTrainer(wide_model(), nn.functional.mse_loss, adamw, two_stages()) as trainer:
        for x, y in batches[:2]:
            trainer.step(x, y)
        expected_model, expected_optimizer = trainer.state_dict(), optimizer_states(trainer)
        assert trainer.save_checkpoint(tmp_path / "blocking") == 2  # wait=True: complete on return
        assert list_checkpoints(tmp_path / "blocking") == [2]
        assert trainer.save_checkpoint(tmp_path / "background", wait=False) == 2
        during = trainer.step(*batches[2])  # changes every weight in place while the files are written
        trainer.step(*batches[3])
        saved = trainer.wait_for_checkpoint()
        assert saved.complete and saved.step == 2 and trainer.wait_for_checkpoint() is None
        assert saved.writers == ("replica 0 stage 0", "replica 0 stage 1")
        # each worker's step after the save started before its writer finished: the write did not stall it
        for stage, written in enumerate(saved.written_unix):
            started = min(event.start for event in during.timeline if event.stage == stage)
            assert started < written, (stage, started, written)
        assert saved.host_bytes > 2 * 3 * WIDE * WIDE * 4  # weights and both Adam moments of the wide layers
        after = trainer.state_dict()
        assert not torch.equal(after["2.weight"], expected_model["2.weight"])
        # the same bytes as the blocking save at the same step, and the state of that step, loaded into the
        # trainer that trained on from it (every weight and moment of step 4, none of step 2's)
        assert checksums(tmp_path / "background", 2) == checksums(tmp_path / "blocking", 2)
        trainer.load_checkpoint(tmp_path / "background")
        assert trainer.step_count == 2
        assert_bitwise_equal(trainer.state_dict(), expected_model)
        assert_bitwise_equal(optimizer_states(trainer), expected_optimizer)


def test_a_failed_write_raises_naming_the_file_at_the_next_save_and_at_shutdown(ray_cluster, tmp_path):
    (tmp_path / "a-file").write_text("a file where the checkpoint root's parent should be a directory")
    bad, good = tmp_path / "a-file" / "checkpoints", tmp_path / "checkpoints"
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=1)
    x, y = random_batches(4, steps=1)[0]
    trainer = raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config)
    try:
        trainer.step(x, y)
        assert trainer.save_checkpoint(bad, wait=False) == 1
        assert trainer.step(x, y).loss > 0  # training goes on meanwhile
        with pytest.raises(raypipe.CheckpointError, match="could not be written") as error:
            trainer.save_checkpoint(good)  # a save first waits for the one before
        assert error.value.path == str(bad / "step_00000001" / "layer_00000.pt")
        assert "checkpoint step 1, replica 0 stage 0" in str(error.value)
        assert trainer.save_checkpoint(good) == 2 and list_checkpoints(good) == [2]  # raised once, then saves work
        with pytest.raises(raypipe.CheckpointError, match="step_00000002/layer_00000.pt could not be written"):
            trainer.save_checkpoint(bad)  # a blocking save raises at once
        trainer.save_checkpoint(bad, wait=False)
    finally:
        with pytest.raises(raypipe.CheckpointError, match=str(bad)):
            trainer.shutdown()  # the stage actors are freed all the same
    assert trainer.workers == []


@pytest.mark.cluster
def test_a_worker_killed_while_writing_leaves_no_checkpoint_and_training_goes_on(ray_cluster, tmp_path, caplog):
    batches = random_batches(8, steps=3)
    with raypipe.PipelineTrainer(wide_model(), nn.functional.mse_loss, adamw, two_stages()) as trainer:
        trainer.step(*batches[0])
        trainer.save_checkpoint(tmp_path, wait=False)
        os.kill(trainer.workers[1].pid, signal.SIGKILL)  # while its copy or write is in flight
        with caplog.at_level(logging.WARNING, logger="raypipe"):
            trainer.step(*batches[1])  # healed
            saved = trainer.wait_for_checkpoint()
        assert len(trainer.failures) == 1 and not saved.complete and saved.written_unix[1] is None
        assert "checkpoint step 1" in caplog.text and "replica 0 stage 1 died while writing it" in caplog.text
        assert list_checkpoints(tmp_path) == []  # no manifest: loading never takes it
        trainer.step(*batches[2])
        assert trainer.save_checkpoint(tmp_path, keep_last=1) == 3 and list_checkpoints(tmp_path) == [3]
