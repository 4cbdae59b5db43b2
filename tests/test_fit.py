"""fit(): stages read their own micro-batches; both executors give the same training."""
import time

import numpy as np
import pytest
import torch

import raypipe
from raypipe.data import TokenDataset, prepare
from raypipe.models.layers import build_layer
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
from raypipe.run import llama_count_tokens
from tests.reference import InterpretedTrainer, assert_bitwise_equal

MODEL = LlamaConfig(vocab_size=259, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("fit") / "tokens", seq_len=32, max_bytes=300_000)


def llama_trainer(config):
    """The small LLaMA, trained with AdamW and its loss averaged over tokens, under ``config``."""
    return raypipe.PipelineTrainer(llama_layers(MODEL), llama_loss, lambda p: torch.optim.AdamW(p, lr=1e-2), config,
                                   loss_count_fn=llama_count_tokens)


def fit(data, transport, num_stages=2, num_replicas=1, micro_batches=3, steps=4):
    train, validation = (TokenDataset(data, split, micro_batch_size=2, num_micro_batches=micro_batches * num_replicas)
                         for split in ("train", "validation"))
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=micro_batches, num_replicas=num_replicas,
                                    transport=transport, clip_grad_norm=1.0)
    with llama_trainer(config) as trainer:
        results = trainer.fit(train, steps, validation=validation, eval_every=2, progress=False)
        return results, train.state_dict(), trainer.state_dict()


def test_fit_reads_data_in_the_stages_and_executors_agree(ray_cluster, data):
    tasks, position, state = fit(data, "object_store")
    p2p, p2p_position, p2p_state = fit(data, "p2p")
    assert position["next_step"] == p2p_position["next_step"] == 4
    assert [r.eval_loss is not None for r in tasks] == [False, True, False, True]
    assert [r.loss for r in p2p] == pytest.approx([r.loss for r in tasks], rel=1e-6)
    evaluated = [r.eval_loss for r in tasks if r.eval_loss is not None]
    assert [r.eval_loss for r in p2p if r.eval_loss is not None] == pytest.approx(evaluated, rel=1e-6)
    assert tasks[-1].loss < tasks[0].loss
    for key, value in state.items():
        torch.testing.assert_close(p2p_state[key], value, rtol=1e-6, atol=1e-7)
    assert tasks[0].num_tokens == 3 * 2 * 32  # micro-batches x micro-batch size x sequence length
    # the stages read exactly the dataset's step 0: the first loss is the initial model's on that batch
    reference = torch.nn.Sequential(*[build_layer(spec, index, seed=0) for index, spec in
                                      enumerate(llama_layers(MODEL))])
    inputs, targets = TokenDataset(data, micro_batch_size=2, num_micro_batches=3).global_batch(0)
    with torch.no_grad():
        assert tasks[0].loss == pytest.approx(llama_loss(reference(inputs), targets).item(), rel=1e-5)


def test_replicas_reading_their_own_data_train_as_one_pipeline(ray_cluster, data):
    # a step is 6 micro-batches of the dataset: one pipeline runs them all, or 2 replicas share them (each
    # replica's first stage reads its block's inputs, its last its targets; one stage reading both: the one
    # pipeline. Three replicas of one stage train over a real group in
    # tests/executor/test_data_parallel.py::test_a_sharded_checkpoint_loads_into_any_replicas_and_stages and,
    # as one process on the global batch, in-process there; replica_blocks: tests/core/test_micro_batches.py)
    # (the one pipeline runs through the step runner in one process, on the dataset's global batches: the
    # rows test_fit_reads_data_in_the_stages_and_executors_agree shows the stages read; its validation loss
    # in one plain process, with the weights it trained)
    one, one_eval, one_state = one_pipeline_on_global_batches(data, micro_batches=6, steps=2)
    for num_replicas, num_stages in ((2, 2),):
        results, position, state = fit(data, "p2p", num_stages=num_stages, num_replicas=num_replicas,
                                       micro_batches=6 // num_replicas, steps=2)
        assert position["next_step"] == 2 and results[0].num_replicas == num_replicas
        assert results[0].num_tokens == 6 * 2 * 32
        assert [r.loss for r in results] == pytest.approx([r.loss for r in one], rel=1e-5)
        assert results[-1].eval_loss == pytest.approx(one_eval, rel=1e-5)  # every replica evaluates
        for key, value in one_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def one_pipeline_on_global_batches(data, micro_batches: int, steps: int):
    """What ``fit`` on one pipeline of one stage gives: each step's result, the validation loss after the
    last step, the final state."""
    train, validation = (TokenDataset(data, split, micro_batch_size=2, num_micro_batches=micro_batches)
                         for split in ("train", "validation"))
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=micro_batches, clip_grad_norm=1.0)
    trainer = InterpretedTrainer(llama_layers(MODEL), llama_loss, lambda p: torch.optim.AdamW(p, lr=1e-2), config,
                                 loss_count_fn=llama_count_tokens)
    results = [trainer.step(*train.global_batch(step)) for step in range(steps)]
    state = trainer.state_dict()
    model = torch.nn.Sequential(*[build_layer(spec, index, seed=0) for index, spec in enumerate(llama_layers(MODEL))])
    model.load_state_dict(state)
    inputs, targets = validation.global_batch(0)  # every row a whole sequence: the token mean is the batch's
    with torch.no_grad():
        return results, llama_loss(model(inputs), targets).item(), state


