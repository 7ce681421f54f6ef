"""Dynamic batching of scoring requests, with bounded queues (issue 20).

Requests (each a few examples) wait in one queue; a worker takes the oldest and keeps adding the
next ones while the batch stays within ``max_batch`` examples and the oldest has waited less
than ``max_wait`` seconds, then scores the batch in a thread (so the event loop keeps accepting
requests) and answers every request of it. ``workers`` such loops share the queue, each with its
own thread: co-located model instances in one process (DeepRecSys's co-location; the model's
weights are shared, XLA runs the batches concurrently).

Memory is bounded: a request that would take the queue beyond ``max_queue`` examples is refused
at once (:class:`Overloaded`, counted in ``shed``), never queued without limit. Hand-written:
serving frameworks with dynamic batching (Triton, TF Serving, Ray Serve) either do not run a
``jax.export`` artifact or bring a cluster runtime for what is a queue and a loop here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np


class Overloaded(RuntimeError):
    """The queue is full: the request was shed, not queued."""


@dataclasses.dataclass
class _Pending:
    dense: np.ndarray
    ids: np.ndarray
    future: asyncio.Future
    arrived: float


@dataclasses.dataclass
class BatchStats:
    requests: int = 0
    examples: int = 0
    batches: int = 0
    shed: int = 0
    errors: int = 0
    queued_examples: int = 0
    batch_sizes: list[int] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        sizes = self.batch_sizes or [0]
        return {"requests": self.requests, "examples": self.examples, "batches": self.batches,
                "shed": self.shed, "errors": self.errors, "queued_examples": self.queued_examples,
                "mean_batch": float(np.mean(sizes)), "max_batch": int(np.max(sizes))}  # fmt: skip


class DynamicBatcher:
    """``await batcher.score(dense [b, N], ids [b, F, H]) -> [b]``, batched with other calls.

    ``predict(dense, ids) -> scores`` runs in the batcher's threads. Start with :meth:`start`
    (inside the running loop), stop with :meth:`close`."""

    def __init__(self, predict: Callable[[np.ndarray, np.ndarray], np.ndarray], *,
                 max_batch: int = 256, max_wait: float = 0.002, max_queue: int = 4096,
                 workers: int = 1):  # fmt: skip
        if max_batch < 1 or max_queue < max_batch or workers < 1 or max_wait < 0:
            raise ValueError(f"batcher: max_batch={max_batch} >= 1, max_queue={max_queue} >= "
                             f"max_batch, workers={workers} >= 1, max_wait={max_wait} >= 0")  # fmt: skip
        self.predict = predict
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.workers = workers
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._tasks: list[asyncio.Task] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="score")
        self._head: list[_Pending] = []  # a request taken but not fitting the last batch

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(self.workers)]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)

    async def score(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        n = int(dense.shape[0])
        if n > self.max_batch:
            raise ValueError(f"a request of {n} examples exceeds max_batch={self.max_batch}")
        if self.stats.queued_examples + n > self.max_queue:
            self.stats.shed += 1
            raise Overloaded(f"overloaded: {self.stats.queued_examples} examples queued "
                             f"(max {self.max_queue}); retry later")  # fmt: skip
        fut = asyncio.get_running_loop().create_future()
        self.stats.queued_examples += n
        self.stats.requests += 1
        await self._queue.put(_Pending(dense, ids, fut, time.perf_counter()))
        return await fut

    async def _next(self) -> _Pending:
        return self._head.pop() if self._head else await self._queue.get()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next()
            batch, size = [first], int(first.dense.shape[0])
            deadline = first.arrived + self.max_wait
            while size < self.max_batch:
                try:
                    if self._queue.empty():
                        left = deadline - time.perf_counter()
                        if left <= 0:
                            break
                        nxt = await asyncio.wait_for(self._queue.get(), left)
                    else:
                        nxt = self._queue.get_nowait()
                except TimeoutError:
                    break
                if size + nxt.dense.shape[0] > self.max_batch:
                    self._head.append(nxt)  # first in the next batch
                    break
                batch.append(nxt)
                size += int(nxt.dense.shape[0])
            dense = np.concatenate([p.dense for p in batch])
            ids = np.concatenate([p.ids for p in batch])
            try:
                scores = await loop.run_in_executor(self._pool, self.predict, dense, ids)
            except Exception as e:  # every request of the batch gets the error
                self.stats.errors += 1
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                scores = None
            finally:
                self.stats.queued_examples -= size
            self.stats.batches += 1
            self.stats.examples += size
            self.stats.batch_sizes.append(size)
            if len(self.stats.batch_sizes) > 10_000:
                del self.stats.batch_sizes[:5_000]
            if scores is not None:
                start = 0
                for p in batch:
                    n = int(p.dense.shape[0])
                    if not p.future.done():
                        p.future.set_result(scores[start : start + n])
                    start += n
