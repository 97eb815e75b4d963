"""``psrl simulate [CONFIG] [key=value ...] [--policies a,b] [--json] [--sweep KEY=v1,v2] [--plot FILE]
[--frontier] [--min-length-bias X] [--adaptive]``, and ``psrl simulate --recommend RUN_DIR --out FILE
[--max-staleness K] [--min-length-bias X] [--max-discard Y]`` (:mod:`psrl.sim.recommend`).

Prints a comparison table (one row per policy and sweep value) and the staleness frontier; with
``--json`` prints one JSON object per row instead, with exactly the keys of
:data:`psrl.sim.JSON_KEYS`. ``--plot`` writes throughput and staleness against eta and the frontier
(with each frontier point's discarded fraction and length bias) to a PNG. ``--frontier`` prints
only the frontier (with ``--json``: one object per frontier point). ``--min-length-bias`` keeps, for
every policy alike, only runs whose length bias reaches it. Without ``--sweep``, ``--plot`` and
``--frontier`` sweep ``psrl.staleness`` over 0,1,2,4,8.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from psrl.config import ConfigError, load_config
from psrl.errors import one_line_errors
from psrl.sim import DEFAULT_POLICIES, JSON_KEYS, POLICIES
from psrl.sim.divergence import format_divergence
from psrl.sim.report import format_frontier, format_table, frontier_json, plot, sweep
from psrl.sim.workload import Workload

__all__ = ["main", "prepare", "build_parser", "DEFAULT_PLOT_SWEEP"]

DEFAULT_PLOT_SWEEP = "psrl.staleness=0,1,2,4,8"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``psrl simulate``."""
    ap = argparse.ArgumentParser(
        prog="psrl simulate",
        description="Simulate throughput, staleness and waste of psrl and other staleness policies on a workload.",
    )
    ap.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] key=value",
        help="optional YAML config, then dotted overrides such as sim.slots=64 psrl.staleness=2",
    )
    ap.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated subset of {','.join(POLICIES)} (default: {','.join(DEFAULT_POLICIES)}; "
        "'coordinator' runs psrl train's real coordinator in virtual time)",
    )
    ap.add_argument("--json", action="store_true", help=f"one JSON object per row with keys {', '.join(JSON_KEYS)}")
    ap.add_argument(
        "--sweep",
        default=None,
        metavar="KEY=v1,v2,...",
        help="rerun every policy for each value of one config key, e.g. psrl.staleness=0,1,2,4,8",
    )
    ap.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="write throughput/staleness vs eta and the frontier to this PNG",
    )
    ap.add_argument(
        "--frontier",
        action="store_true",
        help="print only the frontier: best steps/h per true max staleness, with each point's "
        "discarded fraction and length bias (with --json: one object per point)",
    )
    ap.add_argument(
        "--min-length-bias",
        type=float,
        default=None,
        metavar="X",
        help="frontier over runs with length_bias >= X only, for every policy alike (e.g. 0.95; default 0, "
        "with --recommend 0.95)",
    )
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="also run the psrl and coordinator policies with psrl.adaptive_staleness.enable=true (psrl.staleness "
        "the ceiling) beside the fixed bounds, and print each run's mean bound and modelled divergence",
    )
    _add_recommend_arguments(ap)
    return ap


def _add_recommend_arguments(ap: argparse.ArgumentParser) -> None:
    """``--recommend RUN_DIR --out FILE [--max-staleness K] [--max-discard Y]`` (:mod:`psrl.sim.recommend`)."""
    ap.add_argument(
        "--recommend",
        default=None,
        metavar="RUN_DIR",
        help="replay a psrl train run directory over staleness, truncation and redundancy, print the frontier and "
        "the configuration picked, and write it (the run's config.yaml, those keys changed) to --out",
    )
    ap.add_argument("--out", default=None, metavar="FILE.yaml", help="with --recommend: the config file to write")
    ap.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="K",
        help="with --recommend: try psrl.staleness 0..K (default: the run's own)",
    )
    ap.add_argument(
        "--max-discard",
        type=float,
        default=0.10,
        metavar="Y",
        help="with --recommend: keep configurations with discarded_fraction <= Y (default 0.1)",
    )


