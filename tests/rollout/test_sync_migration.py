"""Sync (``greedy``, ``status_based`` per indicator, ``check_req_before_sync``, ``seamless_train_version``),
migration as load balancing (start and stop thresholds; tokens and V_traj kept; sync first), and
``interrupt_as_prompt`` both ways.

Instances on :class:`FakeEngine` in virtual time: a decode step over ``k`` rows costs ``k * token_cost``;
the fake's tokens are a pure function of the sequence, so a request continued anywhere must produce
exactly the tokens of uninterrupted generation (``reference_tokens``).
"""

import asyncio
from types import SimpleNamespace

import pytest

from psrl.errors import ConfigError
from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.fakes import FakeEngine
from psrl.rollout.serving.instance import RolloutInstance
from psrl.rollout.serving.router import RoundRobinRouter
from psrl.rollout.serving.session import Session
from psrl.rollout.serving.sync import GreedySync, Migration, StatusBasedSync, build_migration, build_sync
from psrl.runtime.vloop import run_virtual
from psrl.types import EngineLoad
from psrl.weights import ParameterStore
from tests.rollout.harness import pool_of, stub_pool
from tests.rollout.test_rollout_instance import CTX, reference_tokens


def store_at(version=0):
    store = ParameterStore(keep=4)
    store.publish(version, {"v": version})
    return store


def stub(in_flight=0, tps=0.0, kv=None, version=0, queued=0):
    ld = EngineLoad(in_flight, queued, tps, kv)
    return SimpleNamespace(in_flight=in_flight, queued=queued, version=version, load=lambda: ld)


def train_at(version, staleness):
    return SimpleNamespace(train_version=version, staleness=staleness)


TRAIN_AT_1 = train_at(1, 3)


# ---------------------------------------------------------------------------- sync strategies


def test_greedy_pulls_as_soon_as_a_version_exists():
    assert GreedySync(TRAIN_AT_1).should_pull(stub(in_flight=9), latest=1)


@pytest.mark.parametrize(
    "indicator, threshold, below, at",
    [
        ("request_num", 2, stub(in_flight=1), stub(in_flight=2)),
        ("throughput", 50.0, stub(tps=49.9), stub(tps=50.0)),
        ("kv_cache", 0.3, stub(kv=0.29), stub(kv=0.3)),
    ],
)
def test_status_based_pulls_only_below_its_threshold(indicator, threshold, below, at):
    """Each indicator reads its own figure of the instance; equal to the threshold keeps the weights."""
    sync = StatusBasedSync(indicator, threshold, versions=TRAIN_AT_1)
    assert sync.should_pull(below, latest=1) and not sync.should_pull(at, latest=1)


@pytest.mark.parametrize("indicator", ["request_num", "throughput", "kv_cache"])
def test_status_based_never_holds_back_an_instance_too_old_to_reserve_at(indicator):
    """version + staleness < train_version: the instance could only idle, so it pulls whatever its status."""
    sync = StatusBasedSync(indicator, 0.0, versions=train_at(2, 1))
    busy = dict(in_flight=9, tps=1e6, kv=1.0, queued=3)
    assert sync.should_pull(stub(version=0, **busy), latest=2)
    assert not sync.should_pull(stub(version=1, **busy), latest=2)


def test_an_instance_is_too_old_by_the_bound_in_force_not_the_bound_at_build():
    """The adaptive controller lowers the manager's bound: the stale-version escape follows it at once."""
    versions = train_at(3, 2)
    sync = StatusBasedSync("request_num", 0.0, versions=versions)
    old = stub(version=1, in_flight=9, queued=3)
    assert not sync.should_pull(old, latest=3)  # 1 + 2 >= 3: it may still reserve, and it is busy
    versions.staleness = 1
    assert sync.should_pull(old, latest=3)  # 1 + 1 < 3: it could only idle now


def test_check_req_before_sync_waits_for_the_queue():
    on = GreedySync(TRAIN_AT_1, check_req_before_sync=True)
    off = GreedySync(TRAIN_AT_1, check_req_before_sync=False)
    assert not on.should_pull(stub(queued=1), latest=1) and on.should_pull(stub(queued=0), latest=1)
    assert off.should_pull(stub(queued=1), latest=1)


@pytest.mark.parametrize("latest, pulls", [(2, False), (3, True)])
def test_seamless_train_version_holds_pulls_up_to_it(latest, pulls):
    """Versions <= seamless_train_version are not pulled (boundary: equal holds), while the instance is usable."""
    sync = GreedySync(TRAIN_AT_1, seamless_train_version=2)
    assert sync.should_pull(stub(), latest=latest) is pulls


