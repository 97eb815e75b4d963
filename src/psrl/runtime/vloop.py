"""A virtual-time asyncio event loop: the coordinator's injected clock.

The coordinator only ever waits through ``asyncio.sleep`` / ``loop.time()`` / futures, so the
*same* code runs in real time (``asyncio.run``) and in virtual time (:func:`run_virtual`). In
virtual time nothing really sleeps: whenever the loop would block with a timeout and nothing
is ready, it jumps its clock forward to the next timer instead. Tests therefore exercise the
real coordinator with a fake engine, deterministic timings and no wall-clock cost.

Rules of the clock (kept simple so tests stay deterministic):

* ``loop.time()`` starts at ``start`` and moves only when the loop is idle, exactly to the
  next scheduled timer.
* While an executor job (``asyncio.to_thread`` / ``run_in_executor``) is in flight the loop
  blocks for real until the thread reports back; virtual time does not advance meanwhile
  (thread work costs zero virtual seconds).
* If nothing is ready, no timer is scheduled and no thread is running, the program can never
  make progress: :class:`VirtualTimeDeadlock` is raised instead of hanging forever.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple

__all__ = ["VirtualTimeEventLoop", "VirtualTimeDeadlock", "run_virtual"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class VirtualTimeDeadlock(RuntimeError):
    """The loop would wait forever: no ready callback, no timer, no thread in flight."""


class _VirtualSelector(selectors.BaseSelector):
    """Wraps a real selector; a blocking ``select`` advances the loop's virtual clock instead."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.loop: VirtualTimeEventLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list:
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        loop = self.loop
        assert loop is not None
        if loop._threads_in_flight > 0:
            # A worker thread will wake us through the self-pipe; virtual time stays put.
            return self._real.select(None)
        if timeout is None:
            raise VirtualTimeDeadlock(
                f"virtual-time loop would block forever at t={loop.time():.6f}: "
                "nothing is ready, no timer is scheduled and no thread is running"
            )
        loop._advance(timeout)
        return []


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """A ``SelectorEventLoop`` whose ``time()`` is virtual; idle waits advance it instantly."""

    _scheduled: list[asyncio.TimerHandle]
    """The base loop's timer heap (earliest first): a private attribute of ``asyncio.BaseEventLoop`` that the
    stubs leave out, declared here for the one read in :meth:`_advance`."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._vtime = float(start)
        self._threads_in_flight = 0

    def time(self) -> float:
        return self._vtime

    def _advance(self, dt: float) -> None:
        """Move the clock forward to the earliest timer (``dt`` is its distance from now)."""
        target = self._vtime + max(0.0, dt)
        if self._scheduled:
            target = max(target, self._scheduled[0].when())
        self._vtime = target

    def run_in_executor(self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts) -> asyncio.Future[T]:
        fut = super().run_in_executor(executor, func, *args)
        self._threads_in_flight += 1
        fut.add_done_callback(self._thread_done)
        return fut

    def _thread_done(self, _fut: asyncio.Future) -> None:
        self._threads_in_flight -= 1

    async def shutdown_default_executor(self, *args: Any) -> None:
        # The stdlib joins the executor from a plain thread; count it so select() waits for it.
        self._threads_in_flight += 1
        try:
            await super().shutdown_default_executor(*args)
        finally:
            self._threads_in_flight -= 1


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeEventLoop` (like ``asyncio.run``)."""

    def factory() -> VirtualTimeEventLoop:
        return VirtualTimeEventLoop(start)

    with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
        return runner.run(main)
