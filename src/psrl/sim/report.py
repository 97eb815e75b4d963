"""Tables, sweeps, the staleness frontier and its plot.

The frontier is the fair comparison: a policy that bounds only the head of its queue trains
stragglers far beyond its nominal eta, so each sweep point is placed at the staleness the policy
*actually* delivered (``staleness_max``), and a policy's frontier at staleness s is the best
throughput among its points whose true worst case is <= s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from psrl.sim import compare
from psrl.sim.metrics import Result
from psrl.sim.workload import Workload

__all__ = ["format_table", "sweep", "frontier", "format_frontier", "plot"]

_COLUMNS = [
    ("policy", "policy", "{:<15}"),
    ("eta", "staleness", "{:>3}"),
    ("steps/h", "steps_per_hour", "{:>8.1f}"),
    ("ideal", "ideal_steps_per_hour", "{:>8.1f}"),
    ("ratio", "ratio_to_ideal", "{:>5.3f}"),
    ("tr_idle", "trainer_idle", "{:>7.3f}"),
    ("gen_idle", "generator_idle", "{:>8.3f}"),
    ("st_mean", "staleness_mean", "{:>7.2f}"),
    ("p99", "staleness_p99", "{:>4}"),
    ("max", "staleness_max", "{:>4}"),
    ("violations", "violations", "{:>10}"),
    ("discarded", "discarded_fraction", "{:>9.3f}"),
    ("wasted", "wasted_fraction", "{:>6.3f}"),
    ("len_bias", "length_bias", "{:>8.3f}"),
]


def format_table(results: Iterable[Result], label: str | None = None) -> str:
    """One row per result; ``label`` (e.g. the workload) is printed as a title line."""
    head = [title for title, _, _ in _COLUMNS]
    rows = [[fmt.format(getattr(r, attr)) for _, attr, fmt in _COLUMNS] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [] if label is None else [label]
    lines.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def sweep(workloads: Sequence[Workload], policies: list[str]) -> list[Result]:
    """Every policy on every workload (one per sweep value), in that order."""
    out: list[Result] = []
    for wl in workloads:
        out.extend(compare(wl, policies))
    return out


def frontier(results: Iterable[Result], min_length_bias: float = 0.0) -> dict[str, list[tuple[int, float]]]:
    """Per policy, its Pareto points (true max staleness, best steps/h at or below it), ascending.

    ``min_length_bias`` keeps only points that train slow trajectories fairly (e.g. 0.95)."""
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        pts = by_policy.setdefault(r.policy, [])
        if r.length_bias >= min_length_bias:
            pts.append((r.staleness_max, r.steps_per_hour))
    out = {}
    for policy, pts in by_policy.items():
        best, front = -1.0, []
        for s, sph in sorted(pts, key=lambda p: (p[0], -p[1])):
            if sph > best:
                front.append((s, sph))
                best = sph
        out[policy] = front
    return out


def _best_at(front: list[tuple[int, float]], s: int) -> float | None:
    best = None
    for smax, sph in front:
        if smax <= s:
            best = sph
    return best


def format_frontier(results: Iterable[Result], min_length_bias: float = 0.0) -> str:
    """Steps/h each policy reaches with a TRUE worst-case staleness <= s, for each s seen."""
    fr = frontier(results, min_length_bias)
    levels = sorted({s for pts in fr.values() for s, _ in pts})
    policies = list(fr)
    cond = f", length_bias >= {min_length_bias:g}" if min_length_bias > 0 else ""
    lines = [f"frontier: best steps/h with true max staleness <= s{cond} ('-': none)",
             "  ".join([f"{'s':>4}"] + [f"{p:>15}" for p in policies])]
    for s in levels:
        cells = []
        for p in policies:
            v = _best_at(fr[p], s)
            cells.append(f"{'-' if v is None else f'{v:.1f}':>15}")
        lines.append("  ".join([f"{s:>4}"] + cells))
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str | Path, title: str = "") -> Path:
    """Three panels: steps/h vs eta, true max staleness vs eta, and steps/h vs true max staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_policy: dict[str, list[Result]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = ["-", "--", "-.", ":"]
    markers = "osD^v<>px*"
    for k, (policy, rs) in enumerate(by_policy.items()):
        style = dict(linestyle=styles[k % len(styles)], marker=markers[k % len(markers)], label=policy)
        rs = sorted(rs, key=lambda r: r.staleness)
        etas = [r.staleness for r in rs]
        axes[0].plot(etas, [r.steps_per_hour for r in rs], **style)
        axes[1].plot(etas, [r.staleness_max for r in rs], **style)
        pts = sorted((r.staleness_max, r.steps_per_hour) for r in rs)
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], **style)
    if results:
        ideal = results[0].ideal_steps_per_hour
        for ax in (axes[0], axes[2]):
            ax.axhline(ideal, color="grey", linestyle="--", linewidth=1, label="ideal")
    etas_all = sorted({r.staleness for r in results})
    if etas_all:
        axes[1].plot(etas_all, etas_all, color="grey", linestyle="--", linewidth=1, label="staleness = eta")
    axes[0].set(xlabel="eta (psrl.staleness)", ylabel="training steps / hour", title="throughput vs nominal eta")
    axes[1].set(xlabel="eta (psrl.staleness)", ylabel="true max staleness", title="delivered staleness")
    axes[2].set(xlabel="true max staleness", ylabel="training steps / hour", title="frontier")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