def test_build_sync_reads_the_config_section():
    sm = SimpleNamespace(
        method="status_based",
        sync=SimpleNamespace(
            indicator="throughput", threshold=7.0, check_req_before_sync=False, seamless_train_version=1
        ),
    )
    cfg = SimpleNamespace(psrl=SimpleNamespace(sync_and_mig_strategy=sm, staleness=2))
    s = build_sync(cfg, TRAIN_AT_1)
    assert (s.indicator, s.threshold, s.check_req, s.seamless, s.versions) == ("throughput", 7.0, False, 1, TRAIN_AT_1)
    sm.method = "greedy"
    assert isinstance(build_sync(cfg, TRAIN_AT_1), GreedySync)


def test_a_threshold_left_null_in_a_config_built_without_validate_names_its_key():
    """Config.validate() rejects a null status_based or migration threshold; a config built without it gets the
    same one-line error naming the key, not a TypeError from float(None)."""
    sm = SimpleNamespace(
        method="status_based",
        sync=SimpleNamespace(
            indicator="request_num", threshold=None, check_req_before_sync=False, seamless_train_version=0
        ),
        mig=SimpleNamespace(
            enable=True, indicator="request_num", threshold=None, stop_indicator="request_num", stop_threshold=None
        ),
    )
    cfg = SimpleNamespace(psrl=SimpleNamespace(sync_and_mig_strategy=sm, staleness=2))
    with pytest.raises(ConfigError, match="psrl.sync_and_mig_strategy.sync.threshold"):
        build_sync(cfg, TRAIN_AT_1)
    with pytest.raises(ConfigError, match="psrl.sync_and_mig_strategy.mig.threshold"):
        build_migration(cfg)


def test_throughput_sync_on_a_real_instance_waits_for_its_rate_to_drop():
    """An instance decoding 4 rows (token_cost 0.1: 10 tok/s) under a threshold of 5 tok/s keeps version 0
    while it is busy; it pulls once its requests are done and the rate window has emptied."""

    async def main():
        store = store_at()
        inst = RolloutInstance(
            0,
            NoCacheEngine(FakeEngine(token_cost=0.025)),
            store,
            StatusBasedSync("throughput", 5.0, TRAIN_AT_1),
            partial_rollout=True,
        )
        inst.start()
        reqs = [inst.submit(CTX, 40, 0) for _ in range(4)]
        await asyncio.sleep(0.5)
        store.publish(1, {"v": 1})
        inst.wake()
        await asyncio.gather(*(r.future for r in reqs))
        during = {v for r in reqs for v in r.versions}
        for _ in range(30):  # the instance re-checks when woken; the 10 s rate window empties meanwhile
            await asyncio.sleep(1.0)
            inst.wake()
        after = inst.version
        await inst.stop()
        return during, after

    during, after = run_virtual(main())
    assert during == {0} and after == 1


# ---------------------------------------------------------------------------- migration plans


@pytest.mark.parametrize(
    "loads, threshold, stop, moves",
    [
        ((6, 0), 2.0, 1.2, 3),  # inf > 2: move until 3/3
        ((6, 0), 2.0, 2.0, 2),  # 6/0 -> 5/1 (5) -> 4/2 (2.0 <= stop): two moves
        ((4, 2), 2.0, 1.2, 0),  # ratio exactly the threshold: no migration (it must exceed)
        ((5, 2), 2.0, 1.2, 1),  # 2.5 > 2 -> 4/3 (1.33); a second move would overshoot (3/4)
        ((1, 0), 2.0, 1.2, 0),  # moving the only request would only swap the imbalance
        ((0, 0), 2.0, 1.2, 0),
    ],
)
def test_migration_start_and_stop_thresholds(loads, threshold, stop, moves):
    insts = [stub(in_flight=n) for n in loads]
    src, n = Migration("request_num", threshold, "request_num", stop).plan(insts)
    assert n == moves
    if moves:
        assert src is insts[0]


def test_migration_stop_indicator_may_differ_from_the_start_indicator():
    """Start on throughput (100 vs 10 tok/s: 10 > 2), stop on request_num (4 vs 1 requests, stop at 1.5)."""
    insts = [stub(in_flight=4, tps=100.0), stub(in_flight=1, tps=10.0)]
    src, n = Migration("throughput", 2.0, "request_num", 1.5).plan(insts)
    assert src is insts[0] and n == 1  # 4/1 -> 3/2 (1.5)


