"""Traces of the decode replicas' engines under load (lanes/engine/step_trace.py), for the served benchmarks:
one more load, like a measured one but with prompts of its own and out of the results, during which every
decode replica records its next steps with torch.profiler. The profiler slows what it records, so the
traced load's figures are no result; its trace says where a step's time goes.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Awaitable, Callable

from ray import serve

from benchmarks.lib.cluster import log
from benchmarks.lib.loads import Load
from loadtest.workload import WorkloadRequest

TRACED = " (traced)"  # the traced load's name: the load it copies, and this
START_AFTER_S = 1.0  # into the traced load before recording: past its first burst of prompts
TRACE_TIMEOUT_S = 120.0
REGIONS = ("admit", "take_in", "make_room", "draft", "verify_launch", "prefill", "verify_wait", "rollback", "append",
           "send_outputs")


def traced_load(load: Load, requests: list[WorkloadRequest]) -> Load:
    """`load`'s arrivals with `requests` (prompts of their own: the prefix cache holds the measured load's),
    out of the results."""
    return replace(load, name=load.name + TRACED, requests=requests, measured=False)


def decode_tracer(app: str, out_dir: Path, num_steps: int, traces: dict[str, list[dict]]
                  ) -> Callable[[str, Load], Awaitable[None]]:
    """A `sampler` for run_loads: in a traced load, trace `num_steps` steps of every decode replica of `app`
    (files under out_dir/app), their summaries into `traces` by load name."""
    async def trace(url: str, load: Load) -> None:
        if not load.name.endswith(TRACED):
            return
        await asyncio.sleep(START_AFTER_S)
        handle = serve.get_deployment_handle("DecodeLane", app_name=app)
        try:
            summaries = await handle.broadcast("trace", num_steps, str(out_dir / app)).results_async(
                timeout_s=TRACE_TIMEOUT_S)
        except asyncio.CancelledError:
            log(f"{app} {load.name}: the load ended before the trace did (fewer steps, or a later start)")
            raise
        except Exception as exc:  # a diagnostic: never let it end the run
            log(f"{app} {load.name}: no trace ({type(exc).__name__}: {exc})")
            return
        traces[load.name] = summaries
        for summary in summaries:
            log(f"{app} {load.name}: {trace_line(summary)}")
    return trace


def trace_line(summary: dict) -> str:
    regions = summary.get("region_ms_per_step", {})
    parts = [f"{k} {regions[k]:g}" for k in REGIONS if k in regions]
    return (f"{summary['name']}: {summary['steps']} steps, {summary.get('window_ms_per_step')} ms a step "
            f"(device busy {summary.get('device_busy_ms_per_step')}); regions, ms a step: {', '.join(parts)}; "
            f"outside them {summary.get('outside_regions_ms_per_step')}")


def trace_rows(apps: list[dict]) -> list[dict]:
    """One row per traced replica: ms a step in each region, the window and the device's busy time."""
    rows = []
    for app in apps:
        for load, summaries in app.get("traces", {}).items():
            for summary in summaries:
                regions = summary.get("region_ms_per_step", {})
                rows.append({"mode": app["mode"], "load": load, "replica": summary["name"], "steps": summary["steps"],
                             "step ms": summary.get("window_ms_per_step"),
                             "device busy ms": summary.get("device_busy_ms_per_step"),
                             "draft kernels' span": summary.get("region_device_span_ms_per_step", {}).get("draft"),
                             "outside regions": summary.get("outside_regions_ms_per_step"),
                             **{k: regions.get(k) for k in REGIONS}})
    return rows
