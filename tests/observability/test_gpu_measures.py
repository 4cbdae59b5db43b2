"""MFU against the peak of the precision in use, and the reserved-memory gauge."""
import pytest

from raypipe.config import PRECISIONS
from raypipe.core.result import StageStats
from raypipe.observability.metrics import _memory_family
from raypipe.observability.mfu import (
    PEAK_FLOPS_BY_DEVICE,
    PEAK_FP32_FLOPS_BY_DEVICE,
    peak_flops_for_device,
)
from raypipe.stage.measure import device_memory_bytes


@pytest.mark.parametrize(("device_name", "precision", "expected"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 80GB HBM3", "fp16", 989e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 67e12),  # not the bf16 peak: an fp32 run's MFU was ~15x too low
    ("NVIDIA H100 PCIe", "fp32", 51e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA A10G", "fp32", None),
])
def test_peak_follows_the_precision(device_name, precision, expected):
    assert peak_flops_for_device(device_name, precision) == expected


def test_every_precision_has_a_peak_table_with_every_device():
    assert set(PEAK_FP32_FLOPS_BY_DEVICE) == set(PEAK_FLOPS_BY_DEVICE)
    for precision in PRECISIONS:
        assert peak_flops_for_device("NVIDIA H200", precision) is not None
    for name in PEAK_FP32_FLOPS_BY_DEVICE:  # fp32 is slower than the tensor cores on every card
        assert peak_flops_for_device(name, "fp32") < peak_flops_for_device(name, "bf16")


def test_an_unknown_precision_is_named():
    with pytest.raises(ValueError, match=r"^peak_flops_for_device: precision must be one of"):
        peak_flops_for_device("NVIDIA H100", "tf16")


def test_a_cpu_stage_reports_no_device_memory():
    import torch

    assert device_memory_bytes(torch.device("cpu")) == {
        "device_allocated_bytes": None, "device_peak_bytes": None, "device_reserved_bytes": None}


def _memory(stats):
    return {(sample.labels["stage"], sample.labels["kind"]): sample.value for sample in _memory_family(stats).samples}


def test_reserved_memory_is_a_memory_kind_when_reported():
    stats = StageStats(stage=0, device_allocated_bytes=7000, device_peak_bytes=9000, rss_bytes=1)
    stats.device_reserved_bytes = 12000  # the field a CUDA worker fills (see measure.device_memory_bytes)
    memory = _memory([stats])
    assert memory[("0", "device_reserved")] == 12000 and memory[("0", "device_allocated")] == 7000
    assert ("0", "device_reserved") not in _memory([StageStats(stage=0, rss_bytes=1)])  # CPU: absent, not 0


@pytest.mark.gpu
def test_a_gpu_stage_reports_reserved_at_least_allocated():
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(1 << 20, device=device)
    memory = device_memory_bytes(device)
    assert memory["device_reserved_bytes"] >= memory["device_allocated_bytes"] >= held.numel() * 4
    del held
