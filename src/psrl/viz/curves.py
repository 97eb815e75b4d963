"""Learning curves of a run (``RUN_DIR/curves.png``), from ``metrics.jsonl`` and ``trajectories.jsonl``.

Six panels: batch reward and validation accuracy against step and against wall-clock time;
the staleness of the trained trajectories per step (a stacked histogram); the importance
weights, rejection-sampled and masked fractions per step. Names are those of :mod:`psrl.metrics`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from psrl.viz.events import read_valid, valid

__all__ = ["draw_curves", "staleness_by_step"]


NUM = (int, float)


def _rows(path: Path, need: tuple[str, ...] = ()) -> list[dict]:
    """The records of ``path`` that hold finite numbers under ``need``: :func:`psrl.viz.events.read_valid`, whose
    damaged-line report ``psrl viz`` already prints once for the timeline."""
    return read_valid(path, {k: NUM for k in need})[0]


def _num(v) -> bool:
    return valid(v, NUM)


def staleness_by_step(traj_path: Path) -> dict[int, Counter]:
    """``{step: Counter(staleness)}`` of the trained trajectories (step = consumed_version + 1)."""
    out: dict[int, Counter] = defaultdict(Counter)
    for rec in _rows(traj_path, ("consumed_version", "v_traj")):
        out[int(rec["consumed_version"]) + 1][int(rec["consumed_version"]) - int(rec["v_traj"])] += 1
    return dict(out)


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:  # a run without corrections has nothing to label
        ax.legend(fontsize=8, **kw)


def draw_curves(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _rows(run_dir / "metrics.jsonl", ("step", "time", "reward/mean"))
    vals = _rows(run_dir / "metrics.jsonl", ("step", "val/time", "val/accuracy", "val/pass@k"))
    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    for ax, x_key, vx_key, label in ((axes[0, 0], "step", "step", "step"), (axes[0, 1], "time", "val/time", "wall-clock (s)")):
        ax.plot([r[x_key] for r in steps], [r["reward/mean"] for r in steps], color="tab:blue", label="reward/mean (batch)")
        if vals:
            ax.plot([r[vx_key] for r in vals], [r["val/accuracy"] for r in vals], "o-", color="tab:red", label="val/accuracy")
            ax.plot([r[vx_key] for r in vals], [r["val/pass@k"] for r in vals], "s--", color="tab:orange",
                    label=f"val/pass@{int(vals[-1].get('val/k', 1))}")
        ax.set_xlabel(label)
        ax.set_ylabel("reward / accuracy")
        _legend(ax, loc="lower right")
    ax = axes[1, 0]
    hist = staleness_by_step(run_dir / "trajectories.jsonl")
    xs = sorted(hist)
    bottom = [0] * len(xs)
    for s in sorted({s for c in hist.values() for s in c}):
        h = [hist[x].get(s, 0) for x in xs]
        ax.bar(xs, h, bottom=bottom, label=f"staleness {s}")
        bottom = [b + v for b, v in zip(bottom, h)]
    ax.set_xlabel("step")
    ax.set_ylabel("trained trajectories")
    ax.set_title("staleness per step", fontsize=9)
    _legend(ax)
    ax = axes[1, 1]
    for key in ("staleness/mean", "staleness/max"):
        pts = [(r["step"], r[key]) for r in steps if _num(r.get(key))]
        if pts:
            ax.plot(*zip(*pts), label=key)
    ax.set_xlabel("step")
    _legend(ax)
    panels = ((axes[2, 0], "weight", ("correction/is_weight_mean", "correction/is_weight_max", "actor/ratio_mean")),
              (axes[2, 1], "fraction", ("batch/masked_frac", "correction/rs_masked_frac", "correction/is_truncated_frac",
                                        "actor/clip_frac_high")))
    for ax, ylabel, keys in panels:
        for key in keys:
            pts = [(r["step"], r[key]) for r in steps if _num(r.get(key))]
            if pts:
                ax.plot(*zip(*pts), label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        _legend(ax)
    fig.suptitle(f"learning curves of {run_dir.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
