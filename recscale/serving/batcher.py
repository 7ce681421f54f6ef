"""Dynamic batching of scoring requests, with bounded queues (issue 20).

Requests (each a few examples) wait in one FIFO queue. Whenever one of ``workers`` threads is
free, a batch is formed from the oldest request and the next ones while it stays within
``max_batch`` examples and the oldest has waited less than ``max_wait`` seconds; it is scored in
that thread (the event loop keeps accepting requests) and every request of it answered.
``workers`` > 1: co-located model instances in one process (DeepRecSys's co-location; the
weights are shared, XLA runs the batches concurrently). A model with several programs (a
next-item model's top-K and candidate scoring) names each request's ``entry``: a batch holds
requests of one entry, the oldest request's and the next ones of it.

Memory is bounded: a request that would take the queue beyond ``max_queue`` examples is refused
at once (:class:`Overloaded`, counted in ``shed``), never queued without limit. Hand-written:
serving frameworks with dynamic batching (Triton, TF Serving, Ray Serve) either do not run a
``jax.export`` artifact or bring a cluster runtime for what is a queue and a loop here.
"""

from __future__ import annotations

import asyncio
import collections
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
    inputs: tuple[np.ndarray, ...]
    future: asyncio.Future
    arrived: float
    entry: str = ""

    @property
    def size(self) -> int:
        return int(self.inputs[0].shape[0])


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
        return {
            "requests": self.requests,
            "examples": self.examples,
            "batches": self.batches,
            "shed": self.shed,
            "errors": self.errors,
            "queued_examples": self.queued_examples,
            "mean_batch": float(np.mean(sizes)),
            "max_batch": int(np.max(sizes)),
        }


class DynamicBatcher:
    """``await batcher.score(dense [b, N], ids [b, F, H]) -> [b]``, batched with other calls.

    One collector forms batches in arrival order, each as soon as a worker is free: from the
    oldest waiting request, adding the next ones of its entry while the batch stays within
    ``max_batch`` examples and the oldest has waited less than ``max_wait``.
    ``predict(*inputs) -> outputs`` (``predict[entry]``, where it is a dict of entries) runs in
    one of ``workers`` threads on the requests' inputs concatenated along their first axis; its
    output, an array or a tuple of them, is split back along theirs. Start with :meth:`start`
    (inside the running loop); stop with :meth:`close`, which fails every request not yet
    answered."""

    def __init__(
        self,
        predict: Callable[..., Any] | dict[str, Callable[..., Any]],
        *,
        max_batch: int = 256,
        max_wait: float = 0.002,
        max_queue: int = 4096,
        workers: int = 1,
    ):
        if max_batch < 1 or max_queue < max_batch or workers < 1 or max_wait < 0:
            raise ValueError(
                f"batcher: max_batch={max_batch} >= 1, max_queue={max_queue} >= "
                f"max_batch, workers={workers} >= 1, max_wait={max_wait} >= 0"
            )
        self.predict = predict
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.workers = workers
        self.stats = BatchStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._free: asyncio.Semaphore | None = None
        self._collector: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="score")
        self._closed = False

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._free = asyncio.Semaphore(self.workers)
        self._collector = asyncio.create_task(self._collect())

    async def close(self) -> None:
        self._closed = True
        if self._collector is not None:
            self._collector.cancel()
            await asyncio.gather(self._collector, return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)  # batches in flight finish
        self._fail_pending(RuntimeError("the batcher was closed"))
        self._pool.shutdown(wait=True)

    def _fail_pending(self, err: Exception) -> None:
        while self._pending:
            p = self._pending.popleft()
            self.stats.queued_examples -= p.size
            if not p.future.done():
                p.future.set_exception(err)

    async def score(self, *inputs: np.ndarray, entry: str = "") -> Any:
        if self._closed:
            raise RuntimeError("the batcher is closed")
        n = int(inputs[0].shape[0])
        if n > self.max_batch:
            raise ValueError(f"a request of {n} examples exceeds max_batch={self.max_batch}")
        if self.stats.queued_examples + n > self.max_queue:
            self.stats.shed += 1
            raise Overloaded(
                f"overloaded: {self.stats.queued_examples} examples queued "
                f"(max {self.max_queue}); retry later"
            )
        fut = asyncio.get_running_loop().create_future()
        self.stats.queued_examples += n
        self.stats.requests += 1
        self._pending.append(_Pending(inputs, fut, time.perf_counter(), entry))
        self._arrived.set()
        return await fut

    async def _collect(self) -> None:
        while True:
            await self._free.acquire()  # a worker is free: form the next batch
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            first = self._pending[0]
            deadline = first.arrived + self.max_wait
            while True:  # wait for the batch to fill, until the oldest's deadline
                size, batch, full = 0, [], False
                for p in self._pending:
                    if p.entry != first.entry:
                        continue
                    if size + p.size > self.max_batch:
                        full = True
                        break
                    size += p.size
                    batch.append(p)
                full = full or size >= self.max_batch
                left = deadline - time.perf_counter()
                if full or left <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    pass
            taken = {id(p) for p in batch}
            self._pending = collections.deque(p for p in self._pending if id(p) not in taken)
            task = asyncio.create_task(self._run(batch, size))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[_Pending], size: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            inputs = [np.concatenate(x) for x in zip(*(p.inputs for p in batch), strict=True)]
            fn = self.predict[batch[0].entry] if isinstance(self.predict, dict) else self.predict
            out = await loop.run_in_executor(self._pool, fn, *inputs)
        except BaseException as e:  # every request of the batch gets the error
            self.stats.errors += 1
            err = e if isinstance(e, Exception) else RuntimeError("scoring was cancelled")
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(err)
            if not isinstance(e, Exception):
                raise
            return
        finally:
            self.stats.queued_examples -= size
            self.stats.batches += 1
            self.stats.examples += size
            self.stats.batch_sizes.append(size)
            if len(self.stats.batch_sizes) > 10_000:
                del self.stats.batch_sizes[:5_000]
            self._free.release()
        start = 0
        for p in batch:
            n = p.size
            part = (
                tuple(o[start : start + n] for o in out)
                if isinstance(out, tuple)
                else out[start : start + n]
            )
            if not p.future.done():
                p.future.set_result(part)
            start += n
