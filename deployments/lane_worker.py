"""A single worker thread per replica for GPU work, so the replica's event loop stays responsive
and every mutation of a lane's pool is serialised without locks."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class LaneWorker:
    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
