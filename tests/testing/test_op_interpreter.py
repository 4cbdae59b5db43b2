"""The lowered ops of every runnable schedule, run by the step runner over the in-memory channel
in one process (no Ray), train exactly as one plain PyTorch process does (issue 42, item 6);
the harness raises a worker's failure, and a schedule that cannot go on, instead of hanging."""
import copy
import math

import pytest
import torch
from torch import nn

import raypipe
from raypipe.core import ops
from raypipe.errors import StageError, StepAborted
from raypipe.testing.op_interpreter import OpInterpreter
from tests.reference import (adamw, assert_bitwise_equal, assert_parameters_match, make_mlp, random_batches,
                             reference_step)

BATCH, MICRO_BATCHES, STEPS, CLIP = 8, 4, 2, 0.1


MODES = [{"activation_checkpoint": "never"}, {"activation_checkpoint": "always"},
         {"activation_checkpoint": "except_last"},
         {"activation_checkpoint": "always", "activation_checkpoint_segments": 2}]


def assert_trains_as_one_process(pipeline: OpInterpreter, batches: list, count: int, clip: float | None) -> None:
    """Each step's decision against one process accumulating ``count`` micro-batches (loss and
    grad norm to rtol 1e-5, the global clip biting where there is one), then every parameter."""
    model = make_mlp()
    optimizer = adamw(model.parameters())
    for step, (x, y) in enumerate(batches):
        decision = pipeline.step(step, x, y)
        loss, norm = reference_step(model, optimizer, nn.functional.mse_loss, x, y, count, clip)
        assert not decision.skipped
        torch.testing.assert_close(decision.loss, loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(decision.grad_norm, norm, rtol=1e-5, atol=0)
        assert clip is None or norm > clip  # the global clip acted: the decision took every stage's gradients
    assert_parameters_match(pipeline.state_dict(), model.state_dict())


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: "-".join(map(str, mode.values())))
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_interpreted_schedule_trains_as_one_process(schedule, num_stages, mode):
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=MICRO_BATCHES, schedule=schedule,
                                    clip_grad_norm=CLIP, **mode)
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config)
    assert_trains_as_one_process(pipeline, random_batches(BATCH, STEPS), MICRO_BATCHES, CLIP)


def test_split_backward_runs_i_and_w_ops():
    """zb_h1 is interpreted as I and W ops (no B), every stage's W of a micro-batch after its I."""
    config = raypipe.PipelineConfig(num_stages=3, num_micro_batches=MICRO_BATCHES, schedule="zb_h1")
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config)
    pipeline.step(0, *random_batches(BATCH, 1)[0])
    for report in pipeline.reports:
        timeline = [(event.op, event.micro_batch) for event in report.events if event.op in ("B", "I", "W")]
        assert sorted(timeline) == sorted([(kind, mb) for kind in "IW" for mb in range(MICRO_BATCHES)])
        assert all(timeline.index(("I", mb)) < timeline.index(("W", mb)) for mb in range(MICRO_BATCHES))


