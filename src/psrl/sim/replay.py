"""Replay a ``psrl train`` run directory as a simulator workload (``benchmarks/sim_vs_real.py``,
``psrl simulate --recommend``).

A run directory holds ``config.yaml``, ``trajectories.jsonl`` and ``metrics.jsonl``. The replayed workload is
the run's own config (or another config, e.g. a recommended one, over the same run's timings) with

* ``sim.gen_time.dist=trace`` on the run's ``trajectories.jsonl``: the measured ``gen_seconds`` in launch
  order (:func:`psrl.sim.trace.load_trace_records`), corrected by :func:`replay_trace`;
* the training step time: the mean ``time/train_s`` of its ``metrics.jsonl``;
* ``sim.slots`` = ``psrl.deployment.n_rollout_instances x psrl.routing_strategy.max_concurrent_seqs_per_instance``
  (the agent workers of the config replayed);
* ``sim.steps`` = the steps the run recorded;
* with ``psrl.group_post_process.enable``: ``sim.filter_drop_rate`` = the fraction of the run's resolved groups
  its filter dropped (groups with a ``filtered`` record over those with a ``filtered`` or ``trained`` one).

:func:`replay_trace` turns the recorded times into the stream every simulated configuration draws from:

* **Cut-short times are censored, not replayed as they are.** A trajectory the run's proactive filter truncated
  (``truncated: true`` in a run whose ``psrl.proactive_filter_strategy.method`` is ``truncate``) stopped early:
  it would have run *at least* its recorded time. A launched member that never finished (the N' - N slowest of
  a group with group-level redundancy are cancelled and not recorded) would have run at least as long as its
  group's slowest recorded member. Each such time is replaced by a draw, seeded with ``sim.seed``, from the
  run's complete (uncensored) times that are >= it (kept as recorded if none is). With ``method`` other than
  ``truncate``, ``truncated: true`` means the task's length limit ended the episode: a real, complete time.
* **More samples than the run launched.** Redundancy (B' > B, N' > N) and retries launch more trajectories than
  the run did. After the run's own times (in launch order, so the run as it was replays its own arrival of
  work), the stream goes on with :data:`EXTENSION` x as many seeded draws from the same corrected times (the
  empirical distribution, i.i.d.), instead of cycling through the run's order again.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from psrl.config import Config, load_config
from psrl.sim.metrics import warmup_steps
from psrl.sim.trace import launch_key, load_trace_records
from psrl.sim.workload import Workload

__all__ = [
    "EXTENSION",
    "filter_drop_rate",
    "measured_seconds_per_step",
    "replay_overrides",
    "replay_trace",
    "replay_workload",
]

EXTENSION = 4
"""Seeded draws appended after the run's own times, as a multiple of their number."""


def measured_seconds_per_step(run_dir: Path) -> tuple[float, int]:
    """(seconds per step after warm-up, steps) from the run's ``metrics.jsonl`` ``time`` column (the simulator's
    window: end of warm-up to the last step)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [float(r["time"]) for r in rows if "time" in r]
    if not times:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no 'time' column")
    w = warmup_steps(len(times))
    if len(times) <= w:
        return times[-1] / len(times), len(times)
    return (times[-1] - times[w - 1]) / (len(times) - w), len(times)


def replay_overrides(cfg: Config, run_dir: Path, steps: int) -> list[str]:
    """The ``sim.*`` overrides that replay ``run_dir``'s timings under ``cfg``'s deployment."""
    p = cfg.psrl
    slots = p.deployment.n_rollout_instances * p.routing_strategy.max_concurrent_seqs_per_instance
    out = [
        "sim.gen_time.dist=trace",
        f"sim.gen_time.trace={run_dir / 'trajectories.jsonl'}",
        f"sim.slots={slots}",
        f"sim.steps={steps}",
    ]
    if p.group_post_process.enable:
        out.append(f"sim.filter_drop_rate={filter_drop_rate(run_dir)}")
    return out


def filter_drop_rate(run_dir: Path) -> float:
    """Groups with a ``filtered`` record over groups with a ``filtered`` or ``trained`` one (0 if none)."""
    filtered, resolved = set(), set()
    for r in load_trace_records(run_dir / "trajectories.jsonl"):
        if r.get("status") in ("filtered", "trained"):
            resolved.add(r.get("group"))
            if r.get("status") == "filtered":
                filtered.add(r.get("group"))
    return min(len(filtered) / len(resolved), 0.99) if resolved else 0.0


def replay_trace(run_dir: Path, run_cfg: Config, seed: int) -> tuple[float, ...]:
    """The run's generation times, censored ones redrawn, then the seeded extension (module docstring).

    ``run_cfg`` is the config the run ran with: its proactive method says what ``truncated`` means, and its
    group sizes which members a group launched."""
    recs = load_trace_records(run_dir / "trajectories.jsonl")
    truncating = run_cfg.psrl.proactive_filter_strategy.method == "truncate"
    times: list[float] = []
    censored: list[bool] = []
    n_launch = run_cfg.psrl.redundant_group_size
    keys = [launch_key(r) for r in recs]
    ordered = all(k is not None for k in keys)
    cancels = ordered and n_launch > run_cfg.psrl.group_size  # N' > N: the slowest members were cancelled
    group_max: dict[int, float] = {}
    seen: set[tuple[int, int]] = set()
    for k, r in zip(keys, recs):
        t = float(r["gen_seconds"])
        times.append(t)
        censored.append(truncating and bool(r.get("truncated")))
        if k is not None:
            seen.add(k)
            if cancels:
                group_max[k[0]] = max(group_max.get(k[0], 0.0), t)
    if group_max:  # members the run launched but cancelled (N' > N): at least the group's slowest finished one
        missing = [(g, m) for g in group_max for m in range(n_launch) if (g, m) not in seen]
        for g, m in missing:
            keys.append((g, m))
            times.append(group_max[g])
            censored.append(True)
        order = sorted(range(len(times)), key=lambda i: keys[i] or (0, 0))
        times = [times[i] for i in order]
        censored = [censored[i] for i in order]
    rng = np.random.default_rng([seed, 2])
    complete = np.sort(np.asarray([t for t, c in zip(times, censored) if not c], dtype=float))
    out = []
    for t, c in zip(times, censored):
        if c and complete.size:
            lo = int(np.searchsorted(complete, t, side="left"))
            t = float(complete[rng.integers(lo, complete.size)]) if lo < complete.size else t
        out.append(t)
    extension = rng.choice(np.asarray(out, dtype=float), size=EXTENSION * len(out), replace=True)
    return tuple(out) + tuple(float(x) for x in extension)


def replay_workload(
    run_dir: Path,
    steps: int,
    config: Path | None = None,
    overrides: list[str] | None = None,
    trace: tuple[float, ...] | None = None,
) -> Workload:
    """``config`` (default: the run's own ``config.yaml``) with ``overrides``, replayed on ``run_dir``'s timings;
    ``trace``: :func:`replay_trace`'s result when the caller has it already (the same for every configuration
    replayed on one run)."""
    path = config if config is not None else run_dir / "config.yaml"
    extra = list(overrides or [])
    cfg = load_config(path, extra)
    wl = Workload.from_config(load_config(path, extra + replay_overrides(cfg, run_dir, steps)))
    if trace is None:
        trace = replay_trace(run_dir, load_config(run_dir / "config.yaml"), wl.seed)
    return wl.replace(trace=trace)
