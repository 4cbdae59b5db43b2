"""The Grafana dashboard against a real Prometheus scraping a real trainer.

Every PromQL expression of every dashboard panel must return data after a
short training run. Without a ``prometheus`` binary the integration test
skips, except under ``CI=true`` where a missing binary is a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from raypipe.observability.metrics import METRIC_NAMES
from tests.ports import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "raypipe" / "dashboards" / "raypipe.json"

# Grafana's built-in interval variables, replaced by windows that hold several
# 1 s scrapes when the expressions are sent to Prometheus directly.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "5m", "$replica": ".*"}


def dashboard_panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel["targets"]]


def promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables substituted."""
    for variable, window in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, window)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def test_dashboard_panels_use_the_datasource_variable_and_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # per-worker panels can be narrowed to data-parallel replicas ("All" = every one)
    assert variables["replica"]["definition"] == "label_values(raypipe_stage_busy_seconds, replica)"
    assert variables["replica"]["multi"] and variables["replica"]["allValue"] == ".*"
    assert {expr for expr in dashboard_exprs() if "$replica" in expr} == {
        'raypipe_stage_memory_bytes{replica=~"$replica"}', 'raypipe_stage_busy_seconds{replica=~"$replica"}'}
    referenced = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no queries"
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            names = set(re.findall(r"\braypipe_[a-z_]+", target["expr"]))
            assert names <= METRIC_NAMES, f"{panel['title']!r} queries unknown metrics {names - METRIC_NAMES}"
            referenced |= names
    assert referenced == METRIC_NAMES, f"metrics on no panel: {METRIC_NAMES - referenced}"


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
    if path is None:
        reason = "no `prometheus` binary on PATH (Debian: apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + "; CI=true requires it")
        pytest.skip(reason)
    return path


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait_until(condition, timeout: float, what: str, interval: float = 0.5):
    """Poll ``condition()`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if outcome:
            return outcome
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Prometheus:
    """A Prometheus server on a free loopback port, scraping one target every second: ``target``, or
    the one :meth:`scrape` names later (a file it watches). Prometheus hands new targets to its
    scrapers only every 5 s from its start, so one started before its target's process (a trainer)
    scrapes it sooner."""

    def __init__(self, binary: str, target: str | None, directory: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = directory / "targets.json"
        if target is not None:
            self.scrape(target)
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: raypipe\n    file_sd_configs:\n      - files: ['{self.targets}']\n"
        )
        self.log = (directory / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def ready(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"prometheus exited with {self.process.returncode}; see {self.log.name}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def scrape(self, target: str) -> None:
        """Scrape ``target`` (host:port) from now on (the file replaced whole: never read half written)."""
        written = self.targets.with_suffix(".tmp")
        written.write_text(json.dumps([{"targets": [target]}]))
        written.replace(self.targets)

    def query(self, expr: str) -> list[dict]:
        answer = get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert answer["status"] == "success", f"{expr!r}: {answer}"
        return answer["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def prometheus_factory(tmp_path):
    """Start Prometheus scraping a given target (None: the one its :meth:`Prometheus.scrape` names
    later); always stopped at teardown."""
    binary = prometheus_binary()
    started: list[Prometheus] = []

    def start(target: str | None) -> Prometheus:
        prometheus = Prometheus(binary, target, tmp_path)
        started.append(prometheus)
        wait_until(prometheus.ready, 30, "prometheus to become ready")
        return prometheus

    yield start
    for prometheus in started:
        prometheus.stop()


@pytest.fixture(scope="module")
def scraped_exporter(tmp_path_factory):
    """A MetricsExporter without Ray, scraped by one Prometheus: (exporter, prometheus, target), shared
    by the tests that record into it. In the module's order the first sees only its own records; the
    second records the only resizes, and its replica counts are of its own steps."""
    from raypipe.observability.metrics import MetricsExporter

    binary = prometheus_binary()
    with MetricsExporter() as exporter:
        target = urllib.parse.urlsplit(exporter.url).netloc
        prometheus = Prometheus(binary, target, tmp_path_factory.mktemp("prometheus"))
        try:
            wait_until(prometheus.ready, 30, "prometheus to become ready")
            yield exporter, prometheus, target
        finally:
            prometheus.stop()


def assert_every_dashboard_expr_has_data(prometheus: Prometheus, target: str, min_steps: int) -> None:
    up = wait_until(lambda: prometheus.query('up{job="raypipe"} == 1'), 30, f"{target} to be scraped")
    assert up[0]["metric"]["instance"] == target
    exprs = [promql(expr) for expr in dashboard_exprs()]

    def empty_exprs() -> list[str]:
        return [expr for expr in exprs if not prometheus.query(expr)]

    # Bounded: rate() needs two scrapes in its window, so allow a few seconds.
    deadline = time.monotonic() + 30
    while (empty := empty_exprs()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not empty, f"dashboard expressions with no data from Prometheus: {empty}"
    steps = prometheus.query("raypipe_steps_total")
    assert float(steps[0]["value"][1]) >= min_steps


def test_dashboard_queries_against_the_exporter(scraped_exporter):
    """The dashboard and the exporter agree, checked through Prometheus without Ray."""
    from raypipe.core.result import StageStats, StepResult

    exporter, prometheus, target = scraped_exporter
    for step in range(3):
        exporter.record_step(StepResult(
            step=step, loss=1.0 / (step + 1), grad_norm=2.0, step_time=0.1, tokens_per_second=100.0,
            mfu=0.01, stages=[StageStats(stage=s, busy_seconds=0.05, rss_bytes=10**8) for s in range(2)],
            bubble_fraction=[0.5, 0.5],
        ))
    exporter.record_eval(0.9)
    exporter.record_controller_state("running", ("starting", "running", "healing", "stopped"))
    exporter.record_slowdowns({(0, 0, 0): 1.0, (0, 1, 0): 1.4})
    assert_every_dashboard_expr_has_data(prometheus, target, min_steps=3)


def panel_exprs(title: str) -> dict[str, str]:
    """{legend: PromQL} of the dashboard panel with this title."""
    (panel,) = [panel for panel in dashboard_panels() if panel["title"] == title]
    return {target["legendFormat"]: promql(target["expr"]) for target in panel["targets"]}


def test_replicas_panel_shows_an_elastic_run_shrinking_and_growing(scraped_exporter):
    """Replicas over time and resizes by direction, as Prometheus computes the panel's queries."""
    from raypipe.core.result import StepResult

    exprs = panel_exprs("Replicas")
    assert set(exprs) == {"replicas", "resizes ({{direction}})"}

    def series(expr: str) -> dict[str, float]:
        return {sample["metric"].get("direction", ""): float(sample["value"][1]) for sample in prometheus.query(expr)}

    exporter, prometheus, _ = scraped_exporter
    exporter.record_step(StepResult(step=0, loss=1.0, grad_norm=1.0, step_time=0.1, num_replicas=2))
    wait_until(lambda: series(exprs["replicas"]) == {"": 2.0}, 30, "2 replicas in Prometheus")
    # Before any resize every direction is a series of zeros, not absent.
    wait_until(lambda: series(exprs["resizes ({{direction}})"]) == {"shrink": 0.0, "grow": 0.0,
                                                                  "repartition": 0.0, "restore": 0.0}, 30,
               "zero resizes in every direction")
    exporter.record_resize("shrink", 1)
    exporter.record_step(StepResult(step=1, loss=1.0, grad_norm=1.0, step_time=0.1, num_replicas=1))
    wait_until(lambda: series(exprs["replicas"]) == {"": 1.0}, 30, "1 replica after the shrink")
    exporter.record_resize("grow", 2)
    wait_until(lambda: series(exprs["replicas"]) == {"": 2.0}, 30, "2 replicas after the grow")
    # increase() extrapolates over its window, so a single resize reads as >= 1, never as 0.
    resizes = wait_until(lambda: (r := series(exprs["resizes ({{direction}})"])) and r["grow"] > 0 and r,
                         30, "the grow in the resizes query")
    assert resizes["shrink"] >= 1.0 and resizes["grow"] >= 1.0


def test_every_dashboard_query_returns_data_from_a_real_prometheus(ray_cluster, prometheus_factory):
    """A short real training run, scraped by Prometheus, fills every dashboard panel."""
    import torch
    from torch import nn

    import raypipe

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    # slow_steps=1: every worker has a baseline (and a slowdown on its panel) after the first step
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, metrics_port=0, peak_flops_per_second=1e12,
                                    slow_steps=1)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)

    prometheus = prometheus_factory(None)  # before the trainer: its first round of targets comes sooner
    with raypipe.PipelineTrainer(model, nn.functional.mse_loss,
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.01), config=config) as trainer:
        url = urllib.parse.urlsplit(trainer.metrics_url)
        assert url.hostname == "127.0.0.1"  # loopback unless configured otherwise
        prometheus.scrape(url.netloc)
        trainer.step(inputs, targets)
        trainer.evaluate(inputs, targets)
        trainer.step(inputs, targets)
        # The trainer's exporter is scraped every second while the check polls: the rate() and
        # increase() windows fill with samples of the running trainer's series meanwhile.
        assert_every_dashboard_expr_has_data(prometheus, url.netloc, min_steps=2)