class _SyncSoon:
    """A sync strategy the test flips on."""

    def __init__(self):
        self.on = False

    def should_pull(self, inst, latest):
        return self.on


def test_sync_is_considered_first_then_migration():
    """A round in which some instance wants to pull plans no migration; the next round without one does."""
    store = store_at()
    sync = _SyncSoon()
    insts = [
        SimpleNamespace(
            index=i,
            version=0,
            dead=False,
            syncing=False,
            in_flight=n,
            migrated=0,
            wants_pull=lambda: sync.on,
            load=lambda: EngineLoad(0, 0, 0.0, None),
        )
        for i, n in enumerate((6, 0))
    ]
    moved = []
    for inst in insts:
        inst.migrate = lambda n, inst=inst: moved.append((inst.index, n)) or []
    pool = stub_pool(insts, RoundRobinRouter(), migration=Migration("request_num", 2.0, "request_num", 1.2))
    sync.on = True
    pool._on_round(insts[1])
    assert moved == []
    sync.on = False
    pool._on_round(insts[1])
    assert moved == [(0, 3)]
    del store


def test_migration_moves_requests_keeping_tokens_and_v_traj():
    """Six trajectories land on instance 0 (a router that always picks it); once they have 5 tokens each,
    migration (request_num, start 2.0, stop 1.2) is switched on and moves three to instance 1. Every trajectory's tokens equal uninterrupted generation, its
    V_traj is unchanged and its segments are never older than V_traj; moved ones list both instances."""

    class First:
        def pick(self, cands, n):
            return cands[0]

    async def main():
        store = store_at()
        engines = [FakeEngine(token_cost=0.01), FakeEngine(token_cost=0.01)]
        pool = pool_of(engines, store, router=First(), pool=dict(candidate_sort="version"), partial_rollout=True)
        insts = pool.instances
        pool.start()
        await pool.ready()
        sessions = [Session(pool, 0, CTX) for _ in range(6)]
        runs = asyncio.gather(*(s.generate(CTX, 20) for s in sessions))
        await asyncio.sleep(0.3)  # five steps of six rows (0.06 s each): five tokens each on instance 0
        pool.migration = Migration("request_num", 2.0, "request_num", 1.2)
        insts[0].wake()
        segs = await runs
        await pool.stop()
        return engines[0], insts, sessions, segs

    eng, insts, sessions, segs = run_virtual(main())
    assert insts[0].migrated == 3 and insts[1].migrated == 0
    assert sorted(len(s.instances) for s in sessions) == [1, 1, 1, 2, 2, 2]
    for s, seg in zip(sessions, segs):
        assert seg.tokens == reference_tokens(eng, CTX, 20)
        assert s.v_traj == 0 and min(seg.versions) >= s.v_traj
    assert [i.in_flight for i in insts] == [0, 0]


# ---------------------------------------------------------------------------- interrupt_as_prompt


@pytest.mark.parametrize("as_prompt", [False, True])
def test_interrupt_as_prompt_both_ways(as_prompt):
    """A sync lands mid-request (version 1 at t=0.35, one token per 0.1 s).

    false: the same request is paused and resumed (one engine request, ``continued``);
    true: it is handed back and continued as a new request whose context is the old one plus its tokens
    (two engine requests, ``interrupted``). Either way the tokens are those of uninterrupted generation,
    4 of version 0 then 6 of version 1, and V_traj stays 0.
    """

    async def main():
        eng = FakeEngine(token_cost=0.1, record=True)
        store = store_at()
        pool = pool_of([eng], store, partial_rollout=True, interrupt_as_prompt=as_prompt)
        inst = pool.instances[0]
        contexts = []
        generate = inst.engine.generate

        async def counting(req):
            contexts.append(len(req.context))
            return await generate(req)

        inst.engine.generate = counting
        pool.start()
        s = Session(pool, 0, CTX)

        async def publish():
            await asyncio.sleep(0.35)
            store.publish(1, {"v": 1})
            pool.notify_published()

        seg, _ = await asyncio.gather(s.generate(CTX, 10), publish())
        await pool.stop()
        return eng, inst, s, seg, contexts

    eng, inst, s, seg, contexts = run_virtual(main())
    assert seg.tokens == reference_tokens(eng, CTX, 10)
    assert seg.versions == [0] * 4 + [1] * 6 and s.v_traj == 0
    if as_prompt:
        assert contexts == [3, 3 + 4] and inst.interrupted == 1 and inst.continued == 0
    else:
        assert contexts == [3] and inst.continued == 1 and inst.interrupted == 0
