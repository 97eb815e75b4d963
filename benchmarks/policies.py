"""The reference comparison of staleness policies, and the frontier acceptance of issue #13.

    .venv/bin/python benchmarks/policies.py [--steps 300] [--seeds 0,7] [--plot frontier.png] [--million] [--quick]

Workload: 64 generation slots, 16 groups x 4 trajectories per step, lognormal generation times
(median 1 s). Four training-time settings:

* "balanced": train_time = the time the slots need to generate one batch on average when they
  generate continuously (B*N*mean/slots = the mean generation time): generation bound = trainer
  bound, so the generators have no spare capacity at all;
* "gen-bound": half of that; "trainer-bound": twice that;
* "sync-balanced": train_time = the expected time the slots need to generate one batch from
  scratch (the mean makespan of B*N draws on the slots, i.e. a synchronous system's generation
  phase, tail included): the other reading of "balanced"; it leaves the generators spare capacity.

The peers run as they do by default (``psrl/sim/baselines.py`` cites each rule): areal with
max_concurrent_rollouts = B, discard_requeue (Tinker) with groups_per_batch = B workers,
sample_budget (verl fully-async) with staleness_threshold 0.1, trigger_parameter_sync_step 4,
max_concurrent_samples 16. psrl also runs with batch-level redundancy B' = 1.25 B and 1.5 B, and
with the proactive ``truncate`` filter.

Prints (1) one table at eta = 2 (every policy x setting x sigma 0.5/1.0/1.5), (2) the psrl model
next to psrl train's real coordinator at eta = 2, (3) the frontier -- throughput against each
policy's TRUE max staleness over a sweep of its own staleness knob -- on the capacity-balanced
workloads (sigma 0.5 and 1.0) for each seed, without and with a length-bias floor of 0.95, and the
acceptance: psrl's frontier (its best configuration) at or above every peer's (default and tuned
variants) at every s <= 4. Ends with one JSON line. ``--million`` times psrl on 250 steps of 512
groups x 8 (1M trajectories); ``benchmarks/sim_million.py`` does only that.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from psrl.sim import Result, Workload, simulate
from psrl.sim.report import best_at, format_frontier, frontier, plot

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as stored  # noqa: E402

SIGMAS = (0.5, 1.0, 1.5)
SETTINGS = ("gen-bound", "balanced", "trainer-bound", "sync-balanced")
_CAPACITY_FACTOR = {"gen-bound": 0.5, "balanced": 1.0, "trainer-bound": 2.0}
FRONTIER_ETAS = (0, 1, 2, 3, 4, 6, 8)


def workload(sigma: float, setting: str, steps: int, eta: int = 2, seed: int = 0, **changes) -> Workload:
    """The reference workload (``changes``: Workload fields, e.g. redundant_batch_size)."""
    B, N, slots = 16, 4, 64
    wl = Workload(
        slots=slots,
        steps=steps,
        staleness=eta,
        batch_size=B,
        redundant_batch_size=B,
        group_size=N,
        redundant_group_size=N,
        dist="lognormal",
        median=1.0,
        sigma=sigma,
        train_time=train_time(sigma, setting, B * N, slots),
        seed=seed,
    )
    return wl.replace(**changes)


def train_time(sigma: float, setting: str, trajectories: int, slots: int) -> float:
    """Seconds of one training step in ``setting`` (lognormal, median 1)."""
    if setting == "sync-balanced":
        return mean_makespan(sigma, trajectories, slots)
    return _CAPACITY_FACTOR[setting] * trajectories * math.exp(sigma**2 / 2) / slots


def mean_makespan(sigma: float, trajectories: int, slots: int, batches: int = 20000) -> float:
    """Expected time ``slots`` need to generate ``trajectories`` lognormal(0, sigma) draws from scratch
    (Monte Carlo, fixed seed; one draw per slot when trajectories == slots, the case used here)."""
    if trajectories != slots:
        raise ValueError("mean_makespan assumes one trajectory per slot")
    draws = np.random.default_rng(12345).lognormal(0.0, sigma, (batches, trajectories))
    return float(draws.max(axis=1).mean())


# (label, policy, workload changes) of the eta = 2 table: the peers at their defaults.
VARIANTS = [
    ("psrl", "psrl", {}),
    ("psrl B'=1.25B", "psrl", {"redundant_batch_size": 20}),
    ("psrl B'=1.5B", "psrl", {"redundant_batch_size": 24}),
    ("psrl truncate", "psrl", {"proactive_method": "truncate", "proactive_threshold": 4}),
    ("sync", "sync", {}),
    ("one_step_off", "one_step_off", {}),
    ("areal", "areal", {}),
    ("discard_requeue", "discard_requeue", {}),
    ("sample_budget", "sample_budget", {}),
]

# The frontier: every family is a set of configurations; each is run over a sweep of the family's
# own staleness knob (eta = psrl.staleness = AReaL's max_head_offpolicyness = Tinker's
# max_steps_off_policy; verl's staleness_threshold). A family's frontier is the best over all of them.
VERL_THRESHOLDS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
PSRL_FAMILY = [
    ("psrl", {}),
    ("psrl B'=1.25B", {"redundant_batch_size": 20}),
    ("psrl B'=1.5B", {"redundant_batch_size": 24}),
    ("psrl truncate", {"proactive_method": "truncate", "proactive_threshold": 4}),
    ("psrl truncate t=1", {"proactive_method": "truncate", "proactive_threshold": 1}),
    # psrl.proactive_filter_strategy.scope = head: truncate only buffer T's blockers, only while the trainer waits
    ("psrl head-truncate t=2", {"proactive_method": "truncate", "proactive_threshold": 2, "proactive_scope": "head"}),
    (
        "psrl head-truncate t=2 g=0.25",
        {"proactive_method": "truncate", "proactive_threshold": 2, "proactive_scope": "head", "proactive_grace": 0.25},
    ),
    ("psrl head-truncate t=8", {"proactive_method": "truncate", "proactive_threshold": 8, "proactive_scope": "head"}),
]
# The configurations of psrl's frontier in the acceptance. Head-truncate is in psrl train too (issue 24), but has
# its own family (and, with --markdown, its measured twin: the same runs by psrl train's real coordinator), so the
# acceptance stays the one published before it.
PSRL_TRAIN_LABELS = {"psrl", "psrl B'=1.25B", "psrl B'=1.5B", "psrl truncate", "psrl truncate t=1"}
HEAD = "psrl + head-truncate"
HEAD_MEASURED = "psrl + head-truncate, measured"
"""The frontier family of the head-truncate runs of psrl train's real coordinator in virtual time (policy
``coordinator``): the "measured" column of docs/simulate.md."""
# (family, label, policy, changes, knob): knob "eta" sweeps FRONTIER_ETAS, "verl" VERL_THRESHOLDS, None: one run
PEERS = [
    ("sync", "sync", "sync", {}, None),
    ("one_step_off", "one_step_off", "one_step_off", {}, None),
    ("areal", "areal", "areal", {}, "eta"),
    ("discard_requeue", "discard_requeue", "discard_requeue", {}, "eta"),
    ("sample_budget", "sample_budget", "sample_budget", {}, "verl"),
    # tuned variants a user of the peer could pick (not their defaults)
    ("areal tuned", "areal mcr=2B", "areal", {"areal_max_concurrent_rollouts": 32}, "eta"),
    ("areal tuned", "areal mcr=4B", "areal", {"areal_max_concurrent_rollouts": 64}, "eta"),
    (
        "sample_budget tuned",
        "verl k=1",
        "sample_budget",
        {"verl_trigger_parameter_sync_step": 1, "verl_max_concurrent_samples": 32},
        "verl",
    ),
    (
        "sample_budget tuned",
        "verl k=2",
        "sample_budget",
        {"verl_trigger_parameter_sync_step": 2, "verl_max_concurrent_samples": 32},
        "verl",
    ),
]
ACCEPT_S = range(0, 5)
ACCEPT_SIGMAS = (0.5, 1.0)


def run_variant(
    label: str, policy: str, changes: dict, sigma: float, setting: str, steps: int, eta: int = 2, seed: int = 0
) -> Result:
    """One row: the policy on the reference workload, labelled."""
    r = simulate(workload(sigma, setting, steps, eta=eta, seed=seed, **changes), policy)
    r.policy = label
    return r


def row(sigma: float, setting: str, label: str, r: Result) -> str:
    return (
        f"{sigma:>5}  {setting:<13}  {label:<17}  {r.steps_per_hour:>8.0f}  {r.ratio_to_ideal:>5.3f}  "
        f"{r.trainer_idle:>6.3f}  {r.generator_idle:>6.3f}  {r.staleness_mean:>5.2f}  {r.staleness_p99:>3}  "
        f"{r.staleness_max:>4}  {r.violations:>6}  {r.discarded_fraction:>6.3f}  {r.wasted_fraction:>6.3f}  "
        f"{r.length_bias:>6.3f}"
    )


HEADER = (
    "sigma  setting        policy              steps/h  ratio  tr_idl  gn_idl  st_mn  p99   max  "
    "violat  discrd  wasted  lenbias"
)


def reference_table(steps: int, seed: int) -> dict:
    """Print the big table; return the results keyed by (sigma, setting, label)."""
    print(
        f"eta = 2, 64 slots, 16 groups x 4, lognormal(median 1), {steps} steps, seed {seed}; ratio = steps/h over "
        "min(generation bound, trainer bound); peers at their defaults"
    )
    print(HEADER)
    out = {}
    for sigma in SIGMAS:
        for setting in SETTINGS:
            for label, policy, changes in VARIANTS:
                r = run_variant(label, policy, changes, sigma, setting, steps, seed=seed)
                out[(sigma, setting, label)] = r
                print(row(sigma, setting, label, r))
        print()
    return out


def model_vs_real(results: dict, steps: int, seed: int) -> list[dict]:
    """The psrl model next to psrl train's real coordinator (virtual time) on the same workloads, eta = 2; the pairs."""
    checks = [
        ("psrl, sigma 0.5, no redundancy", 0.5, "psrl", {}),
        ("psrl, sigma 0.5, B'=1.25B", 0.5, "psrl B'=1.25B", {"redundant_batch_size": 20}),
        ("psrl, sigma 1.0, B'=1.5B", 1.0, "psrl B'=1.5B", {"redundant_batch_size": 24}),
    ]
    pairs = []
    for setting in ("balanced", "sync-balanced"):
        print(f"model vs real (eta = 2, {setting}; model = the psrl policy, real = psrl train's coordinator):")
        for text, sigma, label, changes in checks:
            r = results[(sigma, setting, label)]
            real = simulate(workload(sigma, setting, steps, seed=seed, **changes), "coordinator")
            pairs.append({"case": text, "setting": setting, "model": r.to_json(), "real": real.to_json()})
            print(
                f"  {text:<32} ratio model {r.ratio_to_ideal:.3f} real {real.ratio_to_ideal:.3f}  "
                f"(violations {r.violations}/{real.violations}, wasted {r.wasted_fraction:.3f}, "
                f"length_bias {r.length_bias:.3f})"
            )
    no_red = [r for (s, st, lab), r in results.items() if lab == "psrl"]
    print(
        f"  psrl without redundancy, all settings: violations {sum(r.violations for r in no_red)}, "
        f"max discarded {max(r.discarded_fraction for r in no_red):.3f}, "
        f"length_bias in [{min(r.length_bias for r in no_red):.3f}, {max(r.length_bias for r in no_red):.3f}]"
    )
    print()
    return pairs


