"""The event log rebuilds the manager's buffer counts exactly, and psrl viz draws it."""

from __future__ import annotations

import json
import random

from psrl.runtime.recorder import EventLog
from psrl.staleness import StalenessManager, StaleVersionError
from psrl.viz.cli import main as viz_main
from psrl.viz.events import buffer_timeline, read_events


def drive(m, rng, steps):
    ids = []
    for _ in range(steps):
        op = rng.random()
        v = m.train_version - rng.randint(0, 1)
        if op < 0.35:
            try:
                eid = m.try_reserve(max(v, 0))
            except StaleVersionError:
                continue
            if eid is not None:
                ids.append((eid, max(v, 0)))
        elif op < 0.85 and ids:
            eid, ver = rng.choice(ids)
            m.complete(eid, ("x", eid), ver)
        elif op < 0.9 and ids:
            eid, _ = rng.choice(ids)
            try:
                m.abort(eid)
            except ValueError:
                pass
        elif m.ready():
            m.consume()


def test_timeline_matches_counts(tmp_path):
    """Replaying events.jsonl gives the same R_b, O_b as the manager for every live buffer."""
    clock = iter(range(10**6)).__next__
    log = EventLog(tmp_path / "events.jsonl", clock=lambda: float(clock()))
    m = StalenessManager(
        staleness=2,
        batch_size=3,
        group_size=2,
        redundant_batch_size=4,
        group_filter=lambda g: g[0][1] % 5 != 0,
        on_event=log,
    )
    drive(m, random.Random(1), 600)
    log.close()
    events = read_events(tmp_path / "events.jsonl")
    assert {e["kind"] for e in events} >= {"reserve", "occupy", "consume", "passive_abort"}
    timeline = buffer_timeline(events)
    for b in range(m.train_version, m.train_version + 3):
        r, o, _ = m.counts(b)
        last = timeline.get(b, [(0, 0, 0)])[-1]
        assert (last[1], last[2]) == (r, o)


def test_viz_writes_png(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    m = StalenessManager(staleness=1, batch_size=2, group_size=1, on_event=log)
    drive(m, random.Random(0), 200)
    log.close()
    (tmp_path / "trajectories.jsonl").write_text(json.dumps({"v_traj": 0, "consumed_version": 1}) + "\n")
    assert viz_main([str(tmp_path)]) == 0
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_flush_puts_buffered_events_on_disk(tmp_path):
    """Events are buffered; flush() (psrl train calls it after every step) writes all of them so far."""
    log = EventLog(tmp_path / "events.jsonl", clock=lambda: 0.0, flush_every=10**9)
    m = StalenessManager(staleness=1, batch_size=2, group_size=1, on_event=log)
    for _ in range(2):
        eid = m.try_reserve(0)
        m.complete(eid, "t", 0)
    m.consume()
    assert read_events(tmp_path / "events.jsonl") == []
    log.flush()
    kinds = [e["kind"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds.count("consume") == 2 and kinds[-1] == "consume"
    m.try_reserve(0)  # one more event after the flush, still buffered
    assert read_events(tmp_path / "events.jsonl")[-1]["kind"] == "consume"
    log.close()
    assert read_events(tmp_path / "events.jsonl")[-1]["kind"] == "reserve"


def test_viz_draws_learning_curves_from_a_run(tmp_path):
    """curves.png from metrics rows (step and validation rows) and the staleness histogram per step."""
    from psrl.viz.curves import staleness_by_step

    rows = [
        {
            "step": s,
            "time": 0.5 * s,
            "reward/mean": 0.1 * s,
            "staleness/mean": 1.0,
            "staleness/max": 2,
            "correction/is_weight_mean": 1.0,
            "batch/masked_frac": 0.3,
        }
        for s in (1, 2, 3)
    ]
    rows.insert(2, {"step": 2, "version": 2, "val/accuracy": 0.5, "val/pass@k": 0.75, "val/k": 4, "val/time": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trajs = [
        {"v_traj": 0, "consumed_version": 1},
        {"v_traj": 1, "consumed_version": 1},
        {"v_traj": 1, "consumed_version": 2},
        {"v_traj": 2, "status": "aborted"},
    ]
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajs))
    assert staleness_by_step(tmp_path / "trajectories.jsonl") == {2: {1: 1, 0: 1}, 3: {1: 1}}
    assert viz_main([str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
