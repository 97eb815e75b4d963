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


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function I_x(a, b): its continued fraction (Numerical Recipes' ``betacf``,
    modified Lentz), on the side of the symmetry I_x(a, b) = 1 - I_(1-x)(b, a) where it converges fast."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    c, d = 1.0, 1.0 / (1.0 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 200):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for num in (even, odd):
            d = 1.0 / (1.0 + num * d)
            c = 1.0 + num / c
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h / a


def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom: bisection on its upper tail
    P(T > t) = I_x(df/2, 1/2) / 2 with x = df / (df + t^2). Standard library only; checked against tables."""
    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        if _incomplete_beta(df / (df + mid * mid), df / 2, 0.5) / 2 > 1 - p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def paired_lower_bound(diffs: list[float], alpha: float) -> float | None:
    """One-sided (1 - alpha) lower confidence bound of the mean of paired differences (paired t); None below 2."""
    n = len(diffs)
    if n < 2:
        return None
    return statistics.fmean(diffs) - student_t_quantile(1 - alpha, n - 1) * statistics.stdev(diffs) / math.sqrt(n)


def final_accuracy(run: dict) -> float:
    """The run's last validation accuracy."""
    return run["vals"][-1]["val/accuracy"]


def last_quarter_accuracy(run: dict) -> float:
    """Mean validation accuracy over the run's last quarter: the validations at step >= 3/4 of its last step."""
    last = run["vals"][-1]["step"]
    return statistics.fmean(v["val/accuracy"] for v in run["vals"] if v["step"] >= 0.75 * last)


METRICS = {"final": final_accuracy, "last_quarter": last_quarter_accuracy}
RULE = (
    "certified: the largest staleness such that every staleness run at or below it passes; passes: at least "
    "{min_seeds} seeds paired with sync (the default corrections at staleness 0) on the same seeds, and for both "
    "the final validation accuracy and the mean over the run's last quarter, the one-sided {level:g} % paired-t "
    "lower confidence bound of (run - sync) is above -{delta:g}; every run counts, also one that never reached "
    "its bound"
)


def certify(runs: list[dict], correction: str, delta: float, alpha: float, min_seeds: int = 5) -> dict:
    """The certificate of ``correction`` over ``runs`` (run records, every one: none is left out for not reaching
    its bound). ``certified`` is None when sync has fewer than ``min_seeds`` seeds (no certificate), else the
    largest staleness whose every run staleness at or below it passes (0: none above sync does)."""
    sync = {r["seed"]: r for r in runs if r["correction"] == "default" and r["staleness"] == 0}
    etas = sorted({r["staleness"] for r in runs if r["correction"] == correction and r["staleness"] > 0})
    rows = []
    for eta in etas:
        arm = {r["seed"]: r for r in runs if r["correction"] == correction and r["staleness"] == eta}
        seeds = sorted(set(arm) & set(sync))
        row: dict = {"staleness": eta, "seeds": seeds, "below_bound": sum(not r["counted"] for r in arm.values())}
        for name, metric in METRICS.items():
            diffs = [metric(arm[s]) - metric(sync[s]) for s in seeds]
            row[name] = {"mean": statistics.fmean(diffs) if diffs else None, "lower": paired_lower_bound(diffs, alpha)}
        row["fails_on"] = [f"{len(seeds)} seeds paired with sync, fewer than {min_seeds}"] * (len(seeds) < min_seeds)
        row["fails_on"] += [
            f"{m} lower bound {signed(row[m]['lower'])} not above -{delta:g}"
            for m in METRICS
            if row[m]["lower"] is None or row[m]["lower"] <= -delta
        ]
        row["passes"] = not row["fails_on"]
        rows.append(row)
    certified = None
    if len(sync) >= min_seeds:
        certified = 0
        for row in rows:  # ascending: the first failure ends it, whatever passes above
            if not row["passes"]:
                break
            certified = row["staleness"]
    return {
        "correction": correction,
        "certified": certified,
        "sync_seeds": sorted(sync),
        "rows": rows,
        "delta": delta,
        "alpha": alpha,
        "min_seeds": min_seeds,
        "rule": RULE.format(min_seeds=min_seeds, level=100 * (1 - alpha), delta=delta),
    }


def verdict(cert: dict) -> str:
    """The certificate in one sentence, with why the first failing staleness fails."""
    if cert["certified"] is None:
        return f"no certificate: sync has {len(cert['sync_seeds'])} seeds, fewer than {cert['min_seeds']}"
    if cert["certified"] == 0:
        out = f"no staleness above 0 is certified at this margin (delta {cert['delta']:g})"
    else:
        out = f"staleness {cert['certified']} is certified (every staleness run up to it passes)"
    failing = next((r for r in cert["rows"] if not r["passes"]), None)
    if failing is not None:
        out += f"; staleness {failing['staleness']} fails: " + "; ".join(failing["fails_on"])
    return out


def signed(x: float | None) -> str:
    """``+0.012`` / ``-0.250``; ``-`` for no value (no seed, or one)."""
    return "-" if x is None else f"{x:+.3f}"


def print_certificates(certs: dict[str, dict]) -> None:
    """The rule, then per correction each staleness's paired differences, their lower bounds and the verdict."""
    print(next(iter(certs.values()))["rule"])
    for corr, cert in certs.items():
        for row in cert["rows"]:
            figures = ", ".join(
                f"{m} {signed(row[m]['mean'])} (lower bound {signed(row[m]['lower'])})" for m in METRICS
            )
            print(
                f"{corr} staleness {row['staleness']}: {len(row['seeds'])} seeds paired with sync, {figures}, "
                f"{row['below_bound']} below their bound: {'passes' if row['passes'] else 'fails'}"
            )
        print(f"{corr}: {verdict(cert)}")


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
