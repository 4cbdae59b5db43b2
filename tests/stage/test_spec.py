"""A layout's worker specs carry their stages' lowered ops: the driver lowers each distinct
schedule once, and a worker that starts (or takes a new layout) lowers nothing."""
import pickle

import pytest
from torch import nn

from raypipe import PipelineConfig
from raypipe.control.elastic import replica_specs
from raypipe.core import lowering
from raypipe.core.schedule import PLACEMENT, make_schedule
from raypipe.stage import spec as spec_module
from raypipe.stage.spec import WorkerSpec


def stage_specs(config: PipelineConfig) -> list[WorkerSpec]:
    return [WorkerSpec(stage, config.num_stages, (nn.Identity(),), (stage,), config)
            for stage in range(config.num_stages)]


@pytest.mark.parametrize("schedule, micro_batches", [("interleaved_1f1b", 10), ("zbv", 8), ("zb_h1", 6),
                                                     ("1f1b", 6)])
def test_a_layouts_workers_get_their_stages_lowering_from_the_driver_and_lower_nothing(monkeypatch, schedule,
                                                                                      micro_batches):
    config = PipelineConfig(num_stages=4, num_micro_batches=micro_batches, schedule=schedule)
    # two replicas, then one after a shrink: m = 10 and 20 (interleaved: a multiple of p, and the flexible order)
    for replicas in (2, 1):
        specs = replica_specs(stage_specs(config), replicas, 2 * micro_batches)
        for spec in specs:
            m = len(spec.block)
            assert m == 2 * micro_batches // replicas
            assert list(spec.ops) == make_schedule(schedule, 4, m, config.virtual_stages)[spec.stage]
            lowered = lowering.lower(make_schedule(schedule, 4, m, config.virtual_stages), PLACEMENT[schedule])
            if config.virtual_stages == 1 and schedule != "zb_h1":  # one stage's ops lower alone
                lowered = [lowering.lower_stage(stage, list(ops), 4) for stage, ops in
                           enumerate(make_schedule(schedule, 4, m))]
            assert list(spec.lowered) == lowered[spec.stage]

        def no_lowering(*args, **kwargs):
            raise AssertionError("a worker lowered its schedule")

        # what a worker does with the spec Ray brought it: nothing lowered, nothing built
        with monkeypatch.context() as patched:
            patched.setattr(lowering, "lower", no_lowering)
            patched.setattr(lowering, "lower_stage", no_lowering)
            patched.setattr(spec_module, "make_schedule", no_lowering)
            patched.setattr(spec_module, "_lowered_schedule", no_lowering)
            for spec in specs:
                shipped = pickle.loads(pickle.dumps(spec))
                assert shipped.lowered_ops() == list(spec.lowered)


def test_a_spec_without_its_lowering_is_lowered_where_it_is_asked_and_checked_against_the_schedule():
    config = PipelineConfig(num_stages=3, num_micro_batches=6, schedule="interleaved_1f1b")
    schedule = make_schedule("interleaved_1f1b", 3, 6, 2)
    for stage in range(3):
        spec = WorkerSpec(stage, 3, (nn.Identity(),), (stage,), config, ops=tuple(schedule[stage]))
        assert spec.lowered_ops() == lowering.lower(schedule, PLACEMENT["interleaved_1f1b"])[stage]
    other = WorkerSpec(0, 3, (nn.Identity(),), (0,), config, ops=tuple(schedule[1]))
    with pytest.raises(ValueError, match="stage 0: its ops are not those of schedule 'interleaved_1f1b'"):
        other.lowered_ops()


def test_a_stages_tensor_parallel_ranks_share_one_layout_of_it(monkeypatch):
    config = PipelineConfig(num_stages=2, num_micro_batches=4, schedule="zbv", tensor_parallel=2)
    laid_out = []
    original = WorkerSpec.for_layout

    def counted(spec, *args, **kwargs):
        laid_out.append((spec.stage, *args[:1]))
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(WorkerSpec, "for_layout", counted)
    specs = replica_specs(stage_specs(config), 2, 8)
    assert sorted(laid_out) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # once per (stage, replica), not per rank
    assert [(spec.replica, spec.stage, spec.tp_rank) for spec in specs] == [
        (replica, stage, rank) for replica in range(2) for stage in range(2) for rank in range(2)]
    for first, second in zip(specs[::2], specs[1::2]):
        assert second.lowered is first.lowered and first.lowered
