"""Every PromQL expression of the Grafana dashboard returns data from a real Prometheus that
scrapes Ray's metrics endpoint while the lanes' and the ingress's metrics are being driven.

Prometheus is Debian's package, installed if missing and started by monitoring/start_prometheus.sh;
if it cannot start, the test fails. The load source is one fixture, `metrics_target`: today a Ray
actor that drives LaneMetrics / IngressMetrics through the values a pdv deployment produces;
pointing it at the real app under load changes nothing else here.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from deployments.metrics import IngressMetrics, LaneMetrics, _registry, read_gpu_stats

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "monitoring" / "grafana" / "verify-pd-dashboard.json"
SCRAPE_INTERVAL = "1s"  # the repo's config says 5s; 1s keeps this test short
RATE_INTERVAL = "30s"
QUERY_DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_metrics_port():
    """Ray with its metrics export on a known port, exporting every second instead of ten."""
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    previous = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=port,
             log_to_driver=False)
    yield port
    ray.shutdown()
    if previous is None:
        os.environ.pop("RAY_metrics_report_interval_ms")
    else:
        os.environ["RAY_metrics_report_interval_ms"] = previous


@ray.remote(num_cpus=0)
class PdvMetricsLoad:
    """What a pdv deployment's lanes and ingress report, at a steady made-up load."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self._lanes = {lane: LaneMetrics(lane, "pdv") for lane in ("prefill", "decode", "verify")}
        self._ingress = IngressMetrics("pdv")
        self._running = True

    async def run(self, tick_s: float = 0.1) -> None:
        while self._running:
            self._tick()
            await asyncio.sleep(tick_s)

    def stop(self) -> None:
        self._running = False

    def _tick(self) -> None:
        rng = self._rng
        for lane, median_ms in (("prefill", 40.0), ("decode", 4.0), ("verify", 20.0)):
            metrics = self._lanes[lane]
            metrics.observe_step(rng.lognormvariate(0, 0.3) * median_ms, rng.randint(1, 16))
            metrics.set_queue_depth(rng.randint(0, 6))
            metrics.sample_gpu()
        self._lanes["prefill"].set_kv_slots(rng.randint(0, 512), 4096, "target")
        self._lanes["verify"].set_kv_slots(rng.randint(1024, 3072), 4096, "target")
        self._lanes["decode"].set_kv_slots(rng.randint(1024, 3072), 4096, "draft")
        self._verify_step(batch_size=rng.randint(1, 8), draft_len=4, accept_prob=0.7)
        if rng.random() < 0.5:
            self._finish_request()

    def _verify_step(self, batch_size: int, draft_len: int, accept_prob: float) -> None:
        self._lanes["decode"].set_draft_length(draft_len)
        per_pos = [0] * draft_len
        for _ in range(batch_size):
            self._lanes["decode"].observe_request_draft_length(draft_len)
            for position in range(draft_len):  # acceptance stops at the first rejection
                if self._rng.random() >= accept_prob:
                    break
                per_pos[position] += 1
        self._lanes["verify"].record_spec(batch_size, batch_size * draft_len, sum(per_pos),
                                          per_pos)

    def _finish_request(self) -> None:
        rng = self._rng
        if rng.random() < 0.1:
            self._ingress.observe_request("failed", None, None, rng.uniform(1, 50), 0)
            return
        tokens = rng.randint(16, 256)
        ttft_ms, tpot_ms = rng.uniform(50, 600), rng.uniform(8, 40)
        self._ingress.observe_request("completed", ttft_ms, tpot_ms,
                                      ttft_ms + tpot_ms * (tokens - 1), tokens)


@pytest.fixture(scope="module")
def metrics_target(ray_metrics_port):
    """The load source: host:port of the Ray metrics endpoint that carries the load's metrics."""
    load = PdvMetricsLoad.remote(seed=0)
    running = load.run.remote()
    yield f"127.0.0.1:{ray_metrics_port}"
    ray.get(load.stop.remote())
    ray.get(running)


@pytest.fixture(scope="module")
def prometheus_url(metrics_target, tmp_path_factory):
    """Prometheus started with the repo's config; only the discovery file and interval differ."""
    workdir = tmp_path_factory.mktemp("prometheus")
    # Ray writes its service-discovery file only when its dashboard runs; this test runs Ray
    # without one, so it writes the same file itself.
    sd_file = workdir / "ray_sd.json"
    sd_file.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [metrics_target]}]))
    config = yaml.safe_load((REPO / "monitoring" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(sd_file)]
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = _free_port()
    started = subprocess.run(
        ["bash", str(REPO / "monitoring" / "start_prometheus.sh"), "--config", str(config_path),
         "--port", str(port), "--data-dir", str(workdir / "data")],
        capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, f"Prometheus did not start:\n{started.stderr}"
    pid = int(started.stdout.split()[-1])
    yield f"http://127.0.0.1:{port}"
    _stop(pid)


def _stop(pid: int, timeout_s: float = 15.0) -> None:
    # The server was started detached (setsid), so it is not our child: poll until it is gone.
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _check_dashboard(prometheus_url: str, gpu_present: bool) -> list[dict]:
    command = [sys.executable, str(REPO / "monitoring" / "check_dashboard.py"),
               "--prometheus-url", prometheus_url, "--rate-interval", RATE_INTERVAL, "--json"]
    if not gpu_present:
        command.append("--no-gpu")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr  # 1 = some expression without data
    return json.loads(done.stdout)


def test_every_dashboard_expression_returns_data(prometheus_url):
    gpu_present = read_gpu_stats() is not None
    deadline = time.monotonic() + QUERY_DEADLINE_S
    while True:
        outcomes = _check_dashboard(prometheus_url, gpu_present)
        missing = [o for o in outcomes if o["status"] in ("empty", "error")]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert not missing, "expressions without data:\n" + "\n".join(
        f"{o['where']}: {o['promql']} ({o['detail']})" for o in missing)
    excused = {o["where"] for o in outcomes if o["status"] == "no_gpu"}
    gpu_queries = {o["where"] for o in outcomes if "ray_vpd_gpu_" in o["promql"]}
    # Only GPU panels may go without data, and only on a machine without a GPU.
    assert excused == (set() if gpu_present else gpu_queries)
    assert len(outcomes) >= 20


def _exported_series() -> dict[str, str]:
    """Series name as Ray exports it -> metric name: ray_ prefix, _total on counters, and
    _bucket / _sum / _count on histograms (as seen on Ray 2.60's /metrics)."""
    suffixes = {"Counter": ["_total"], "Gauge": [""], "Histogram": ["_bucket", "_sum", "_count"]}
    return {f"ray_{metric.info['name']}{suffix}": metric.info["name"]
            for metric in vars(_registry()).values()
            for suffix in suffixes[type(metric).__name__]}


def test_dashboard_uses_exactly_the_exported_metrics(ray_metrics_port):
    used = set(re.findall(r"ray_vpd_[a-z0-9_]+", DASHBOARD.read_text()))
    exported = _exported_series()
    assert used - exported.keys() == set(), "dashboard names series that are not exported"
    shown = {exported[name] for name in used}
    assert set(exported.values()) - shown == set(), "exported metrics that no panel shows"
