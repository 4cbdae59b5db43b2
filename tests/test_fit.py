"""fit(): stages read their own micro-batches; both executors give the same training.

Three trainers on Ray: an elastic run that grows (its rows and numbers against one process, two tests
reading it), the per-op executor's run, and the default executor's run, whose trainer the tests after it
train on from where the one before left it."""
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
MICRO_BATCHES = 3  # a step of the fixed runs (fit below): two stages, one replica


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("fit") / "tokens", seq_len=32, max_bytes=300_000)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def llama_trainer(config):
    """The small LLaMA, trained with AdamW and its loss averaged over tokens, under ``config``."""
    return raypipe.PipelineTrainer(llama_layers(MODEL), llama_loss, adamw, config, loss_count_fn=llama_count_tokens)


def datasets(data, num_micro_batches):
    """The train and validation readers of ``num_micro_batches`` micro-batches of 2 rows a step."""
    return tuple(TokenDataset(data, split, micro_batch_size=2, num_micro_batches=num_micro_batches)
                 for split in ("train", "validation"))


def fixed_config(transport):
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, transport=transport,
                                  clip_grad_norm=1.0)


def fit(trainer, data, steps=4):
    """``steps`` steps of ``fit`` from the dataset's start, evaluating every 2: the results, data position, state."""
    train, validation = datasets(data, MICRO_BATCHES)
    results = trainer.fit(train, steps, validation=validation, eval_every=2, progress=False)
    return results, train.state_dict(), trainer.state_dict()


# -- an elastic run that grows: two tests read it --------------------------------------------------------


@pytest.fixture(scope="module")
def grown(ray_cluster, data):
    """``fit`` on (1, 2) replicas of two stages (2 micro-batches each, 4 a step): started on one replica
    (a placement group holds the other's room), it grows once the room is freed, then trains two steps on
    both and evaluates: each step's result, the data position, the final state. (First in this module:
    the placement group takes every CPU but one replica's.)"""
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 1.0}] * 4)  # room for one replica of two stages
    ray_cluster.get(blocker.ready(), timeout=60)
    train, validation = datasets(data, 4)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2), clip_grad_norm=1.0)
    with llama_trainer(config) as trainer:
        results = trainer.fit(train, 2, progress=False)  # fit trains that many more steps
        remove_placement_group(blocker)
        results += grow(trainer, train)
        results += trainer.fit(train, 2, validation=validation, eval_every=2, progress=False)
        return results, train.state_dict(), trainer.state_dict()


def grow(trainer, train):
    """Steps of ``fit`` until the second replica joined (at a step boundary, once its workers are ready)."""
    import time

    results, deadline = [], time.monotonic() + 120
    while trainer.num_replicas < 2:
        assert time.monotonic() < deadline, "the second replica never joined"
        results += trainer.fit(train, 1, progress=False)
        time.sleep(1)  # the new replica's workers start while the run waits or steps
    return results


@pytest.fixture(scope="module")
def fixed(grown, data, tmp_path_factory):
    """The fixed runs the grown one is compared with: :func:`fit_on_one_then_two` as many steps on one
    replica and then on two as it ran, and the folder of its checkpoint of the step it grew at."""
    root = tmp_path_factory.mktemp("fixed")
    replicas = [r.num_replicas for r in grown[0]]
    return (*fit_on_one_then_two(data, root, replicas.count(1), replicas.count(2)), root)


