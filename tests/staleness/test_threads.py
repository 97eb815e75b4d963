"""Thread hammer: many threads reserve/complete/abort while one consumes; counts stay exact."""

from __future__ import annotations

import random
import threading

from psrl.staleness import StalenessManager, StaleVersionError


def test_thread_hammer_keeps_bound_and_conservation():
    """Under contention no count goes wrong: every trained trajectory is within eta and none is trained twice."""
    eta, B, N, steps = 2, 4, 2, 40
    m = StalenessManager(staleness=eta, batch_size=B, group_size=N, redundant_batch_size=5, redundant_group_size=3)
    stop = threading.Event()
    trained = []
    errors = []

    def producer(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                v = m.train_version
                try:
                    eid = m.try_reserve(v)
                except StaleVersionError:
                    continue
                if eid is None:
                    m.drain_aborted()
                    continue
                if rng.random() < 0.05:
                    m.abort(eid)
                    continue
                for i in range(3):
                    m.complete(eid, (seed, eid, i, v), v)
        except Exception as exc:  # surfaced to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    done = 0
    while done < steps and not errors:
        if m.ready():
            batch = m.consume()
            for g in batch.groups:
                assert len(g) == N
                trained.extend((batch.version, t) for t in g)
            done += 1
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert len(trained) == steps * B * N == len({t for _, t in trained})
    assert all(c - t[3] <= eta for c, t in trained)
    hist = m.stats.staleness_hist
    assert sum(hist) == steps * B and len(hist) == eta + 1
    for b in range(m.train_version, m.train_version + eta + 1):
        r, o, e = m.counts(b)
        assert r >= 0 and o >= 0 and e >= 0
