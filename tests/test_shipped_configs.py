"""The configs a user deploys (`serve deploy configs/...`) validate, and the one-GPU pd and pdv configs carry the
settings that benchmarks/lanes_1gpu.py measured (its `pd512_sm50` and `pdv512`), so the files and their comments
stay true."""

from pathlib import Path

import pytest
import yaml

from deployments.config import AppConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = {path: yaml.safe_load(path.read_text()) for path in sorted((REPO_ROOT / "configs").glob("**/*.yaml"))}
# Serve app configs (a cluster launcher's config sits beside them in placements/)
CONFIGS = [path for path, doc in DOCS.items() if "applications" in doc]


def _args(path: Path) -> dict:
    (app,) = DOCS[path]["applications"]
    assert app["import_path"] == "deployments.builder:build_app"
    return app["args"]


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO_ROOT / "configs")) for p in CONFIGS])
def test_every_shipped_config_validates(path):
    AppConfig.model_validate(_args(path))


def test_the_one_gpu_pd_config_is_what_the_benchmark_measured():
    from benchmarks.lanes_1gpu import VARIANTS
    from benchmarks.lib.apps import GPU_SHARES

    cfg = AppConfig.model_validate(_args(REPO_ROOT / "configs" / "pd-1gpu.yaml"))
    base, overrides = VARIANTS["pd512_sm50"]
    assert cfg.mode == base == "pd"
    assert cfg.engine.idle_prefill_tokens == overrides["engine"]["idle_prefill_tokens"] == 512
    assert cfg.prefill_lane.mps_sm_percent == overrides["prefill_lane"]["mps_sm_percent"] == 50
    assert cfg.prefill_lane.mps_priority is None  # below the decode lane's, the default the benchmark ran
    assert {"prefill_lane": cfg.prefill_lane.num_gpus, "decode_lane": cfg.decode_lane.num_gpus} == GPU_SHARES["pd"]
    assert cfg.local_prefill_max_tokens == 512 and cfg.ingress.num_replicas == 2


def test_the_one_gpu_pdv_config_is_what_the_benchmark_measured():
    from benchmarks.lanes_1gpu import VARIANTS
    from benchmarks.lib.apps import GPU_SHARES

    cfg = AppConfig.model_validate(_args(REPO_ROOT / "configs" / "pdv-1gpu.yaml"))
    base, overrides = VARIANTS["pdv512"]
    assert cfg.mode == base == "pdv"
    assert cfg.engine.idle_prefill_tokens == overrides["engine"]["idle_prefill_tokens"] == 512
    assert cfg.prefill_lane.mps_sm_percent is None and cfg.prefill_lane.mps_priority is None  # as measured
    assert cfg.shared_drafts is None  # the ring of device memory, on where the decode lane has a GPU
    assert cfg.local_prefill_max_tokens == 0  # pdv's split, off: it cost p99 TPOT on mixed traffic
    assert {lane: getattr(cfg, lane).num_gpus for lane in GPU_SHARES["pdv"]} == GPU_SHARES["pdv"]
    assert cfg.ingress.num_replicas == 2