def _knob_runs(label, policy, changes, knob, sigma, steps, seed) -> list[Result]:
    if knob == "eta":
        return [run_variant(label, policy, changes, sigma, "balanced", steps, eta=e, seed=seed) for e in FRONTIER_ETAS]
    if knob == "verl":
        out = []
        for t in VERL_THRESHOLDS:
            r = run_variant(
                label, policy, {**changes, "verl_staleness_threshold": t}, sigma, "balanced", steps, seed=seed
            )
            r.extra = {**r.extra, "verl_staleness_threshold": t}
            out.append(r)
        return out
    return [run_variant(label, policy, changes, sigma, "balanced", steps, seed=seed)]


def frontier_runs(sigma: float, steps: int, seed: int, measured: bool = False) -> tuple[list[Result], dict[str, str]]:
    """Every configuration of every family on the capacity-balanced workload; and label -> family. ``measured``:
    the head-truncate configurations also run by psrl train's coordinator (labels ending " (coordinator)")."""
    results, family = [], {}
    for label, changes in PSRL_FAMILY:
        results += _knob_runs(label, "psrl", changes, "eta", sigma, steps, seed)
        family[label] = "psrl (best config)" if label in PSRL_TRAIN_LABELS else HEAD
    if measured:
        for label, changes in PSRL_FAMILY:
            if family[label] == HEAD:
                real = f"{label} (coordinator)"
                results += _knob_runs(real, "coordinator", changes, "eta", sigma, steps, seed)
                family[real] = HEAD_MEASURED
    for fam, label, policy, changes, knob in PEERS:
        results += _knob_runs(label, policy, changes, knob, sigma, steps, seed)
        family[label] = fam
    return results, family