def test_a_chunked_steps_timeline_names_each_ops_chunk():
    """Under zbv (two chunks a worker, in a V) every F, I and W event names the chunk it ran on,
    one of each per micro-batch and chunk, so the timeline can tell a V's halves apart."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES)
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config, schedule="zbv",
                             virtual_stages=2)
    pipeline.step(0, *random_batches(BATCH, 1)[0])
    for report in pipeline.reports:
        computed = sorted((event.op, event.chunk, event.micro_batch) for event in report.events
                          if event.op in ("F", "I", "W"))
        assert computed == sorted((op, chunk, mb) for op in "FIW" for chunk in (0, 1) for mb in range(MICRO_BATCHES))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zb_h1_gives_bitwise_the_results_of_1f1b_in_low_precision(precision):
    """zb_h1 is 1F1B with each B split into I and W, and every stage's W ops in 1F1B's B order:
    on the same layout the same gradients sum in the same order, so the same bits, skipped
    steps included (fp16: a loss scale that overflows skips the step on every stage)."""
    results = {}
    for schedule in ("1f1b", "zb_h1"):
        config = raypipe.PipelineConfig(num_stages=3, num_micro_batches=MICRO_BATCHES, schedule=schedule,
                                        precision=precision, clip_grad_norm=CLIP)
        pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config,
                                 loss_scale=1024.0 if precision == "fp16" else None)
        decisions = [pipeline.step(step, x, y) for step, (x, y) in enumerate(random_batches(BATCH, STEPS))]
        if precision == "fp16":
            pipeline.loss_scale = 2.0**120  # fp16 gradients overflow
            decisions.append(pipeline.step(STEPS, *random_batches(BATCH, 1, seed=5)[0]))
            assert decisions[-1].skip_reason == "overflow"
        assert not any(decision.skipped for decision in decisions[:STEPS])
        results[schedule] = decisions, pipeline.state_dict()
    assert repr(results["zb_h1"][0]) == repr(results["1f1b"][0])  # an overflow's norm is NaN
    assert_bitwise_equal(results["1f1b"][1], results["zb_h1"][1])


CHUNKED = [("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 2, 3, 4), ("interleaved_1f1b", 3, 2, 6),
           ("zbv", 2, 2, 4), ("zbv", 3, 2, 4), ("zbv", 3, 2, 3)]  # zbv p=3, m=3: its list-scheduled order


@pytest.mark.parametrize("num_replicas", [1, 2])
@pytest.mark.parametrize("mode", MODES, ids=lambda mode: "-".join(map(str, mode.values())))
@pytest.mark.parametrize("schedule, num_stages, virtual_stages, micro_batches", CHUNKED,
                         ids=lambda value: str(value))
def test_interpreted_chunks_train_as_one_process(schedule, num_stages, virtual_stages, micro_batches, mode,
                                                 num_replicas):
    """Several model chunks per worker (the interleaved schedules), each worker one StageWorker holding
    its v chunks as the executors' do: every chunk's gradients in the one decision, equal to one
    process; two replicas with ZeRO-1."""
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=micro_batches, clip_grad_norm=CLIP,
                                    num_replicas=num_replicas, shard_optimizer=num_replicas > 1, **mode)
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config, schedule=schedule,
                             virtual_stages=virtual_stages)
    assert len(pipeline.workers) == num_replicas * num_stages
    assert sorted(index for worker in pipeline.workers[:num_stages] for index in worker.layer_indices) == list(
        range(len(make_mlp())))
    count = micro_batches * num_replicas
    assert_trains_as_one_process(pipeline, random_batches(2 * count, STEPS), count, CLIP)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_chunked_schedules_give_bitwise_the_results_of_1f1b_on_their_virtual_stages(schedule, precision):
    """v chunks on each of p workers cut the model as 1F1B on p * v stages does, and each chunk sums its
    micro-batches' gradients in the same order: the same bits in low precision, an fp16 overflow's skip
    included."""
    results = {}
    for name, num_stages, virtual_stages in ((schedule, 2, 2), ("1f1b", 4, 1)):
        config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=MICRO_BATCHES,
                                        precision=precision, clip_grad_norm=CLIP)
        pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config,
                                 loss_scale=1024.0 if precision == "fp16" else None, schedule=name,
                                 virtual_stages=virtual_stages)
        decisions = [pipeline.step(step, x, y) for step, (x, y) in enumerate(random_batches(BATCH, STEPS))]
        if precision == "fp16":
            pipeline.loss_scale = 2.0**120
            decisions.append(pipeline.step(STEPS, *random_batches(BATCH, 1, seed=5)[0]))
            assert decisions[-1].skip_reason == "overflow"
        assert not any(decision.skipped for decision in decisions[:STEPS])
        results[name] = decisions, pipeline.state_dict()
    assert repr(results[schedule][0]) == repr(results["1f1b"][0])
    assert_bitwise_equal(results["1f1b"][1], results[schedule][1])


# (stages, micro-batches): fewer micro-batches than stages, as many, more; one stage alone and with
# accumulation; 3 and 4 split the batch of 10 unevenly; odd sums clip (tests/executor/test_equivalence.py
# runs a subset on each executor)
SIZES = [(1, 1), (1, 4), (2, 2), (2, 3), (3, 2), (3, 3), (3, 4)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("num_stages, micro_batches", SIZES)
def test_every_size_trains_as_one_process(num_stages, micro_batches, schedule):
    clip = 0.05 if (num_stages + micro_batches) % 2 else None
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=micro_batches, schedule=schedule,
                                    clip_grad_norm=clip)
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config)
    assert_trains_as_one_process(pipeline, random_batches(10, 3), micro_batches, clip)


# (replicas, stages, micro-batches per replica): a lone stage, fewer micro-batches than stages and more
# (the batch split unevenly), three replicas; m != 2 clips (tests/executor/test_data_parallel.py runs a
# subset on Ray)
REPLICA_CASES = [(2, 1, 2), (2, 2, 1), (2, 2, 3), (3, 2, 2)]


@pytest.mark.parametrize("shard_optimizer", [True, False], ids=["zero1", "replicated"])
@pytest.mark.parametrize("num_replicas, num_stages, micro_batches", REPLICA_CASES)
def test_replicas_train_as_one_process_on_the_global_batch(num_replicas, num_stages, micro_batches,
                                                           shard_optimizer):
    clip = 0.05 if micro_batches != 2 else None
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=micro_batches, clip_grad_norm=clip,
                                    num_replicas=num_replicas, shard_optimizer=shard_optimizer, schedule="1f1b")
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config)
    assert_trains_as_one_process(pipeline, random_batches(12, 3), num_replicas * micro_batches, clip)
    for replica in pipeline.replicas[1:]:  # every replica stepped alike
        for ours, theirs in zip(pipeline.replicas[0].workers, replica.workers):
            assert_bitwise_equal(ours.layers.state_dict(), theirs.layers.state_dict())


def _worker_states(pipeline: OpInterpreter) -> list:
    return [(copy.deepcopy(worker.layers.state_dict()), copy.deepcopy(worker.optimizer.state_dict()))
            for worker in pipeline.workers]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_nan_step_changes_nothing_in_any_precision(precision, clip):
    """A NaN in one input row: every worker skips the step (parameters and optimizer state bitwise
    as they were), and the next clean step is the uninterrupted run's (tests/executor/test_nonfinite.py
    runs a subset on Ray, with the trainer's ``nonfinite="raise"``)."""
    def run(poison: bool):
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3, precision=precision,
                                        clip_grad_norm=clip, schedule="1f1b")
        pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config,
                                 loss_scale=1024.0 if precision == "fp16" else None)
        (x1, y1), (x2, y2) = random_batches(6, 2)
        pipeline.step(0, x1, y1)  # the optimizer has state
        if poison:
            before = _worker_states(pipeline)
            bad = x2.clone()
            bad[2, 3] = math.nan  # a row of micro-batch 1
            decision = pipeline.step(1, bad, y2)
            assert (decision.skipped, decision.skip_reason) == (True, "nonfinite") and math.isnan(decision.loss)
            for (weights, state), (weights_after, state_after) in zip(before, _worker_states(pipeline)):
                assert_bitwise_equal(weights, weights_after)
                assert repr(state) == repr(state_after)
        return pipeline.step(2, x2, y2), pipeline.state_dict()

    (clean, state), (expected, expected_state) = run(True), run(False)
    assert not clean.skipped and clean.loss == expected.loss
    assert_bitwise_equal(expected_state, state)


