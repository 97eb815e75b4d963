"""The run directory: ``config.yaml``, ``metrics.jsonl``, ``trajectories.jsonl``.

Lines are flushed as they are written, so a crashed run keeps everything up to the crash. A
checkpoint stores the byte length of both JSONL files; resuming truncates them back to it,
so a resumed run's files read as if it had never stopped (no duplicated steps).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.metrics import checked

if TYPE_CHECKING:
    from psrl.runtime.adaptive import Move

__all__ = [
    "RunRecorder",
    "set_aside_previous_run",
    "EventLog",
    "BOUND_EVENT",
    "RUN_FILES",
    "EVENTS_FILE",
    "default_run_dir",
    "read_jsonl",
    "jsonl_lines",
]

RUN_FILES = ("metrics.jsonl", "trajectories.jsonl")
EVENTS_FILE = "events.jsonl"
"""The :class:`EventLog` of a run (the timeline of ``psrl viz``); a checkpoint stores its length too."""
"""The JSONL files a :class:`RunRecorder` appends to (a checkpoint stores their lengths, a resume cuts them back)."""


def default_run_dir(root: str | Path = "runs") -> Path:
    """``runs/<UTC timestamp>`` (a suffix is added if it exists)."""
    import datetime

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    path = Path(root) / stamp
    k = 1
    while path.exists():
        path = Path(root) / f"{stamp}-{k}"
        k += 1
    return path


def set_aside_previous_run(run_dir: str | Path) -> Path | None:
    """Move an earlier run's logs (``metrics.jsonl``, ``trajectories.jsonl``, ``events.jsonl``) and checkpoints
    (``checkpoint*``) into ``previous/<UTC time>/`` of ``run_dir`` so a run that starts over there
    (``trainer.resume=false``) neither appends to them nor could later resume one of its checkpoints; returns
    that directory, or None when there was nothing to move."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    names = [*RUN_FILES, EVENTS_FILE]
    old = [run_dir / n for n in names if (run_dir / n).exists()] + sorted(run_dir.glob("checkpoint*"))
    if not old:
        return None
    aside = default_run_dir(run_dir / "previous")
    aside.mkdir(parents=True)
    for path in old:
        path.rename(aside / path.name)
    return aside


class RunRecorder:
    """Appends JSON lines to the run directory; the sink the agent manager and coordinator write to."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._files = {name: open(self.run_dir / name, "a", encoding="utf-8") for name in RUN_FILES}

    def write_config(self, cfg: Any) -> Path:
        import yaml

        from psrl.config import config_to_dict

        path = self.run_dir / "config.yaml"
        path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return path

    def trajectory(self, rec: dict) -> None:
        self._write("trajectories.jsonl", rec)

    def metric(self, row: dict) -> None:
        """One row, once :func:`psrl.metrics.checked` says every key is in the metric table."""
        self._write("metrics.jsonl", checked(row))

    def _write(self, name: str, obj: dict) -> None:
        f = self._files[name]
        f.write(json.dumps(_plain(obj), separators=(",", ":")) + "\n")
        f.flush()

    def offsets(self) -> dict[str, int]:
        """Current byte length of each JSONL file (stored in checkpoints)."""
        out = {}
        for name, f in self._files.items():
            f.flush()
            out[name] = os.fstat(f.fileno()).st_size
        return out

    def truncate(self, offsets: dict[str, int]) -> None:
        """Cut the JSONL files back to ``offsets`` (resume from a checkpoint)."""
        for name, size in offsets.items():
            f = self._files[name]
            f.flush()
            if os.fstat(f.fileno()).st_size > int(size):
                os.ftruncate(f.fileno(), int(size))

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def _plain(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, enums / paths strings."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, str):
        return str(obj)
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL file (tests, benchmarks, plots)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, value, None)`` for every non-blank line of a JSONL file that parses, ``(line number, None,
    why)`` for one that does not: for files a run may have left damaged (killed mid-line, disk full, edited),
    whose readers decide what a damaged line means. An unreadable file raises OSError."""
    with Path(path).open(encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or an integer too long to convert
                yield n, None, e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                continue
            yield n, value, None


BOUND_EVENT = "staleness_bound"
"""The ``kind`` of an ``events.jsonl`` line saying the adaptive controller moved the bound (not a core event)."""


class EventLog:
    """``events.jsonl``: an ``on_event`` callback for :class:`psrl.staleness.StalenessManager` appending each
    transition (:class:`psrl.staleness.Event`) as a JSON line ``{"t", "kind", "entry", "buffer", ...}``, ``t`` in
    seconds of ``clock`` since the first event this log writes (``psrl train`` opens the log before it builds the
    run, so the build and the warm start are not on the timeline).

    Lines are buffered and flushed every ``flush_every`` events and on :meth:`flush`; ``psrl train``
    flushes after every training step, so a run that is killed keeps its log up to the last step.
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] | None = None, flush_every: int = 256):
        self.path = Path(path)
        self._fh = self.path.open("a", buffering=1 << 16)
        self._clock = clock or time.monotonic
        self._t0: float | None = None
        self._n = 0
        self._flush_every = flush_every

    def __call__(self, ev: Any) -> None:
        self._write(ev._asdict())

    def _write(self, fields: dict) -> None:
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        rec = {"t": round(now - self._t0, 6), **fields}
        self._fh.write(json.dumps(rec, default=str) + "\n")
        self._n += 1
        if self._n % self._flush_every == 0:
            self._fh.flush()

    def bound(self, move: Move) -> None:
        """A move of ``psrl.adaptive_staleness``'s bound (:class:`psrl.runtime.adaptive.Move`) as a line
        ``{"t", "kind": "staleness_bound", "step", "old", "new", "reason"}``: it applies to reservations made
        after ``t`` (``psrl viz`` marks it on the buffer timeline)."""
        self._write({"kind": BOUND_EVENT, "step": move.step, "old": move.old, "new": move.new, "reason": move.reason})

    def flush(self) -> None:
        self._fh.flush()

    def offset(self) -> int:
        """Bytes on disk after a flush (a checkpoint stores it; a resume cuts the file back to it)."""
        self._fh.flush()
        return os.fstat(self._fh.fileno()).st_size

    def close(self) -> None:
        self._fh.close()
