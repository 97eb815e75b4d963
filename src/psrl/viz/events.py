"""Read ``events.jsonl`` (the core's transitions, written by :class:`psrl.runtime.recorder.EventLog`) and
rebuild buffer counts from them, so the buffer timeline of the seed's animation can be drawn from a real run.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from psrl.runtime.recorder import jsonl_lines
from psrl.staleness import EventKind

_RELEASES = (EventKind.FILTERED, EventKind.SURPLUS, EventKind.ABORT, EventKind.PASSIVE_ABORT)
"""The kinds that end a RESERVED entry, releasing its reservation at the event's buffer."""


def read_events(path: str | Path) -> list[dict]:
    """Every event of ``events.jsonl`` (strict: a damaged line raises; ``psrl viz`` uses :func:`read_valid`)."""
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


Fields = Mapping[str, tuple[type, ...]]


def read_valid(path: str | Path, fields: Fields | Callable[[object], Fields]) -> tuple[list[dict], list[str]]:
    """``(records, damaged)`` of a JSONL file a run may have left damaged (killed mid-line, disk full, edited):
    the records that parse and hold ``fields`` with those types (``fields(record)`` when the fields depend on
    the record's kind), and one ``file:line: why`` per line that does not. A missing file reads as empty."""
    p = Path(path)
    good: list[dict] = []
    bad: list[str] = []
    if not p.exists():
        return good, bad
    for n, rec, why in jsonl_lines(p):
        if why is not None:
            bad.append(f"{p}:{n}: not JSON ({why})")
            continue
        want = fields(rec) if callable(fields) else fields
        missing = [k for k, tps in want.items() if not isinstance(rec, dict) or not valid(rec.get(k), tps)]
        if missing:
            bad.append(f"{p}:{n}: no valid {missing[0]!r}")
            continue
        good.append(rec)
    return good, bad


def valid(value: object, types: tuple[type, ...]) -> bool:
    """``value`` has one of ``types``; a bool is not a number, NaN and infinities are not times."""
    if isinstance(value, bool) or not isinstance(value, types):
        return False
    return not isinstance(value, float) or math.isfinite(value)


def buffer_timeline(events: Iterable[dict]) -> dict[int, list[tuple[float, int, int]]]:
    """Per buffer version, the ``(t, R_b, O_b)`` after every transition that touched it."""
    R: dict[int, int] = defaultdict(int)
    O: dict[int, int] = defaultdict(int)
    out: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for ev in events:
        kind, b, t = ev["kind"], ev["buffer"], ev["t"]
        touched = [b]
        if kind == EventKind.RESERVE:
            R[b] += 1
        elif kind == EventKind.OCCUPY:
            rb = ev.get("reserved_buffer", b)
            rb = rb if isinstance(rb, int) and not isinstance(rb, bool) else b
            R[rb] -= 1
            O[b] += 1
            touched.append(rb)
        elif kind in _RELEASES:
            R[b] -= 1
        elif kind == EventKind.CONSUME:
            O[b] -= 1
        for x in set(touched):
            out[x].append((t, R[x], O[x]))
    return dict(out)
