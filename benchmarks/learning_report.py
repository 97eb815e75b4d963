"""Summaries, table and figure of ``benchmarks/learning.py``: per (correction, staleness) over seeds.

A run's record (``summarise_run``) keeps what the table needs and nothing of the weights, so it can be
written next to the run directory and read back on a later invocation (``--out`` reused: runs already
made are not made again).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

DIVERGENCE = ("divergence/ess", "divergence/m2", "divergence/kl")


def spread(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": round(statistics.fmean(xs), 4),
        "std": round(statistics.pstdev(xs), 4) if len(xs) > 1 else 0.0,
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
        "n": len(xs),
    }


def time_to_reach(vals: list[dict], target: float) -> float | None:
    """Wall-clock seconds of the first validation at or above ``target`` (None: never)."""
    for v in vals:
        if v["val/accuracy"] >= target - 1e-12:
            return v["time"]
    return None


def _mean_of(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return statistics.fmean(xs) if xs else None


def summarise_run(correction: str, seed: int, eta: int, rows: list[dict], vals: list[dict], sim: dict) -> dict:
    """One run's record. It counts only if it reached its staleness (realised ``staleness/max`` == eta) and ran
    at least 4 x eta steps, so that the bound was exercised, not just allowed -- except a run of the ``adaptive``
    arm, whose eta is the ceiling the controller may or may not reach: it counts when it ran its steps, and
    records the mean ``staleness/bound`` the controller set."""
    realised = max(r["staleness/max"] for r in rows)
    adaptive = correction == "adaptive"
    at_bound = sum(1 for r in rows if r["staleness/max"] == eta)
    return {
        "correction": correction,
        "seed": seed,
        "staleness": eta,
        "steps": len(rows),
        "vals": vals,
        "s_per_step": rows[-1]["time"] / len(rows),
        "reward_last_third": statistics.fmean(x["reward/mean"] for x in rows[-max(1, len(rows) // 3) :]),
        "realised_max": realised,
        "steps_at_bound": at_bound,
        "counted": (realised <= eta) if adaptive else (realised == eta and len(rows) >= 4 * eta),
        "bound_mean": _mean_of(rows, "staleness/bound"),
        "divergence": {k: _mean_of(rows, k) for k in DIVERGENCE},
        "sim": {k: sim[k] for k in ("measured_s_per_step", "predicted_s_per_step", "ideal_s_per_step")},
    }


def summarise(runs: list[dict], sync_final: float, sync_sps: dict[int, float]) -> dict:
    """One (correction, staleness) cell over seeds: every figure is a spread over the counted runs only."""
    ok = [r for r in runs if r["counted"]]
    return {
        "counted": f"{len(ok)}/{len(runs)}",
        "val_accuracy": spread([r["vals"][-1]["val/accuracy"] for r in ok]),
        "val_pass_at_k": spread([r["vals"][-1]["val/pass@k"] for r in ok]),
        "train_reward_last_third": spread([r["reward_last_third"] for r in ok]),
        "seconds_per_step": spread([r["s_per_step"] for r in ok]),
        "speedup_over_sync": spread([sync_sps[r["seed"]] / r["s_per_step"] for r in ok if r["seed"] in sync_sps]),
        "measured_over_simulated": spread(
            [r["sim"]["measured_s_per_step"] / r["sim"]["predicted_s_per_step"] for r in ok]
        ),
        "seconds_to_sync_final_accuracy": spread([time_to_reach(r["vals"], sync_final) for r in ok]),
        "realised_staleness_max": spread([r["realised_max"] for r in runs]),
        "bound_mean": spread([r.get("bound_mean") for r in ok if r.get("bound_mean") is not None]),
        **{k.split("/")[1]: spread([r["divergence"][k] for r in ok]) for k in DIVERGENCE},
    }


def within_one_std(summary: dict[str, dict], correction: str) -> int | None:
    """The largest staleness of ``correction`` whose counted mean final accuracy is within one std of sync's
    (default corrections, staleness 0); None when no staleness of it is."""
    sync = summary["default"]["0"]["val_accuracy"]
    best = None
    for eta, cell in summary[correction].items():
        a = cell["val_accuracy"]
        if a["n"] and abs(a["mean"] - sync["mean"]) <= sync["std"] + 1e-12:
            best = max(best or 0, int(eta))
    return best


def print_table(summary: dict[str, dict], runs: list[dict]) -> None:
    print(
        f"{'correction':>10} {'stale':>5} {'val acc mean±std [min-max]':>28} {'s/step':>13} {'speedup':>7} "
        f"{'s to sync':>9} {'ess':>6} {'m2':>8} {'kl':>8} {'max':>5} {'counted':>7}"
    )
    for corr, cells in summary.items():
        for eta, s in cells.items():
            a, sp, up, tt = (
                s["val_accuracy"],
                s["seconds_per_step"],
                s["speedup_over_sync"],
                s["seconds_to_sync_final_accuracy"],
            )
            if not a["n"]:
                print(f"{corr:>10} {eta:>5} {'(no counted run)':>28}{'':>60} {s['counted']:>7}")
                continue
            reach = "-" if tt["mean"] is None else f"{tt['mean']:.1f} ({tt['n']})"
            mx = s["realised_staleness_max"]
            print(
                f"{corr:>10} {eta:>5} {a['mean']:>8.3f}±{a['std']:.3f} [{a['min']:.3f}-{a['max']:.3f}] "
                f"{sp['mean']:>7.3f}±{sp['std']:.3f} {up['mean'] or 0:>6.2f}x {reach:>9} {s['ess']['mean']:>6.3f} "
                f"{s['m2']['mean']:>8.4f} {s['kl']['mean']:>8.4f} {mx['min']:>2.0f}-{mx['max']:<2.0f} {s['counted']:>7}"
            )
    bad = [r for r in runs if not r["counted"]]
    for r in bad:
        print(
            f"not counted: {r['correction']} seed {r['seed']} staleness {r['staleness']}: realised staleness/max "
            f"{r['realised_max']} over {r['steps']} steps (needs {r['staleness']} over >= {4 * r['staleness']})"
        )


def draw(results: dict[tuple[str, int], list[dict]], summary: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for (corr, eta), runs in results.items():
        runs = [r for r in runs if r["counted"]]
        if corr != "default" or not runs:
            continue
        n = min(len(r["vals"]) for r in runs)
        steps = [runs[0]["vals"][i]["step"] for i in range(n)]
        acc = [[r["vals"][i]["val/accuracy"] for r in runs] for i in range(n)]
        (line,) = axes[0].plot(steps, [statistics.fmean(a) for a in acc], "o-", label=f"staleness {eta}")
        axes[0].fill_between(steps, [min(a) for a in acc], [max(a) for a in acc], alpha=0.12, color=line.get_color())
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("val/accuracy (greedy)")
    axes[0].set_title("default corrections: mean, min-max band")
    sync = summary["default"]["0"]["val_accuracy"]
    axes[1].axhspan(sync["mean"] - sync["std"], sync["mean"] + sync["std"], color="grey", alpha=0.2, label="sync ± std")
    ess_ax = axes[2].twinx()
    for i, (corr, cells) in enumerate(summary.items()):
        pts = [(int(e), c) for e, c in cells.items() if c["val_accuracy"]["n"]]
        xs = [e * (1 + 0.04 * (i - 1)) + 0.04 * (i - 1) for e, _ in pts]
        axes[1].errorbar(
            xs,
            [c["val_accuracy"]["mean"] for _, c in pts],
            [c["val_accuracy"]["std"] for _, c in pts],
            fmt="o-",
            capsize=3,
            label=corr,
        )
        axes[2].plot([e for e, _ in pts], [c["m2"]["mean"] for _, c in pts], "o-", label=f"{corr}: divergence/m2")
        axes[2].plot([e for e, _ in pts], [c["kl"]["mean"] for _, c in pts], "x--", label=f"{corr}: divergence/kl")
        ess_ax.plot([e for e, _ in pts], [c["ess"]["mean"] for _, c in pts], "s:", alpha=0.6, label=f"{corr}: ess")
    axes[1].set_xlabel("psrl.staleness")
    axes[1].set_ylabel("final val/accuracy, mean ± std")
    axes[1].set_title("final accuracy per correction (counted runs)")
    axes[2].set_xlabel("psrl.staleness")
    axes[2].set_ylabel("run mean (nats^2 / nats)")
    axes[2].set_yscale("symlog", linthresh=1e-3)
    ess_ax.set_ylabel("divergence/ess, run mean (dotted)")
    ess_ax.set_ylim(0, 1.05)
    ess_ax.legend(fontsize=7, loc="center right")
    axes[2].set_title("divergence of the batches, run means over counted seeds")
    for ax in axes[1:]:
        ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_xticks(sorted({int(e) for cells in summary.values() for e in cells}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
