"""The engine failure policy, on the real coordinator in virtual time with engines that fail on demand.

A request an engine fails goes back to its session with its ``V_traj`` and the tokens it got, and
is re-run elsewhere (``engine/failed_requests``); the engine is restarted up to
``rollout.max_restarts`` times (``engine/restarts``), then its instance is dead (``engine/dead``)
and the others carry the run; with no instance left the run stops with a message naming the key.
"""

import asyncio
import subprocess
import sys
from pathlib import Path

from psrl.rollout.client.records import MemorySink
from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.fakes import FakeEngine, FakeTask, FakeTrainer
from psrl.rollout.serving.instance import RolloutInstance
from psrl.rollout.serving.sync import GreedySync
from psrl.runtime.local import publish_first_version, wire
from psrl.runtime.vloop import run_virtual
from psrl.weights import ParameterStore
from tests.rollout.harness import check_bound, config, run, statuses


class FlakyEngine(NoCacheEngine):
    """A fake engine whose decode steps number ``fail_at`` raise (a dead server); ``restart`` brings it back."""

    def __init__(self, fail_at=(), always=False, **kw):
        super().__init__(FakeEngine(token_cost=0.01), **kw)
        self.fail_at, self.always = set(fail_at), always
        self.calls = 0
        self.restarted = 0

    async def _decode(self, rows):
        self.calls += 1
        if self.always or self.calls in self.fail_at:
            raise ConnectionError(f"engine died at decode step {self.calls}")
        return await super()._decode(rows)

    async def restart(self):
        self.restarted += 1


def _coord(cfg, engines, sink):
    task = FakeTask(turns=2, turn_tokens=4)
    trainer = FakeTrainer(train_time=0.5)
    return wire(cfg, task, trainer, engines, publish_first_version(cfg, trainer), sink=sink, log=lambda _: None)


def test_failed_requests_are_rerun_with_their_tokens_and_the_engine_restarted():
    """One engine dies twice mid-run: its requests are handed back and re-run, it is restarted twice, and every
    trained trajectory keeps the bound: nothing lost, nothing trained twice."""
    cfg = config(rollout__max_restarts=3)
    sink = MemorySink()
    flaky = FlakyEngine(fail_at={5, 40})
    coord = _coord(cfg, [flaky, NoCacheEngine(FakeEngine(token_cost=0.01))], sink)
    rows = run(coord, 6)
    assert flaky.restarted == 2 and rows[-1]["engine/restarts"] == 2 and rows[-1]["engine/dead"] == 0
    assert rows[-1]["engine/failed_requests"] > 0
    trained = check_bound(sink.trajectories, 1)
    assert trained == 6 * 2 * 2
    assert statuses(sink.trajectories)["error"] == 0
    uids = [r["uid"] for r in sink.trajectories if r["status"] == "trained"]
    assert len(uids) == len(set(uids))


def test_an_engine_failing_past_max_restarts_is_given_up_and_the_others_carry_the_run():
    """An engine that always fails is restarted rollout.max_restarts times, then dead; the run still finishes."""
    cfg = config(rollout__max_restarts=2)
    sink = MemorySink()
    broken = FlakyEngine(always=True)
    rows = run(_coord(cfg, [broken, NoCacheEngine(FakeEngine(token_cost=0.01))], sink), 4)
    assert broken.restarted == 2
    assert rows[-1]["engine/dead"] == 1 and rows[-1]["engine/restarts"] == 2
    assert check_bound(sink.trajectories, 1) == 4 * 2 * 2


def test_an_engine_failing_before_the_first_publish_is_restarted_on_the_weights_it_holds():
    """Nothing published yet (an empty store): the failed engine is restarted and serves again on its initial
    weights, as load_initial leaves them, instead of counting a failed restart for want of a version to load."""

    async def main():
        flaky = FlakyEngine(fail_at={2})
        inst = RolloutInstance(0, flaky, ParameterStore(keep=2), GreedySync(), log=lambda _: None, max_restarts=1)
        inst.start()
        failed = inst.submit([1, 2, 3], 4, 0)
        await failed.future
        served = inst.submit([1, 2, 3], 4, 0)
        await served.future
        await inst.stop()
        return flaky, inst, failed, served

    flaky, inst, failed, served = run_virtual(main())
    assert failed.interrupted and inst.failed == 1
    assert flaky.restarted == 1 and inst.restarts == 1 and not inst.dead
    assert served.finish == "length" and served.versions == [0] * 4


NO_INSTANCE_LEFT = """
from psrl.errors import RunError
from psrl.rollout.client.records import MemorySink
from tests.rollout.harness import config, run
from tests.rollout.test_engine_faults import FlakyEngine, _coord
coord = _coord(config(rollout__max_restarts=1), [FlakyEngine(always=True), FlakyEngine(always=True)], MemorySink())
try:
    run(coord, 3)
except RunError as exc:
    print("STOPPED:", exc)
"""


def test_the_run_stops_with_a_message_when_no_instance_is_left():
    """Every engine fails for good: the run stops (no hang) with a message that names rollout.max_restarts.

    Run in a child interpreter: in this scenario CPython 3.11.7 under pytest leaves its AST recursion counter
    off, and a later lazy import in the same process fails with "AST constructor recursion depth mismatch"."""
    out = subprocess.run(
        [sys.executable, "-c", NO_INSTANCE_LEFT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "STOPPED: rollout.max_restarts: every rollout instance is dead" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


class DroppingEngine(FlakyEngine):
    """A fake engine whose ``resume`` drops a cancel that comes while it waits (as ``asyncio.wait_for`` on Python
    3.11 does when the reply arrives with the cancel)."""

    def __init__(self):
        super().__init__()
        self.resuming = asyncio.Event()

    async def resume(self):
        self.resuming.set()
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            pass
        await super().resume()


def test_stop_ends_the_instance_even_where_an_engine_call_dropped_the_cancel():
    """The run stops an instance during a weight load whose resume swallows the cancel: the loop still ends (it
    checks that a cancel was asked), so ``stop`` returns instead of waiting for the loop forever."""

    async def main():
        store = ParameterStore(keep=2)
        engine = DroppingEngine()
        store.publish(0, {"v": 0})
        inst = RolloutInstance(0, engine, store, GreedySync(), log=lambda _: None)
        inst.start()
        await inst.ready.wait()
        store.publish(1, {"v": 1})
        inst.wake()
        await engine.resuming.wait()  # mid-load
        stopped = asyncio.ensure_future(inst.stop())
        done, _ = await asyncio.wait([stopped], timeout=60.0)  # virtual seconds
        return stopped in done

    assert run_virtual(main())
