"""MetricsExporter over real HTTP (no Ray), and the MFU helpers (observability.mfu)."""
from __future__ import annotations

import errno
import ipaddress
import math
import re
import socket
import urllib.error
import urllib.request


import pytest
from prometheus_client.parser import text_string_to_metric_families

from raypipe.observability.metrics import METRIC_NAMES, MetricsExporter
from raypipe.observability.mfu import (
    PEAK_FLOPS_BY_DEVICE,
    mfu,
    model_flops_per_token,
    peak_flops_for_device,
)
from raypipe.core.result import StageStats, StepResult


def known_step(**overrides) -> StepResult:
    """A hand-made two-stage step; stage 1 reports CUDA memory, stage 0 does not."""
    fields = dict(
        step=7, loss=2.5, grad_norm=4.0, step_time=0.25, clip_coefficient=0.5,
        skipped=False, loss_scale=None, num_samples=8, num_tokens=1024,
        tokens_per_second=4096.0, mfu=0.125,
        stages=[
            StageStats(stage=0, busy_seconds=0.2, held_for_backward_bytes=1000, offloaded_bytes=0,
                       rss_bytes=5_000_000),
            StageStats(stage=1, busy_seconds=0.15, held_for_backward_bytes=2000, offloaded_bytes=300,
                       device_allocated_bytes=7000, device_peak_bytes=9000, rss_bytes=6_000_000),
        ],
        bubble_fraction=[0.2, 0.4],
    )
    fields.update(overrides)
    return StepResult(**fields)


def scrape(exporter: MetricsExporter) -> dict:
    """Scrape over HTTP and parse: {sample name: {frozenset(labels): value}}, plus help texts."""
    with urllib.request.urlopen(exporter.url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, dict[frozenset, float]] = {}
    helps: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
            helps[sample.name] = family.documentation
    return {"samples": samples, "help": helps}


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped["samples"][name][frozenset(labels.items())]


@pytest.fixture
def exporter():
    with MetricsExporter() as exporter:
        yield exporter


def test_counters_start_at_zero_and_unknown_gauges_are_absent(exporter):
    scraped = scrape(exporter)
    labelled = ("raypipe_skipped_steps_total", "raypipe_restarts_total", "raypipe_resizes_total")
    assert {name: value(scraped, name) for name in scraped["samples"] if name not in labelled} == {
        "raypipe_steps_total": 0.0, "raypipe_replayed_steps_total": 0.0, "raypipe_recovery_seconds": 0.0,
    }
    assert scraped["samples"]["raypipe_restarts_total"] == {
        frozenset({"reason": reason}.items()): 0.0 for reason in ("died", "hung", "unreachable")}
    assert scraped["samples"]["raypipe_skipped_steps_total"] == {
        frozenset({"reason": "overflow"}.items()): 0.0, frozenset({"reason": "nonfinite"}.items()): 0.0}
    # every direction from the start, so increase() has a series before the first resize
    assert scraped["samples"]["raypipe_resizes_total"] == {
        frozenset({"direction": direction}.items()): 0.0 for direction in ("shrink", "grow", "repartition", "restore")}


def test_step_values_labels_and_help(exporter):
    exporter.record_step(known_step())
    exporter.record_eval(2.75)
    exporter.record_recovery(["died"], 3.5, 0)
    exporter.record_controller_state("running", ("starting", "running"))
    exporter.record_slowdowns({(0, 0, 0): 1.0, (0, 1, 0): 2.5})
    scraped = scrape(exporter)

    assert set(scraped["samples"]) == METRIC_NAMES  # every name the module lists, and none it does not
    for name in METRIC_NAMES:
        assert scraped["help"][name].strip(), f"{name} has no help text"
    assert value(scraped, "raypipe_loss") == 2.5
    assert value(scraped, "raypipe_eval_loss") == 2.75
    assert value(scraped, "raypipe_grad_norm") == 4.0
    assert value(scraped, "raypipe_clip_coefficient") == 0.5
    assert value(scraped, "raypipe_step_seconds") == 0.25
    assert value(scraped, "raypipe_tokens_per_second") == 4096.0
    assert value(scraped, "raypipe_mfu") == 0.125
    assert value(scraped, "raypipe_loss_scale") == 1.0  # no scaling: the scale in effect is 1
    assert value(scraped, "raypipe_steps_total") == 1.0
    assert value(scraped, "raypipe_skipped_steps_total", reason="overflow") == 0.0
    assert value(scraped, "raypipe_replicas") == 1.0  # StepResult's default: one replica ran it

    assert scraped["samples"]["raypipe_bubble_fraction"] == {
        frozenset({"stage": "0", "replica": "0", "tp_rank": "0"}.items()): 0.2,
        frozenset({"stage": "1", "replica": "0", "tp_rank": "0"}.items()): 0.4,
    }
    assert scraped["samples"]["raypipe_worker_slowdown"] == {
        frozenset({"stage": "0", "replica": "0", "tp_rank": "0"}.items()): 1.0,
        frozenset({"stage": "1", "replica": "0", "tp_rank": "0"}.items()): 2.5,
    }
    assert scraped["samples"]["raypipe_stage_busy_seconds"] == {
        frozenset({"stage": "0", "replica": "0", "tp_rank": "0"}.items()): 0.2,
        frozenset({"stage": "1", "replica": "0", "tp_rank": "0"}.items()): 0.15,
    }
    memory = {
        (dict(labels)["stage"], dict(labels)["kind"]): v
        for labels, v in scraped["samples"]["raypipe_stage_memory_bytes"].items()
    }
    # Stage 0's CUDA fields are None: not exported rather than exported as 0.
    assert memory == {
        ("0", "held_for_backward"): 1000, ("0", "offloaded"): 0, ("0", "rss"): 5_000_000,
        ("1", "held_for_backward"): 2000, ("1", "offloaded"): 300, ("1", "rss"): 6_000_000,
        ("1", "device_allocated"): 7000, ("1", "device_peak"): 9000,
    }


