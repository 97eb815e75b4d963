"""Resumable checkpoints of an asynchronous run.

A checkpoint is taken between two training steps, in one synchronous block (nothing else runs
meanwhile), and holds: the trainer (weights, optimiser, version, generator states), a snapshot
of the staleness manager (occupied groups not yet trained are kept), the agent manager's prompt
stream and counters, and the byte length of the JSONL files.

Resuming restores all of it. In-flight generation cannot be restored, so every entry that was
still RESERVED is aborted and the trajectories it already held are recorded as ``aborted``
(never lost silently); the JSONL files are cut back to their checkpoint length, so steps
after the checkpoint are not duplicated. Writing goes to ``checkpoint.tmp`` first and is
renamed into place, so a crash while saving leaves the previous checkpoint intact.

The newest checkpoint is ``checkpoint/``; the ``trainer.keep_checkpoints - 1`` before it stay as
``checkpoint.v<version>/``. Each ends with ``manifest.json`` (its version and every file's size),
written last, so a partial copy is detected. A checkpoint that cannot be read or restored
(truncated, overwritten, from an incompatible version) is never a traceback: :func:`resume` says
so, moves it aside as ``<name>.damaged`` and uses the newest intact one before it (a restore that fails
because the trainer could not run -- a rank died or did not start -- moves nothing and is raised); only when none is
intact does it raise :class:`~psrl.errors.RunError` naming the directory and what to do. A save that
fails (a full disk) removes its partial ``checkpoint.tmp`` and raises :class:`CheckpointWriteError`;
the previous checkpoint is untouched. ``events.jsonl`` is cut back to its checkpoint length like the
other logs (a SIGKILL may leave half a line there), and a run that died before its first checkpoint
starts its logs over.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psrl.errors import PsrlError, RunError, describe
from psrl.rollout.client.records import trajectory_record
from psrl.runtime.recorder import EVENTS_FILE, RUN_FILES
from psrl.staleness import Event, StalenessManager
from psrl.train.launch import RankFailure
from psrl.types import StepTrainer

__all__ = ["save_checkpoint", "CheckpointSaver", "load_checkpoint", "restore_manager", "resume", "CheckpointWriteError"]

_STATE = "coordinator.pkl"
_MANIFEST = "manifest.json"
_EVENTS = EVENTS_FILE
_KEPT = re.compile(r"^checkpoint\.v(\d+)$")
_KEYS = ("version", "staleness", "agents", "offsets")
_FIX = (
    "delete that directory to resume from the one before it (if any), set trainer.resume=false to start "
    "over in this run directory, or give a new trainer.run_dir"
)


class CheckpointWriteError(RunError):
    """A checkpoint could not be written (a full disk, a read-only directory); the previous one is intact."""


def save_checkpoint(run_dir: str | Path, coord: Any, recorder: Any) -> Path:
    """Write ``run_dir/checkpoint`` for ``coord`` (a :class:`~psrl.runtime.coordinator.Coordinator`)."""
    return _write(*_capture(run_dir, coord, recorder))


class CheckpointSaver:
    """Checkpoints of one run, the periodic ones written off the event loop and the training thread.

    What a checkpoint holds is captured synchronously, between two steps (weights and AdamW state copied,
    the coordinator's state pickled to bytes), so the run is free to go on; the copy goes to disk in one
    writer thread, one checkpoint at a time. Costs one more copy of weights + optimiser state in memory
    while it writes. A write that fails is raised at the next save or at :meth:`close`. The trainer is a
    :class:`~psrl.types.StepTrainer`: ``state_dict`` now, ``save`` in the writer thread.
    """

    def __init__(self, background: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.background = bool(background)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="psrl-checkpoint") if background else None
        self._pending: Any = None

    def save(self, run_dir: str | Path, coord: Any, recorder: Any, wait: bool = False) -> None:
        """Checkpoint now; with ``wait`` (a stop) or no background writer, on disk when this returns."""
        self.wait()
        job = _capture(run_dir, coord, recorder, copy=self.background and not wait)
        if self._pool is None or wait:
            _write(*job)
        else:
            self._pending = self._pool.submit(_write, *job)

    def wait(self) -> None:
        """The write in progress, if any, finished (its CheckpointWriteError raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _capture(run_dir: str | Path, coord: Any, recorder: Any, copy: bool = False) -> tuple:
    """Everything a checkpoint writes, taken now: ``(run_dir, version, keep, trainer_state, coordinator bytes,
    trainer)``. ``copy``: the trainer's tensors are copied (a writer thread saves them while training goes on)."""
    offsets = recorder.offsets() if recorder is not None else {}
    events = getattr(coord.manager, "on_event", None)
    if events is not None and hasattr(events, "offset"):  # the buffer timeline (psrl.runtime.recorder.EventLog)
        offsets[_EVENTS] = events.offset()
    state = {**coord.state_dict(), "offsets": offsets}
    trainer_state = coord.trainer.state_dict() if copy else None
    return (
        Path(run_dir),
        int(coord.version),
        coord.cfg.trainer.keep_checkpoints,
        trainer_state,
        pickle.dumps(state),
        coord.trainer,
    )


def _write(
    run_dir: Path, version: int, keep: int, trainer_state: dict | None, coord_state: bytes, trainer: StepTrainer
) -> Path:
    """``checkpoint.tmp`` written and renamed into place, the kept ones rotated (see the module docstring)."""
    tmp, final = run_dir / "checkpoint.tmp", run_dir / "checkpoint"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        trainer.save(tmp, trainer_state)
        (tmp / _STATE).write_bytes(coord_state)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / _MANIFEST).write_text(json.dumps({"version": version, "files": files}))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"checkpoint {final}",
            f"could not be written: {describe(e)}; the previous checkpoint is intact",
            "free disk space (or fix the directory's permissions); "
            "the same command resumes from the previous checkpoint",
        ) from e
    if final.exists():
        prev = _version_of(final)
        kept = run_dir / f"checkpoint.v{prev}" if prev is not None else run_dir / "checkpoint.old"
        shutil.rmtree(kept, ignore_errors=True)
        final.rename(kept)
    tmp.rename(final)
    shutil.rmtree(run_dir / "checkpoint.old", ignore_errors=True)
    for old in _kept(run_dir)[max(keep - 1, 0) :]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _version_of(path: Path) -> int | None:
    """The version in a checkpoint's manifest (None for a checkpoint written before manifests, or damaged)."""
    try:
        return int(json.loads((path / _MANIFEST).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _kept(run_dir: Path) -> list[Path]:
    """The older checkpoints ``checkpoint.v<version>``, newest first."""
    found = [(int(m.group(1)), p) for p in run_dir.glob("checkpoint.v*") if (m := _KEPT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to try, newest first: ``checkpoint``, ``checkpoint.old`` (a save cut short), the kept ones."""
    first = [run_dir / n for n in ("checkpoint", "checkpoint.old") if (run_dir / n).is_dir()]
    return first + _kept(run_dir)


def _read_state(path: Path) -> dict:
    """``coordinator.pkl`` of ``path``, checked against the manifest (a partial copy fails here)."""
    if (path / _MANIFEST).exists():
        manifest = json.loads((path / _MANIFEST).read_text())
        for name, size in dict(manifest["files"]).items():
            have = (path / name).stat().st_size if (path / name).exists() else None
            if have != int(size):
                raise ValueError(
                    f"{name} is {'missing' if have is None else f'{have} bytes'}, the manifest says {size}"
                )
    with open(path / _STATE, "rb") as f:
        state = pickle.load(f)
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        raise ValueError(f"{_STATE} does not hold {', '.join(_KEYS)}")
    return state


def load_checkpoint(run_dir: str | Path) -> dict | None:
    """The state :func:`save_checkpoint` wrote plus ``dir`` (for ``trainer.load``) of the newest checkpoint
    whose state reads, or None when there is none; if none reads, RunError naming the newest."""
    damaged = []
    for path in _candidates(Path(run_dir)):
        try:
            state = _read_state(path)
        except Exception as e:  # unpickling damaged bytes can raise almost anything
            damaged.append((path, e))
            continue
        state["dir"] = path
        return state
    if damaged:
        path, err = damaged[0]
        raise RunError(f"checkpoint {path}", f"cannot be read: {describe(err)}", _FIX) from err
    return None


def restore_manager(
    snapshot: dict, group_filter: Any = None, sink: Any = None, on_event: Callable[[Event], Any] | None = None
) -> StalenessManager:
    """The staleness manager of a checkpoint, with every RESERVED entry aborted and its trajectories reported;
    ``on_event`` hears it from then on (the aborts belong to the process that died, not to the event log)."""
    m = StalenessManager.restore(snapshot, group_filter=group_filter)
    m.drain_aborted()  # their generations died with the old process
    T = m.train_version
    for b in range(T, T + m.max_staleness + 1):  # reservations made under a larger bound sit up to there
        for eid in m.blocking(b):
            held = m.entry_members(eid)
            m.abort(eid)
            for traj in held:
                if sink is not None:
                    sink.trajectory(trajectory_record(traj, "aborted", reason="resume"))
    if on_event is None:
        return m
    return StalenessManager.restore(m.snapshot(), group_filter=group_filter, on_event=on_event)


def resume(
    run_dir: str | Path,
    trainer: StepTrainer,
    recorder: Any,
    group_filter: Any = None,
    log: Callable[[str], None] | None = None,
    on_event: Callable[[Event], Any] | None = None,
) -> dict | None:
    """Restore the newest intact checkpoint of ``run_dir`` into ``trainer`` and ``recorder``; None when there
    is none (then the logs a run killed before its first checkpoint left are cut to empty).

    A damaged newer checkpoint is reported through ``log``, renamed ``<name>.damaged`` and skipped.
    Returns the checkpoint state with ``manager`` (the restored staleness manager, ``on_event`` its listener); the
    caller builds its coordinator with it and hands ``state["agents"]`` to ``agents.load_state_dict``.
    """
    run_dir = Path(run_dir)
    damaged: list[tuple[Path, Exception, str]] = []
    for path in _candidates(run_dir):
        try:
            ck = _read_state(path)
        except Exception as e:  # unpickling damaged bytes can raise almost anything
            damaged.append((path, e, "cannot be read"))
            continue
        ck["dir"] = path
        try:
            trainer.load(path)
            offsets = {str(k): int(v) for k, v in dict(ck["offsets"]).items()}
            if any(k not in RUN_FILES + (_EVENTS,) or v < 0 for k, v in offsets.items()):
                raise ValueError(f"bad JSONL offsets {offsets}")
            _cut(run_dir, offsets, recorder)  # before the manager reports the aborted trajectories into those files
            ck["manager"] = restore_manager(ck["staleness"], group_filter, recorder, on_event)
        except Exception as e:  # a damaged trainer.pt, or a state from another model / config
            if not _blames_checkpoint(e):
                raise  # the trainer could not run (a rank died, Ray failed): the checkpoint stays as it is
            damaged.append((path, e, "cannot be restored"))
            continue
        for bad, err, what in damaged:
            aside = bad.with_name(bad.name + ".damaged")
            shutil.rmtree(aside, ignore_errors=True)
            bad.rename(aside)
            (log or print)(
                f"checkpoint {bad} {what} ({describe(err)}): resuming from {path} (version "
                f"{ck['version']}) instead; the damaged one is kept as {aside}"
            )
        return ck
    if damaged:
        path, err, what = damaged[0]
        raise RunError(f"checkpoint {path}", f"{what}: {describe(err)}", _FIX) from err
    _cut(run_dir, {**{name: 0 for name in RUN_FILES}, _EVENTS: 0}, recorder)  # no checkpoint: the run starts over
    return None


def _blames_checkpoint(e: BaseException) -> bool:
    """Whether a failed restore says the checkpoint is damaged: not when a rank died, went silent or could not
    start, nor for psrl's own config / run errors or Ray's errors (a cluster that failed, not the files)."""
    if isinstance(e, RankFailure):
        return e.command_failed
    if isinstance(e, PsrlError) or type(e).__module__.split(".")[0] == "ray":
        return False
    return True


def _cut(run_dir: Path, offsets: dict[str, int], recorder: Any) -> None:
    """The JSONL logs back to ``offsets`` (the recorder's files through it, ``events.jsonl`` directly: its
    writer opens it after the resume)."""
    if recorder is not None:
        recorder.truncate({k: v for k, v in offsets.items() if k in RUN_FILES})
    events = run_dir / _EVENTS
    if _EVENTS in offsets and events.exists() and events.stat().st_size > offsets[_EVENTS]:
        os.truncate(events, offsets[_EVENTS])