@pytest.mark.cluster
def test_a_killed_reading_stage_in_fit_costs_no_step_and_no_sample(ray_cluster, data):
    """fit with SIGKILLs of the first stage and of the last (both read the dataset): the
    replacements get the datasets again, and every loss and weight is bitwise the same."""
    import os
    import signal

    def run(kill_at):
        train = TokenDataset(data, "train", micro_batch_size=2, num_micro_batches=3)
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3, clip_grad_norm=1.0, max_failures=None)
        with llama_trainer(config) as trainer:
            def kill(result):
                if result.step in kill_at:
                    os.kill(trainer.workers[kill_at[result.step]].pid, signal.SIGKILL)

            results = trainer.fit(train, 5, progress=False, callback=kill)
            return [r.loss for r in results], train.state_dict(), trainer.state_dict(), trainer.failures

    losses, position, state, _ = run({})
    killed_losses, killed_position, killed_state, failures = run({0: 0, 2: 1})  # stage 0 after step 0, then 1
    assert len(failures) == 2
    assert killed_losses == losses and killed_position == position == {**position, "next_step": 5}
    assert all(torch.equal(killed_state[key], value) for key, value in state.items())


def test_fit_saving_every_step_returns_with_its_final_checkpoint_complete(ray_cluster, data, tmp_path):
    """Checkpoints saved in the background every step: when fit returns, the newest is the
    final state (bitwise, with the data position) and keep_last pruned the older ones. (First,
    on the same trainer: a dataset of other micro-batches is refused, training nothing.)"""
    from raypipe.checkpoint.store import list_checkpoints, read_manifest

    train = TokenDataset(data, "train", micro_batch_size=2, num_micro_batches=2)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2)
    with llama_trainer(config) as trainer:
        with pytest.raises(ValueError, match=r"yields 3 micro-batches per step but a step of the pipeline has 2 "):
            trainer.fit(TokenDataset(data, micro_batch_size=2, num_micro_batches=3), 1, progress=False)
        assert trainer.step_count == 0
        trainer.fit(train, 3, checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_last=2, progress=False)
        assert list_checkpoints(tmp_path) == [2, 3]
        assert read_manifest(tmp_path, 3)["extra"]["dataset"]["next_step"] == 3
        final = trainer.state_dict()
        trainer.step_from_datasets(3, 4, 4 * 32)  # moves the weights on, then back to the final checkpoint
        trainer.load_checkpoint(tmp_path)
        assert trainer.step_count == 3
        assert all(torch.equal(value, final[key]) for key, value in trainer.state_dict().items())