def test_replicas_reading_their_own_data_train_as_one_pipeline(grown, fixed, data):
    # a step is 4 micro-batches of the dataset: one pipeline runs them all, or 2 replicas share them (each
    # replica's first stage reads its block's inputs, its last its targets; one stage reading both: the one
    # pipeline. Three replicas of one stage train over a real group in
    # tests/executor/test_data_parallel.py::test_a_sharded_checkpoint_loads_into_any_replicas_and_stages and,
    # as one process on the global batch, in-process there; replica_blocks: tests/core/test_micro_batches.py)
    # (the one pipeline runs through the step runner in one process, on the dataset's global batches: the
    # rows test_fit_reads_data_in_the_stages_and_executors_agree shows the stages read; its validation loss
    # in one plain process, with the weights it trained). The replicas: the elastic run's once it grew, the
    # one pipeline from the state it grew at (the fixed run's checkpoint of that step: every bit the run's)
    results, position, state = grown
    on_two = results[[r.num_replicas for r in results].index(2):]  # the steps once it grew
    one, one_eval, one_state = one_pipeline_on_global_batches(data, micro_batches=4, steps=len(on_two),
                                                              checkpoint=fixed[2])
    assert position["next_step"] == len(results) and [r.num_replicas for r in on_two] == [2] * len(on_two)
    assert on_two[0].num_tokens == 4 * 2 * 32  # both replicas' micro-batches
    assert [r.loss for r in on_two] == pytest.approx([r.loss for r in one], rel=1e-5)
    assert on_two[-1].eval_loss == pytest.approx(one_eval, rel=1e-5)  # every replica evaluates
    for key, value in one_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def one_pipeline_on_global_batches(data, micro_batches: int, steps: int, checkpoint=None):
    """What ``fit`` on one pipeline of one stage gives, from the newest checkpoint under ``checkpoint``
    (else from the start): each step's result, the validation loss after the last step, the final state."""
    train, validation = datasets(data, micro_batches)
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=micro_batches, clip_grad_norm=1.0)
    trainer = InterpretedTrainer(llama_layers(MODEL), llama_loss, adamw, config, loss_count_fn=llama_count_tokens)
    if checkpoint is not None:
        trainer.load_checkpoint(checkpoint)
    first = trainer.step_count
    results = [trainer.step(*train.global_batch(step)) for step in range(first, first + steps)]
    state = trainer.state_dict()
    model = torch.nn.Sequential(*[build_layer(spec, index, seed=0) for index, spec in enumerate(llama_layers(MODEL))])
    model.load_state_dict(state)
    inputs, targets = validation.global_batch(0)  # every row a whole sequence: the token mean is the batch's
    with torch.no_grad():
        return results, llama_loss(model(inputs), targets).item(), state


def test_an_elastic_fit_that_grows_reads_the_same_rows_as_a_fixed_one(grown, fixed):
    """Stages read their block of each step from the dataset, and the block moves when the run
    grows: every bit as a fixed run on one replica, resumed on two at the step the run grew (the
    step runner in one process: on Ray it computes the same bits)."""
    results, _, state = grown
    replicas = [r.num_replicas for r in results]
    assert replicas[:2] == [1, 1] and replicas[-2:] == [2, 2]
    # how many steps ran on one replica depends on how soon the new workers started
    fixed_results, fixed_state, _ = fixed
    assert [r.num_replicas for r in fixed_results] == replicas
    assert [r.loss for r in results] == [r.loss for r in fixed_results]
    assert_bitwise_equal(fixed_state, state)
    # replicated, the new replica copied a live one: every replica holds its stage's whole optimizer state
    alone = {report.stage: report.optimizer_bytes for report in results[0].stages}
    assert sorted((report.replica, report.stage, report.optimizer_bytes) for report in results[-1].stages) == [
        (replica, stage, alone[stage]) for replica in range(2) for stage in range(2)]


def fit_on_one_then_two(data, root, steps_on_one, steps_on_two):
    """``steps_on_one`` steps on one replica of 4 micro-batches, checkpointed, then loaded
    into two replicas of 2 that train ``steps_on_two`` more, in one process on the dataset's
    global batches: the results and final state."""
    train, _ = datasets(data, 4)
    results = []
    for num_replicas, steps in ((1, steps_on_one), (2, steps_on_two)):
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4 // num_replicas, num_replicas=num_replicas,
                                        clip_grad_norm=1.0)
        trainer = InterpretedTrainer(llama_layers(MODEL), llama_loss, adamw, config, loss_count_fn=llama_count_tokens)
        if results:
            trainer.load_checkpoint(root)
        results += [trainer.step(*train.global_batch(step)) for step in range(len(results), len(results) + steps)]
        if num_replicas == 1:
            trainer.save_checkpoint(root)
    return results, trainer.state_dict()