class FailsWhenAsked(nn.Module):
    """The identity, until ``fail`` is set: then its forward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("asked to fail")
        return x


def test_a_failing_worker_releases_the_others_and_its_error_is_raised():
    """Replica 1's last stage fails in its forward while the other workers wait for it (its
    neighbour for a gradient, replica 0 in the gradient reduction): the step raises that
    worker's error, not a released worker's StepAborted, no thread hangs, and the next step
    runs as the uninterrupted run's does."""
    def pipeline_of():
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=2, shard_optimizer=True,
                                        schedule="1f1b")
        return OpInterpreter([*make_mlp(), FailsWhenAsked()], nn.functional.mse_loss, adamw, config)

    (x1, y1), (x2, y2) = random_batches(8, 2)
    pipeline, uninterrupted = pipeline_of(), pipeline_of()
    failing = pipeline.replicas[1].workers[1].layers[-1]
    failing.fail = True
    with pytest.raises(StageError) as raised:
        pipeline.step(0, x1, y1)
    assert not isinstance(raised.value, StepAborted)
    assert str(raised.value).startswith("replica 1, stage 1, op F, micro-batch 0: ValueError: asked to fail")
    failing.fail = False
    assert repr(pipeline.step(1, x2, y2)) == repr(uninterrupted.step(1, x2, y2))
    assert_bitwise_equal(pipeline.state_dict(), uninterrupted.state_dict())


