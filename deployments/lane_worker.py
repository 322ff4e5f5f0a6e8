"""A single worker thread per replica for GPU work, so the replica's event loop stays responsive
and every mutation of a lane's pool is serialised without locks. On a GPU the thread issues its
work on a stream of the lane's priority (lanes/streams.py), which also orders lanes of different
replicas that share the GPU."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from lanes.streams import lane_stream

T = TypeVar("T")


class LaneWorker:
    def __init__(self, name: str, device: torch.device, priority: int):
        stream = lane_stream(device, priority)

        def use_lane_stream():
            if stream is not None:
                torch.cuda.set_stream(stream)

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=use_lane_stream)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