def _relabel(results: list[Result], family: dict[str, str]) -> list[Result]:
    out = []
    for r in results:
        c = copy.copy(r)
        c.extra = {**r.extra, "label": r.policy}
        c.policy = family[r.policy]
        out.append(c)
    return out


def _config(r: Result) -> str:
    """The configuration behind a frontier point: its label and the knob value that produced it."""
    label = r.extra.get("label", r.policy)
    if label.startswith(("verl", "sample_budget")):
        return f"{label} staleness_threshold={r.extra.get('verl_staleness_threshold')}"
    return f"{label} eta={r.staleness}"


def acceptance_check(results: list[Result], family: dict[str, str], min_length_bias: float) -> list[dict]:
    """For each s in ACCEPT_S and each peer family: psrl's best (any config) and plain psrl against the peer's best."""
    fams = frontier(_relabel(results, family), min_length_bias)
    plain = frontier([r for r in results if r.policy == "psrl"], min_length_bias).get("psrl", [])
    psrl_best = fams.pop("psrl (best config)")
    fams.pop(HEAD, None)  # psrl's, not a peer; kept out of "best config" (see PSRL_TRAIN_LABELS)
    fams.pop(HEAD_MEASURED, None)
    rows = []
    for s in ACCEPT_S:
        ours = best_at(psrl_best, s)
        mine = best_at(plain, s)
        for fam, pts in fams.items():
            peer = best_at(pts, s)
            rows.append(
                {
                    "s": s,
                    "peer": fam,
                    "min_length_bias": min_length_bias,
                    "peer_steps_per_hour": None if peer is None else peer.steps_per_hour,
                    "peer_config": None if peer is None else _config(peer.result),
                    "psrl_steps_per_hour": None if ours is None else ours.steps_per_hour,
                    "psrl_config": None if ours is None else _config(ours.result),
                    "plain_psrl_steps_per_hour": None if mine is None else mine.steps_per_hour,
                    "holds": peer is None or (ours is not None and ours.steps_per_hour >= peer.steps_per_hour),
                    "plain_holds": peer is None or (mine is not None and mine.steps_per_hour >= peer.steps_per_hour),
                }
            )
    return rows


