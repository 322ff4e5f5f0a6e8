"""One app's run: its config, deploy, a list of loads through Serve's proxy, delete. Failures are
recorded, never raised, so the next app still runs; the run keeps to a deadline. Also the steps the one-GPU
lane scripts share: their flags by device, the pair and the cluster, a deploy with its warm-up."""

import argparse
import asyncio
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import yaml
from ray import serve

from benchmarks.lib.timelines import lane_activity, timelines
from benchmarks.lib.cluster import REPO, deploy, device_memory_note, log, replica_log_tail, start_cluster
from benchmarks.lib.loads import Load, estimate_s, request_spec_counters, warmup_requests
from benchmarks.lib.pairs import save_pair
from benchmarks.lib.results import point_line
from loadtest.arrivals import OpenLoop
from loadtest.report import Point
from loadtest.runner import run_load
from loadtest.spec_stats import SpecDecodeCounters
from loadtest.workload import LogNormal, load_tokenizer

# The served benchmarks' defaults by device: dtype, the uniform workload's log-normal lengths, the lanes' CPUs,
# timeouts. GPU: one H200 (139 GiB).
PRESETS = {
    "cuda": dict(dtype="bfloat16", prompt_len_median=128, min_prompt_len=16, max_prompt_len=384, output_len_median=128,
                 min_output_len=64, max_output_len=192, lane_num_cpus=1.0, deploy_timeout_s=180.0,
                 request_timeout_s=120.0),
    "cpu": dict(dtype="float32", prompt_len_median=32, min_prompt_len=4, max_prompt_len=96, output_len_median=16,
                min_output_len=8, max_output_len=32, lane_num_cpus=0.25, deploy_timeout_s=300.0, request_timeout_s=120.0),
}
# Lane shares of one GPU; pdv's are configs/pdv-1gpu.yaml's.
PDV_1GPU = yaml.safe_load((REPO / "configs" / "pdv-1gpu.yaml").read_text())["applications"][0]["args"]
GPU_SHARES = {"nospec": {"decode_lane": 1.0}, "spec": {"decode_lane": 1.0},
              "unified": {"decode_lane": 1.0}, "pd": {"prefill_lane": 0.35, "decode_lane": 0.65},
              "pdv": {lane: PDV_1GPU[lane]["num_gpus"] for lane in ("prefill_lane", "decode_lane", "verify_lane")}}
MAX_ONGOING = 512  # per deployment: above the most requests a run keeps in flight (Serve's default 256 is not)


def engine_args(max_model_len: int, max_num_seqs: int, draft_len: int = 3) -> dict:
    """The benchmarks' engine: L = `draft_len` (3, the best single-stream L at agreement 0.8)."""
    return {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "num_speculative_tokens": draft_len,
            "max_draft_len": max(draft_len, 8), "gpu_memory_utilization": 0.9}


def app_args(mode: str, target: Path | None, draft: Path | None, *, dtype: str, engine: dict,
             lane_num_cpus: float, one_gpu: bool, controller: bool = False) -> dict:
    """configs/<mode>.yaml's args with a benchmark's models (paths absolute: replicas may run elsewhere; None: the
    config's own), engine sizes and CPUs; every lane and the ingress admit MAX_ONGOING requests. `one_gpu`: the lanes
    share one GPU (GPU_SHARES); `controller`: the draft-length controller decides L from the first step."""
    config = yaml.safe_load((REPO / "configs" / f"{mode}.yaml").read_text())["applications"][0]["args"]
    for role, override in (("target", target), ("draft", draft)):
        config[role]["path"] = str(Path(override or REPO / config[role]["path"]).resolve())
        config[role]["dtype"] = dtype
    config["engine"] = {**config["engine"], **engine}
    config["max_queued_requests"] = MAX_ONGOING
    for lane in ("ingress", "prefill_lane", "decode_lane", "verify_lane"):
        config[lane] = {**config.get(lane, {}), "max_ongoing_requests": MAX_ONGOING}
        if lane != "ingress":
            config[lane]["num_cpus"] = lane_num_cpus
    for lane, share in (GPU_SHARES[mode] if one_gpu else {}).items():
        config[lane]["num_gpus"] = share
    if controller and mode != "nospec":
        draft_len = engine["num_speculative_tokens"]
        config["controller"] = {"enabled": True, "initial_draft_len": draft_len, "max_draft_len": max(draft_len, 8)}
    return config


