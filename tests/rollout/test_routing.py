"""Routing (``psrl.routing_strategy``): the four methods, the cost model and its fit, stickiness,
candidate and request order, and the multi-level queue by V_traj.

Fakes: instances are ``SimpleNamespace`` with the attributes the pool and routers read (``index``,
``version``, ``running``, ``syncing``, ``load()``); the end-to-end cases run real instances on
:class:`FakeEngine` in virtual time (a decode step over ``k`` rows costs ``step_cost + k * token_cost``).
"""

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.fakes import FakeEngine
from psrl.rollout.serving.instance import RolloutInstance
from psrl.rollout.serving.router import (
    CostModel,
    RandomRouter,
    RequestNumBalanceRouter,
    RoundRobinRouter,
    ThroughputOptimalRouter,
    build_router,
    fit_cost_model,
    load_cost_model,
    save_cost_model,
)
from psrl.rollout.serving.session import Session
from psrl.rollout.serving.sync import GreedySync
from psrl.runtime.profile import profile_engine
from psrl.runtime.vloop import run_virtual
from psrl.types import EngineLoad
from psrl.weights import ParameterStore
from tests.rollout.harness import pool_of, stub_pool

CTX = [1, 2, 3]


def stub(index, running=0, version=0, tps=0.0, kv=None, syncing=False):
    ld = EngineLoad(running, 0, tps, kv)
    return SimpleNamespace(index=index, running=running, version=version, syncing=syncing, load=lambda: ld)


def on(rs):
    """A config holding ``rs`` as ``psrl.routing_strategy``."""
    return SimpleNamespace(psrl=SimpleNamespace(routing_strategy=rs))


def store_at(version=0):
    store = ParameterStore(keep=4)
    store.publish(version, {"v": version})
    return store


# ---------------------------------------------------------------------------- the simple methods


def test_random_router_is_seeded_and_uses_every_candidate():
    """Same seed, same choices; over many picks every candidate is chosen."""
    cands = [stub(i) for i in range(3)]
    a = [RandomRouter(7).pick(cands, 3).index for _ in range(1)]
    r1, r2 = RandomRouter(7), RandomRouter(7)
    picks = [r1.pick(cands, 3).index for _ in range(60)]
    assert picks == [r2.pick(cands, 3).index for _ in range(60)] and a[0] == picks[0]
    assert set(picks) == {0, 1, 2}


def test_build_router_reads_every_method():
    rs = SimpleNamespace(method="", cost_model_path=None, delta_throughput_threshold=0.5)
    for method, cls in [
        ("random", RandomRouter),
        ("round_robin", RoundRobinRouter),
        ("request_num_balance", RequestNumBalanceRouter),
        ("throughput_optimal", ThroughputOptimalRouter),
    ]:
        rs.method = method
        assert isinstance(build_router(on(rs)), cls)


# ---------------------------------------------------------------------------- throughput_optimal


def total_throughput(models, loads):
    return sum(m.throughput(n) for m, n in zip(models, loads))


_model = st.builds(CostModel, k1=st.just(0.0), k2=st.floats(0, 0.05), k3=st.floats(0.001, 0.2), k4=st.floats(0, 0.5))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_model, st.integers(0, 12)), min_size=1, max_size=5))
def test_marginal_gain_choice_maximises_the_estimated_global_throughput(specs):
    """Slow obvious twin: try the request on every instance, keep the one with the largest total throughput."""
    models = [m for m, _ in specs]
    loads = [n for _, n in specs]
    router = ThroughputOptimalRouter(models, delta_threshold=0.0)
    cands = [stub(i, running=n) for i, n in enumerate(loads)]
    chosen = router.pick(cands, len(cands)).index
    totals = [total_throughput(models, [n + (i == k) for i, n in enumerate(loads)]) for k in range(len(loads))]
    assert totals[chosen] == pytest.approx(max(totals), rel=1e-9, abs=1e-12)


def test_marginal_gain_on_a_known_throughput_curve():
    """Instance 0 is saturated (step = 1.0 * n: T = 1 tok/s whatever n); instance 1 batches (step = 1 + 0.1 n).

    At loads (1, 3): gain_0 = 0, gain_1 = 4/1.4 - 3/1.3 = 0.55 -> instance 1, although it runs more.
    """
    router = ThroughputOptimalRouter([CostModel(k3=1.0), CostModel(k3=0.1, k4=1.0)], delta_threshold=0.0)
    assert router.pick([stub(0, running=1), stub(1, running=3)], 2).index == 1
    assert RequestNumBalanceRouter().pick([stub(0, running=1), stub(1, running=3)], 2).index == 0


