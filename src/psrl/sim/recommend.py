"""``psrl simulate --recommend RUN_DIR --out FILE``: a configuration for the next run, from this run's timings.

The run's workload is replayed (:mod:`psrl.sim.replay`: its generation times and step time, its slots) under
the run's own config -- *the run as it was* -- and under every point of a grid over the recommended keys
(:data:`KEYS`):

* ``psrl.staleness``: 0 .. ``--max-staleness`` (default: the run's own);
* the proactive filter: as the run had it, off (``method: null``; when the run had one), and ``truncate`` with
  ``scope`` window and head and ``threshold`` 1, 2, 4, 8 (at most B', the entries of a buffer), grace 0;
* redundancy: B' in {B, 1.25 B, 1.5 B} x N' in {N, N + max(1, N // 4)} (rounded up; N' at most the agent
  workers) and the run's own.

Each point is simulated with the ``psrl`` policy (the real ``StalenessManager``; ``tests/sim`` holds it equal
to ``psrl train``'s coordinator in virtual time) on the same replayed stream. A point is *feasible* when its
staleness is <= ``--max-staleness``, its ``length_bias`` >= ``--min-length-bias`` (default 0.95) and its
``discarded_fraction`` <= ``--max-discard`` (default 0.10). The *frontier* is the feasible points no other
feasible point beats or equals on all of steps/h, length bias, discarded fraction and staleness (of equal ones,
the one changing fewest keys). The *pick*: of the frontier points within :data:`TIE` of the fastest, the one
with the smallest staleness, then the highest length bias, the least discarded, the fewest changed keys.

The run's ``config.yaml`` is written to ``FILE`` with the picked keys changed and ``trainer.run_dir`` set to
null (a fresh ``runs/<time>``: the run's own directory would be *resumed* by ``psrl train``), after
``load_config`` accepted it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psrl.config import Config, ConfigError, apply_overrides, check_out_dir, config_to_dict, load_config
from psrl.sim import simulate
from psrl.sim.metrics import Result
from psrl.sim.replay import measured_seconds_per_step, replay_workload

__all__ = ["KEYS", "TIE", "Point", "Recommendation", "recommend", "write_config", "format_recommendation"]

_P = "psrl.proactive_filter_strategy."
_R = "psrl.redundant_rollout."
KEYS = (
    "psrl.staleness",
    _P + "method",
    _P + "threshold",
    _P + "scope",
    _P + "grace",
    _R + "enable",
    _R + "alg_global_batch_size",
    _R + "redundant_global_batch_size",
    _R + "alg_rollout_n",
    _R + "redundant_rollout_n",
)
"""The keys a recommendation may change (and ``trainer.run_dir``, always reset to null)."""
TIE = 0.01
"""Points within this fraction of the fastest feasible one count as equally fast."""
_THRESHOLDS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Point:
    """One simulated configuration: the values of :data:`KEYS` and its result."""

    settings: dict[str, Any]
    changes: dict[str, Any]
    result: Result
    redundant_batch_size: int
    """B' of this configuration."""
    redundant_group_size: int
    """N' of this configuration."""

    @property
    def staleness(self) -> int:
        return int(self.settings["psrl.staleness"])

    def label(self) -> tuple[str, str, str, str]:
        """(staleness, filter, B', N') as printed."""
        s = self.settings
        method = s[_P + "method"]
        filt = "off" if method is None else f"{method} {s[_P + 'scope']} {s[_P + 'threshold']}"
        return str(self.staleness), filt, str(self.redundant_batch_size), str(self.redundant_group_size)


@dataclass(frozen=True)
class Recommendation:
    run_dir: Path
    steps: int
    measured_s_per_step: float
    baseline: Result
    points: list[Point]
    feasible: list[Point]
    frontier: list[Point]
    pick: Point
    constraints: dict[str, float]
    rejected: list[str]
    """Why ``load_config`` rejected the grid points it rejected (one message each)."""

    @property
    def speedup(self) -> float:
        return self.baseline.seconds_per_step / self.pick.result.seconds_per_step

    def to_json(self) -> dict:
        r = self.pick.result
        return {
            "run": str(self.run_dir),
            "measured_s_per_step": self.measured_s_per_step,
            "as_run_s_per_step": self.baseline.seconds_per_step,
            "predicted_s_per_step": r.seconds_per_step,
            "speedup": self.speedup,
            "length_bias": r.length_bias,
            "discarded_fraction": r.discarded_fraction,
            "staleness": self.pick.staleness,
            "changes": self.pick.changes,
            "simulated": len(self.points),
            "feasible": len(self.feasible),
        }