# -- the two executors; the default one's trainer trains on in the tests after ------------------------------


@pytest.fixture(scope="module")
def fitted(ray_cluster, data):
    """:func:`fit` on the default executor, from a fresh trainer: its results, data position and
    state; and the trainer, which the tests below train on from where the one before left it
    (each asserting nothing of the step it started at)."""
    with llama_trainer(fixed_config("p2p")) as trainer:
        yield fit(trainer, data), trainer


def test_fit_reads_data_in_the_stages_and_executors_agree(ray_cluster, data, fitted):
    with llama_trainer(fixed_config("object_store")) as trainer:
        tasks, position, state = fit(trainer, data)
    (p2p, p2p_position, p2p_state), _ = fitted
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


def test_fit_saving_every_step_returns_with_its_final_checkpoint_complete(fitted, data, tmp_path):
    """Checkpoints saved in the background every step: when fit returns, the newest is the
    final state (bitwise, with the data position) and keep_last pruned the older ones. (First,
    on the same trainer: a dataset of other micro-batches is refused, training nothing.)"""
    from raypipe.checkpoint.store import list_checkpoints, read_manifest

    _, trainer = fitted
    start = trainer.step_count
    train, _ = datasets(data, MICRO_BATCHES)
    with pytest.raises(ValueError, match=r"yields 2 micro-batches per step but a step of the pipeline has 3 "):
        trainer.fit(TokenDataset(data, micro_batch_size=2, num_micro_batches=2), 1, progress=False)
    assert trainer.step_count == start
    trainer.fit(train, 3, checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_last=2, progress=False)
    assert list_checkpoints(tmp_path) == [start + 2, start + 3]
    assert read_manifest(tmp_path, start + 3)["extra"]["dataset"]["next_step"] == 3
    final = trainer.state_dict()
    trainer.step_from_datasets(3, 6, 6 * 32)  # moves the weights on, then back to the final checkpoint
    trainer.load_checkpoint(tmp_path)
    assert trainer.step_count == start + 3
    assert all(torch.equal(value, final[key]) for key, value in trainer.state_dict().items())


def test_a_step_that_meets_a_changed_shard_names_it_and_checkpoints_the_steps_before(fitted, tmp_path):
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
    train, _ = datasets(data, MICRO_BATCHES)
    ends = np.cumsum([shard["num_rows"] for shard in train.shards])  # split-wide row after each shard's last
    first_read = {}  # shard -> the first step that reads one of its rows
    for step in range(train.steps_per_epoch):
        for row in np.concatenate([train.row_indices(step, micro_batch) for micro_batch in range(MICRO_BATCHES)]):
            first_read.setdefault(int(np.searchsorted(ends, row, side="right")), step)
    shard, failing_step = min(((s, step) for s, step in first_read.items() if step >= 2), key=lambda item: item[1])
    path = data / train.shards[shard]["file"]
    changed = bytearray(path.read_bytes())
    changed[len(changed) // 2] ^= 0xFF
    path.write_bytes(bytes(changed))

    _, trainer = fitted
    start = trainer.step_count
    with pytest.raises(raypipe.StageError, match=f"checksum mismatch for shard .*{path.name}"):
        trainer.fit(train, failing_step + 2, checkpoint_dir=str(tmp_path / "ckpt"), progress=False)
    assert trainer.step_count - start == train.next_step == failing_step  # the step changed nothing
    assert list_checkpoints(tmp_path / "ckpt") == [start + failing_step]
    assert read_manifest(tmp_path / "ckpt", start + failing_step)["extra"]["dataset"]["next_step"] == failing_step
    state = trainer.state_dict()
    trainer.step_from_datasets(0, 6, 6 * 32)  # moves the weights on, then back to the saved steps
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(value, state[key]) for key, value in trainer.state_dict().items())
