"""pdv's three lane replicas (decode, prefill, verify) built in one process by the app's own factories,
with Ray's handles replaced by in-process ones that copy every argument and result through pickle, as Ray
does. For questions about what the replicas' Python code holds (retention, per-request state), where a Ray
cluster would only add noise: no Serve, no router, no second process."""

import asyncio
import inspect
import os
import pickle
from functools import partial

from deployments.config import AppConfig
from deployments.factories import build_engine, build_prompt_prefiller, build_verify_lane
from deployments.replicas.engine_replica import EngineServer
from deployments.replicas.prefill_replica import PrefillServer
from deployments.replicas.verify_replica import VerifyServer
from lanes.sample.params import SamplingParams


def _copied(value):
    return pickle.loads(pickle.dumps(value))


class _Method:
    def __init__(self, target, name: str):
        self.target, self.name = target, name

    def remote(self, *args, **kwargs):
        args, kwargs = _copied((args, kwargs))

        async def call():
            result = getattr(self.target, self.name)(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return _copied(result)

        return asyncio.get_running_loop().create_task(call())


class InProcessHandle:
    """A DeploymentHandle to one replica object of this process: `handle.method.remote(...)` is a task."""

    def __init__(self):
        self.target = None

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self.target, name)


def build_pdv(target: str, draft: str, **engine) -> tuple[EngineServer, PrefillServer, VerifyServer]:
    """(decode, prefill, verify) replicas of a pdv app on CPU, wired to each other in process."""
    lane = {"num_cpus": 0.05}
    config = AppConfig.model_validate({
        "mode": "pdv", "target": {"path": target}, "draft": {"path": draft},
        "engine": {"max_model_len": 256, "max_num_seqs": 8, "num_speculative_tokens": 3,
                   "prefill_chunk_tokens": 32, **engine},
        "ingress": lane, "prefill_lane": lane, "verify_lane": lane, "decode_lane": lane,
    })
    to_verify, to_prefill = InProcessHandle(), InProcessHandle()
    verify = VerifyServer(partial(build_verify_lane, config), config.mode)
    to_verify.target = verify
    prefill = PrefillServer(partial(build_prompt_prefiller, config), config.mode, to_verify)
    to_prefill.target = prefill
    decode = EngineServer(partial(build_engine, config), config.mode, prefill=to_prefill, verify=to_verify)
    return decode, prefill, verify


async def drive(decode: EngineServer, prompts: list[list[int]], first: int, count: int, concurrency: int,
                max_tokens: int) -> int:
    """Requests first .. first + count - 1 (prompt i % len(prompts)), `concurrency` at once, greedy; the
    tokens they made. A request that ends with an error raises."""
    limit = asyncio.Semaphore(concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> int:
        async with limit:
            made = 0
            async for out in decode.generate(prompts[i % len(prompts)], params, f"cmpl-{i:08d}-{os.urandom(6).hex()}"):
                assert not getattr(out, "error", None), out
                made += len(out.token_ids)
            return made

    return sum(await asyncio.gather(*(one(i) for i in range(first, first + count))))


def per_request_state(decode: EngineServer, prefill: PrefillServer, verify: VerifyServer) -> dict[str, int]:
    """Sizes of every container the three replicas key by request (or by a request's slot): all 0 once
    the requests they served have ended."""
    core = decode.engine.core
    return {
        "decode streams": len(decode.engine._streams), "decode inbox": len(decode.engine._inbox),
        "scheduler requests": len(core.scheduler.by_id), "detokenizers": len(core._detok),
        "lost requests": len(core._lost), "prefills submitted": len(core.prefiller._submitted),
        "prefills done": len(core.prefiller._done), "verify slot owners": len(verify.owners._by_slot),
        "verify slots used": verify.lane.pool.num_used, "prefill batcher waiting": prefill.batcher.waiting,
    }
