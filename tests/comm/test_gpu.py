"""GPU paths: p2p over NCCL, Ray Direct Transport over NCCL, pinned-memory offload, bf16 on CUDA.

Marked ``gpu``: deselected where CUDA is absent (see conftest), run where it exists; those
also marked ``gpus2`` need two GPUs on the node and are deselected (counted in a closing line) on one.
Their CPU fallbacks run everywhere: the gloo transport (tests/test_trainer_errors.py) and
object-store offload (tests/stage/test_recompute.py).
"""
import pytest
import torch
from torch import nn

import raypipe
import raypipe.core.schedule
from raypipe.comm.direct import DirectTransport
from raypipe.executor import make_executor
from raypipe.executor.per_op import PerOpExecutor
from raypipe.runtime.actor_classes import direct_transport_worker
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker


def test_nccl_worker_sends_only_activations_and_gradients_by_nccl():
    # Runs without a GPU: the NCCL actor class is built exactly as on a GPU cluster.
    # Only forward/backward results may go by NCCL: grad stats and the optimizer step
    # must stay plain objects, because every stage's apply depends on them.
    config = raypipe.PipelineConfig(num_stages=2, transport="nccl")
    executor = make_executor(config, raypipe.core.schedule.make_schedule("gpipe", 2, 1))
    assert isinstance(executor, PerOpExecutor) and isinstance(executor.transport, DirectTransport)
    routes = executor.actor_class().__ray_metadata__.method_meta.method_name_to_tensor_transport
    # a split backward's I returns what B returns (the input gradient); W returns nothing
    assert routes == {"forward": "NCCL", "backward": "NCCL", "backward_input": "NCCL"}


def test_nccl_worker_computes_what_a_plain_stage_worker_computes():
    # The NCCL worker's own code (its forward/backward overrides), run in-process on the CPU.
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=1)
    results = []
    for worker_class in (StageWorker, direct_transport_worker(StageWorker, "nccl")):
        torch.manual_seed(0)
        worker = worker_class(WorkerSpec(0, 1, (nn.Linear(4, 3),), (0,), config, loss_fn=nn.functional.mse_loss))
        loss = worker.forward(0, torch.ones(2, 4), torch.zeros(2, 3), 1.0, 0)
        worker.backward(0, None, 1.0)
        results.append((loss, worker.finish_backward()))
    assert results[0] == results[1] and results[0][1][0] > 0


def _train(config, steps=3, make_layers=None, batch=None):
    torch.manual_seed(0)
    if make_layers is None:
        layers = [nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 8)]
    else:
        layers = make_layers()
    x, y = batch if batch is not None else (torch.randn(32, 64), torch.randn(32, 8))
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                 config) as trainer:
        losses = [trainer.step(x, y).loss for _ in range(steps)]
        return losses, trainer.state_dict()


def _assert_same_run(run, reference, rel=1e-6):
    assert run[0] == pytest.approx(reference[0], rel=rel)
    for key, value in reference[1].items():
        torch.testing.assert_close(run[1][key], value)


# transport="p2p" on GPUs sends activations and gradients stage to stage over NCCL; transport="nccl" is
# Ray Direct Transport, a task per op whose tensor results go by NCCL
@pytest.mark.gpu
@pytest.mark.gpus2
@pytest.mark.parametrize("transport", ["p2p", "nccl"])
def test_nccl_transports_match_object_store_on_gpus(ray_cluster, transport):
    base = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4, use_gpu=True)
    reference = _train(base.replace(transport="object_store"))
    _assert_same_run(_train(base.replace(transport=transport)), reference)


@pytest.mark.gpu
@pytest.mark.gpus2
def test_1f1b_at_two_stages_moves_64_mb_activations_over_nccl(ray_cluster):
    # Messages far beyond NCCL's internal buffering: at p=2 an order in which both stages send
    # before they receive waits forever on NCCL (the tiny tensors of the other tests hide it).
    # A short p2p timeout turns such a deadlock into a failure instead of a hang.
    width, rows = 4096, 4096  # one micro-batch's activation: 4096 x 4096 fp32 = 64 MiB
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(2 * rows, width, generator=generator), torch.randn(2 * rows, 8, generator=generator))

    def layers():
        return [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 8)]

    base = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="1f1b", use_gpu=True,
                                  snapshot_every=0, balance=[2, 2])
    reference = _train(base.replace(transport="object_store"), steps=2, make_layers=layers, batch=batch)
    _assert_same_run(_train(base.replace(transport="p2p", p2p_timeout_s=60.0), steps=2, make_layers=layers,
                            batch=batch), reference, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.gpus2
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_chunked_schedules_move_64_mb_activations_over_nccl(ray_cluster, schedule):
    # Two chunks on each GPU, activations far beyond NCCL's buffering: interleaved sends from the last
    # worker back to the first, zbv has both ends on worker 0, so each worker's exchanges send on before
    # they receive. The payloads whose headers the lowering awaits first are received in the exchange's
    # batch; received after it, the ring would wait forever (a short p2p timeout makes that a failure).
    # Against one chunk per worker on the object store: the same sums (two micro-batches add alike in
    # any order), so the same run within rounding.
    width, rows = 4096, 4096  # one micro-batch's activation: 4096 x 4096 fp32 = 64 MiB
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(2 * rows, width, generator=generator), torch.randn(2 * rows, 8, generator=generator))

    def layers():
        return [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 8)]

    reference = _train(raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="1f1b", use_gpu=True,
                                              snapshot_every=0, balance=[2, 2], transport="object_store"),
                       steps=2, make_layers=layers, batch=batch)
    chunked = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule=schedule, virtual_stages=2,
                                     use_gpu=True, snapshot_every=0, balance=[1, 1, 1, 1], p2p_timeout_s=60.0)
    _assert_same_run(_train(chunked, steps=2, make_layers=layers, batch=batch), reference, rel=1e-5)


@pytest.mark.gpu
def test_pinned_memory_offload_matches_no_offload_on_gpu(ray_cluster):
    base = raypipe.PipelineConfig(num_stages=1, num_micro_batches=4, use_gpu=True, activation_checkpoint="always")
    plain = _train(base)
    offloaded = _train(base.replace(offload_activations=True))
    assert offloaded[0] == pytest.approx(plain[0], rel=1e-6)
    for key, value in plain[1].items():
        torch.testing.assert_close(offloaded[1][key], value)


@pytest.mark.gpu
@pytest.mark.gpus2
def test_zero1_over_nccl_changes_no_bit_of_a_bf16_run(ray_cluster):
    # two replicas of one stage, one GPU each: their gradients reduce-scattered and their bf16
    # compute weights all-gathered over NCCL, against the same run all-reducing (every bit the same at d=2)
    base = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2, num_replicas=2, precision="bf16", use_gpu=True)
    replicated = _train(base)
    sharded = _train(base.replace(shard_optimizer=True))
    assert sharded[0] == replicated[0]
    for key, value in replicated[1].items():
        assert torch.equal(sharded[1][key], value), key
