"""A reading stage's view of the dataset: whole steps, the next one read in the background."""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import torch

from raypipe.core.micro_batches import loss_weights
from raypipe.data import TokenDataset, prepare
from raypipe.stage.data_reader import StageData
from tests.data.test_data import write_corpus

MICRO_BATCHES = 4


def count_divisible_by_three(targets: torch.Tensor) -> int:
    """A loss count that differs between micro-batches, so a weight needs every micro-batch's count."""
    return int((targets % 3 == 0).sum())


@pytest.fixture
def dataset(tmp_path) -> Path:
    """Many small shards, so consecutive steps load different ones."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus, documents=60)
    return prepare(tmp_path / "data", corpus=corpus, seq_len=16, val_fraction=0.1, rows_per_shard=4)


def open_split(path: Path, split: str = "train") -> TokenDataset:
    return TokenDataset(path, split=split, micro_batch_size=1, num_micro_batches=MICRO_BATCHES, seed=3)


def stage_data(path: Path, reads_inputs: bool, reads_targets: bool, block: range, read_ahead: bool) -> StageData:
    data = StageData(count_divisible_by_three, block, reads_inputs, reads_targets, read_ahead)
    data.attach(open_split(path), open_split(path, "validation"))
    return data


def wait_for_read_ahead(data: StageData) -> None:
    _, pending = concurrent.futures.wait(list(data._ahead.values()), timeout=30)  # woken when they finish
    assert not pending, "the read-ahead did not finish"


def shards_of(reader: TokenDataset, step: int, block: range) -> set[int]:
    rows = np.concatenate([reader.row_indices(step, index) for index in block])
    return set((np.searchsorted(reader._offsets, rows, side="right") - 1).tolist())


@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("reads_inputs, reads_targets, block", [
    (True, False, range(2, 4)),  # first stage of replica 1 of 2
    (False, True, range(0, 2)),  # last stage of replica 0 of 2
    (True, True, range(0, 4)),  # a one-stage pipeline
])
def test_a_stage_reads_what_the_dataset_holds_for_its_block(dataset, read_ahead, reads_inputs, reads_targets, block):
    data = stage_data(dataset, reads_inputs, reads_targets, block, read_ahead)
    reference = {split: open_split(dataset, split) for split in ("train", "validation")}
    # training steps in order, an evaluation between them, and a step run again (a replay after a failure)
    for split, step in [("train", 0), ("train", 1), ("validation", 0), ("train", 2), ("train", 1), ("train", 3)]:
        expected = [reference[split].get(step, index) for index in range(MICRO_BATCHES)]
        weights = loss_weights([count_divisible_by_three(targets) for _, targets in expected])
        for position, index in enumerate(block):
            if reads_inputs:
                assert torch.equal(data.inputs(step, position, split), expected[index][0])
            if reads_targets:
                targets, weight = data.targets_and_weight(step, position, split)
                assert torch.equal(targets, expected[index][1]) and weight == weights[index]


def test_the_next_step_is_read_while_this_one_runs_and_its_failure_waits_for_its_step(dataset, tmp_path,
                                                                                        monkeypatch):
    block = range(0, 2)
    reference = open_split(dataset)
    expected = {step: [reference.get(step, index)[0] for index in block] for step in (1, 2)}
    assert shards_of(reference, 2, block) - shards_of(reference, 0, block) - shards_of(reference, 1, block), \
        "the fixture must make step 2 need a shard that steps 0 and 1 do not"
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))  # the stage decodes its shards itself
    data = stage_data(dataset, True, False, block, read_ahead=True)

    data.inputs(0, 0, "train")
    wait_for_read_ahead(data)
    for shard in Path(dataset).glob("train-*.parquet"):
        shard.unlink()
    # step 1 was read before its files went; reading it starts step 2's read, which fails in the background
    assert all(torch.equal(data.inputs(1, position, "train"), expected[1][position]) for position in range(2))
    wait_for_read_ahead(data)
    with pytest.raises(OSError, match=r"train-\d+\.parquet"):
        data.inputs(2, 0, "train")


def test_without_a_dataset_the_error_names_the_split(dataset):
    data = StageData(None, range(1), reads_inputs=True, reads_targets=False)
    with pytest.raises(RuntimeError, match="no train dataset attached to this stage"):
        data.inputs(0, 0, "train")