def frontier_section(steps: int, seeds: list[int], plot_path: str | None) -> list[dict]:
    """Sweep every family on the capacity-balanced workloads; print the frontiers and the acceptance."""
    verdicts = []
    for seed in seeds:
        for sigma in ACCEPT_SIGMAS:
            results, family = frontier_runs(sigma, steps, seed)
            ideal = results[0].ideal_steps_per_hour
            print(
                f"capacity-balanced, sigma {sigma}, seed {seed}, {steps} steps (ideal {ideal:.1f} steps/h); "
                f"eta swept over {list(FRONTIER_ETAS)}, verl staleness_threshold over {list(VERL_THRESHOLDS)}"
            )
            by_family = _relabel(results, family)
            for mlb in (0.0, 0.95):
                print(format_frontier([r for r in results if r.policy == "psrl"] + by_family, mlb))
                rows = acceptance_check(results, family, mlb)
                bad = [r for r in rows if not r["holds"]]
                plain_bad = [r for r in rows if not r["plain_holds"]]
                where = sorted({f"{r['peer']} s={r['s']}" for r in plain_bad})
                plain = "HOLDS" if not plain_bad else "below " + ", ".join(where)
                print(
                    f"  acceptance (s <= {max(ACCEPT_S)}, length_bias >= {mlb:g}): psrl's frontier >= every peer: "
                    f"{'HOLDS' if not bad else 'FAILS'}; plain psrl (no redundancy, no truncation): {plain}"
                )
                for r in bad:
                    print(
                        f"    psrl below {r['peer']} at s={r['s']}: {r['psrl_steps_per_hour']} < "
                        f"{r['peer_steps_per_hour']:.1f} ({r['peer_config']})"
                    )
                for r in rows:
                    verdicts.append({"seed": seed, "sigma": sigma, **r})
            print()
            if plot_path:
                path = plot_path.replace(".png", f"_sigma{sigma}_seed{seed}.png")
                plot(
                    by_family,
                    path,
                    title=f"capacity-balanced, lognormal sigma {sigma}, seed {seed}",
                    min_length_bias=0.95,
                )
                print(f"plot written to {path}\n")
    return verdicts