def test_latest_step_wins_and_counters_accumulate(exporter):
    exporter.record_step(known_step())
    exporter.record_step(known_step(step=8, loss=1.5, skipped=True, skip_reason="overflow", loss_scale=32768.0,
                                    mfu=None, stages=known_step().stages[:1], bubble_fraction=[0.3]))
    exporter.record_step(known_step(step=9, loss=float("nan"), skipped=True, skip_reason="nonfinite", mfu=None,
                                    stages=known_step().stages[:1], bubble_fraction=[0.3]))
    exporter.record_recovery(["died"], 4.0, 0)
    exporter.record_recovery(["died", "hung"], 2.5, 3)
    scraped = scrape(exporter)
    assert math.isnan(value(scraped, "raypipe_loss"))
    assert value(scraped, "raypipe_loss_scale") == 1.0
    assert value(scraped, "raypipe_steps_total") == 3.0
    assert value(scraped, "raypipe_skipped_steps_total", reason="overflow") == 1.0
    assert value(scraped, "raypipe_skipped_steps_total", reason="nonfinite") == 1.0
    assert value(scraped, "raypipe_restarts_total", reason="died") == 2.0
    assert value(scraped, "raypipe_restarts_total", reason="hung") == 1.0
    assert value(scraped, "raypipe_restarts_total", reason="unreachable") == 0.0
    assert value(scraped, "raypipe_replayed_steps_total") == 3.0
    assert value(scraped, "raypipe_recovery_seconds") == 2.5  # the latest recovery
    assert "raypipe_mfu" not in scraped["samples"]  # unknown peak: no MFU rather than 0
    assert "raypipe_eval_loss" not in scraped["samples"]  # no evaluation yet
    # A stage that no longer exists (e.g. after a resize) is no longer reported.
    assert scraped["samples"]["raypipe_bubble_fraction"] == {
        frozenset({"stage": "0", "replica": "0", "tp_rank": "0"}.items()): 0.3}


def test_counters_are_exposed_as_counters(exporter):
    exporter.record_step(known_step())
    with urllib.request.urlopen(exporter.url, timeout=5) as response:
        types = {family.name: family.type for family in text_string_to_metric_families(response.read().decode())}
    assert types["raypipe_steps"] == "counter"
    assert types["raypipe_skipped_steps"] == "counter"
    assert types["raypipe_restarts"] == "counter"
    assert types["raypipe_resizes"] == "counter"
    assert types["raypipe_replicas"] == "gauge"


def test_replicas_follow_steps_and_resizes(exporter):
    """An elastic run of (1, 2): starts at 2, a lost node shrinks it to 1, a new one grows it back."""
    exporter.record_step(known_step(step=0, num_replicas=2))
    assert value(scrape(exporter), "raypipe_replicas") == 2.0
    exporter.record_resize("shrink", 1)
    scraped = scrape(exporter)  # between the resize and the next step: the resize's count
    assert value(scraped, "raypipe_replicas") == 1.0
    assert (value(scraped, "raypipe_resizes_total", direction="shrink"),
            value(scraped, "raypipe_resizes_total", direction="grow")) == (1.0, 0.0)
    exporter.record_step(known_step(step=1, num_replicas=1))
    exporter.record_resize("grow", 2)
    exporter.record_step(known_step(step=2, num_replicas=2))
    exporter.record_resize("shrink", 1)
    scraped = scrape(exporter)
    assert value(scraped, "raypipe_replicas") == 1.0
    assert (value(scraped, "raypipe_resizes_total", direction="shrink"),
            value(scraped, "raypipe_resizes_total", direction="grow")) == (2.0, 1.0)
    exporter.record_step(known_step(step=3, num_replicas=1))
    assert value(scrape(exporter), "raypipe_steps_total") == 4.0  # a resize is not a step


