"""Model FLOPs utilization (MFU): each device's peak dense FLOP/s by precision, the
model's training FLOPs per token (``6 * N``), and the achieved share of the peak."""
from __future__ import annotations

import re

# Peak dense (no sparsity) bf16 tensor-core FLOP/s per device, from NVIDIA's
# datasheets (their headline figures are often "with sparsity", i.e. 2x these).
# Keys are matched as whole words of the device name, longest key first, so
# "H100 PCIe" wins over "H100", and "A10" does not match "A100" or "A10G".
PEAK_FLOPS_BY_DEVICE: dict[str, float] = {
    "B200": 2.25e15,
    "H200": 989e12,  # SXM
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "H100": 989e12,  # SXM (cuda name "NVIDIA H100 80GB HBM3")
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "A6000": 155e12,
}


# Peak FP32 FLOP/s per device (CUDA cores, no tensor cores), from the same datasheets: an fp32
# run's matmuls compute at this rate unless TF32 is enabled (torch leaves it off by default;
# a run that turns it on should set ``peak_flops_per_second`` to the card's TF32 figure).
PEAK_FP32_FLOPS_BY_DEVICE: dict[str, float] = {
    "B200": 75e12,  # HGX B200: 600 TFLOPS for 8
    "H200": 67e12,  # SXM
    "H200 NVL": 60e12,
    "GH200": 67e12,
    "H100": 67e12,  # SXM
    "H100 NVL": 60e12,
    "H100 PCIe": 51e12,
    "H800": 67e12,
    "A100": 19.5e12,
    "A800": 19.5e12,
    "L40S": 91.6e12,
    "L4": 30.3e12,
    "A10": 31.2e12,
    "A6000": 38.7e12,
}
# raypipe's precisions and the table of the peak their matmuls run at (fp16 and bf16 share
# the tensor cores' rate on every card above)
PEAK_TABLE_BY_PRECISION: dict[str, dict[str, float]] = {
    "bf16": PEAK_FLOPS_BY_DEVICE, "fp16": PEAK_FLOPS_BY_DEVICE, "fp32": PEAK_FP32_FLOPS_BY_DEVICE,
}


def _words(name: str) -> list[str]:
    return re.findall(r"[A-Z0-9]+", name.upper())


def peak_flops_for_device(name: str, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of a device name such as ``torch.cuda.get_device_name()`` at the
    matmul rate of ``precision`` ("bf16", "fp16": tensor cores; "fp32": CUDA cores), so that
    an fp32 run's MFU is not measured against the bf16 peak.

    Returns None when the device is not in the precision's table (then MFU
    is not reported unless the user configures a peak).
    """
    if precision not in PEAK_TABLE_BY_PRECISION:
        raise ValueError(f"peak_flops_for_device: precision must be one of {sorted(PEAK_TABLE_BY_PRECISION)}, "
                         f"got {precision!r}")
    table = PEAK_TABLE_BY_PRECISION[precision]
    words = _words(name)
    for key in sorted(table, key=lambda k: len(_words(k)), reverse=True):
        key_words = _words(key)
        for i in range(len(words) - len(key_words) + 1):
            if words[i : i + len(key_words)] == key_words:
                return table[key]
    return None


def model_flops_per_token(num_parameters: int) -> float:
    """Training FLOPs per token, approximated as ``6 * N``.

    2N for the forward matmuls plus 4N for backward (input and weight grads).
    It ignores attention's sequence-length term and activation-checkpoint
    recomputation: MFU counts the model's FLOPs, not the hardware's.
    """
    if num_parameters <= 0:
        raise ValueError(f"num_parameters must be positive, got {num_parameters!r}")
    return 6.0 * num_parameters


def mfu(
    num_parameters: int,
    tokens: int,
    seconds: float,
    peak_flops_per_device: float,
    num_devices: int,
) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the devices' peak FLOP/s."""
    for name, value in (
        ("tokens", tokens),
        ("seconds", seconds),
        ("peak_flops_per_device", peak_flops_per_device),
        ("num_devices", num_devices),
    ):
        if not value > 0:
            raise ValueError(f"mfu: {name} must be positive, got {value!r}")
    achieved = model_flops_per_token(num_parameters) * tokens / seconds
    return achieved / (peak_flops_per_device * num_devices)