def test_a_schedule_that_cannot_go_on_is_named_not_waited_for():
    """Stage 0 waits for a gradient before it sends anything, stage 1 for its first activation:
    neither can go on, and the error names what each waits for."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="gpipe")
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config)
    runner = pipeline.replicas[0].runners[0]
    early = ops.LoweredOp(ops.RECV_GRAD, 0, 1)
    assert early in runner.ops
    runner.ops = [early, *(op for op in runner.ops if op != early)]
    with pytest.raises(RuntimeError) as raised:
        pipeline.step(0, *random_batches(BATCH, 1)[0])
    assert str(raised.value) == (
        "the lowered schedule is stuck: no worker can go on (stage 0 at RECV_GRAD of micro-batch 0 (message key "
        f"{ops.message_key(0, 1, 2)}) from stage 1; stage 1 at RECV_ACT of micro-batch 0 (message key "
        f"{ops.message_key(0, 1, 2)}) from stage 0)")


def test_messages_between_two_workers_pair_in_issue_order():
    """Stage 0 leaves out its first send: stage 1's first receive takes the second micro-batch's
    activation, and says so."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="gpipe")
    pipeline = OpInterpreter(list(make_mlp()), nn.functional.mse_loss, adamw, config)
    runner = pipeline.replicas[0].runners[0]
    first_send = ops.LoweredOp(ops.SEND_ACT, 0, 1)
    assert first_send in runner.ops
    runner.ops = [op for op in runner.ops if op != first_send]
    with pytest.raises(RuntimeError, match=r"^stage 1: RECV_ACT of micro-batch 0 \(message key \d+\) from stage 0 "
                                           r"got the activation of message key \d+ instead \(the messages are "
                                           r"mis-paired\)"):
        pipeline.step(0, *random_batches(BATCH, 1)[0])


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("zbv", 2)])
def test_the_statistics_receives_are_posted_before_each_worker_first_waits_not_before_stage_0s_first_forward(
        monkeypatch, schedule, v):
    """The step runner asks its channel to post the statistics all-reduce's receives
    (``expect_statistics``) once a step, just before the worker's first op that waits for a
    peer: on stage 0 after its first forward (the first rank of a run posts one from every other
    worker, which would delay the forward every other stage waits for), on the others before
    their first op, which receives."""
    from raypipe.testing.memory_channel import MemoryChannel

    calls: list = []
    expect = MemoryChannel.expect_statistics

    def recording(channel, length):
        calls.append((channel.stage, length))
        return expect(channel, length)

    monkeypatch.setattr(MemoryChannel, "expect_statistics", recording)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4, schedule=schedule, virtual_stages=v)
    pipeline = OpInterpreter([nn.Linear(4, 4) for _ in range(4)], nn.functional.mse_loss,
                             lambda parameters: torch.optim.SGD(parameters, lr=0.1), config)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipeline.step(0, x, y)
    assert sorted(calls) == [(0, 3 * 2 * v), (1, 3 * 2 * v)]  # once a worker, three numbers a virtual stage
    for runner in pipeline.replicas[0].runners:
        posted_before = runner.ops[runner._statistics_posted_before]
        assert any(part.kind in ops.RECEIVES for part in posted_before.unbatched())
        assert not any(part.kind in ops.RECEIVES for op in runner.ops[:runner._statistics_posted_before]
                       for part in op.unbatched())
    assert pipeline.replicas[0].runners[0]._statistics_posted_before > 0  # stage 0 forwards first


def test_a_receive_an_exchange_leaves_to_the_op_that_uses_it_is_waited_for_and_timed_there(monkeypatch):
    """A channel whose exchanges leave each receive to the op that uses it (gloo's P2PChannel does:
    :class:`~raypipe.comm.step_messages.DeferredReceive`) trains bitwise as one whose exchanges wait for
    all, and the worker times each such receive where it waited for it: in interleaved 1F1B's steady
    state stage 1's exchange after B1.0 receives the activation of F0.5 and the gradient of B1.1, and
    that gradient is waited for after F0.5, not before it."""
    import functools

    from raypipe.comm.step_messages import DeferredReceive
    from raypipe.testing.memory_channel import MemoryChannel

    config = raypipe.PipelineConfig(num_stages=4, num_micro_batches=8, schedule="interleaved_1f1b", virtual_stages=2)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(8)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def trained() -> tuple:
        pipeline = OpInterpreter(copy.deepcopy(layers), nn.functional.mse_loss,
                                 lambda parameters: torch.optim.SGD(parameters, lr=0.1), config)
        decision = pipeline.step(0, x, y)
        events = {(event.op, event.chunk, event.micro_batch): event for event in pipeline.reports[1].events}
        return repr(decision), pipeline.state_dict(), events

    decision, state, waited = trained()
    exchange = MemoryChannel.exchange

    def deferring(channel, sends, receives, key_of, header_first=()):
        exchange(channel, sends, [], key_of)
        return [DeferredReceive(functools.partial(channel.recv_activation if part.kind == ops.RECV_ACT
                                                  else channel.recv_gradient, key_of(part), part.peer))
                for part in receives]

    monkeypatch.setattr(MemoryChannel, "exchange", deferring)
    deferred_decision, deferred_state, deferred = trained()
    assert deferred_decision == decision
    assert_bitwise_equal(deferred_state, state)
    assert waited[("recv", 1, 1)].end <= waited[("F", 0, 5)].start  # waited for in the exchange, before F0.5
    assert deferred[("F", 0, 5)].end <= deferred[("recv", 1, 1)].start <= deferred[("B", 1, 1)].start
