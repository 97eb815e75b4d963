"""Soak: `psrl train` on the default task for >= 10 minutes under random faults, then an audit.

The run is the real ``psrl train`` (``psrl.train_cli.main``, default config: ``tool_arith`` on two hf
rollout instances) in a child process whose engine and reward are wrapped to fail at random:

* ``engine_kill``  -- a decode step of an hf engine raises (a dead server): its requests go back to
  their sessions with their tokens, the engine restarts (``rollout.max_restarts`` is set high);
* ``reward_hang``  -- the reward never returns: cancelled at ``task.reward_timeout``, retried / reported;
* ``reward_raise`` -- the reward raises; ``reward_nan`` -- it scores NaN: retried, then status ``error``.

Part way through, the whole run is SIGKILLed and restarted with the same command (it resumes from its
last checkpoint); at the end it gets SIGTERM (finishes its step, checkpoints). Every wait is bounded.

The audit reads only the run directory: ``trajectories.jsonl`` (one record per trajectory: trained,
dropped by reason, errors with their reason), ``metrics.jsonl`` (each step once), ``events.jsonl``
(each buffer event once, no half line) and the final checkpoint (trajectories still held in buffers).
``lost`` = trajectories the agent manager completed that have neither a record nor a place in the
checkpoint. Injected faults are logged by the child in ``soak_faults.jsonl``; those after the checkpoint
a resume went back to are rolled back with the run (counted ``rolled_back``: the resume recovered them).

Usage: ``python benchmarks/soak.py [--minutes 10] [--seed 0] [--run-dir DIR] [key=value ...]``.
The last line is one JSON object: minutes, steps, generated, trained, dropped, errors, violations, lost,
duplicates, injected, recovered, reported, clean_stops, kills.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

FAULTS = "soak_faults.jsonl"


# ----------------------------------------------------------------------------------------- the child


def child(ns: argparse.Namespace, args: list[str]) -> int:
    """``psrl train args`` with the hf engine and the task's reward wrapped to fail at random."""
    import asyncio

    from psrl.rollout.engines.hf import HFEngine
    from psrl.tasks.tool_arith import ToolArithTask
    from psrl.train_cli import main

    run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.run_dir=")))
    run_dir.mkdir(parents=True, exist_ok=True)
    _roll_back(run_dir)
    rng = random.Random(f"{ns.seed}-{os.getpid()}")
    log = open(run_dir / FAULTS, "a", encoding="utf-8")

    def note(kind: str) -> None:
        log.write(json.dumps({"t": time.time(), "kind": kind}) + "\n")
        log.flush()

    decode = HFEngine._decode

    async def flaky_decode(self, rows):
        if rng.random() < ns.p_engine:
            note("engine_kill")
            raise ConnectionError("soak: injected engine death")
        return await decode(self, rows)

    reward = ToolArithTask.reward

    async def flaky_reward(self, prompt, episode):
        u = rng.random()
        if u < ns.p_reward:
            note("reward_hang")
            await asyncio.sleep(3600)  # bounded by task.reward_timeout
        elif u < 2 * ns.p_reward:
            note("reward_raise")
            raise RuntimeError("soak: injected reward error")
        elif u < 3 * ns.p_reward:
            note("reward_nan")
            return {"score": math.nan, "acc": 0.0, "seq_reward": math.nan, "seq_final_reward": math.nan}
        return reward(self, prompt, episode)

    HFEngine._decode = flaky_decode
    ToolArithTask.reward = flaky_reward
    return main(args)


def _roll_back(run_dir: Path) -> None:
    """Drop the logged faults the resume will roll back: those after the checkpoint was written (no
    checkpoint: the run starts over, so all of them)."""
    path = run_dir / FAULTS
    if not path.exists():
        return
    manifest = run_dir / "checkpoint" / "manifest.json"
    cut = manifest.stat().st_mtime if manifest.exists() else -1.0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            dropped += 1  # half a line from the kill
            continue
        if rec.get("rolled_back") or rec["t"] <= cut:
            kept.append(rec)
        else:
            kept.append({**rec, "rolled_back": True})
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


# ---------------------------------------------------------------------------------------- the parent


