"""Tables, sweeps, the staleness frontier and its plot.

The frontier is the fair comparison: a policy that bounds only the head of its queue trains
stragglers far beyond its nominal eta, so each sweep point is placed at the staleness the policy
*actually* delivered (``staleness_max``), and a policy's frontier at staleness s is the best
throughput among its points whose true worst case is <= s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from psrl.sim import compare
from psrl.sim.metrics import Result
from psrl.sim.workload import Workload

__all__ = ["format_table", "sweep", "frontier", "FrontierPoint", "best_at", "format_frontier", "frontier_json", "plot"]

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


class FrontierPoint(NamedTuple):
    """One point of a policy's frontier: the best run with a true max staleness <= ``s``."""

    s: int
    steps_per_hour: float
    result: Result

    @property
    def discarded_fraction(self) -> float:
        return self.result.discarded_fraction

    @property
    def length_bias(self) -> float:
        return self.result.length_bias


def frontier(results: Iterable[Result], min_length_bias: float = 0.0) -> dict[str, list[FrontierPoint]]:
    """Per policy, its Pareto points (true max staleness, best steps/h at or below it), ascending.

    ``min_length_bias`` keeps only runs that train slow trajectories fairly (e.g. 0.95), for every
    policy alike. A policy with no run left keeps its key with an empty list."""
    by_policy: dict[str, list[Result]] = {}
    for r in results:
        pts = by_policy.setdefault(r.policy, [])
        if r.length_bias >= min_length_bias:
            pts.append(r)
    out = {}
    for policy, rs in by_policy.items():
        best, front = -1.0, []
        for r in sorted(rs, key=lambda r: (r.staleness_max, -r.steps_per_hour)):
            if r.steps_per_hour > best:
                front.append(FrontierPoint(r.staleness_max, r.steps_per_hour, r))
                best = r.steps_per_hour
        out[policy] = front
    return out


def best_at(front: list[FrontierPoint], s: int) -> FrontierPoint | None:
    """The frontier's point at staleness level ``s``: the best run with true max staleness <= s."""
    best = None
    for p in front:
        if p.s <= s:
            best = p
    return best


def format_frontier(results: Iterable[Result], min_length_bias: float = 0.0) -> str:
    """For each true staleness level s seen and each policy: the best steps/h with a TRUE worst-case
    staleness <= s, with that run's discarded fraction and length bias."""
    fr = frontier(results, min_length_bias)
    levels = sorted({p.s for pts in fr.values() for p in pts})
    policies = list(fr)
    cond = f", length_bias >= {min_length_bias:g} for every policy" if min_length_bias > 0 else ""
    w = max([17] + [len(p) for p in policies])
    lines = [
        f"frontier: best steps/h with true max staleness <= s{cond}; disc = discarded fraction, "
        "bias = length bias of that run ('-': no run)",
        "  ".join([f"{'':>4}"] + [f"{p:>{w}}" for p in policies]),
        "  ".join([f"{'s':>4}"] + [f"{'steps/h  disc  bias':>{w}}" for _ in policies]),
    ]
    for s in levels:
        cells = []
        for p in policies:
            pt = best_at(fr[p], s)
            cell = (
                "-" if pt is None else f"{pt.steps_per_hour:7.1f}  {pt.discarded_fraction:4.2f}  {pt.length_bias:4.2f}"
            )
            cells.append(f"{cell:>{w}}")
        lines.append("  ".join([f"{s:>4}"] + cells))
    return "\n".join(lines)


def frontier_json(results: Iterable[Result], min_length_bias: float = 0.0) -> list[dict]:
    """The frontier's points as plain records (``psrl simulate --frontier --json``)."""
    out = []
    for policy, pts in frontier(results, min_length_bias).items():
        for p in pts:
            r = p.result
            out.append(
                {
                    "policy": policy,
                    "s": p.s,
                    "steps_per_hour": p.steps_per_hour,
                    "ratio_to_ideal": r.ratio_to_ideal,
                    "discarded_fraction": r.discarded_fraction,
                    "length_bias": r.length_bias,
                    "staleness": r.staleness,
                }
            )
    return out


def plot(results: Sequence[Result], path: str | Path, title: str = "", min_length_bias: float = 0.0) -> Path:
    """Top: steps/h vs eta, true max staleness vs eta, and the frontier (steps/h vs true max
    staleness, every run as a faint marker, the Pareto points joined). Bottom: the discarded fraction
    and the length bias of each frontier point, and the frontier under ``min_length_bias`` (when
    given; every policy alike)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_policy: dict[str, list[Result]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    fronts = frontier(results)
    constrained = frontier(results, min_length_bias) if min_length_bias > 0 else None
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    (a_eta, a_st, a_fr), (a_disc, a_bias, a_con) = axes
    styles = ["-", "--", "-.", ":"]
    markers = "osD^v<>px*"
    for k, (policy, rs) in enumerate(by_policy.items()):
        style = dict(linestyle=styles[k % len(styles)], marker=markers[k % len(markers)], label=policy)
        color = f"C{k % 10}"
        rs = sorted(rs, key=lambda r: r.staleness)
        etas = [r.staleness for r in rs]
        a_eta.plot(etas, [r.steps_per_hour for r in rs], color=color, **style)
        a_st.plot(etas, [r.staleness_max for r in rs], color=color, **style)
        a_fr.scatter(
            [r.staleness_max for r in rs],
            [r.steps_per_hour for r in rs],
            color=color,
            alpha=0.25,
            marker=markers[k % len(markers)],
            s=18,
        )
        pts = fronts[policy]
        a_fr.step([p.s for p in pts], [p.steps_per_hour for p in pts], where="post", color=color, **style)
        a_disc.plot([p.s for p in pts], [p.discarded_fraction for p in pts], color=color, **style)
        a_bias.plot([p.s for p in pts], [p.length_bias for p in pts], color=color, **style)
        if constrained is not None and constrained[policy]:
            cp = constrained[policy]
            a_con.step([p.s for p in cp], [p.steps_per_hour for p in cp], where="post", color=color, **style)
    if results:
        ideal = results[0].ideal_steps_per_hour
        for ax in (a_eta, a_fr) + ((a_con,) if constrained is not None else ()):
            ax.axhline(ideal, color="grey", linestyle="--", linewidth=1, label="ideal")
    etas_all = sorted({r.staleness for r in results})
    if etas_all:
        a_st.plot(etas_all, etas_all, color="grey", linestyle="--", linewidth=1, label="staleness = eta")
    a_eta.set(xlabel="eta (psrl.staleness)", ylabel="training steps / hour", title="throughput vs nominal eta")
    a_st.set(xlabel="eta (psrl.staleness)", ylabel="true max staleness", title="delivered staleness")
    a_fr.set(xlabel="true max staleness", ylabel="training steps / hour", title="frontier (all runs faint)")
    a_disc.set(xlabel="true max staleness", ylabel="discarded fraction", title="frontier points: discarded work")
    a_bias.set(xlabel="true max staleness", ylabel="length bias", title="frontier points: length bias")
    if constrained is not None:
        a_con.set(
            xlabel="true max staleness",
            ylabel="training steps / hour",
            title=f"frontier, length_bias >= {min_length_bias:g}",
        )
    else:
        a_con.set_axis_off()
    for ax in (a_eta, a_st, a_fr, a_disc, a_bias) + ((a_con,) if constrained is not None else ()):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
