"""Where a run's wall time goes: named phases, and the part of each spent compiling.

The trainer wraps each part of a run (setup, restore/init, training steps, evaluations,
checkpoints, close) in :meth:`PhaseTimer.phase`; JAX reports every trace, lowering and backend
compile through ``jax.monitoring``, and :func:`_on_duration` adds those seconds to the phase
running on that thread, so a phase's ``compile_s`` says how much of it was compilation rather
than work. The trainer writes the result as one ``timings.jsonl`` row per ``train()`` call, the
numbers ``benchmarks/sweep_overhead.py`` and the sweep results read (a trial's share of time in
training steps is what bounds how much compute a sweep can afford).

A phase started inside another pauses it (a tiered table's cache swap inside the wait for
data): each second is counted once, in the innermost phase. A phase never nests in itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

# The three stages of every compile JAX performs (jax/_src/dispatch.py). A persistent-cache hit
# happens inside the backend stage (whose event then times the load, not a compile) and also
# reports ``_CACHE_HIT``: ``compiles`` counts programs built either way, ``cache_hits`` the loads.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_COMPILE = _COMPILE_EVENTS[2]
_CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"

_local = threading.local()  # .timer: the PhaseTimer whose phase runs on this thread
_registered = False
_register_lock = threading.Lock()


def _on_duration(event: str, duration: float, **_: object) -> None:
    timer: PhaseTimer | None = getattr(_local, "timer", None)
    if timer is None or timer._current is None:
        return
    name = timer._current
    if event in _COMPILE_EVENTS:
        timer.compile_s[name] = timer.compile_s.get(name, 0.0) + duration
        if event == _BACKEND_COMPILE:
            timer.compiles[name] = timer.compiles.get(name, 0) + 1
    elif event == _CACHE_HIT:  # inside a backend-compile event, whose time covers it
        timer.cache_hits[name] = timer.cache_hits.get(name, 0) + 1


def _register() -> None:
    global _registered
    with _register_lock:
        if not _registered:
            import jax  # noqa: PLC0415

            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True


class PhaseTimer:
    """Accumulates wall seconds per phase, with compile seconds and counts inside each."""

    def __init__(self) -> None:
        _register()
        self.started_at = time.time()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.compile_s: dict[str, float] = {}
        self.compiles: dict[str, int] = {}
        self.cache_hits: dict[str, int] = {}
        self._current: str | None = None
        self._open: list[str] = []  # the phases entered, outermost first
        self._since = 0.0  # when the current phase last started or resumed

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name in self._open:
            raise RuntimeError(f"phase {name!r} started inside itself ({' > '.join(self._open)})")
        previous, outer = getattr(_local, "timer", None), self._current
        now = time.perf_counter()
        if outer is not None:  # paused until this one ends
            self.seconds[outer] = self.seconds.get(outer, 0.0) + now - self._since
        self._open.append(name)
        _local.timer, self._current, self._since = self, name, now
        try:
            yield
        finally:
            now = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._since
            self.counts[name] = self.counts.get(name, 0) + 1
            self._open.pop()
            self._current, self._since, _local.timer = outer, now, previous

    def summary(self) -> dict:
        """The JSON row: per phase ``{seconds, count, compile_s, compiles, cache_hits}`` (programs
        built, compiled or loaded from the persistent cache, and of them the loads), the
        total, and ``entered_at`` / ``exited_at`` (epoch seconds), from which a caller that
        knows when the process started and ended gets its start-up and teardown."""
        phases = {
            name: {
                "seconds": round(s, 4),
                "count": self.counts[name],
                "compile_s": round(self.compile_s.get(name, 0.0), 4),
                "compiles": self.compiles.get(name, 0),
                "cache_hits": self.cache_hits.get(name, 0),
            }
            for name, s in self.seconds.items()
        }
        return {
            "entered_at": self.started_at,
            "exited_at": time.time(),
            "total_s": round(sum(self.seconds.values()), 4),
            "compile_s": round(sum(self.compile_s.values()), 4),
            "phases": phases,
        }
