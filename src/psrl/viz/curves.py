"""Learning curves of a run (``RUN_DIR/curves.png``), from ``metrics.jsonl`` and ``trajectories.jsonl``.

Eight panels: batch reward and validation accuracy against step and against wall-clock time;
the staleness of the trained trajectories per step (a stacked histogram); the importance
weights, rejection-sampled and masked fractions per step; the divergence of the behaviour from the
pre-update policy (``divergence/ess``, ``divergence/m2``, ``divergence/kl``) per step, and the ESS per
staleness level (``divergence/ess@s<k>``). Names are those of :mod:`psrl.metrics`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from psrl.metrics import levels
from psrl.viz.events import read_valid, valid

__all__ = ["curves_figure", "draw_curves", "ess_by_level", "staleness_by_step"]


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


def ess_by_level(rows: list[dict]) -> dict[int, list[float]]:
    """``{staleness level: [divergence/ess@s<level> of every step row that has it]}``."""
    out: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        for k, v in levels(r, "divergence/ess").items():
            if isinstance(v, (int, float)) and _num(v):  # isinstance for the type checker: _num is the test
                out[k].append(float(v))
    return dict(out)


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:  # a run without corrections has nothing to label
        ax.legend(fontsize=8, **kw)


def draw_curves(run_dir: Path, out: Path) -> Path:
    """Write :func:`curves_figure` of ``run_dir`` to ``out``."""
    import matplotlib.pyplot as plt

    fig = curves_figure(run_dir)
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def curves_figure(run_dir: Path):
    """The figure of :func:`draw_curves` (a matplotlib ``Figure``; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _rows(run_dir / "metrics.jsonl", ("step", "time", "reward/mean"))
    vals = _rows(run_dir / "metrics.jsonl", ("step", "val/time", "val/accuracy", "val/pass@k"))
    fig, axes = plt.subplots(4, 2, figsize=(11, 13))
    for ax, x_key, vx_key, label in (
        (axes[0, 0], "step", "step", "step"),
        (axes[0, 1], "time", "val/time", "wall-clock (s)"),
    ):
        ax.plot(
            [r[x_key] for r in steps], [r["reward/mean"] for r in steps], color="tab:blue", label="reward/mean (batch)"
        )
        if vals:
            pass_k = f"val/pass@{int(vals[-1].get('val/k', 1))}"
            for key, style, color, name in (
                ("val/accuracy", "o-", "tab:red", "val/accuracy"),
                ("val/pass@k", "s--", "tab:orange", pass_k),
            ):
                ax.plot([r[vx_key] for r in vals], [r[key] for r in vals], style, color=color, label=name)
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
    for key in ("staleness/mean", "staleness/max", "staleness/bound"):  # bound: psrl.staleness or the controller's
        _plot_key(ax, steps, key)
    ax.set_xlabel("step")
    _legend(ax)
    panels = (
        (axes[2, 0], "weight", ("correction/is_weight_mean", "correction/is_weight_max", "actor/ratio_mean")),
        (
            axes[2, 1],
            "fraction",
            ("batch/masked_frac", "correction/rs_masked_frac", "correction/is_truncated_frac", "actor/clip_frac_high"),
        ),
    )
    for ax, ylabel, keys in panels:
        for key in keys:
            _plot_key(ax, steps, key)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        _legend(ax)
    _divergence_panels(axes[3, 0], axes[3, 1], steps)
    fig.suptitle(f"learning curves of {run_dir.name}")
    fig.tight_layout()
    return fig


def _plot_key(ax, steps: list[dict], key: str, *style: str, **kw: Any) -> None:
    """``key`` against step, over the rows that hold a number for it (none: nothing drawn)."""
    pts = [(r["step"], r[key]) for r in steps if _num(r.get(key))]
    if pts:
        ax.plot(*zip(*pts), *style, label=key, **kw)


def _divergence_panels(by_step, by_level, steps: list[dict]) -> None:
    """ESS (left axis) with M2 and KL (right axis, nats) against step; ESS against staleness level, every step's
    value as a dot and the mean over steps as a line."""
    right = by_step.twinx()
    for ax, key, style in (
        (by_step, "divergence/ess", "-"),
        (right, "divergence/m2", "--"),
        (right, "divergence/kl", ":"),
    ):
        _plot_key(ax, steps, key, style, color={"-": "tab:blue", "--": "tab:red", ":": "tab:purple"}[style])
    by_step.set_xlabel("step")
    by_step.set_ylabel("ESS (normalised)")
    right.set_ylabel("M2 (nats^2), KL (nats)")
    by_step.set_title("divergence of the behaviour from the pre-update policy", fontsize=9)
    handles = [h for ax in (by_step, right) for h in ax.get_legend_handles_labels()[0]]
    if handles:
        by_step.legend(handles=handles, fontsize=8)
    levels = ess_by_level(steps)
    for k, ys in sorted(levels.items()):
        by_level.plot([k] * len(ys), ys, ".", color="tab:blue", alpha=0.3)
    if levels:
        xs = sorted(levels)
        by_level.plot(
            xs,
            [sum(levels[k]) / len(levels[k]) for k in xs],
            "o-",
            color="tab:blue",
            label="divergence/ess@s<k>, mean over steps",
        )
        by_level.set_xticks(xs)
    by_level.set_xlabel("staleness (version - V_traj)")
    by_level.set_ylabel("ESS (normalised)")
    by_level.set_title("ESS per staleness level", fontsize=9)
    _legend(by_level)
