"""The load tester against a real Serve instance (tiny pair, CPU): every request accounted for.

One run mixes requests that complete, requests the server refuses (400: output or prompt beyond
the context) and requests that time out (a long generation under a short per-request timeout).
Its counts must add up, each request must end as its kind predicts, the summary's percentiles
must equal numpy's over the completed rows of requests.csv, and the acceptance read from
`/v1/spec_decode/stats` must match the per-request usage. Then `python -m loadtest compare` runs
against two modes and its table and files are checked.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from loadtest.arrivals import OpenLoop
from loadtest.report import Point, write_point
from loadtest.runner import RunResult, run_load
from loadtest.summary import LATENCY_METRICS
from loadtest.workload import (LogNormal, WorkloadRequest, count_tokens, load_tokenizer,
                               random_prompt, synthetic, usable_token_ids)
from tests import serve_helpers
from tests.serve_helpers import app_config, serving

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 4096
# Short requests finish in well under a second here; a slow one needs about 4000 decode steps'
# worth of tokens, tens of seconds on this CPU, so it cannot finish within the timeout.
TIMEOUT_S = 4.0
SLOW_OUTPUT_LEN = 4000


@pytest.fixture(scope="module")
def urls(pair_paths) -> dict[str, str]:
    """pdv and nospec apps, by mode -> base URL (without /v1)."""
    target, draft = pair_paths
    engine = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8, "num_speculative_tokens": 3,
              "prefill_chunk_tokens": 32}
    with serving({mode: app_config(mode, target, draft, engine=engine) for mode in ("pdv", "nospec")}):
        yield {mode: serve_helpers.base_url(mode).removesuffix("/v1") for mode in ("pdv", "nospec")}


def mixed_workload(tokenizer_dir: str, seed: int = 0) -> list[WorkloadRequest]:
    """Short requests, refused ones (kinds too_long_output, too_long_prompt) and slow ones,
    shuffled."""
    tokenizer = load_tokenizer(tokenizer_dir)
    rng = np.random.default_rng(seed)
    short = synthetic(tokenizer, 14, seed, prompt_lengths=LogNormal(16, 0.5, 4, 48),
                      output_lengths=LogNormal(12, 0.5, 4, 24))
    prompt = short[0].prompt
    long_prompt = random_prompt(tokenizer, usable_token_ids(tokenizer), MAX_MODEL_LEN + 64, rng)
    refused = [WorkloadRequest(prompt, short[0].prompt_len, MAX_MODEL_LEN + 1, "too_long_output")
               for _ in range(3)]
    refused.append(WorkloadRequest(long_prompt, count_tokens(tokenizer, long_prompt), 4,
                                   "too_long_prompt"))
    slow = [WorkloadRequest(prompt, short[0].prompt_len, SLOW_OUTPUT_LEN, "slow")
            for _ in range(3)]
    requests = short + refused + slow
    random.Random(seed).shuffle(requests)
    return requests


@pytest.fixture(scope="module")
def mixed_run(urls, pair_paths) -> tuple[list[WorkloadRequest], RunResult]:
    workload = mixed_workload(pair_paths[0])
    short = LogNormal(8, 0.1, 4, 16)
    warmup = synthetic(load_tokenizer(pair_paths[0]), 2, seed=9, prompt_lengths=short,
                       output_lengths=short)
    result = asyncio.run(run_load(urls["pdv"], workload, OpenLoop(rate_rps=8.0), warmup=warmup,
                                  timeout_s=TIMEOUT_S, progress=False))
    return workload, result


EXPECTED_STATUS = {"normal": "completed", "too_long_output": "failed", "too_long_prompt": "failed",
                   "slow": "timed_out"}


def test_every_submitted_request_is_one_record_with_the_status_its_kind_predicts(mixed_run):
    workload, result = mixed_run
    summary = result.summary()
    assert [r.index for r in result.records] == list(range(len(workload)))
    assert summary.submitted == len(workload)
    assert summary.submitted == summary.completed + summary.failed + summary.timed_out
    assert (summary.completed, summary.failed, summary.timed_out) == (14, 4, 3)
    assert summary.warmup_requests == 2
    for record, request in zip(result.records, workload):
        assert (record.kind, record.output_len) == (request.kind, request.output_len)
        assert record.status == EXPECTED_STATUS[request.kind], (record.kind, record.error)
        if request.kind.startswith("too_long"):
            assert record.http_status == 400 and record.error.startswith("HTTP 400")
        if record.status == "completed":
            assert record.completion_tokens == request.output_len
            assert record.ttft_ms is not None and record.ttft_ms <= record.e2e_ms
        if record.status == "timed_out":
            assert record.e2e_ms >= TIMEOUT_S * 1000 * 0.99


def test_summary_percentiles_equal_numpy_over_the_completed_rows_on_disk(mixed_run, tmp_path):
    _, result = mixed_run
    summary = result.summary()
    directory = write_point(tmp_path, Point("pdv", result, summary), config={})
    rows = pd.read_csv(directory / "requests.csv")
    assert len(rows) == summary.submitted
    completed = rows[rows["status"] == "completed"]
    for metric in LATENCY_METRICS:
        if metric == "itl_ms":
            values = [gap for cell in completed["itl_ms"] for gap in json.loads(cell)]
        else:
            values = completed[metric].dropna().tolist()
        stats = summary.latency_ms[metric]
        assert stats.count == len(values) > 0, metric
        expected = np.percentile(values, [50, 95, 99])
        assert [stats.p50, stats.p95, stats.p99] == pytest.approx(expected, rel=1e-9), metric
        assert stats.mean == pytest.approx(np.mean(values), rel=1e-9), metric
    # Timed-out requests did stream tokens; none of theirs may enter the statistics.
    timed_out = rows[rows["status"] == "timed_out"]
    assert timed_out["ttft_ms"].notna().all()


def test_acceptance_from_server_counters_matches_the_per_request_usage(mixed_run):
    _, result = mixed_run
    spec = result.summary().spec_decode
    assert spec is not None, result.spec_error
    completed = [r for r in result.records if r.status == "completed"]
    # Refused and timed-out requests never finish on the server, so only completed ones count.
    assert spec.num_drafts == sum(r.num_drafts for r in completed)
    assert spec.num_draft_tokens == sum(r.num_draft_tokens for r in completed) > 0
    assert spec.num_accepted_tokens == sum(r.num_accepted_tokens for r in completed)
    assert 0.0 <= spec.acceptance_rate <= 1.0
    assert spec.acceptance_rate == pytest.approx(spec.num_accepted_tokens / spec.num_draft_tokens)
    assert spec.mean_acceptance_length == pytest.approx(
        1 + spec.num_accepted_tokens / spec.num_drafts)


def test_compare_cli_against_two_modes_writes_its_table_and_files(urls, pair_paths, tmp_path):
    output_dir = tmp_path / "compare"
    command = [sys.executable, "-m", "loadtest", "compare",
               "--target", f"pdv={urls['pdv']}", "--target", f"nospec={urls['nospec']}",
               "--tokenizer", pair_paths[0], "--seed", "1", "--num-requests", "10",
               "--warmup-requests", "2", "--max-concurrency", "3",
               "--prompt-len-median", "16", "--max-prompt-len", "48",
               "--output-len-median", "12", "--max-output-len", "24",
               "--slo", "ttft_ms=60000", "--timeout-s", "120", "--no-progress",
               "--output-dir", str(output_dir)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    columns = ["pdv concurrency=3", "nospec concurrency=3"]
    table = pd.read_csv(output_dir / "compare.csv", index_col=0)
    assert list(table.columns) == columns
    for column in columns:
        counts = table[column]
        assert counts["submitted"] == 10
        assert counts["completed"] + counts["failed"] + counts["timed_out"] == 10
        assert counts["completed"] == 10 and counts["goodput_rps"] > 0
    assert 0.0 <= table.loc["acceptance_rate", columns[0]] <= 1.0
    assert np.isnan(table.loc["acceptance_rate", columns[1]])  # nospec drafts nothing
    printed = (output_dir / "compare.txt").read_text()
    assert printed in done.stdout and "acceptance_rate" in printed
    markdown = (output_dir / "compare.md").read_text().splitlines()
    assert markdown[0] == "|  | " + " | ".join(columns) + " |"
    assert "| submitted | 10 | 10 |" in markdown
    assert (output_dir / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    workloads = []
    for mode in ("pdv", "nospec"):
        point = output_dir / mode / "concurrency_3"
        document = json.loads((point / "result.json").read_text())
        assert document["summary"]["submitted"] == len(document["requests"]) == 10
        rows = pd.read_csv(point / "requests.csv")
        workloads.append(rows.sort_values("index")[["prompt_len", "output_len"]].values.tolist())
    assert workloads[0] == workloads[1]  # one seeded workload for both modes