@dataclass
class AppRun:
    """What one deployed app gave: its points in load order, or why it stopped."""

    name: str
    status: str = "ok"  # ok, failed
    error: str | None = None
    deploy_s: float | None = None
    points: list[tuple[Load, Point]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # load name -> why
    lanes: dict[str, dict] = field(default_factory=dict)  # load name -> the lanes' timelines read
    replica_logs: str | None = None  # the replicas' last lines, when the app failed

    def failed(self, error: str) -> None:
        self.status, self.error = "failed", error
        self.replica_logs = replica_log_tail(self.name)[-6000:]
        log(f"{self.name}: {error}\n{traceback.format_exc()}{self.replica_logs}")


def deploy_app(run: AppRun, config: dict, timeout_s: float) -> bool:
    """Deploy `config` as app `run.name`; False, the failure recorded, if it did not come up."""
    try:
        run.deploy_s = deploy(run.name, config, timeout_s)
    except Exception as exc:  # recorded; the next app still runs
        run.failed(f"deploy: {type(exc).__name__}: {exc}")
        return False
    log(f"{run.name}: deployed in {run.deploy_s:.1f} s{device_memory_note()}")
    return True


def run_loads(run: AppRun, port: int, loads: list[Load], deadline_s: float, *, request_timeout_s: float,
              seed: int, on_point: Callable[[AppRun], None] = lambda run: None,
              lanes_of: Callable[[float, float], dict] | None = None, request_counters: bool = False,
              sampler: Callable[[str, Load], Awaitable[None]] | None = None, min_load_s: float = 0.0) -> None:
    """Run `loads` in order against the deployed app `run.name`, a point each into `run`. A load whose estimate (or
    `min_load_s`) no longer fits before `deadline_s` (time.monotonic) is skipped, and no request waits past it by more
    than 10 s. `on_point(run)` after every point; `lanes_of(start_s, end_s)` reads the lanes' timelines over each
    measured point; `request_counters`: acceptance from the responses' own counters (the server's totals cover one
    ingress replica of several); `sampler(app_url, load)` runs beside every load, cancelled when it ends."""
    done = {load.name: point.summary for load, point in run.points}
    warmups = frozenset(load.name for load in loads if not load.measured)
    for load in loads:
        arrivals = load.resolve(done)
        left_s = deadline_s - time.monotonic()
        needs_s = max(min_load_s, estimate_s(load, arrivals, done, warmups)) if arrivals else 0.0
        if arrivals is None or needs_s > left_s:
            run.skipped[load.name] = (f"time budget: needs ~{needs_s:.0f} s, {left_s:.0f} s left" if arrivals
                                      else f"no completed requests at {load.rate_of} to take a rate from")
            log(f"{run.name} {load.name}: skipped ({run.skipped[load.name]})")
            continue
        timeout_s = max(10.0, min(request_timeout_s, left_s + 10))
        start_s = time.time()
        url = f"http://127.0.0.1:{port}/{run.name}"
        result = asyncio.run(beside(run_load(url, load.requests, arrivals, options=load.options, timeout_s=timeout_s,
                                             seed=seed, progress=False), sampler(url, load) if sampler else None))
        if request_counters:
            result.spec_before = SpecDecodeCounters(0, 0, 0, [])
            result.spec_after = request_spec_counters(result.records)
            result.spec_error = None
        point = Point(label=run.name, result=result, summary=result.summary())
        done[load.name] = point.summary
        run.points.append((load, point))
        log(f"{run.name} {load.name}: {point_line(point)}{device_memory_note()}")
        if lanes_of is not None and load.measured:
            run.lanes[load.name] = lanes_of(start_s, time.time())
        on_point(run)


def run_app(name: str, config: dict, port: int, loads: list[Load], deadline_s: float, *,
            deploy_timeout_s: float, **options) -> AppRun:
    """Deploy `config` as app `name`, run `loads` against it (run_loads, with `options`), delete it."""
    run = AppRun(name)
    if not deploy_app(run, config, deploy_timeout_s):
        return run
    try:
        run_loads(run, port, loads, deadline_s, **options)
    except Exception as exc:  # recorded; the next app still runs
        run.failed(f"{type(exc).__name__}: {exc}")
    finally:
        serve.delete(name)
    return run


async def beside(load: Awaitable, sampler: Awaitable[None] | None):
    """`load`'s result, with `sampler` running until it ends."""
    task = asyncio.create_task(sampler) if sampler is not None else None
    try:
        return await load
    finally:
        if task is not None:
            task.cancel()


def lane_reader(name: str, mode: str) -> Callable[[float, float], dict]:
    """`lanes_of` for run_loads: each lane's busy share and the prefill path's waits over a window, logged;
    a failure to read them is recorded instead of ending the run (a diagnostic)."""
    def read(start_s: float, end_s: float) -> dict:
        try:
            lanes = lane_activity(timelines(name, mode, start_s), start_s, end_s + 0.01)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        for key in ("prefill_path", "per_verify_ms", "engine_steps", "decode_steps"):
            if value := lanes.get(key):
                log(f"  {key}: {json.dumps(value)}")
        return lanes

    return read


def last_point(run: AppRun, load: Load) -> Point | None:
    """`load`'s point, if it was the last one run (None: it was skipped or failed)."""
    return run.points[-1][1] if run.points and run.points[-1][0] is load else None


# ---- the sizes by device, and steps the one-GPU lane scripts share (lane_faults, lane_soak, lanes_1gpu) -------

def sized_args(parser: argparse.ArgumentParser, sizes: dict[str, dict], argv: list[str] | None) -> argparse.Namespace:
    """`argv` parsed by `parser` (results.script_parser's, with --device) plus a flag per key of `sizes`, by default
    the --device's value (a list: comma-separated ints); the values in effect are set on `args` and gathered in
    `args.sizes`, and `args.dtype` is the device's (PRESETS)."""
    for key, value in sizes["cuda"].items():
        kind = (lambda text: [int(x) for x in text.split(",")]) if isinstance(value, list) else type(value)
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=None,
                            help=f"default {value} on cuda, {sizes['cpu'][key]} on cpu")
    args = parser.parse_args(argv)
    args.sizes = {key: sizes[args.device][key] if getattr(args, key) is None else getattr(args, key)
                  for key in sizes["cuda"]}
    vars(args).update(args.sizes, dtype=PRESETS[args.device]["dtype"])
    return args


