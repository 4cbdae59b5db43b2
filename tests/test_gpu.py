"""GPU paths: NCCL direct transport, pinned-memory offload, bf16 on CUDA.

Marked ``gpu``: deselected where CUDA is absent (see conftest), run where it exists.
Their CPU fallbacks run everywhere: the gloo transport (tests/test_trainer_errors.py) and
object-store offload (tests/test_recompute.py).
"""
import pytest
import torch
from torch import nn

import raypipe
from raypipe.transport import CollectiveTransport, make_transport


def test_nccl_transport_is_selectable_without_a_gpu():
    transport = make_transport("nccl")
    assert isinstance(transport, CollectiveTransport) and transport.name == "nccl"
    actor_class = transport.actor_class()  # builds the RDT-decorated actor class
    assert actor_class is not None
    with pytest.raises(ValueError, match="unknown transport"):
        make_transport("infiniband")


def _train(config, steps=3):
    torch.manual_seed(0)
    layers = [nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 8)]
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                 config) as trainer:
        losses = [trainer.step(x, y).loss for _ in range(steps)]
        return losses, trainer.state_dict()


@pytest.mark.gpu
def test_nccl_transport_matches_object_store_on_gpus(ray_cluster):
    if torch.cuda.device_count() < 2:
        pytest.fail("the NCCL transport test needs 2 GPUs on this node")
    base = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4, use_gpu=True)
    reference = _train(base)
    nccl = _train(base.replace(transport="nccl"))
    assert nccl[0] == pytest.approx(reference[0], rel=1e-6)
    for key, value in reference[1].items():
        torch.testing.assert_close(nccl[1][key], value)


@pytest.mark.gpu
def test_pinned_memory_offload_matches_no_offload_on_gpu(ray_cluster):
    base = raypipe.PipelineConfig(num_stages=1, num_micro_batches=4, use_gpu=True, checkpoint="always")
    plain = _train(base)
    offloaded = _train(base.replace(offload=True))
    assert offloaded[0] == pytest.approx(plain[0], rel=1e-6)
    for key, value in plain[1].items():
        torch.testing.assert_close(offloaded[1][key], value)
