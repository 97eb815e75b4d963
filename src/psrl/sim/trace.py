"""Reading a run of ``psrl train`` back as a workload: the generation times of ``trajectories.jsonl`` in launch
order (``sim.gen_time.trace``) and the training time per step of the ``metrics.jsonl`` beside it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from psrl.config import ConfigError
from psrl.runtime.recorder import jsonl_lines

__all__ = ["load_trace", "load_trace_records", "launch_key", "trace_train_time"]


def load_trace(path: str | Path) -> list[float]:
    """The ``gen_seconds`` of every finished trajectory in a ``trajectories.jsonl``, in launch order.

    ``psrl train`` writes records as trajectories resolve (fast ones first); replaying that order
    would start the slow ones late. Its ids (group ``g<k>``, uid ``g<k>-<member>``) give the launch
    order, so records are sorted by them when every record has them; otherwise file order is kept.
    """
    return [float(r["gen_seconds"]) for r in load_trace_records(path)]


def load_trace_records(path: str | Path) -> list[dict]:
    """The records behind :func:`load_trace` (finished, with ``gen_seconds``), in launch order."""
    p = Path(path)
    if not p.exists():
        raise ConfigError("sim.gen_time.trace", f"file not found: {p}", "give a run's trajectories.jsonl")
    recs = []
    for n, rec in _jsonl(p, "sim.gen_time.trace"):
        # an aborted (cancelled) record holds a partial time: not a full generation
        if "gen_seconds" in rec and rec.get("status") != "aborted":
            if not _seconds(rec["gen_seconds"]):
                raise ConfigError(
                    "sim.gen_time.trace",
                    f"{p}:{n}: gen_seconds is {rec['gen_seconds']!r}, not a number of seconds >= 0",
                    "give a trajectories.jsonl written by psrl train",
                )
            recs.append(rec)
    if not recs:
        raise ConfigError("sim.gen_time.trace", f"no 'gen_seconds' field in {p}")
    keys = [k for k in map(launch_key, recs) if k is not None]
    if len(keys) == len(recs):
        recs = [r for _, r in sorted(zip(keys, recs), key=lambda kr: kr[0])]
    return recs


def _jsonl(p: Path, key: str) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` of a JSONL file; a damaged line is a ConfigError naming ``key`` and the line."""
    try:
        for n, rec, why in jsonl_lines(p):
            if why is not None:
                raise ConfigError(
                    key,
                    f"{p}:{n} is not a JSON line ({why})",
                    "give a trajectories.jsonl written by psrl train (or delete the damaged line)",
                )
            if not isinstance(rec, dict):
                raise ConfigError(key, f"{p}:{n} is not a JSON object", "give a trajectories.jsonl of psrl train")
            yield n, rec
    except OSError as e:
        raise ConfigError(key, f"cannot read {p} ({e.strerror})", "give a readable file") from e


def _seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def launch_key(rec: dict) -> tuple[int, int] | None:
    """(group number, member number) from ids like group 'g12', uid 'g12-3'; None if not that shape."""
    group, uid = str(rec.get("group", "")), str(rec.get("uid", ""))
    head, _, member = uid.rpartition("-")
    if not (group.startswith("g") and group[1:].isdigit() and head == group and member.isdigit()):
        return None
    return int(group[1:]), int(member)


_TRAIN_KEYS = ("time/train_s",)


def trace_train_time(trace_path: str | Path) -> float | None:
    """Mean training seconds per step from the ``metrics.jsonl`` beside the trace, if it records them."""
    p = Path(trace_path).with_name("metrics.jsonl")
    if not p.exists():
        return None
    vals = []
    for _, rec in _jsonl(p, "sim.gen_time.trace"):
        for k in _TRAIN_KEYS:
            if k in rec and _seconds(rec[k]):
                vals.append(float(rec[k]))
                break
    return float(np.mean(vals)) if vals else None
