"""Conformance: hundreds of random schedules driven through the spec's public API only.

Covers all four buffer states, both redundancy levels, a group filter, aborts, snapshot/restore
and the asyncio API; every answer is compared with the reference model written from the spec.
"""

from __future__ import annotations

import asyncio
import pickle
import random

import pytest

from psrl.staleness import BufferState, NotReadyError, StalenessManager, StaleVersionError

from .reference import RefManager


class OddSum:
    """Picklable filter: drops a group whose member numbers sum to a multiple of 3."""

    def __call__(self, group):
        return sum(t[1] for t in group) % 3 != 0


async def settle(task):
    """Let a just-created task run as far as it can without anything else changing."""
    for _ in range(3):
        await asyncio.sleep(0)
    return task.done()


async def run_schedule(seed: int, seen_states: set) -> None:
    rng = random.Random(seed)
    eta = rng.randint(0, 3)
    B = rng.randint(1, 3)
    Bp = B + rng.choice([0, 0, 1, 2])
    N = rng.randint(1, 3)
    Np = N + rng.choice([0, 0, 1])
    flt = OddSum() if rng.random() < 0.3 else None
    use_async = rng.random() < 0.5
    m = StalenessManager(
        staleness=eta, batch_size=B, group_size=N, redundant_batch_size=Bp, redundant_group_size=Np, group_filter=flt
    )
    ref = RefManager(eta, B, N, Bp, group_filter=flt)
    ids, counter = [], 0
    for _ in range(80):
        op = rng.choices(["reserve", "complete", "abort", "consume", "drain", "snap"], [4, 8, 1, 2, 1, 0.5])[0]
        T = m.train_version
        if op == "reserve":
            v = T - rng.randint(-1, eta + 1)
            probe = RefManager.__new__(RefManager)
            probe.__dict__ = pickle.loads(pickle.dumps(ref.__dict__))
            predicted, r = probe.reserve(v, "probe")
            if use_async and predicted in ("ok", "refused"):
                task = asyncio.ensure_future(m.reserve(v))
                done = await settle(task)
                assert done == (predicted == "ok"), (seed, predicted)
                if not done:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    continue
                eid = task.result()
            else:
                try:
                    eid = m.try_reserve(v)
                except StaleVersionError:
                    assert predicted == "stale", seed
                    continue
                except ValueError:
                    assert predicted == "value", seed
                    continue
                if eid is None:
                    assert predicted == "refused", seed
                    continue
            assert predicted == "ok", (seed, predicted)
            assert ref.reserve(v, eid) == ("ok", r)
            assert eid in m.blocking(r)
            ids.append((eid, v))
        elif op == "complete" and ids:
            eid, v = rng.choice(ids)
            version = min(v + rng.randint(0, 1), T)
            counter += 1
            traj = (eid, counter, version)
            want = ref.complete(eid, traj, version)
            got = m.complete(eid, traj, version)
            assert (got.status, got.buffer) == want, seed
        elif op == "abort" and ids:
            eid, _ = rng.choice(ids)
            want = ref.abort(eid)
            try:
                assert m.abort(eid) == want, seed
            except ValueError:
                assert want == "value", seed
        elif op == "consume":
            want = ref.consume()
            if use_async and want is not None:
                task = asyncio.ensure_future(m.next_batch())
                assert await settle(task), seed
                batch = task.result()
            else:
                try:
                    batch = m.consume()
                except NotReadyError:
                    assert want is None, seed
                    continue
            assert batch.groups == want, seed
            assert all(batch.version - t[2] <= eta for g in batch.groups for t in g), seed
        elif op == "drain":
            assert sorted(m.drain_aborted()) == sorted(ref.drain()), seed
        elif op == "snap":
            m = StalenessManager.restore(pickle.loads(pickle.dumps(m.snapshot())), group_filter=flt)
        T = m.train_version
        assert T == ref.T
        for b in range(T, T + eta + 2):
            s = m.state(b)
            assert s == ref.state(b), seed
            assert sorted(m.blocking(b)) == sorted(ref.blocking(b)), seed
            seen_states.add(BufferState(s))


def test_random_schedules_match_the_spec():
    """300 random schedules; all four buffer states must be visited along the way."""
    seen: set = set()

    async def main():
        for seed in range(300):
            await run_schedule(seed, seen)

    asyncio.run(main())
    assert seen == set(BufferState)


@pytest.mark.parametrize("seed", [0, 1])
def test_snapshot_survives_pickle_of_trajectories(seed):
    """A restored manager hands out the same batches as the original."""
    rng = random.Random(seed)
    a = StalenessManager(staleness=1, batch_size=2, group_size=2)
    ids = [a.try_reserve(0) for _ in range(3)]
    for eid in ids:
        a.complete(eid, rng.random(), 0)
    b = StalenessManager.restore(pickle.loads(pickle.dumps(a.snapshot())))
    for m in (a, b):
        for eid in ids:
            m.complete(eid, "second", 0)
    assert a.consume() == b.consume()
