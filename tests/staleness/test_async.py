"""The asyncio API: waiters wake on events (no polling), StaleVersionError while waiting, cancellation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from psrl.staleness import StalenessManager, StaleVersionError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def test_reserve_waits_until_a_slot_frees():
    """A refused reserve is admitted as soon as an abort releases a slot."""

    async def main():
        m = StalenessManager(staleness=0, batch_size=1, group_size=1)
        first = await m.reserve(0)
        waiter = asyncio.ensure_future(m.reserve(0))
        await asyncio.sleep(0)
        assert not waiter.done()
        m.abort(first)
        second = await waiter
        assert m.blocking(0) == [second]

    run(main())


def test_next_batch_waits_for_ready_buffer():
    """next_batch returns the batch once the B-th group occupies buffer T."""

    async def main():
        m = StalenessManager(staleness=1, batch_size=2, group_size=1)
        consumer = asyncio.ensure_future(m.next_batch())
        ids = [await m.reserve(0) for _ in range(2)]
        m.complete(ids[0], "a", 0)
        await asyncio.sleep(0)
        assert not consumer.done()
        m.complete(ids[1], "b", 0)
        batch = await consumer
        assert batch.groups == [["a"], ["b"]] and m.train_version == 1

    run(main())


def test_waiting_reserve_becomes_stale():
    """A reserve waiting at version v raises StaleVersionError once T passes v + eta."""

    async def main():
        m = StalenessManager(staleness=0, batch_size=1, group_size=1)
        eid = await m.reserve(0)
        waiter = asyncio.ensure_future(m.reserve(0))
        await asyncio.sleep(0)
        m.complete(eid, "x", 0)
        m.consume()
        with pytest.raises(StaleVersionError):
            await waiter

    run(main())


def test_a_waiting_reserve_follows_the_bound_in_force():
    """A fall of the bound makes a waiting reserve stale at once; a raise admits a refused one."""

    async def main():
        m = StalenessManager(staleness=1, batch_size=1, group_size=1, max_staleness=2)
        first = await m.reserve(0)
        m.complete(first, "x", 0)
        m.consume()  # T = 1
        assert await m.reserve(0) is not None  # 0 + 1 >= 1: buffer 1
        waiter = asyncio.ensure_future(m.reserve(0))  # buffer 1 is full: it waits
        await asyncio.sleep(0)
        assert not waiter.done()
        m.set_staleness(2)  # buffer 2 is admissible now
        admitted = await waiter
        assert m.blocking(2) == [admitted]
        stale = asyncio.ensure_future(m.reserve(0))  # buffers 1 and 2 are full: it waits
        await asyncio.sleep(0)
        m.set_staleness(0)  # 0 + 0 < T = 1
        with pytest.raises(StaleVersionError):
            await stale

    run(main())


def test_cancelled_waiter_does_not_disturb_others():
    """Cancelling one waiting reserve leaves other waiters able to wake."""

    async def main():
        m = StalenessManager(staleness=0, batch_size=1, group_size=1)
        first = await m.reserve(0)
        w1 = asyncio.ensure_future(m.reserve(0))
        w2 = asyncio.ensure_future(m.reserve(0))
        await asyncio.sleep(0)
        w1.cancel()
        await asyncio.sleep(0)
        m.abort(first)
        assert (await w2) is not None
        assert w1.cancelled()

    run(main())


def test_wakeup_from_another_thread():
    """A change made by another thread wakes a waiter of the event loop."""

    async def main():
        m = StalenessManager(staleness=0, batch_size=1, group_size=1)
        eid = await m.reserve(0)
        consumer = asyncio.ensure_future(m.next_batch())
        await asyncio.sleep(0)
        t = threading.Thread(target=m.complete, args=(eid, "x", 0))
        t.start()
        batch = await consumer
        t.join()
        assert batch.groups == [["x"]]

    run(main())


def test_pipeline_end_to_end():
    """Producers and a trainer coroutine run concurrently; every batch respects the bound."""

    async def main():
        eta, B, N, steps = 1, 3, 2, 6
        m = StalenessManager(staleness=eta, batch_size=B, group_size=N)
        versions = []

        async def producer(k):
            while m.train_version < steps:
                v = m.train_version
                try:
                    eid = await m.reserve(v)
                except StaleVersionError:
                    continue
                for i in range(N):
                    await asyncio.sleep(0)
                    m.complete(eid, (k, i, v), v)

        async def trainer():
            for _ in range(steps):
                batch = await m.next_batch()
                versions.extend(batch.version - t[2] for g in batch.groups for t in g)

        producers = [asyncio.ensure_future(producer(k)) for k in range(4)]
        await trainer()
        for p in producers:
            p.cancel()
        await asyncio.gather(*producers, return_exceptions=True)
        assert len(versions) == steps * B * N
        assert max(versions) <= eta

    run(main())
