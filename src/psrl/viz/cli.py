"""``psrl viz RUN_DIR [--out FILE]``: the buffer timeline and staleness of a run, and its learning curves.

Writes ``timeline.png`` (below) and ``curves.png`` (:mod:`psrl.viz.curves`: reward and
validation against step and wall-clock, staleness per step, importance weights and masked
fractions) in the run directory.

Top panel: for each buffer version, reserved (light) and occupied (dark) entries over time,
rebuilt from ``events.jsonl`` -- the Reserve / Occupy / Consume animation of the seed, from a real
run. Bottom panel: staleness (consumed_version - V_traj) of every trained trajectory, from
``trajectories.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from psrl.viz.events import buffer_timeline, read_events


def staleness_counts(traj_path: Path) -> Counter:
    counts: Counter = Counter()
    if not traj_path.exists():
        return counts
    with traj_path.open() as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("consumed_version") is not None:
                counts[rec["consumed_version"] - rec["v_traj"]] += 1
    return counts


def draw(run_dir: Path, out: Path, max_buffers: int = 12) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events_path = run_dir / "events.jsonl"
    timeline = buffer_timeline(read_events(events_path)) if events_path.exists() else {}
    stale = staleness_counts(run_dir / "trajectories.jsonl")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 1]})
    versions = sorted(timeline)[:max_buffers]
    for i, b in enumerate(versions):
        pts = timeline[b]
        ts = [p[0] for p in pts]
        peak = max(max(p[1] + p[2] for p in pts), 1)
        occ = [i + 0.9 * p[2] / peak for p in pts]
        res = [i + 0.9 * (p[1] + p[2]) / peak for p in pts]
        ax1.fill_between(ts, i, res, step="post", color="tab:orange", alpha=0.35, label="reserved" if i == 0 else None)
        ax1.fill_between(ts, i, occ, step="post", color="tab:blue", alpha=0.8, label="occupied" if i == 0 else None)
    ax1.set_yticks([i + 0.45 for i in range(len(versions))], [f"V{b}" for b in versions])
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("buffer version")
    ax1.set_title(f"staleness buffers of {run_dir.name}: reserve / occupy / consume")
    if versions:
        ax1.legend(loc="upper left")
    xs = sorted(stale)
    ax2.bar([str(x) for x in xs], [stale[x] for x in xs], color="tab:green")
    ax2.set_xlabel("staleness = consumed_version - V_traj")
    ax2.set_ylabel("trajectories")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="psrl viz", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/timeline.png)")
    ap.add_argument("--max-buffers", type=int, default=12)
    ns = ap.parse_args(argv)
    if not ns.run_dir.is_dir():
        print(f"psrl viz: {ns.run_dir} is not a run directory (made by psrl train)")
        return 2
    from psrl.viz.curves import draw_curves

    out = draw(ns.run_dir, ns.out or ns.run_dir / "timeline.png", ns.max_buffers)
    curves = draw_curves(ns.run_dir, out.with_name("curves.png"))
    print(f"wrote {out} and {curves}")
    return 0