def pair_and_cluster(args: argparse.Namespace) -> tuple:
    """(pair, its tokenizer, Serve's port): the constructed pair saved (benchmarks/lib/pairs.py), Ray up."""
    pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed)
    # Serve's own replica retries (not start_model_cluster's one): a replacement that fails to start, say
    # while the killed process's memory is not yet back, is retried as in a user's deployment.
    port = start_cluster({"TOKENIZERS_PARALLELISM": "false",
                          "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")})
    return pair, load_tokenizer(pair.target), port


def deploy_warm(mode: str, args: argparse.Namespace, pair, tokenizer, port: int, deadline_s: float,
                prompt_len: int, long_prompts: int = 0, long_prompt_len: int = 0) -> tuple[AppRun, dict]:
    """(run, config): `mode` as configs/<mode>.yaml on the pair, its lanes on one GPU on cuda, warmed up by a
    burst of max_num_seqs requests of about `prompt_len` tokens (CUDA graphs are captured per batch bucket
    on first use); run.status is "failed" if it did not deploy."""
    sizes, preset = args.sizes, PRESETS[args.device]
    config = app_args(mode, pair.target, pair.draft, dtype=args.dtype, lane_num_cpus=preset["lane_num_cpus"],
                      engine=engine_args(sizes["max_model_len"], sizes["max_num_seqs"]), one_gpu=args.device == "cuda")
    run = AppRun(mode)
    if deploy_app(run, config, preset["deploy_timeout_s"]):
        prompts = LogNormal(prompt_len, 0.6, 4, 3 * prompt_len)
        burst = warmup_requests(tokenizer, sizes["max_num_seqs"], args.seed + 7, prompts, long_prompts, long_prompt_len)
        run_loads(run, port, [Load("warmup", burst, OpenLoop(float("inf")), measured=False)], deadline_s,
                  request_timeout_s=preset["request_timeout_s"], seed=args.seed)
    return run, config
