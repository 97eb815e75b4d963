"""Record the core's transitions to ``events.jsonl`` and rebuild buffer counts from them.

``EventLog`` is an ``on_event`` callback for :class:`psrl.staleness.StalenessManager`: one JSON line
per transition with a timestamp from an injected clock (``loop.time`` in the coordinator, simulated
time in the simulator), so the buffer timeline of the seed's animation can be drawn from a real run.
"""

from __future__ import annotations

import json
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

    def close(self) -> None:
        self._fh.close()


def read_events(path: str | Path) -> list[dict]:
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


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