def test_an_elastic_fit_that_grows_reads_the_same_rows_as_a_fixed_one(ray_cluster, data, tmp_path):
    """Stages read their block of each step from the dataset, and the block moves when the run
    grows: every bit as a fixed run on one replica, resumed on two at the step the run grew."""
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 1.0}] * 4)  # room for one replica of two stages
    ray_cluster.get(blocker.ready(), timeout=60)
    train = TokenDataset(data, "train", micro_batch_size=2, num_micro_batches=4)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2), clip_grad_norm=1.0)
    with llama_trainer(config) as trainer:
        results = trainer.fit(train, 2, progress=False)  # fit trains that many more steps
        remove_placement_group(blocker)
        deadline = time.monotonic() + 120
        while trainer.num_replicas < 2:
            assert time.monotonic() < deadline, "the second replica never joined"
            results += trainer.fit(train, 1, progress=False)
            time.sleep(1)  # the new replica's workers start while the run waits or steps
        results += trainer.fit(train, 2, progress=False)
        state = trainer.state_dict()
    replicas = [r.num_replicas for r in results]
    assert replicas[:2] == [1, 1] and replicas[-2:] == [2, 2]
    # how many steps ran on one replica depends on how soon the new workers started
    fixed, fixed_state = fit_on_one_then_two(data, tmp_path, replicas.count(1), replicas.count(2))
    assert [r.num_replicas for r in fixed] == replicas
    assert [r.loss for r in results] == [r.loss for r in fixed]
    assert_bitwise_equal(fixed_state, state)


def fit_on_one_then_two(data, root, steps_on_one, steps_on_two):
    """``steps_on_one`` steps on one replica of 4 micro-batches, checkpointed, then loaded
    into two replicas of 2 that train ``steps_on_two`` more: the results and final state."""
    results = []
    for num_replicas, steps in ((1, steps_on_one), (2, steps_on_two)):
        train = TokenDataset(data, "train", micro_batch_size=2, num_micro_batches=4)
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4 // num_replicas, num_replicas=num_replicas,
                                        clip_grad_norm=1.0)
        with llama_trainer(config) as trainer:
            if results:
                train.load_state_dict(trainer.load_checkpoint(str(root))["dataset"])
            results += trainer.fit(train, steps, checkpoint_dir=str(root), progress=False)
            state = trainer.state_dict()
    return results, state


def test_a_step_that_meets_a_changed_shard_names_it_and_checkpoints_the_steps_before(ray_cluster, tmp_path):
    """Opening reads no shard, so a shard changed after prepare (same size) is found by the
    stage that first reads it, at that step: the error names the file, and fit checkpoints the
    steps before it, so a rerun after fixing the file redoes none."""
    import uuid

    from raypipe.checkpoint.store import list_checkpoints, read_manifest

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    generator = torch.Generator().manual_seed(0)
    for index in range(24):  # text of its own (a uuid), so no node has decoded these shards before
        words = torch.randint(0, 26, (900,), generator=generator).tolist()
        (corpus / f"doc{index}.txt").write_text(f"{uuid.uuid4()} " + "".join(chr(97 + w) for w in words))
    data = prepare(tmp_path / "tokens", corpus=corpus, seq_len=32, rows_per_shard=64)
    train = TokenDataset(data, "train", micro_batch_size=2, num_micro_batches=2)
    ends = np.cumsum([shard["num_rows"] for shard in train.shards])  # split-wide row after each shard's last
    first_read = {}  # shard -> the first step that reads one of its rows
    for step in range(train.steps_per_epoch):
        for row in np.concatenate([train.row_indices(step, micro_batch) for micro_batch in range(2)]):
            first_read.setdefault(int(np.searchsorted(ends, row, side="right")), step)
    shard, failing_step = min(((s, step) for s, step in first_read.items() if step >= 2), key=lambda item: item[1])
    path = data / train.shards[shard]["file"]
    changed = bytearray(path.read_bytes())
    changed[len(changed) // 2] ^= 0xFF
    path.write_bytes(bytes(changed))

    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2)
    with llama_trainer(config) as trainer:
        with pytest.raises(raypipe.StageError, match=f"checksum mismatch for shard .*{path.name}"):
            trainer.fit(train, failing_step + 2, checkpoint_dir=str(tmp_path / "ckpt"), progress=False)
        assert trainer.step_count == train.next_step == failing_step  # the step changed nothing
        assert list_checkpoints(tmp_path / "ckpt") == [failing_step]
        assert read_manifest(tmp_path / "ckpt", failing_step)["extra"]["dataset"]["next_step"] == failing_step
        state = trainer.state_dict()
        trainer.step_from_datasets(0, 4, 4 * 32)  # moves the weights on, then back to the saved steps
        trainer.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(value, state[key]) for key, value in trainer.state_dict().items())
