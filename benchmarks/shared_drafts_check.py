"""Does a ring of drafts hand its batches over in order between two processes on one GPU?
(lanes/device/shared_drafts.py; pdv's decode and verify replicas on one GPU use it.)

    python3 benchmarks/shared_drafts_check.py --out OUT          # plain, then under NVIDIA MPS

A process that plays the decode engine puts `--batches` batches into a ring, each behind a kernel that
keeps its stream busy for `--delay-ms` first, so that each copy into the ring ends well after `put` has
returned and the slot's reference has been sent. A second process, the verify replica, maps the ring and
takes each batch as its reference arrives. Were the interprocess event not waited for, it would read a
slot before the copy into it ended, and find the values of that slot's previous batch. The check reads
every batch back and compares; it also times `put` on the host (it must not wait for the device) and the
whole hand-over. With `--mps` it runs once more with both processes as clients of MPS, as the benchmarks
run the lanes. Writes shared_drafts_check.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.mps import control_log_tail, mps_daemon  # noqa: E402
from lanes.device.shared_drafts import DraftRing, OpenRing  # noqa: E402

ROWS, WIDTH = 64, 4
SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep's unit; about a millisecond at an H200's ~2 GHz


def verify_side(conn) -> None:
    """The second process: map the ring, then read back each batch whose reference arrives."""
    ring = OpenRing(conn.recv())
    conn.send("mapped")
    while (ref := conn.recv()) is not None:
        conn.send(ring.take(ref).tolist())  # .tolist() waits for the take, which waits for the engine's copy


def check(batches: int, delay_ms: float, device_type: str = "cuda") -> dict:
    cuda = device_type == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ring = DraftRing(device, ROWS, WIDTH)
    here, there = mp.get_context("spawn").Pipe()
    verify = mp.get_context("spawn").Process(target=verify_side, args=(there,), daemon=True)
    verify.start()
    here.send(ring.handle())
    assert here.recv() == "mapped"
    wrong, put_us, round_ms = 0, [], []
    for k in range(batches):
        rows = 1 + k % ROWS
        drafts = torch.full((rows, WIDTH), k, dtype=torch.long, device=device)
        if cuda:
            torch.cuda.synchronize()
        start_s = time.perf_counter()
        if cuda:
            torch.cuda._sleep(int(delay_ms * SLEEP_CYCLES_PER_MS))  # the engine's stream busy: drafting still runs
        put_s = time.perf_counter()
        ref = ring.put(drafts)
        put_us.append((time.perf_counter() - put_s) * 1e6)
        here.send(ref)
        wrong += here.recv() != drafts.tolist()
        round_ms.append((time.perf_counter() - start_s) * 1e3)
    here.send(None)
    verify.join(10)
    ring.close()
    return {"batches": batches, "delay_ms": delay_ms, "wrong": wrong, "put_us_p50": round(statistics.median(put_us), 1),
            "put_us_max": round(max(put_us), 1), "round_ms_p50": round(statistics.median(round_ms), 3),
            "ok": wrong == 0}


def _report(conn, batches: int, delay_ms: float, device_type: str) -> None:
    conn.send(check(batches, delay_ms, device_type))


def in_new_process(batches: int, delay_ms: float, device_type: str) -> dict:
    """`check` in a process of its own (one that CUDA starts in afresh: under MPS, as an MPS client)."""
    here, there = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_report, args=(there, batches, delay_ms, device_type))
    process.start()
    result = here.recv()
    process.join(30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--mps", action="store_true", help="then once more under NVIDIA MPS")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the shared-memory ring "
                        "(a dry run of the check itself; no stream to delay)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Plain first in a process of its own: CUDA, once initialised here, would not become an MPS client.
    runs = {"plain": in_new_process(args.batches, args.delay_ms, args.device)}
    print("plain:", runs["plain"], flush=True)
    if args.mps:
        directory = Path("/tmp/vpd-mps-check")
        with mps_daemon(directory):
            runs["mps"] = in_new_process(args.batches, args.delay_ms, args.device)
        print("mps:", runs["mps"], flush=True)
        runs["mps_control_log"] = control_log_tail(directory, 40)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    (args.out / "shared_drafts_check.json").write_text(json.dumps({"device": device, **runs}, indent=1))
    if not all(run["ok"] for run in runs.values() if isinstance(run, dict)):
        raise SystemExit("a batch read back wrong")


if __name__ == "__main__":
    main()
