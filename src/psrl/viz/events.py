"""Record the core's transitions to ``events.jsonl`` and rebuild buffer counts from them.

``EventLog`` is an ``on_event`` callback for :class:`psrl.staleness.StalenessManager`: one JSON line
per transition with a timestamp from an injected clock (``loop.time`` in the coordinator, simulated
time in the simulator), so the buffer timeline of the seed's animation can be drawn from a real run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Optional

from psrl.staleness import Event


class EventLog:
    """Append each :class:`Event` as a JSON line ``{"t", "kind", "entry", "buffer", ...}``.

    Lines are buffered and flushed every ``flush_every`` events and on :meth:`flush`; ``psrl train``
    flushes after every training step, so a run that is killed keeps its log up to the last step.
    """

    def __init__(self, path: str | Path, clock: Optional[Callable[[], float]] = None, flush_every: int = 256):
        self.path = Path(path)
        self._fh = self.path.open("a", buffering=1 << 16)
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._n = 0
        self._flush_every = flush_every

    def __call__(self, ev: Event) -> None:
        rec = {"t": round(self._clock() - self._t0, 6), **ev._asdict()}
        self._fh.write(json.dumps(rec, default=str) + "\n")
        self._n += 1
        if self._n % self._flush_every == 0:
            self._fh.flush()

    def flush(self) -> None:
        self._fh.flush()

    def offset(self) -> int:
        """Bytes on disk after a flush (a checkpoint stores it; a resume cuts the file back to it)."""
        self._fh.flush()
        return os.fstat(self._fh.fileno()).st_size

    def close(self) -> None:
        self._fh.close()


def read_events(path: str | Path) -> list[dict]:
    """Every event of ``events.jsonl`` (strict: a damaged line raises; ``psrl viz`` uses :func:`read_valid`)."""
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_valid(path: str | Path, fields: dict[str, tuple[type, ...]]) -> tuple[list[dict], list[str]]:
    """``(records, damaged)`` of a JSONL file a run may have left damaged (killed mid-line, disk full, edited):
    the records that parse and hold ``fields`` with those types, and one ``file:line: why`` per line that
    does not. A missing file reads as empty."""
    p = Path(path)
    good: list[dict] = []
    bad: list[str] = []
    if not p.exists():
        return good, bad
    with p.open(encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                bad.append(f"{p}:{n}: not JSON ({e.msg})")
                continue
            missing = [k for k, tps in fields.items() if not isinstance(rec, dict) or not _valid(rec.get(k), tps)]
            if missing:
                bad.append(f"{p}:{n}: no valid {missing[0]!r}")
                continue
            good.append(rec)
    return good, bad


def _valid(value: object, types: tuple[type, ...]) -> bool:
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
        if kind == "reserve":
            R[b] += 1
        elif kind == "occupy":
            rb = ev.get("reserved_buffer", b)
            rb = rb if isinstance(rb, int) and not isinstance(rb, bool) else b
            R[rb] -= 1
            O[b] += 1
            touched.append(rb)
        elif kind in ("filtered", "surplus", "abort", "passive_abort"):
            R[b] -= 1
        elif kind == "consume":
            O[b] -= 1
        for x in set(touched):
            out[x].append((t, R[x], O[x]))
    return dict(out)
