"""A rollout instance given up on rejoins when its engine can come back elsewhere (issue #37: a rollout node that
comes back is used again), on the real coordinator in virtual time.

The engine's ``rejoin`` stands in for a Ray engine actor's (:meth:`psrl.runtime.ray_runtime.RayEngine.rejoin`: a
new actor once a rollout node has room, at most ``runtime.ray_rejoin_attempts``): the instance starts the new
engine, loads the newest version, serves again and logs one line per attempt; the audit stays clean. An attempt
whose engine does not start is one line and the next attempt; with none left the instance stays dead and the
others carry the run.
"""

import asyncio
import re

from psrl.rollout.client.records import MemorySink
from psrl.rollout.fakes import FakeTask, FakeTrainer
from psrl.runtime.local import publish_first_version, wire
from tests.rollout.harness import check_bound, config, run
from tests.rollout.test_engine_faults import FlakyEngine


class LostEngine(FlakyEngine):
    """Fails at decode step ``fail_at`` (its node lost); ``rejoin`` returns a new place after ``back_s`` virtual
    seconds, ``attempts`` times; the engines of the first ``bad_starts`` attempts fail to start."""

    def __init__(self, fail_at: int, back_s: float = 2.0, attempts: int = 3, bad_starts: int = 0):
        super().__init__(fail_at={fail_at})
        self.back_s, self.attempts, self.bad_starts = back_s, attempts, bad_starts
        self.tried = 0

    async def start(self):
        if 0 < self.tried <= self.bad_starts:
            raise ConnectionError(f"engine of attempt {self.tried} did not start")
        await super().start()

    async def rejoin(self):
        if self.tried >= self.attempts:
            return None
        await asyncio.sleep(self.back_s)  # the node comes back
        self.tried += 1
        self.fail_at = set()  # the new engine works
        return f"on node n{self.tried} (attempt {self.tried}/{self.attempts})"


def _run(lost: LostEngine, steps: int, max_restarts: int = 0) -> tuple[list[dict], MemorySink, list[str]]:
    cfg = config(rollout__max_restarts=max_restarts)
    sink, lines = MemorySink(), []
    task, trainer = FakeTask(turns=2, turn_tokens=4), FakeTrainer(train_time=0.5)
    from psrl.rollout.engines.base import NoCacheEngine
    from psrl.rollout.fakes import FakeEngine

    other = NoCacheEngine(FakeEngine(token_cost=0.01))
    coord = wire(cfg, task, trainer, [lost, other], publish_first_version(cfg, trainer), sink=sink, log=lines.append)
    return run(coord, steps), sink, lines


def test_a_dead_instance_rejoins_loads_the_newest_version_and_its_later_trajectories_are_trained():
    rows, sink, lines = _run(LostEngine(fail_at=5), 10)
    dead = [r["engine/dead"] for r in rows]
    assert max(dead) == 1 and dead[-1] == 0 and rows[-1]["engine/rejoins"] == 1
    said = [ln for ln in lines if "rejoin" in ln]
    assert len(said) == 1, lines
    m = re.fullmatch(r"rollout instance 0 rejoined on node n1 \(attempt 1/3\), holding version (\d+)", said[0])
    assert m, said
    back_at = int(m.group(1))
    assert back_at >= 1  # it missed versions while dead, and loaded the newest, not its old one
    assert check_bound(sink.trajectories, 1) == 10 * 2 * 2
    later = [
        r for r in sink.trajectories if r["status"] == "trained" and 0 in r["instances"] and r["v_traj"] >= back_at
    ]
    assert later  # the instance served again, and what it wrote was trained


def test_an_attempt_whose_engine_does_not_start_is_one_line_and_the_next_attempt_follows():
    lost = LostEngine(fail_at=5, bad_starts=1)
    rows, sink, lines = _run(lost, 10)
    said = [ln for ln in lines if "rejoin" in ln]
    assert len(said) == 2 and lost.tried == 2, lines
    assert said[0].startswith("rollout instance 0 could not rejoin on node n1 (attempt 1/3): ConnectionError")
    assert said[1].startswith("rollout instance 0 rejoined on node n2 (attempt 2/3)")
    assert rows[-1]["engine/rejoins"] == 1 and rows[-1]["engine/dead"] == 0
    assert check_bound(sink.trajectories, 1) == 10 * 2 * 2


def test_with_its_attempts_spent_the_instance_stays_dead_and_the_other_carries_the_run():
    lost = LostEngine(fail_at=5, attempts=1, bad_starts=1)
    rows, sink, lines = _run(lost, 8)
    said = [ln for ln in lines if "rejoin" in ln]
    assert lost.tried == 1 and len(said) == 1 and said[0].startswith("rollout instance 0 could not rejoin"), lines
    assert rows[-1]["engine/dead"] == 1 and rows[-1]["engine/rejoins"] == 0
    assert check_bound(sink.trajectories, 1) == 8 * 2 * 2