def head_agreement(results: list[Result], family: dict[str, str], sigma: float, seed: int) -> dict:
    """Head-truncate: the simulator's psrl policy against psrl train's coordinator, run by run (same label, eta)
    and cell by cell (the frontier tables' best point at s <= 4, with and without the length-bias floor)."""
    model = {(r.policy, r.staleness): r for r in results if r.policy in {lab for lab, _ in PSRL_FAMILY}}
    diffs = []
    for r in results:
        if r.policy.endswith(" (coordinator)"):
            m = model[(r.policy.removesuffix(" (coordinator)"), r.staleness)]
            diffs.append(abs(r.ratio_to_ideal - m.ratio_to_ideal) / m.ratio_to_ideal)
    cells = []
    fams = {HEAD: [], HEAD_MEASURED: []}
    for r in results:
        if r.policy.startswith("psrl head"):
            fams[HEAD_MEASURED if r.policy.endswith(" (coordinator)") else HEAD].append(r)
    for mlb in (0.0, 0.95):
        fr = frontier(_relabel(fams[HEAD] + fams[HEAD_MEASURED], family), mlb)
        for s in ACCEPT_S:
            a, b = best_at(fr.get(HEAD, []), s), best_at(fr.get(HEAD_MEASURED, []), s)
            if a is not None and b is not None:
                cells.append(abs(b.steps_per_hour - a.steps_per_hour) / a.steps_per_hour)
            elif (a is None) != (b is None):
                cells.append(float("inf"))  # one delivers s, the other not
    out = {
        "sigma": sigma,
        "seed": seed,
        "runs": len(diffs),
        "max_run_rel_diff": max(diffs, default=0.0),
        "cells": len(cells),
        "max_cell_rel_diff": max(cells, default=0.0),
    }
    print(
        f"head-truncate, sigma {sigma}, seed {seed}: psrl model vs psrl train's coordinator: {len(diffs)} runs, "
        f"max |ratio difference| {100 * out['max_run_rel_diff']:.2f} %; {len(cells)} frontier cells, max "
        f"{100 * out['max_cell_rel_diff']:.2f} %\n"
    )
    return out


