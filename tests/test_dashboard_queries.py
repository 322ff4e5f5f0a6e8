"""Every PromQL expression of the Grafana dashboard returns data from a real Prometheus that
scrapes Ray's metrics endpoint while a real pdv app (tiny pair, Ray Serve) is under load from the
load tester.

Prometheus is Debian's package, installed if missing and started by monitoring/start_prometheus.sh;
if it cannot start, the test fails. Prometheus finds Ray the way monitoring/prometheus.yml says:
through a file-based service-discovery file listing each node's metrics export address. Ray's
dashboard writes that file from the GCS node table; Ray runs here without a dashboard, so the test
writes the same content from `ray.nodes()`.

GPU-only expressions: those over `ray_vpd_gpu_*` (panels "GPU utilisation" and "GPU memory
used"). Lanes export them only from a GPU, so on a machine without one they are checked to be
the only expressions without data; where a GPU is present the lanes are placed on it and every
expression, GPU ones included, must return data.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml

from deployments.telemetry.metrics import _registry, read_gpu_stats
from loadtest.arrivals import ClosedLoop
from loadtest.runner import RunResult, run_load
from loadtest.workload import LogNormal, load_tokenizer, synthetic
from tests import serve_helpers
from tests.serve_helpers import app_config, serving

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "monitoring" / "grafana" / "verify-pd-dashboard.json"
GPU_ONLY_PANELS = {"GPU utilisation", "GPU memory used"}
# Ray's metrics report interval is 10 s by default; 1 s keeps this test short. Read by the raylet and
# every worker it starts, so this module gets a Ray cluster of its own, started with it.
CLUSTER = {"env_vars": {"RAY_metrics_report_interval_ms": "1000"}}
SCRAPE_INTERVAL = "1s"  # the repo's config says 5s, for the same reason
RATE_INTERVAL = "30s"
QUERY_DEADLINE_S = 120.0
LOAD_ROUND_S = 5.0  # the load runs in rounds of this length until the checks are done
pytestmark = pytest.mark.serve(cluster=CLUSTER)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gpu_present() -> bool:
    return read_gpu_stats() is not None


@pytest.fixture(scope="module")
def app_url(pair_paths, gpu_present):
    """A pdv app on the tiny pair, with Ray exporting metrics every second."""
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "num_gpus": 0.2 if gpu_present else 0}
    config = app_config("pdv", target, draft, ingress={"num_cpus": 0.05}, prefill_lane=lane,
                        verify_lane=lane, decode_lane={**lane, "num_replicas": 2})
    with serving({"pdv": config}, **CLUSTER):
        yield serve_helpers.base_url("pdv").removesuffix("/v1"), target


class BackgroundLoad:
    """The load tester driving the app in rounds, on its own thread, until stopped."""

    def __init__(self, base_url: str, tokenizer_dir: str):
        tokenizer = load_tokenizer(tokenizer_dir)
        self.workload = synthetic(tokenizer, 24, seed=0, prompt_lengths=LogNormal(24, 0.5, 4, 96),
                                  output_lengths=LogNormal(24, 0.5, 4, 64))
        self.base_url = base_url
        self.results: list[RunResult] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._rounds()), daemon=True)

    async def _rounds(self) -> None:
        while not self._stop.is_set():
            # As some clients do: a field this server does not know, which it ignores and counts.
            async with httpx.AsyncClient(timeout=60) as http:
                await http.post(f"{self.base_url}/v1/completions", json={
                    "model": "vpd-python", "prompt": "hi", "max_tokens": 2, "x_client_trace_id": "t1"})
            self.results.append(await run_load(self.base_url, self.workload, ClosedLoop(3),
                                               duration_s=LOAD_ROUND_S, timeout_s=60.0,
                                               progress=False))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120.0)
        assert not self._thread.is_alive(), "the load did not stop"


@pytest.fixture(scope="module")
def load(app_url):
    base_url, tokenizer_dir = app_url
    background = BackgroundLoad(base_url, tokenizer_dir)
    background.start()
    yield background
    background.stop()


def ray_service_discovery() -> list[dict]:
    """What Ray's dashboard writes to prom_metrics_service_discovery.json (node targets)."""
    targets = [f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
               for node in ray.nodes() if node["alive"]]
    return [{"labels": {"job": "ray"}, "targets": targets}]


@pytest.fixture(scope="module")
def prometheus_url(load, tmp_path_factory):
    """Prometheus started with the repo's config; only the discovery file and interval differ."""
    workdir = tmp_path_factory.mktemp("prometheus")
    sd_file = workdir / "ray_sd.json"
    sd_file.write_text(json.dumps(ray_service_discovery()))
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


def _panel_title(where: str) -> str:
    return where.rsplit(" [", 1)[0]


def test_every_dashboard_expression_returns_data_from_the_app_under_load(prometheus_url, load,
                                                                          gpu_present):
    deadline = time.monotonic() + QUERY_DEADLINE_S
    while True:
        outcomes = _check_dashboard(prometheus_url, gpu_present)
        missing = [o for o in outcomes if o["status"] in ("empty", "error")]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    load.stop()
    assert not missing, "expressions without data:\n" + "\n".join(
        f"{o['where']}: {o['promql']} ({o['detail']})" for o in missing)
    gpu_only = {o["where"] for o in outcomes if "ray_vpd_gpu_" in o["promql"]}
    assert {_panel_title(where) for where in gpu_only} == GPU_ONLY_PANELS
    excused = {o["where"] for o in outcomes if o["status"] == "no_gpu"}
    # Only GPU panels may go without data, and only on a machine without a GPU.
    assert excused == (set() if gpu_present else gpu_only)
    assert len(outcomes) >= 20
    # The data came from real traffic that the app served in full.
    records = [r for result in load.results for r in result.records]
    assert records and all(r.status == "completed" for r in records), \
        {r.error for r in records if r.status != "completed"}


def _exported_series() -> dict[str, str]:
    """Series name as Ray exports it -> metric name: ray_ prefix, _total on counters, and
    _bucket / _sum / _count on histograms (as seen on Ray 2.60's /metrics)."""
    suffixes = {"Counter": ["_total"], "Gauge": [""], "Histogram": ["_bucket", "_sum", "_count"]}
    return {f"ray_{metric.info['name']}{suffix}": metric.info["name"]
            for metric in vars(_registry()).values()
            for suffix in suffixes[type(metric).__name__]}


def test_dashboard_uses_exactly_the_exported_metrics(app_url):
    used = set(re.findall(r"ray_vpd_[a-z0-9_]+", DASHBOARD.read_text()))
    exported = _exported_series()
    assert used - exported.keys() == set(), "dashboard names series that are not exported"
    shown = {exported[name] for name in used}
    assert set(exported.values()) - shown == set(), "exported metrics that no panel shows"