@pytest.mark.parametrize("threshold, expected", [(0.0, 0), (0.5, 1)])
def test_delta_throughput_threshold_skips_an_instance_past_its_knee(threshold, expected):
    """Instance 0 (fast, step = 0.1 + 0.1 n) at n = 8 gains 0.12 tok/s, 1.4% of its idle gain 5; instance 1
    (slow, step = 1 + 0.01 n) idle gains 0.99 (100% of its own). The larger gain wins unless the threshold
    rules instance 0 out: 0.5 of its idle gain."""
    fast, slow = CostModel(k3=0.1, k4=0.1), CostModel(k3=0.01, k4=1.0)
    assert fast.gain(8) < slow.gain(0) or threshold == 0.0  # the arithmetic of the docstring
    router = ThroughputOptimalRouter([fast, slow], delta_threshold=threshold)
    cands = [stub(0, running=8), stub(1, running=0)]
    gains = [fast.gain(8), slow.gain(0)]
    if threshold == 0.0:
        expected = max(range(2), key=lambda k: gains[k])
    assert router.pick(cands, 2).index == expected


def test_every_instance_below_the_threshold_still_gets_the_best_one():
    router = ThroughputOptimalRouter([CostModel(k3=1.0), CostModel(k3=1.0)], delta_threshold=0.9)
    assert router.pick([stub(0, running=5), stub(1, running=2)], 2).index in (0, 1)


def test_online_fit_from_the_engines_own_figures_recovers_the_curve():
    """Load figures sampled from step = 0.2 + 0.05 n (tokens/s = n / step) fit back to k3 = 0.05, k4 = 0.2."""
    true = CostModel(k3=0.05, k4=0.2)
    m = fit_cost_model([(n, 0.0, true.throughput(n)) for n in (1, 2, 4, 8)])
    assert (m.k3, m.k4) == (pytest.approx(0.05), pytest.approx(0.2))
    assert fit_cost_model([(4, 0.0, 10.0), (4, 0.0, 11.0)]) is None  # one load only: nothing to fit
    router = ThroughputOptimalRouter(None)
    for n in (1, 3, 6):
        router.observe(stub(0, running=n, tps=true.throughput(n)))
    assert router.fitted[0].k3 == pytest.approx(0.05) and router.fitted[0].k4 == pytest.approx(0.2)


def test_online_router_starts_as_request_num_balance():
    """No figures yet: the fewest running trajectories."""
    assert ThroughputOptimalRouter(None).pick([stub(0, running=3), stub(1, running=1)], 2).index == 1


def test_profile_fits_a_fake_engine_and_the_file_round_trips(tmp_path):
    """psrl profile's measurement on a FakeEngine (step = 0.05 + 0.01 n) gives back its own cost curve."""

    async def main():
        return await profile_engine(FakeEngine(token_cost=0.01, step_cost=0.05), sizes=(1, 2, 4, 8), tokens=5)

    samples = run_virtual(main())
    m = fit_cost_model(samples)
    assert (m.k3, m.k4) == (pytest.approx(0.01), pytest.approx(0.05))
    path = tmp_path / "cost.json"
    save_cost_model(path, [m, CostModel(k3=2.0)])
    loaded = load_cost_model(path)
    assert loaded[0].as_dict() == pytest.approx(m.as_dict()) and loaded[1].k3 == 2.0
    rs = SimpleNamespace(method="throughput_optimal", cost_model_path=str(path), delta_throughput_threshold=0.5)
    assert build_router(on(rs)).fixed[1].k3 == 2.0
    (tmp_path / "bad.json").write_text(json.dumps({"instances": [{"k3": "x"}]}))
    from psrl.errors import ConfigError

    with pytest.raises(ConfigError, match="cost_model_path"):
        load_cost_model(tmp_path / "bad.json")


# ---------------------------------------------------------------------------- the pool: candidates, stickiness


def test_group_stickiness_keeps_a_group_on_its_first_instance_while_it_has_room():
    insts = [stub(0), stub(1)]
    pool = stub_pool(insts, RoundRobinRouter(), capacity=2, group_sticky=True)
    first = pool.route(0, group="g0")
    insts[first.index].running = 1
    assert pool.route(0, group="g0") is first  # round_robin alone would move on
    insts[first.index].running = 2  # full: the next member goes elsewhere
    assert pool.route(0, group="g0") is not first
    plain = stub_pool([stub(0), stub(1)], RoundRobinRouter(), group_sticky=False)
    assert [plain.route(0, group="g").index for _ in range(2)] == [0, 1]


