"""A checkpoint restores weights, optimizer and LR-schedule state into any partition."""
import pytest
import torch
from torch import nn

import raypipe
from tests.reference import assert_parameters_match, in_process, make_mlp

STEPS = 4


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def batches():
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 8, generator=generator), torch.randn(12, 4, generator=generator)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def straight_and_its_trainer(ray_cluster, tmp_path_factory):
    """One run of STEPS steps on two stages with the warm-up schedule, checkpointed half way (its only
    checkpoint, of step 2): each step's result, the final state and the checkpoints' folder, which
    the tests below read and never change; and its trainer, kept for the tests that save and load
    checkpoints of their own (each in its own folder, asserting nothing of where the trainer started)."""
    root = tmp_path_factory.mktemp("straight")
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3, balance=[2, 5])
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config, lr_scheduler=warmup) as trainer:
        results = []
        for step, (x, y) in enumerate(batches()):
            if step == 2:
                assert trainer.save_checkpoint(root, extra={"note": "half way"}) == 2
            results.append(trainer.step(x, y))
        yield (results, trainer.state_dict(), root), trainer


@pytest.fixture
def straight(straight_and_its_trainer):
    return straight_and_its_trainer[0]


@pytest.fixture
def trainer(straight_and_its_trainer):
    """A trainer of make_mlp() on two stages, as the tests before left it."""
    return straight_and_its_trainer[1]


def test_lr_schedule_matches_single_process(straight):
    results, state, _ = straight
    reference = make_mlp()
    optimizer = adamw(reference.parameters())
    scheduler = warmup(optimizer)
    for result, (x, y) in zip(results, batches(), strict=True):
        for xm, ym in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3)):
            (nn.functional.mse_loss(reference(xm), ym) * xm.shape[0] / 12).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        assert result.learning_rate == pytest.approx(optimizer.param_groups[0]["lr"])
    assert_parameters_match(state, reference.state_dict())


def test_resume_into_another_partition_equals_an_uninterrupted_run(straight):
    # the files the trainer's workers wrote, loaded by the workers of three stages, each its layers, in one
    # process (the workers' loading code; a trainer's load on Ray: the tests below and test_fit.py)
    data = batches()
    _, expected, root = straight  # checkpointed after 2 of its steps
    other_partition = raypipe.PipelineConfig(num_stages=3, num_micro_batches=3, balance=[3, 2, 2])
    with in_process(make_mlp(seed=99), nn.functional.mse_loss, adamw, other_partition,
                    lr_scheduler=warmup) as trainer:
        extra = trainer.load_checkpoint(root)
        assert extra["note"] == "half way" and trainer.step_count == 2
        for x, y in data[2:]:
            trainer.step(x, y)
        assert_parameters_match(trainer.state_dict(), expected)


def test_a_damaged_checkpoint_file_raises_a_checkpoint_error_naming_it(trainer, tmp_path):
    x, y = batches()[0]
    trainer.step(x, y)
    step = trainer.save_checkpoint(tmp_path)
    before = trainer.state_dict()
    damaged = tmp_path / f"step_{step:08d}" / "layer_00004.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, still a zip file
    damaged.write_bytes(bytes(data))
    with pytest.raises(raypipe.CheckpointError, match="layer_00004.pt is damaged") as error:
        trainer.load_checkpoint(tmp_path)
    assert error.value.path == str(damaged)
    damaged.unlink()
    with pytest.raises(raypipe.CheckpointError, match="layer_00004.pt is listed in its manifest but missing"):
        trainer.load_checkpoint(tmp_path, step=step)
    assert_parameters_match(trainer.state_dict(), before, rtol=0, atol=0)


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(trainer, tmp_path, caplog):
    data = batches()
    start = trainer.step_count
    trainer.step(*data[0])
    older = trainer.save_checkpoint(tmp_path)
    expected = trainer.state_dict()
    trainer.step(*data[1])
    newest = trainer.save_checkpoint(tmp_path)
    damaged = tmp_path / f"step_{newest:08d}" / "layer_00002.pt"
    damaged.write_bytes(damaged.read_bytes()[:-7])  # truncated, as by a crash mid-copy
    with caplog.at_level("WARNING", logger="raypipe"):
        trainer.load_checkpoint(tmp_path)
    assert trainer.step_count == older == start + 1
    assert str(damaged) in caplog.text  # the warning names the bad file
    assert_parameters_match(trainer.state_dict(), expected, rtol=0, atol=0)
    with pytest.raises(raypipe.CheckpointError, match="layer_00002.pt") as error:
        trainer.load_checkpoint(tmp_path, step=newest)  # asked for by step: no fallback
    assert error.value.path == str(damaged)
    # and no stage loaded its part of it (stage 0's files are intact): the state is the one before's
    assert_parameters_match(trainer.state_dict(), expected, rtol=0, atol=0)
    # training on from the one before saves that step again: the damaged checkpoint is replaced
    trainer.step(*data[1])
    with caplog.at_level("WARNING", logger="raypipe"):
        assert trainer.save_checkpoint(tmp_path) == newest
    assert f"replacing the damaged checkpoint of step {newest}" in caplog.text
    trainer.load_checkpoint(tmp_path, step=newest)
    assert trainer.step_count == newest