def _own(cfg: Config) -> dict[str, Any]:
    """The run's values of :data:`KEYS`."""
    flat = config_to_dict(cfg)
    out = {}
    for key in KEYS:
        node: Any = flat
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def grid(cfg: Config, max_staleness: int) -> list[dict[str, Any]]:
    """Every configuration tried: full values of :data:`KEYS` (module docstring)."""
    own, p = _own(cfg), cfg.psrl
    filters = [{k: own[k] for k in KEYS if k.startswith(_P)}]
    if own[_P + "method"] is not None:
        filters.append(
            {_P + "method": None, _P + "threshold": own[_P + "threshold"], _P + "scope": "window", _P + "grace": 0.0}
        )
    for scope in ("window", "head"):
        for t in sorted({min(t, p.redundant_batch_size) for t in _THRESHOLDS}):
            filters.append({_P + "method": "truncate", _P + "threshold": t, _P + "scope": scope, _P + "grace": 0.0})
    b, n = p.batch_size, p.group_size
    workers = p.deployment.n_rollout_instances * p.routing_strategy.max_concurrent_seqs_per_instance
    sizes = {(bb, nn) for bb in (b, math.ceil(1.25 * b), math.ceil(1.5 * b)) for nn in (n, n + max(1, n // 4))}
    sizes = {(bb, nn) for bb, nn in sizes if nn <= workers}
    own_sizes = (p.redundant_batch_size, p.redundant_group_size)
    redundancy = [{k: own[k] for k in KEYS if k.startswith(_R)}]
    for bb, nn in sorted(sizes - {own_sizes}):
        if (bb, nn) == (b, n):
            redundancy.append({_R + "enable": False, **{_R + k: None for k in _R_SIZES}})
        else:
            vals = (b, bb, n, nn)
            redundancy.append({_R + "enable": True, **{_R + k: v for k, v in zip(_R_SIZES, vals)}})
    out = []
    for eta in range(max_staleness + 1):
        for f in _dedupe(filters):
            for r in redundancy:
                out.append({"psrl.staleness": eta, **f, **r})
    return out


_R_SIZES = ("alg_global_batch_size", "redundant_global_batch_size", "alg_rollout_n", "redundant_rollout_n")


def _dedupe(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for d in items:
        key = tuple(sorted(d.items()))
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _overrides(settings: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in settings.items()]


def recommend(
    run_dir: Path, max_staleness: int | None = None, min_length_bias: float = 0.95, max_discard: float = 0.10
) -> Recommendation:
    """Simulate the run as it was and the grid; return the feasible frontier and the pick (module docstring)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ConfigError("--recommend", f"{run_dir} has no config.yaml", "give a run directory written by psrl train")
    cfg = load_config(run_dir / "config.yaml")
    k = cfg.psrl.staleness if max_staleness is None else max_staleness
    if k < 0:
        raise ConfigError("--max-staleness", f"must be >= 0, got {k}", "e.g. --max-staleness 2")
    if not 0.0 <= min_length_bias <= 1.0:
        raise ConfigError("--min-length-bias", f"must be in [0, 1], got {min_length_bias}", "e.g. 0.95")
    if not 0.0 <= max_discard <= 1.0:
        raise ConfigError("--max-discard", f"must be in [0, 1], got {max_discard}", "e.g. 0.1")
    measured, steps = measured_seconds_per_step(run_dir)
    own = _own(cfg)
    base_wl = replay_workload(run_dir, steps)
    trace = base_wl.trace
    assert trace is not None
    baseline = simulate(base_wl, "psrl")
    points, rejected = [], []
    for settings in grid(cfg, k):
        try:
            wl = replay_workload(run_dir, steps, overrides=_overrides(settings), trace=trace)
        except ConfigError as e:  # a combination the config rejects (e.g. an adaptive minimum above this staleness)
            rejected.append(str(e))
            continue
        changes = {key: v for key, v in settings.items() if v != own[key]}
        points.append(Point(settings, changes, simulate(wl, "psrl"), wl.redundant_batch_size, wl.redundant_group_size))
    feasible = [
        p
        for p in points
        if p.result.violations == 0
        and p.result.length_bias >= min_length_bias
        and p.result.discarded_fraction <= max_discard
    ]
    constraints = {"max_staleness": k, "min_length_bias": min_length_bias, "max_discard": max_discard}
    if not feasible:
        raise ConfigError("--min-length-bias / --max-discard", _infeasible(points, constraints), _relax(points))
    front = frontier(feasible)
    fastest = max(p.result.steps_per_hour for p in front)
    near = [p for p in front if p.result.steps_per_hour >= (1.0 - TIE) * fastest]
    pick = min(near, key=lambda p: (p.staleness, -p.result.length_bias, p.result.discarded_fraction, len(p.changes)))
    return Recommendation(run_dir, steps, measured, baseline, points, feasible, front, pick, constraints, rejected)


def frontier(points: list[Point]) -> list[Point]:
    """Points no other beats or equals on steps/h, length bias, discarded fraction and staleness (of equal ones,
    the one with the fewest changes), by staleness then speed."""

    def score(p: Point) -> tuple[float, float, float, float]:
        r = p.result
        return (r.steps_per_hour, r.length_bias, -r.discarded_fraction, -p.staleness)

    ranked = sorted(points, key=lambda p: len(p.changes))
    scores = [score(p) for p in ranked]
    out: list[Point] = []
    kept: set[int] = set()
    for i, (p, sp) in enumerate(zip(ranked, scores)):
        beaten = any(
            all(a >= b for a, b in zip(sq, sp)) and (sq != sp or j in kept) for j, sq in enumerate(scores) if j != i
        )
        if not beaten:
            out.append(p)
            kept.add(i)
    return sorted(out, key=lambda p: (p.staleness, -p.result.steps_per_hour))


def _infeasible(points: list[Point], c: dict[str, float]) -> str:
    best_bias = max((p.result.length_bias for p in points), default=0.0)
    best_disc = min((p.result.discarded_fraction for p in points), default=1.0)
    return (
        f"no configuration with staleness <= {c['max_staleness']:g} has length_bias >= {c['min_length_bias']:g} and "
        f"discarded_fraction <= {c['max_discard']:g} ({len(points)} simulated: the highest length bias is "
        f"{best_bias:.3f}, the least discarded {best_disc:.3f})"
    )


def _relax(points: list[Point]) -> str:
    fastest = max(points, key=lambda p: p.result.steps_per_hour, default=None)
    if fastest is None:
        return "raise --max-staleness"
    r = fastest.result
    return (
        f"relax a constraint: e.g. the fastest configuration simulated has length_bias {r.length_bias:.3f} and "
        f"discarded_fraction {r.discarded_fraction:.3f}; or raise --max-staleness"
    )


def write_config(rec: Recommendation, out: str | Path) -> Path:
    """The run's ``config.yaml`` with the pick's keys changed and ``trainer.run_dir`` null, validated by
    ``load_config`` before it is written (atomically) to ``out``."""
    import yaml

    out = Path(out)
    if out.is_dir():
        raise ConfigError("--out", f"{out} is a directory", "give a YAML file name, e.g. --out next.yaml")
    check_out_dir("--out", out.parent)
    data = yaml.safe_load((rec.run_dir / "config.yaml").read_text())
    apply_overrides(data, _overrides(rec.pick.changes) + ["trainer.run_dir=null"])
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        load_config(tmp)
    except ConfigError:
        tmp.unlink()
        raise
    os.replace(tmp, out)
    return out


def _row(p: Point, base: Result, tag: str = "") -> str:
    r = p.result
    eta, filt, b, n = p.label()
    return (
        f"{eta:>3}  {filt:<18} {b:>3} {n:>3}  {r.seconds_per_step:>7.3f}  {r.steps_per_hour:>8.1f}  "
        f"{base.seconds_per_step / r.seconds_per_step:>6.2f}x  {r.length_bias:>8.3f}  {r.discarded_fraction:>9.3f}"
        f"{tag}"
    )


def format_recommendation(rec: Recommendation, out: Path | None = None, max_rows: int = 25) -> str:
    """The printed report: the run, the constraints, the frontier table, the pick and its changed keys."""
    b, c, pick = rec.baseline, rec.constraints, rec.pick
    lines = [
        f"run {rec.run_dir}: {rec.steps} steps; measured {rec.measured_s_per_step:.3f} s/step, replayed as it was "
        f"{b.seconds_per_step:.3f} s/step ({b.seconds_per_step / rec.measured_s_per_step - 1:+.1%}), length_bias "
        f"{b.length_bias:.3f}, discarded {b.discarded_fraction:.3f}",
        f"constraints: staleness <= {c['max_staleness']:g}, length_bias >= {c['min_length_bias']:g}, "
        f"discarded <= {c['max_discard']:g}: {len(rec.feasible)} of {len(rec.points)} configurations simulated meet them",
        *(
            [f"({len(rec.rejected)} combinations rejected by the config, e.g. {rec.rejected[0]})"]
            if rec.rejected
            else []
        ),
        "frontier (feasible; none of the others is at least as good in steps/h, length bias, discarded and staleness):",
        f"{'eta':>3}  {'proactive filter':<18} {'Bp':>3} {'Np':>3}  {'s/step':>7}  {'steps/h':>8}  "
        f"{'speedup':>7}  {'len_bias':>8}  {'discarded':>9}",
    ]
    rows = rec.frontier if len(rec.frontier) <= max_rows else rec.frontier[:max_rows]
    lines += [_row(p, b, "   <- recommended" if p is pick else "") for p in rows]
    if len(rec.frontier) > max_rows:
        lines.append(f"... {len(rec.frontier) - max_rows} more frontier points")
    r = pick.result
    eta, filt, bb, nn = pick.label()
    lines.append(
        f"recommended: staleness {eta}, proactive filter {filt}, B' {bb}, N' {nn}: {r.seconds_per_step:.3f} s/step "
        f"predicted, {rec.speedup:.2f}x the run as it was (length_bias {r.length_bias:.3f}, discarded "
        f"{r.discarded_fraction:.3f})"
    )
    if pick.changes:
        lines.append("changed keys: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in pick.changes.items()))
    else:
        lines.append("changed keys: none (the run as it was is the pick)")
    if out is not None:
        lines.append(f"written {out} (trainer.run_dir reset to null): psrl train {out}")
    return "\n".join(lines)