def test_capacity_keeps_trajectories_off_a_full_instance_unless_all_are_full():
    insts = [stub(0, running=4), stub(1, running=3)]
    pool = stub_pool(insts, RoundRobinRouter(), capacity=4)
    assert pool.route(0).index == 1
    insts[1].running = 4
    assert pool.route(0).index in (0, 1)  # none has room: the router still picks


@pytest.mark.parametrize("sort, expected", [("version", 1), ("reserve_capability", 0)])
def test_candidate_sort_indicator_breaks_ties(sort, expected):
    """Equal running counts for the router, so the order decides: newest version vs most free slots."""
    insts = [stub(0, running=1, version=0), stub(1, running=1, version=1)]
    router = ThroughputOptimalRouter([CostModel(k3=1.0)] * 2, delta_threshold=0.0)  # equal gains: a tie
    insts[1].running = 2 if sort == "reserve_capability" else 1
    insts[0].running = 1
    pool = stub_pool(insts, router if sort == "reserve_capability" else RequestNumBalanceRouter(), candidate_sort=sort)
    assert pool.route(0).index == expected


def test_without_trajectory_stickiness_every_turn_is_routed_again():
    """Two turns of one trajectory on round_robin: sticky stays on instance 0, non-sticky moves to 1."""

    async def main(sticky):
        store = store_at()
        pool = pool_of([FakeEngine(token_cost=0.1) for _ in range(2)], store, pool=dict(trajectory_sticky=sticky))
        pool.start()
        s = Session(pool, 0, CTX)
        seg1 = await s.generate(CTX, 3)
        await s.generate(CTX + seg1.tokens + [5], 3)
        await pool.stop()
        return s.instances, s.v_traj

    assert run_virtual(main(True)) == ([0], 0)
    assert run_virtual(main(False)) == ([0, 1], 0)


# ---------------------------------------------------------------------------- the queue at an instance


def admission_order(**kw):
    """Five requests queue behind a running one (max_batch 1); which contexts are admitted in which order."""

    async def main():
        eng = FakeEngine(token_cost=0.1, record=True)
        inst = RolloutInstance(0, NoCacheEngine(eng), store_at(2), GreedySync(), max_batch=1, **kw)
        inst.start()
        await asyncio.sleep(0)
        first = inst.submit(CTX, 2, 0)
        await asyncio.sleep(0.05)  # the first request is in the engine (its first step runs until 0.1)
        specs = [(1, 4), (0, 6), (2, 5), (0, 3), (1, 7)]  # (V_traj, context length)
        reqs = [inst.submit(list(range(n)), 1, v) for v, n in specs]
        await asyncio.gather(first.future, *(r.future for r in reqs))
        await inst.stop()
        return [b[0] for b in eng.seen[2:]]  # one row per step once the first request is done

    return run_virtual(main())


def test_multi_level_queue_admits_older_v_traj_first():
    """Contexts by V_traj: 0 -> (6, 3), 1 -> (4, 7), 2 -> (5); small_id within a level."""
    assert admission_order(multi_priority_queue=True) == [6, 3, 4, 7, 5]
    assert admission_order() == [4, 6, 5, 3, 7]  # off: arrival order


@pytest.mark.parametrize(
    "sort, expected",
    [("small_id", [4, 6, 5, 3, 7]), ("short_length", [3, 4, 5, 6, 7]), ("long_length", [7, 6, 5, 4, 3])],
)
def test_request_sort_indicator_orders_a_queue(sort, expected):
    assert admission_order(request_sort=sort) == expected


def test_multi_level_queue_comes_before_the_request_sort():
    assert admission_order(multi_priority_queue=True, request_sort="short_length") == [3, 6, 4, 7, 5]


def test_psrl_profile_writes_the_file_cost_model_path_reads(tmp_path, capsys):
    """psrl profile on the tiny built-in model's hf engines: one fitted model per instance, loadable by the router."""
    from psrl.runtime.profile import main

    out = tmp_path / "cost.json"
    assert (
        main(
            [
                "model.n_layer=1",
                "model.n_embd=32",
                "model.n_head=2",
                "psrl.deployment.n_rollout_instances=2",
                "--out",
                str(out),
                "--sizes",
                "1,2,4",
                "--tokens",
                "4",
            ]
        )
        == 0
    )
    models = load_cost_model(out)
    assert len(models) == 2 and all(m.k3 > 0 for m in models)
    assert "cost_model_path" in capsys.readouterr().out