def test_keep_last_keeps_only_the_newest_checkpoints(trainer, tmp_path):
    from raypipe.checkpoint.store import list_checkpoints

    # loading from a folder without a checkpoint names the folder
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        trainer.load_checkpoint(tmp_path)
    start = trainer.step_count
    for x, y in batches()[:3]:
        trainer.step(x, y)
        trainer.save_checkpoint(tmp_path, keep_last=2)
    assert list_checkpoints(tmp_path) == [start + 2, start + 3]
    with pytest.raises(ValueError, match="keep_last"):
        trainer.save_checkpoint(tmp_path / "other", keep_last=0)


def test_a_checkpoint_of_another_model_names_the_stage_layer_and_tensor(trainer, tmp_path, caplog):
    """Checkpoints of other models (written by stage workers through the step runner in one process, the
    files a Ray worker writes) loaded into the trainer of make_mlp() on two stages (balance [2, 5])."""
    def saved_by_one_worker(model, root):
        config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=1)
        generator = torch.Generator().manual_seed(6)
        with in_process(model, nn.functional.mse_loss, adamw, config) as other:  # a step: its optimizer state too
            other.step(torch.randn(12, 8, generator=generator), torch.randn(12, model[-1].out_features,
                                                                            generator=generator))
            return other.save_checkpoint(root)

    other_head = make_mlp(seed=1)
    other_head[6] = nn.Linear(16, 5)  # stage 1's last layer: (5, 16) in the checkpoint where the model has (4, 16)
    step = saved_by_one_worker(other_head, tmp_path / "other_head")
    before = trainer.state_dict()
    with caplog.at_level("WARNING", logger="raypipe"):
        with pytest.raises(raypipe.CheckpointError) as error:
            trainer.load_checkpoint(tmp_path / "other_head")  # the newest: intact files of another model, no fallback
    assert str(error.value).splitlines()[0] == (
        f"stage 1 (layers 2–6): layer 6 'weight' is (5, 16) in the checkpoint, (4, 16) in the model "
        f"(checkpoint {tmp_path / 'other_head'} step {step}; is it of another model?)")
    # no fallback to an older checkpoint (the warning says "trying an older one"); not `"damaged" not in`:
    # caplog also holds Ray's "Unhandled error" lines of earlier tests' calls, logged when collected
    assert "trying an older one" not in caplog.text
    # no stage changed: every worker read and checked its layers before any loaded them (stage 0's fit)
    assert_parameters_match(trainer.state_dict(), before, rtol=0, atol=0)
    step = saved_by_one_worker(make_mlp()[:5], tmp_path / "five_layers")
    with pytest.raises(raypipe.CheckpointError, match=r"^the model \(7 layers\): the checkpoint holds 5 layers"):
        trainer.load_checkpoint(tmp_path / "five_layers", step=step)


def test_layer_misfit_names_a_missing_an_unexpected_and_a_misshapen_tensor():
    from raypipe.stage.checkpointing import layer_misfit, stage_and_layers

    model = {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}
    assert layer_misfit(4, model, {"weight": torch.ones(3, 2), "bias": torch.ones(3)}) is None
    assert layer_misfit(4, model, {"weight": torch.ones(3, 2)}) == "layer 4 'bias' is in the model, not in the checkpoint"
    assert layer_misfit(4, model, {**model, "scale": torch.ones(1), "shift": torch.ones(1)}) == (
        "layer 4 'scale' is in the checkpoint, not in the model (and 1 more)")
    assert layer_misfit(4, model, {"weight": torch.ones(2, 2), "bias": torch.ones(3)}) == (
        "layer 4 'weight' is (2, 2) in the checkpoint, (3, 2) in the model")
    assert (stage_and_layers(1, [3, 4, 5]), stage_and_layers(0, [0])) == ("stage 1 (layers 3–5)", "stage 0 (layer 0)")
