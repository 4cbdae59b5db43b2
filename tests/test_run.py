"""raypipe.run: the data side of a run config (the training itself: tests/deployment/test_jobs.py)."""
import torch

from raypipe.config import PipelineConfig
from raypipe.data import prepare
from raypipe.models.llama import get_config
from raypipe.run import RunConfig, _datasets
from tests.data.test_hf_tokenizer import stdlib_slice


def test_an_elastic_run_reads_the_global_batch_of_its_most_replicas(tmp_path):
    """(1, 2) replicas of 3 micro-batches read a step of 6, the rows a fixed 2-replica run reads, whatever runs."""
    prepare(tmp_path / "data", corpus=stdlib_slice(1), seq_len=16)
    run = RunConfig(data=str(tmp_path / "data"), prepare_if_missing=False, micro_batch_size=2, seq_len=16)
    model = get_config("tiny")

    def train_split(num_replicas):
        pipeline = PipelineConfig(num_stages=2, num_micro_batches=3, num_replicas=num_replicas)
        return _datasets(run, pipeline, model, 16)[1][0]

    fixed, elastic, from_yaml, one = (train_split(r) for r in (2, (1, 2), [1, 2], 1))
    assert (fixed.num_micro_batches, elastic.num_micro_batches, from_yaml.num_micro_batches) == (6, 6, 6)
    assert one.num_micro_batches == 3
    for step in (0, 1):
        assert torch.equal(elastic.global_batch(step)[0], fixed.global_batch(step)[0])
        assert torch.equal(from_yaml.global_batch(step)[1], fixed.global_batch(step)[1])


def test_a_run_trains_on_packed_documents_exactly_when_it_asks_to(tmp_path):
    import pytest

    model, pipeline = get_config("tiny"), PipelineConfig(num_stages=1, num_micro_batches=2)
    for pack in (False, True):
        prepare(tmp_path / str(pack), corpus=stdlib_slice(1), seq_len=16, pack=pack)
    for pack in (False, True):
        asked = RunConfig(data=str(tmp_path / str(pack)), pack=pack, prepare_if_missing=False, seq_len=16)
        assert _datasets(asked, pipeline, model, 16)[1][0].packed is pack
        other = RunConfig(data=str(tmp_path / str(not pack)), pack=pack, prepare_if_missing=False, seq_len=16)
        with pytest.raises(ValueError, match="prepare it with `raypipe prepare --pack`" if pack
                           else "set pack: true"):
            _datasets(other, pipeline, model, 16)
