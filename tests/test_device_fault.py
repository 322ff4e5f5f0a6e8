"""A failed forward that leaves the device unusable (a sticky CUDA error) stops the engine and fails
the replica's health check, in every form the engine runs in (issue 15, item 1). A lane that loses a
tensor-parallel worker rank fails its work at once as well.

On the CPU there is no sticky state, so these tests inject the finding (what `device_fault` would
return after an illegal memory access) together with a failing verify forward; the last test makes
a real device-side assert on a GPU, where there is one, and checks that the probe finds it.
"""

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deployments.replicas.lane_worker import LaneLost, LaneWorker
from lanes.engine.async_engine import AsyncEngine
from lanes.engine.process import ProcessEngine
from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import pair_engine, random_prompts

FAULT = "AcceleratorError: CUDA error: an illegal memory access was encountered (injected)"
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def _fail_verify_after(core, good_steps: int, before_raise=None):
    """Make the engine's verify forward raise after `good_steps` good ones (what a kernel fault does),
    launched as scheduled (`launch`) or ahead of the step it follows (the verify lane's `launch_after`)."""
    calls = [0]

    def failing(launch):
        def launch_or_fail(*args):
            calls[0] += 1
            if calls[0] > good_steps:
                if before_raise is not None:
                    before_raise()
                raise RuntimeError("verify forward failed")
            return launch(*args)
        return launch_or_fail

    core.verifier.launch = failing(core.verifier.launch)
    core.verifier.lane.launch_after = failing(core.verifier.lane.launch_after)
    return core


def faulty_engine():
    """An engine whose device turns unusable after its third verify (built in the engine process)."""
    import lanes.engine.core

    lanes.engine.core.device_fault = lambda device: FAULT
    return _fail_verify_after(pair_engine("llama"), good_steps=3)


async def _outcomes(engine, prompts) -> list[str]:
    """How each stream ended: "tokens" (completed), or the error it ended with."""
    async def one(prompt):
        try:
            async for out in engine.generate(prompt, PARAMS):
                if out.error is not None:  # the requests of the failed batch end with an error output
                    return out.error
        except Exception as exc:  # the others fail with the engine
            return f"{type(exc).__name__}: {exc}"
        return "tokens"

    return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)


def _all_failed(outcomes: list[str]) -> bool:
    return all(o.startswith(("RuntimeError", "EngineDeviceFault")) for o in outcomes)


async def _refused_after(engine) -> str:
    """A request that arrives after the fault fails at once instead of waiting on a stopped loop."""
    return (await asyncio.wait_for(_outcomes(engine, [[1, 2, 3]]), 5))[0]


def test_lane_worker_reports_a_device_fault_after_a_failed_job(monkeypatch):
    monkeypatch.setattr("deployments.replicas.lane_worker.device_fault", lambda device: FAULT)
    worker = LaneWorker("test", torch.device("cpu"), 0)

    def boom():
        raise RuntimeError("forward failed")

    async def main():
        assert await worker.run(lambda: 7) == 7
        assert worker.problem() is None
        with pytest.raises(RuntimeError, match="forward failed"):
            await worker.run(boom)

    asyncio.run(main())
    assert "illegal memory access" in worker.problem()


def test_lane_worker_without_a_device_fault_stays_healthy_after_a_failed_job():
    worker = LaneWorker("test", torch.device("cpu"), 0)

    async def main():
        with pytest.raises(ZeroDivisionError):
            await worker.run(lambda: 1 / 0)
        assert await worker.run(lambda: 3) == 3

    asyncio.run(main())
    assert worker.problem() is None  # on the CPU a failed job fails its own batch only


def test_lane_worker_reports_a_job_that_runs_past_the_wedge_bound():
    worker = LaneWorker("test", torch.device("cpu"), 0)

    async def main():
        job = asyncio.ensure_future(worker.run(time.sleep, 0.5))
        await asyncio.sleep(0.2)
        wedged = worker.problem(wedged_after_s=0.1)
        await job
        return wedged

    assert "has run for" in asyncio.run(main())
    assert worker.problem(wedged_after_s=0.1) is None


def test_a_lane_that_loses_a_worker_rank_fails_the_job_it_waits_on_and_every_later_one_at_once():
    # A prefill or verify replica's tensor-parallel worker rank ended: the job on the thread would wait
    # on it in a collective (here: a job that takes 5 s). The caller must not wait for it.
    worker = LaneWorker("test", torch.device("cpu"), 0)
    stuck = threading.Event()

    async def main():
        job = asyncio.ensure_future(worker.run(stuck.wait, 5.0))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        worker.lose("tensor-parallel worker rank 1 is gone (ActorDiedError)")
        with pytest.raises(LaneLost, match="rank 1 is gone"):
            await job
        failed_after_s = time.monotonic() - start
        with pytest.raises(LaneLost):
            await worker.run(lambda: 3)
        stuck.set()
        return failed_after_s

    assert asyncio.run(main()) < 0.5
    assert "rank 1 is gone" in worker.problem()


def test_engine_thread_stops_and_fails_every_stream_on_a_device_fault(monkeypatch):
    monkeypatch.setattr("lanes.engine.core.device_fault", lambda device: FAULT)
    prompts = random_prompts(4, VOCAB, 5, 20, seed=3)

    async def main():
        engine = AsyncEngine(_fail_verify_after(pair_engine("llama"), good_steps=3))
        try:
            outcomes = await _outcomes(engine, prompts)
            await asyncio.sleep(0.2)
            return outcomes, engine.problem(60.0), engine.loop_alive(), await _refused_after(engine)
        finally:
            engine.shutdown()

    outcomes, problem, alive, later = asyncio.run(main())
    assert _all_failed(outcomes), outcomes
    assert "device is unusable" in problem and "illegal memory access" in problem
    assert not alive
    assert later.startswith("EngineDeviceFault"), later


def test_engine_process_exits_and_fails_every_stream_on_a_device_fault():
    prompts = random_prompts(4, VOCAB, 5, 20, seed=4)

    async def main():
        engine = ProcessEngine(faulty_engine)
        try:
            outcomes = await _outcomes(engine, prompts)
            engine._proc.wait(timeout=30)
            await asyncio.sleep(0.2)  # the reader thread sees the socket close
            return outcomes, engine.problem(60.0), await _refused_after(engine)
        finally:
            engine.shutdown()

    outcomes, problem, later = asyncio.run(main())
    assert _all_failed(outcomes), outcomes
    assert "illegal memory access" in problem  # the process is gone, not serving on a dead context
    assert later.startswith("EngineDeviceFault"), later


CUDA_PROBE = """
import torch
from lanes.device.fault import device_fault
device = torch.device("cuda")
print("before:", device_fault(device))
try:
    torch.zeros(4, device=device)[torch.tensor([1 << 20], device=device)].cpu()  # device-side assert
except Exception as exc:
    print("gather:", type(exc).__name__)
print("after:", device_fault(device))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a sticky CUDA error needs a GPU")
def test_probe_finds_a_real_device_side_assert():
    # In a child process: the error poisons the CUDA context of the process that meets it.
    out = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    assert "before: None" in out, out
    after = out.split("after:")[1]
    assert "None" not in after and "CUDA" in after, out
