"""The stall watchdog: the bound on every back-pressure wait of a run (``reserve``, ``next_batch``).

The protocol's waits are correct but unbounded by themselves: a generation that never returns, a
tool that hangs, a buffer that can never fill would leave ``psrl train`` waiting forever. The
watchdog measures *progress* -- a trajectory completed or failed, or a training step started or
finished -- and when there is none for ``trainer.stall_timeout_s`` seconds it writes what the run is
waiting on (buffer states and their blocking entries, in-flight trajectories per rollout instance,
the last buffer events) to ``RUN_DIR/stall-<n>.json`` and the console. After a second period with
still no progress it stops the run with a :class:`~psrl.errors.RunError` (through the agent
manager's ``failure`` future, which the coordinator already watches), so ``psrl train`` checkpoints
and exits with one line.

A training step in progress counts as progress (it runs in a thread and cannot be interrupted;
with ``psrl.staleness=0`` generation rightly waits for it). Time comes from the event loop only,
so tests drive the watchdog in virtual time; it wakes every quarter period, so a stall is noticed
between 1 and 1.25 periods after the last progress.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.errors import RunError

if TYPE_CHECKING:
    from psrl.runtime.coordinator import Coordinator

__all__ = ["Watchdog", "stall_report"]


class Watchdog:
    """Watches ``coord`` (a :class:`~psrl.runtime.coordinator.Coordinator`) for ``timeout`` seconds of no progress.

    Args:
        coord: the coordinator (its ``status()``, staleness manager, progress counters and ``in_step``).
        timeout: ``trainer.stall_timeout_s``; the run stops after twice this with no progress.
        run_dir: where ``stall-<n>.json`` goes (None: console only).
        log: the console.
    """

    def __init__(
        self, coord: Coordinator, timeout: float, run_dir: Path | None = None, log: Callable[[str], None] = print
    ):
        self.coord, self.timeout, self.run_dir, self.log = coord, float(timeout), run_dir, log
        self.dumps: list[Path] = []
        self.stalls = 0
        """Stall reports written (each period of ``timeout`` without progress)."""

    def progress(self) -> tuple:
        """Changes whenever a trajectory completes or fails or a step starts or ends."""
        c = self.coord.agents.counts
        return (c.generated, c.failed, self.coord.version, self.coord.in_step)

    async def run(self) -> None:
        """Until cancelled: report a stall after one period, stop the run after two."""
        loop = asyncio.get_running_loop()
        last, since, reported = self.progress(), loop.time(), False
        while True:
            await asyncio.sleep(self.timeout / 4)
            now, seen = loop.time(), self.progress()
            if seen != last or self.coord.in_step:
                last, since, reported = seen, now, False
                continue
            idle = now - since
            if idle >= 2 * self.timeout:
                self._stop(idle)
                return
            if idle >= self.timeout and not reported:
                reported = True
                self._report(idle)

    def _report(self, idle: float) -> None:
        self.stalls += 1
        report = stall_report(self.coord, idle)
        where = ""
        if self.run_dir is not None:
            path = Path(self.run_dir) / f"stall-{self.stalls}.json"
            path.write_text(json.dumps(report, indent=1, default=str))
            self.dumps.append(path)
            where = f"; details in {path}"
        self.log(
            f"stall: no trajectory completed and no training step for {idle:.0f}s "
            f"(trainer.stall_timeout_s={self.timeout:g}): {report['summary']}{where}; "
            f"the run stops if nothing moves for another {self.timeout:g}s"
        )

    def _stop(self, idle: float) -> None:
        err = RunError(
            "run",
            f"stalled: no trajectory completed and no training step for {idle:.0f}s "
            f"(2 x trainer.stall_timeout_s={self.timeout:g}); {stall_report(self.coord, idle)['summary']}",
            "see the stall-*.json report in the run directory for what it waited on; raise "
            "trainer.stall_timeout_s if generations or rewards legitimately take this long; "
            "the run is checkpointed and the same command resumes it",
        )
        failure = self.coord.agents.failure
        if failure is not None and not failure.done():
            failure.set_exception(err)


def stall_report(coord: Coordinator, idle: float, events: int = 50) -> dict:
    """What a stalled run is waiting on: buffers (state, counts, blocking entries), instances (version, load,
    in-flight trajectories with their age and whether they are in a model turn or a tool call), the last
    ``events`` buffer events, and a one-line ``summary``."""
    m = coord.manager
    buffers = {}
    for b, state in m.buffer_states().items():
        occupied, reserved, _ = m.counts(b)
        buffers[str(b)] = {
            "state": str(state),
            "occupied": occupied,
            "reserved": reserved,
            "blocking": [str(e) for e in m.blocking(b)],
        }
    status = coord.status()
    flight: dict[int, list] = {i.index: [] for i in status.instances}
    for t in status.in_flight:
        flight.setdefault(t.instance, []).append(
            {
                "trajectory": t.trajectory,
                "entry": t.entry,
                "age_s": round(t.age_s, 3),
                "in": "model turn" if t.in_model_turn else "tool call or reward",
            }
        )
    instances = [{**dataclasses.asdict(i), "in_flight": flight.get(i.index, [])} for i in status.instances]
    n_flight = sum(len(v) for v in flight.values())
    oldest = max((t["age_s"] for v in flight.values() for t in v), default=0.0)
    states = " ".join(f"{b}:{v['state']}" for b, v in buffers.items())
    summary = (
        f"T={m.train_version}, buffers {states}, "
        f"{n_flight} trajectories in flight (oldest {oldest:.0f}s), instances "
        f"v{[i['version'] for i in instances]} dead {[i['index'] for i in instances if i['dead']]}"
    )
    return {
        "idle_s": round(idle, 3),
        "train_version": m.train_version,
        "summary": summary,
        "buffers": buffers,
        "instances": instances,
        "last_events": _last_events(m, events),
    }


def _last_events(manager: Any, n: int) -> list:
    """The last ``n`` lines of the run's buffer-event log (``events.jsonl``), if it has one."""
    log = getattr(manager, "on_event", None)
    path = getattr(log, "path", None)
    if log is None or path is None:
        return []
    log.flush()
    try:
        with open(path, "rb") as fh:  # only the end: the log of a long run is large
            fh.seek(max(0, fh.seek(0, 2) - 400 * n))
            tail = fh.read().decode("utf-8", errors="replace").splitlines()[1:][-n:]
    except OSError:
        return []
    out = []
    for line in tail:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(line.rstrip("\n"))
    return out
