"""The virtual-time event loop: the injected clock every coordinator test runs on."""

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.runtime.vloop import VirtualTimeDeadlock, VirtualTimeEventLoop, run_virtual


async def _sleep_and_read(delay: float) -> float:
    await asyncio.sleep(delay)
    return asyncio.get_running_loop().time()


def test_long_sleeps_cost_no_real_time():
    """A million virtual seconds pass instantly, and time() reports exactly the slept amount."""
    t0 = time.monotonic()
    assert run_virtual(_sleep_and_read(1e6)) == pytest.approx(1e6)
    assert time.monotonic() - t0 < 1.0


def test_start_time_is_honoured():
    """run_virtual(start=...) sets the clock's origin."""
    assert run_virtual(_sleep_and_read(2.5), start=100.0) == pytest.approx(102.5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=1, max_size=12))
def test_concurrent_sleepers_wake_at_their_own_deadline(delays):
    """Each of several concurrent sleepers wakes exactly at its delay; the loop ends at the max."""

    async def main():
        woke = await asyncio.gather(*(_sleep_and_read(d) for d in delays))
        return woke, asyncio.get_running_loop().time()

    woke, end = run_virtual(main())
    for d, w in zip(delays, woke):
        assert w == pytest.approx(d, abs=1e-6)
    assert end == pytest.approx(max(delays), abs=1e-6)


def test_wait_for_timeout_fires_in_virtual_time():
    """A timeout on something that never happens fires at its virtual deadline."""

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 30.0)
        return asyncio.get_running_loop().time()

    assert run_virtual(main()) == pytest.approx(30.0)


def test_thread_work_is_awaited_and_costs_no_virtual_time():
    """to_thread really waits for the thread; the virtual clock does not move meanwhile."""

    def work():
        time.sleep(0.02)
        return 42

    async def main():
        loop = asyncio.get_running_loop()
        before = loop.time()
        out = await asyncio.to_thread(work)
        return out, loop.time() - before

    out, dt = run_virtual(main())
    assert out == 42 and dt == 0.0


def test_timers_keep_running_while_a_thread_works():
    """Callbacks that are ready still run while a thread is in flight (the loop is not frozen)."""

    def work():
        time.sleep(0.05)

    async def ticker(seen):
        for _ in range(3):
            seen.append("tick")
            await asyncio.sleep(0)

    async def main():
        seen = []
        await asyncio.gather(asyncio.to_thread(work), ticker(seen))
        return seen

    assert run_virtual(main()) == ["tick"] * 3


def test_waiting_forever_raises_instead_of_hanging():
    """Nothing ready, no timer, no thread: VirtualTimeDeadlock, not a hang."""

    async def main():
        await asyncio.Event().wait()

    with pytest.raises(VirtualTimeDeadlock):
        run_virtual(main())


def test_is_a_selector_event_loop():
    """The virtual loop is a real SelectorEventLoop (sockets, call_soon_threadsafe work as usual)."""
    loop = VirtualTimeEventLoop()
    try:
        assert isinstance(loop, asyncio.SelectorEventLoop)
        assert loop.time() == 0.0
    finally:
        loop.close()