def _recommend(ns: argparse.Namespace) -> int:
    """``psrl simulate --recommend``: print the frontier and the pick, write ``--out``."""
    from pathlib import Path

    from psrl.sim.recommend import format_recommendation, recommend, write_config

    if ns.args or ns.sweep or ns.plot or ns.frontier:
        raise ConfigError(
            "--recommend",
            "takes no config, overrides, --sweep, --plot or --frontier",
            "run psrl simulate --recommend RUN_DIR --out FILE [--max-staleness K] [--min-length-bias X] "
            "[--max-discard Y]",
        )
    if ns.out is None:
        raise ConfigError("--out", "--recommend needs a file to write", "add --out next.yaml")
    mlb = 0.95 if ns.min_length_bias is None else ns.min_length_bias
    rec = recommend(Path(ns.recommend), ns.max_staleness, mlb, ns.max_discard)
    out = write_config(rec, ns.out)
    if ns.json:
        print(json.dumps({**rec.to_json(), "out": str(out)}))
    else:
        print(format_recommendation(rec, out))
    return 0


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first positional without '=' is the config file; the rest are overrides."""
    path, overrides = None, []
    for i, a in enumerate(args):
        if "=" not in a and i == 0:
            path = a
        elif "=" not in a:
            raise ConfigError(a, "expected key=value", "put the config file first, then key=value overrides")
        else:
            overrides.append(a)
    return path, overrides


def _parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not vals:
        raise ConfigError("--sweep", f"cannot read {text!r}", "write it as --sweep psrl.staleness=0,1,2,4,8")
    return key.strip(), vals


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise ConfigError(
            "--policies",
            f"unknown policy {', '.join(unknown) or '(none)'}",
            f"use a comma-separated subset of {','.join(POLICIES)}",
        )
    return names


def _workloads(path: str | None, overrides: list[str], sweep_spec: str | None) -> list[Workload]:
    if sweep_spec is None:
        return [Workload.from_config(load_config(path, overrides))]
    key, values = _parse_sweep(sweep_spec)
    return [Workload.from_config(load_config(path, overrides + [f"{key}={v}"])) for v in values]


def _describe(wl: Workload) -> str:
    shape = f"alpha={wl.alpha}" if wl.dist == "pareto" else f"sigma={wl.sigma}"
    return (
        f"workload: slots={wl.slots} B={wl.batch_size} B'={wl.redundant_batch_size} N={wl.group_size} "
        f"N'={wl.redundant_group_size} gen={wl.dist}(median={wl.median}, {shape}) "
        f"train_time={wl.train_time:g} sync_time={wl.sync_time:g} drop={wl.filter_drop_rate:g} steps={wl.steps}\n"
        f"peers: areal max_concurrent_rollouts={wl.areal_max_concurrent_rollouts or wl.batch_size}, "
        f"tinker groups_per_batch={wl.tinker_groups_per_batch or wl.batch_size}, "
        f"verl staleness_threshold={wl.verl_staleness_threshold:g} "
        f"trigger_parameter_sync_step={wl.verl_trigger_parameter_sync_step} "
        f"max_concurrent_samples={wl.verl_max_concurrent_samples}"
    )


def prepare(ns: argparse.Namespace) -> tuple[list[str], list[Workload], list[Workload]]:
    """``(policies, workloads, plot workloads)``: everything ``psrl simulate`` checks before it runs."""
    if ns.min_length_bias is None:  # --recommend reads None as its own default (0.95)
        ns.min_length_bias = 0.0
    path, overrides = _split_args(ns.args)
    policies = _policies(ns.policies)
    if not 0.0 <= ns.min_length_bias <= 1.0:
        raise ConfigError("--min-length-bias", f"must be in [0, 1], got {ns.min_length_bias}", "e.g. 0.95")
    sweep_spec = ns.sweep if ns.sweep is not None or not ns.frontier else DEFAULT_PLOT_SWEEP
    workloads = _workloads(path, overrides, sweep_spec)
    plot_workloads = workloads
    if ns.plot:
        from pathlib import Path

        from psrl.config import check_out_dir

        if Path(ns.plot).is_dir():
            raise ConfigError("--plot", f"{ns.plot} is a directory", "give a PNG file name, e.g. --plot frontier.png")
        check_out_dir("--plot", Path(ns.plot).parent)
    if ns.plot and sweep_spec is None:
        plot_workloads = _workloads(path, overrides, DEFAULT_PLOT_SWEEP)
    return policies, workloads, plot_workloads


@one_line_errors("psrl simulate")
def main(argv: list[str]) -> int:
    """Entry point of ``psrl simulate``; returns the exit status (2 for a configuration error)."""
    ns = build_parser().parse_args(argv)
    if ns.recommend is not None:
        return _recommend(ns)
    if ns.out is not None or ns.max_staleness is not None:
        raise ConfigError("--out", "--out and --max-staleness go with --recommend RUN_DIR", "add --recommend RUN_DIR")
    policies, workloads, plot_workloads = prepare(ns)
    t0 = time.perf_counter()
    results = sweep(workloads, policies)
    if ns.adaptive:
        results = _with_adaptive(results, workloads, policies)
    mlb = ns.min_length_bias
    if ns.frontier and ns.json:
        for point in frontier_json(results, mlb):
            print(json.dumps(point))
    elif ns.frontier:
        print(_describe(workloads[0]))
        print(format_frontier(results, mlb))
    elif ns.json:
        for r in results:
            print(json.dumps(r.to_json()))
    else:
        print(_describe(workloads[0]))
        print(format_table(results))
        if ns.adaptive or workloads[0].adaptive.enable:
            print()
            print(format_divergence(results, workloads[0].adaptive))
        if len(workloads) > 1:
            print()
            print(format_frontier(results, mlb))
        print(f"({len(results)} simulations, {time.perf_counter() - t0:.1f} s)")
    if ns.plot:
        plot_results = results if plot_workloads is workloads else sweep(plot_workloads, policies)
        out = plot(plot_results, ns.plot, title=_describe(plot_workloads[0]), min_length_bias=mlb)
        print(f"plot written to {out}", file=sys.stderr if ns.json else sys.stdout)
    return 0


def _with_adaptive(results: list, workloads: list[Workload], policies: list[str]) -> list:
    """``--adaptive``: after each workload's runs, its psrl-family policies again with the controller on."""
    from psrl.sim import simulate

    family = [p for p in policies if p in ("psrl", "coordinator")]
    if not family:
        raise ConfigError("--adaptive", "needs the psrl or coordinator policy", "add psrl to --policies")
    per = len(results) // len(workloads)
    out = []
    for i, wl in enumerate(workloads):
        out.extend(results[i * per : (i + 1) * per])
        if not wl.adaptive.enable:
            on = wl.replace(adaptive=dataclasses.replace(wl.adaptive, enable=True))
            on.adaptive.check(on.staleness)
            out.extend(simulate(on, p) for p in family)
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