def parent(ns: argparse.Namespace, overrides: list[str]) -> dict:
    root = Path(ns.run_dir) if ns.run_dir else Path(tempfile.mkdtemp(prefix="psrl-soak-"))
    run_dir = root / "run"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"--seed={ns.seed}",
        f"--p-engine={ns.p_engine}",
        f"--p-reward={ns.p_reward}",
        "--",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=1000000",
        "rollout.max_restarts=1000000",
        "trainer.checkpoint_every=5",
        "task.reward_timeout=1",
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    end = start + ns.minutes * 60
    rng = random.Random(ns.seed)
    kill_at = start + rng.uniform(0.35, 0.65) * ns.minutes * 60
    kills, stops, rcs = 0, [], []
    k = 0
    while time.monotonic() < end:
        k += 1
        out = open(root / f"soak-{k}.log", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        print(f"soak: invocation {k} (pid {proc.pid}) -> {root / f'soak-{k}.log'}", flush=True)
        until = kill_at if kills < ns.kills and kill_at > time.monotonic() else end
        rc = _wait(proc, until - time.monotonic())
        if rc is None and until == kill_at:
            # a kill before the first checkpoint would only restart the run: wait for one (bounded by the end)
            while rc is None and not (run_dir / "checkpoint").exists() and time.monotonic() < end:
                rc = _wait(proc, 1.0)
        if rc is None and until == kill_at and time.monotonic() < end:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = _wait(proc, 60)
            kills += 1
            kill_at = time.monotonic() + (end - time.monotonic()) / 2  # the next kill (if --kills > 1)
            print(f"soak: SIGKILLed invocation {k} at {(time.monotonic() - start) / 60:.1f} min", flush=True)
        elif rc is None:
            os.killpg(proc.pid, signal.SIGTERM)
            rc = _wait(proc, 600)
            if rc is None:  # the clean stop itself hung: that is a failure of the soak
                os.killpg(proc.pid, signal.SIGKILL)
                rc = _wait(proc, 60)
                stops.append("SIGTERM did not stop the run within 600 s")
        else:  # the run stopped by itself: a clean stop has one psrl line saying why; then resume
            tail = (root / f"soak-{k}.log").read_text().strip().splitlines()[-1:] or [""]
            stops.append(f"rc {rc}: {tail[0][:300]}")
            print(f"soak: invocation {k} stopped by itself: {stops[-1]}", flush=True)
        rcs.append(rc)
        out.close()
    minutes = (time.monotonic() - start) / 60
    report = audit(run_dir)
    report.update(minutes=round(minutes, 2), kills=kills, clean_stops=stops, exit_codes=rcs, run_dir=str(run_dir))
    return report


def _wait(proc: subprocess.Popen, seconds: float):
    try:
        return proc.wait(timeout=max(seconds, 0.0))
    except subprocess.TimeoutExpired:
        return None


# ------------------------------------------------------------------------------------------ the audit


def audit(run_dir: Path) -> dict:
    """Generated, trained, dropped by reason, staleness violations, lost, duplicates; faults and their fate."""
    import yaml

    eta = int(yaml.safe_load((run_dir / "config.yaml").read_text())["psrl"]["staleness"])
    recs, bad_traj = _jsonl(run_dir / "trajectories.jsonl")
    rows, bad_rows = _jsonl(run_dir / "metrics.jsonl")
    events, bad_events = _jsonl(run_dir / "events.jsonl")
    try:
        with open(run_dir / "checkpoint" / "coordinator.pkl", "rb") as f:
            state = pickle.load(f)
    except FileNotFoundError:  # stopped before its first checkpoint: nothing to account for yet
        state = {"version": 0, "agents": {"counts": Counter()}, "staleness": {"buffers": {}}}
    counts = state["agents"]["counts"]
    held = [
        t for reserved, groups in state["staleness"]["buffers"].values() for e in [*reserved, *groups] for t in e[4]
    ]

    uids = Counter(r["uid"] for r in recs)
    steps = Counter(r["step"] for r in rows if "time" in r)  # validation rows carry no time
    ev = Counter((e.get("kind"), str(e.get("entry"))) for e in events)
    done = {r["uid"] for r in recs if r["status"] != "error"} | {t.uid for t in held}
    trained = [r for r in recs if r["status"] == "trained"]
    violations = [
        r["uid"]
        for r in trained
        if r["consumed_version"] - r["v_traj"] > eta
        or (r["segment_versions"] and min(r["segment_versions"]) < r["v_traj"])
    ]
    dropped = Counter(r["status"] for r in recs if r["status"] not in ("trained", "error"))
    errors = Counter(_reason(r.get("error", "")) for r in recs if r["status"] == "error")

    faults, _ = _jsonl(run_dir / FAULTS)
    kept = Counter(f["kind"] for f in faults if not f.get("rolled_back"))
    rolled_back = sum(1 for f in faults if f.get("rolled_back"))
    restarts = _per_invocation_sum(rows, "engine/restarts")
    reward_faults = kept["reward_hang"] + kept["reward_raise"] + kept["reward_nan"]
    retried, failed = counts["error_retries"], counts["failed"]
    # a reward fault is retried (error_retries), or reported (failed: status error with its reason), or was in
    # flight when the run stopped (its trajectory cancelled with the run: neither counter moves); an engine
    # death is one restart. A negative difference would be a failure no injection explains.
    reward_left, engine_left = reward_faults - retried - failed, kept["engine_kill"] - restarts
    at_stop = max(reward_left, 0) + max(engine_left, 0)
    return {
        "steps": int(state["version"]),
        "generated": int(counts["generated"]),
        "trained": len(trained),
        "dropped": dict(dropped),
        "held_in_checkpoint": len(held),
        "errors": dict(errors),
        "violations": len(violations),
        "lost": int(counts["generated"]) - len(done),
        "duplicates": {
            "trajectories": sum(n - 1 for n in uids.values() if n > 1),
            "steps": sum(n - 1 for n in steps.values() if n > 1),
            "events": sum(n - 1 for n in ev.values() if n > 1),
        },
        "damaged_lines": bad_traj + bad_rows + bad_events,
        "steps_recorded": sorted(steps) == list(range(1, int(state["version"]) + 1)),
        "injected": dict(Counter(f["kind"] for f in faults)),
        "recovered": retried + restarts + rolled_back,
        "reported": failed,
        "in_flight_at_stop": at_stop,
        "unexplained_failures": max(-reward_left, 0) + max(-engine_left, 0),
        "engine_restarts": restarts,
        "reward_retries": retried,
        "rolled_back": rolled_back,
    }


def _jsonl(path: Path) -> tuple[list[dict], int]:
    """The records of a JSONL file the run may have left damaged, and how many lines did not parse."""
    from psrl.viz.events import read_valid

    out, bad = read_valid(path, {})
    return out, len(bad)


def _reason(error: str) -> str:
    for key in ("RewardTimeout", "NonFiniteReward", "RuntimeError"):
        if key in error:
            return key
    return error.split("(", 1)[0] or "?"


def _per_invocation_sum(rows: list[dict], key: str) -> int:
    """A per-invocation cumulative counter summed over invocations (it restarts at 0 when the run resumes)."""
    total, last = 0, 0
    for r in rows:
        if key not in r:
            continue
        v = int(r[key])
        if v < last:
            total += last
        last = v
    return total + last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None, help="where run/ and the logs go (default: a temporary directory)")
    p.add_argument("--kills", type=int, default=1, help="SIGKILLs of the whole run, each followed by a resume")
    p.add_argument("--p-engine", type=float, default=0.0005, help="chance a decode step kills its engine")
    p.add_argument("--p-reward", type=float, default=0.02, help="chance of each reward fault (hang, raise, NaN)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns, rest = p.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    if ns.child:
        return child(ns, rest)
    report = parent(ns, rest)
    for key in (
        "minutes",
        "steps",
        "generated",
        "trained",
        "dropped",
        "held_in_checkpoint",
        "errors",
        "violations",
        "lost",
        "duplicates",
        "damaged_lines",
        "steps_recorded",
        "injected",
        "recovered",
        "engine_restarts",
        "reward_retries",
        "rolled_back",
        "reported",
        "in_flight_at_stop",
        "unexplained_failures",
        "kills",
        "clean_stops",
        "exit_codes",
        "run_dir",
    ):
        print(f"{key:>20}: {report[key]}")
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "minutes",
                    "generated",
                    "trained",
                    "violations",
                    "lost",
                    "recovered",
                    "reported",
                    "in_flight_at_stop",
                    "unexplained_failures",
                    "duplicates",
                    "kills",
                    "injected",
                    "steps",
                    "dropped",
                    "errors",
                )
            }
        )
    )
    clean = (
        report["lost"] == 0
        and report["violations"] == 0
        and not any(report["duplicates"].values())
        and report["unexplained_failures"] == 0
        and report["steps_recorded"]
        and not report["damaged_lines"]
    )
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
