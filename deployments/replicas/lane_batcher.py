"""Continuous batching of a lane's calls: when the lane's previous forward ends, everything that
arrived meanwhile (up to `max_batch`) goes into the next one.

Why not Ray Serve's `@serve.batch`: it closes a batch once its wait timeout passes after the first
arrival, whether or not the lane is free, and queues the closed batches behind the one running
(Ray 2.60, `_BatchQueue._process_batches`). Under load that makes many small forwards run one after
another: on the CPU probe (docs/diagnoses.md) 32 requests went through 14 prefill
forwards of 2.3 prompts each while they waited about 1 s in that queue. Here a batch is formed only
when the lane can run it, so the forward holds everyone waiting, and an idle lane starts at once.
"""

import asyncio
from collections import deque
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class LaneBatcher(Generic[T, R]):
    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], max_batch: int,
                 cost: Callable[[T], int] | None = None, capacity: int | None = None):
        """`cost`, `capacity`: a batch takes items in arrival order while their costs sum to at most
        `capacity` (the prefill lane: KV blocks of the prompts against its scratch pool's), and
        always at least one item."""
        self._run = run  # one forward over a batch; returns one result per item, in order
        self._max_batch = max_batch
        self._cost = cost
        self._capacity = capacity
        self._waiting: deque[tuple[T, asyncio.Future]] = deque()
        self._arrived: asyncio.Event | None = None  # created on the replica's event loop
        self._loop_task: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        """Items not yet in a forward."""
        return len(self._waiting)

    async def submit(self, item: T) -> R:
        if self._loop_task is None:  # started lazily: the constructor may run outside the event loop
            self._arrived = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._forward_loop())
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._arrived.set()
        return await future

    async def _forward_loop(self) -> None:
        while True:
            await self._arrived.wait()
            batch = self._next_batch()
            if not self._waiting:
                self._arrived.clear()
            batch = [(item, future) for item, future in batch if not future.cancelled()]
            if batch:
                await self._forward(batch)

    def _next_batch(self) -> list[tuple[T, asyncio.Future]]:
        batch, spent = [], 0
        while self._waiting and len(batch) < self._max_batch:
            cost = self._cost(self._waiting[0][0]) if self._cost is not None else 0
            if batch and self._capacity is not None and spent + cost > self._capacity:
                break
            batch.append(self._waiting.popleft())
            spent += cost
        return batch

    async def _forward(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} gave {len(results)} results")
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch; the loop goes on
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():  # its caller may have gone (request cancelled)
                future.set_result(result)
