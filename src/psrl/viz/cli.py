"""``psrl viz RUN_DIR [--out FILE]``: the buffer timeline and staleness of a run, and its learning curves.

Writes ``timeline.png`` (below) and ``curves.png`` (:mod:`psrl.viz.curves`: reward and
validation against step and wall-clock, staleness per step, importance weights and masked
fractions, divergence per step and ESS per staleness level) in the run directory.

Top panel: for each buffer version, reserved (light) and occupied (dark) entries over time,
rebuilt from ``events.jsonl`` -- the Reserve / Occupy / Consume animation of the seed, from a real
run. Bottom panel: staleness (consumed_version - V_traj) of every trained trajectory, from
``trajectories.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from psrl.errors import RunError, one_line_errors
from psrl.runtime.recorder import BOUND_EVENT, EVENTS_FILE
from psrl.viz.events import buffer_timeline, read_valid

_NUM = (int, float)
EVENT_FIELDS = {"t": _NUM, "kind": (str,), "buffer": (int,)}
"""What an events.jsonl line must hold to be drawn; other lines are reported as damaged and skipped."""
BOUND_FIELDS = {"t": _NUM, "kind": (str,), "new": (int,)}
"""What a move of the adaptive bound (``kind`` ``staleness_bound``) must hold to be marked on the timeline."""
TRAJ_FIELDS = {"v_traj": (int,)}


def staleness_counts(records: list[dict]) -> Counter:
    """Trained trajectories per staleness (consumed_version - V_traj)."""
    counts: Counter = Counter()
    for rec in records:
        cv = rec.get("consumed_version")
        if isinstance(cv, int) and not isinstance(cv, bool):
            counts[cv - rec["v_traj"]] += 1
    return counts


def load_run(run_dir: Path, warn=print) -> tuple[dict, Counter, list[dict]]:
    """``(buffer timeline, staleness counts, moves of the adaptive bound)`` of a run directory. Damaged lines
    (a run killed mid-write, a truncated copy) are skipped and counted in one warning; a directory with neither
    file is an error."""
    events_path, traj_path = run_dir / EVENTS_FILE, run_dir / "trajectories.jsonl"
    if not events_path.is_file() and not traj_path.is_file():
        raise RunError(
            f"{run_dir}",
            "holds neither events.jsonl nor trajectories.jsonl",
            "give the run directory psrl train wrote (trainer.run_dir, or runs/<time>)",
        )
    records, bad_e = read_valid(events_path, lambda rec: BOUND_FIELDS if _is_bound(rec) else EVENT_FIELDS)
    events = [r for r in records if not _is_bound(r)]
    bounds = [r for r in records if _is_bound(r)]
    trajs, bad_t = read_valid(traj_path, TRAJ_FIELDS)
    bad = bad_e + bad_t
    if bad:
        warn(f"psrl viz: skipped {len(bad)} damaged line(s), first: {bad[0]}")
    return buffer_timeline(events), staleness_counts(trajs), bounds


def _is_bound(rec: object) -> bool:
    return isinstance(rec, dict) and rec.get("kind") == BOUND_EVENT


def draw(run_dir: Path, out: Path, max_buffers: int = 12, warn=print) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline, stale, bounds = load_run(run_dir, warn)
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
    for i, move in enumerate(bounds):  # psrl.adaptive_staleness moved the bound of new reservations here
        label = "staleness/bound moves" if i == 0 else None
        ax1.axvline(move["t"], color="tab:red", linestyle="--", linewidth=0.8, label=label)
        ax1.annotate(f"{move['new']}", (move["t"], len(versions)), color="tab:red", fontsize=8)
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
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise RunError(
            f"--out {out}", f"cannot write the PNG ({e.strerror or e})", "give a path in a writable directory"
        ) from e
    finally:
        plt.close(fig)
    return out


@one_line_errors("psrl viz")
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="psrl viz", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/timeline.png)")
    ap.add_argument("--max-buffers", type=int, default=12)
    ns = ap.parse_args(argv)
    if not ns.run_dir.is_dir():
        raise RunError(f"{ns.run_dir}", "is not a directory", "give the run directory psrl train wrote")
    if ns.max_buffers < 1:
        raise RunError("--max-buffers", f"must be >= 1, got {ns.max_buffers}", "e.g. --max-buffers 12")
    from psrl.viz.curves import draw_curves

    out = draw(
        ns.run_dir,
        ns.out or ns.run_dir / "timeline.png",
        ns.max_buffers,
        warn=lambda line: print(line, file=sys.stderr),
    )
    curves = draw_curves(ns.run_dir, out.with_name("curves.png"))
    print(f"wrote {out} and {curves}")
    return 0