def frontier_table(results: list[Result], family: dict[str, str], min_length_bias: float) -> str:
    """One frontier table of docs/simulate.md: ratio to ideal of each family's best point with true max staleness
    <= s (s = 0..4), with its discarded fraction d and length bias b when they are not 0 / 1."""
    plain = [r for r in results if r.policy == "psrl"]
    fr = frontier(plain + _relabel(results, family), min_length_bias)
    names = list(fr)
    lines = ["| s | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in ACCEPT_S:
        cells = []
        for n in names:
            pt = best_at(fr[n], s)
            if pt is None:
                cells.append("-")
                continue
            r = pt.result
            cell = f"{r.ratio_to_ideal:.2f}"
            if r.discarded_fraction >= 0.005 or r.length_bias < 0.995:
                cell += f" (d {r.discarded_fraction:.2f}, b {r.length_bias:.2f})"
            if "best config" in n or "tuned" in n or "head" in n:
                cell += f" {_config(r).replace('psrl ', '').replace(' (coordinator)', '')}"
            cells.append(cell)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_frontier(steps: int, seed: int, measured: bool = False, store: list | None = None) -> list[dict]:
    """The frontier tables of docs/simulate.md (``frontier_table``) for each sigma, without and with a length-bias
    floor of 0.95. ``measured``: with the head-truncate column measured on psrl train's coordinator, and the
    agreement. ``store``: each sigma's runs and families are appended to it (``--results``)."""
    agreement = []
    for sigma in ACCEPT_SIGMAS:
        results, family = frontier_runs(sigma, steps, seed, measured)
        if store is not None:
            store.append({"sigma": sigma, "family": family, "runs": [asdict(r) for r in results]})
        if measured:
            agreement.append(head_agreement(results, family, sigma, seed))
        for mlb in (0.0, 0.95):
            cond = "any length bias" if mlb == 0 else f"length_bias >= {mlb:g}"
            print(f"sigma {sigma}, {cond} (ratio to ideal; d = discarded fraction, b = length bias):\n")
            print(frontier_table(results, family, mlb) + "\n")
    return agreement


def million() -> float:
    """Time psrl on ~1M trajectories: 250 steps of 512 groups x 8, 4096 slots, balanced, sigma 1."""
    wl = Workload(
        slots=4096,
        steps=250,
        staleness=2,
        batch_size=512,
        redundant_batch_size=512,
        group_size=8,
        redundant_group_size=8,
        sigma=1.0,
        train_time=math.exp(0.5),
    )
    t0 = time.perf_counter()
    r = simulate(wl, "psrl")
    dt = time.perf_counter() - t0
    print(
        f"1M-trajectory run: psrl, {r.launched_trajectories} trajectories launched, "
        f"{r.trained_trajectories} trained, {wl.steps} steps: {dt:.1f} s wall, {dt / 60:.2f} of the 60 s budget "
        f"(ratio {r.ratio_to_ideal:.3f}, violations {r.violations})"
    )
    return dt


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,7", help="comma-separated seeds of the frontier acceptance")
    ap.add_argument("--plot", default=None, help="write the frontier plots to FILE_sigma<s>_seed<k>.png")
    ap.add_argument("--million", action="store_true", help="also time the 1M-trajectory psrl run")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    ap.add_argument(
        "--markdown", action="store_true", help="print only the frontier tables of docs/simulate.md (first seed)"
    )
    ap.add_argument(
        "--measured",
        action="store_true",
        help="with --markdown: add the head-truncate column measured on psrl train's coordinator (virtual time; "
        "about 10 s per run) and print the model-vs-real agreement for every seed (one JSON line)",
    )
    ap.add_argument(
        "--results", type=Path, default=None, help="store the reference table's runs here (with the command)"
    )
    ns = ap.parse_args(argv)
    steps = 12 if ns.quick else ns.steps
    seeds = [int(x) for x in ns.seeds.split(",") if x.strip()]
    if ns.markdown:
        store: list[dict] = []
        agreement = markdown_frontier(steps, seeds[0], ns.measured, store)
        if ns.results:  # every frontier run of the first seed, with its family (docs/simulate.md renders the tables)
            stored.write(ns.results, {"steps": steps, "seed": seeds[0], "measured": ns.measured, "frontier": store})
        if ns.measured:
            for seed in seeds[1:]:
                for sigma in ACCEPT_SIGMAS:
                    agreement.append(head_agreement(*frontier_runs(sigma, steps, seed, True), sigma, seed))
            worst = max(max(a["max_run_rel_diff"], a["max_cell_rel_diff"]) for a in agreement)
            print(
                json.dumps(
                    {
                        "benchmark": "head_scope_agreement",
                        "steps": steps,
                        "worst_rel_diff": worst,
                        "within_5pct": worst <= 0.05,
                        "rows": agreement,
                    }
                )
            )
        return 0
    t0 = time.perf_counter()
    results = reference_table(steps, seeds[0])
    pairs = model_vs_real(results, steps, seeds[0])
    if ns.results:  # the reference table's runs and the model-vs-real pairs (docs/simulate.md renders them)
        reference = [{"sigma": k[0], "setting": k[1], "label": k[2], **asdict(r)} for k, r in results.items()]
        stored.write(ns.results, {"steps": steps, "seed": seeds[0], "reference": reference, "model_vs_real": pairs})
    verdicts = frontier_section(steps, seeds[:1] if ns.quick else seeds, ns.plot)
    million_s = million() if ns.million else None
    print(f"({time.perf_counter() - t0:.1f} s)")
    print(
        json.dumps(
            {
                "benchmark": "policies",
                "steps": steps,
                "seeds": seeds,
                "acceptance_holds": all(v["holds"] for v in verdicts),
                "plain_psrl_holds": all(v["plain_holds"] for v in verdicts),
                "failures": [v for v in verdicts if not v["holds"]],
                "plain_psrl_below": [
                    {
                        k: v[k]
                        for k in (
                            "seed",
                            "sigma",
                            "s",
                            "peer",
                            "min_length_bias",
                            "plain_psrl_steps_per_hour",
                            "peer_steps_per_hour",
                            "peer_config",
                        )
                    }
                    for v in verdicts
                    if not v["plain_holds"]
                ],
                "million_seconds": million_s,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