@pytest.mark.parametrize(("direction", "num_replicas", "message"), [
    ("up", 2, "resize direction must be one of ('shrink', 'grow', 'repartition', 'restore'), got 'up'"),
    ("Shrink", 1, "got 'Shrink'"),
    ("grow", 0, "replicas after a resize must be an int >= 1, got 0"),
    ("grow", 2.0, "got 2.0"),
])
def test_bad_resize_is_rejected_and_counts_nothing(exporter, direction, num_replicas, message):
    exporter.record_step(known_step(num_replicas=2))
    with pytest.raises(ValueError, match=re.escape(message)):
        exporter.record_resize(direction, num_replicas)
    scraped = scrape(exporter)
    assert value(scraped, "raypipe_replicas") == 2.0
    assert set(scraped["samples"]["raypipe_resizes_total"].values()) == {0.0}


def test_two_exporters_in_one_process_are_independent():
    with MetricsExporter() as first, MetricsExporter() as second:
        first.record_step(known_step(loss=1.0))
        second.record_step(known_step(loss=9.0))
        second.record_step(known_step(loss=8.0))
        assert first.port != second.port
        assert value(scrape(first), "raypipe_loss") == 1.0
        assert value(scrape(first), "raypipe_steps_total") == 1.0
        assert value(scrape(second), "raypipe_loss") == 8.0
        assert value(scrape(second), "raypipe_steps_total") == 2.0


def test_binds_loopback_by_default_and_url_names_the_port(exporter):
    host, port = exporter.address
    assert ipaddress.ip_address(host).is_loopback
    assert port > 0 and exporter.port == port
    assert exporter.url == f"http://127.0.0.1:{port}/metrics"
    other_address = _non_loopback_address()
    if other_address is not None:  # reachable on loopback only, not on the machine's other address
        with pytest.raises(OSError):
            socket.create_connection((other_address, port), timeout=2).close()


def _non_loopback_address() -> str | None:
    """This machine's outward-facing IPv4 address, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects a route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_close_frees_the_port():
    exporter = MetricsExporter()
    port = exporter.port
    scrape(exporter)
    exporter.close()
    exporter.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with MetricsExporter(port=port) as again:
        assert again.port == port
        assert value(scrape(again), "raypipe_steps_total") == 0.0


def test_busy_port_is_a_clear_error(exporter):
    with pytest.raises(OSError, match=f"127.0.0.1:{exporter.port}") as caught:
        MetricsExporter(port=exporter.port)
    assert caught.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("port", [-1, 65536, "9100"])
def test_bad_port_is_rejected(port):
    with pytest.raises(ValueError, match="metrics port"):
        MetricsExporter(port=port)


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA A10G", None),  # not "A10": whole words only
        ("Tesla T4", None),
        ("cpu", None),
    ],
)
def test_peak_flops_for_device(device_name, expected):
    assert peak_flops_for_device(device_name) == expected


def test_every_table_entry_is_found_by_its_own_name():
    for name, flops in PEAK_FLOPS_BY_DEVICE.items():
        assert peak_flops_for_device(f"NVIDIA {name}") == flops


def test_mfu_matches_hand_computation():
    # 1e9 params, 2000 tokens in 0.5 s on 4 devices of 1e15: 6e9*4000/4e15 = 0.006
    assert model_flops_per_token(1_000_000_000) == 6e9
    assert mfu(1_000_000_000, 2000, 0.5, 1e15, 4) == pytest.approx(0.006, rel=1e-12)


@pytest.mark.parametrize("argument", ["tokens", "seconds", "peak_flops_per_device", "num_devices"])
def test_mfu_rejects_non_positive_inputs(argument):
    arguments = dict(num_parameters=10, tokens=10, seconds=1.0, peak_flops_per_device=1e12, num_devices=1)
    arguments[argument] = 0
    with pytest.raises(ValueError, match=argument):
        mfu(**arguments)


def test_a_stages_tensor_parallel_workers_are_told_apart_by_their_tp_rank(exporter):
    """At t > 1 a stage's t workers each report: one series each, labelled with its tp_rank."""
    stats = [StageStats(stage=0, busy_seconds=0.2, tp_rank=0), StageStats(stage=0, busy_seconds=0.3, tp_rank=1)]
    exporter.record_step(known_step(stages=stats, bubble_fraction=[0.1]))
    assert scrape(exporter)["samples"]["raypipe_stage_busy_seconds"] == {
        frozenset({"stage": "0", "replica": "0", "tp_rank": "0"}.items()): 0.2,
        frozenset({"stage": "0", "replica": "0", "tp_rank": "1"}.items()): 0.3,
    }


def test_slowdowns_are_replaced_by_the_latest_and_absent_before_any(exporter):
    assert "raypipe_worker_slowdown" not in scrape(exporter)["samples"]  # no baseline yet: absent, not 1
    exporter.record_slowdowns({(1, 2, 1): 1.5})
    exporter.record_slowdowns({(0, 2, 0): 1.1})  # workers left out (a layout changed) are no longer reported
    assert scrape(exporter)["samples"]["raypipe_worker_slowdown"] == {
        frozenset({"stage": "2", "replica": "0", "tp_rank": "0"}.items()): 1.1}
