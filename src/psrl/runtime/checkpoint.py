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

A checkpoint that cannot be read (truncated, overwritten, from an incompatible version) is never a
traceback: :func:`load_checkpoint` falls back to ``checkpoint.old`` when that one is intact, and
otherwise raises :class:`~psrl.errors.RunError` naming the directory and what to do.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any, Optional

from psrl.errors import RunError, describe
from psrl.rollout.records import trajectory_record
from psrl.runtime.recorder import _FILES
from psrl.staleness import StalenessManager

__all__ = ["save_checkpoint", "load_checkpoint", "restore_manager", "resume"]

_STATE = "coordinator.pkl"
_KEYS = ("version", "staleness", "agents", "offsets")
_FIX = ("delete that directory to resume from the one before it (if any), set trainer.resume=false to start "
        "over in this run directory, or give a new trainer.run_dir")


def save_checkpoint(run_dir: str | Path, coord: Any, recorder: Any) -> Path:
    """Write ``run_dir/checkpoint`` for ``coord`` (a :class:`~psrl.runtime.coordinator.Coordinator`)."""
    run_dir = Path(run_dir)
    state = {**coord.checkpoint_state(), "offsets": recorder.offsets() if recorder is not None else {}}
    tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    coord.trainer.save(tmp)
    with open(tmp / _STATE, "wb") as f:
        pickle.dump(state, f)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(run_dir: str | Path) -> Optional[dict]:
    """The state :func:`save_checkpoint` wrote plus ``dir`` (for ``trainer.load``), or None when there is
    none. A damaged ``checkpoint`` falls back to an intact ``checkpoint.old``; if none is intact, RunError."""
    damaged = []
    for name in ("checkpoint", "checkpoint.old"):
        path = Path(run_dir) / name
        if not path.exists():
            continue
        try:
            with open(path / _STATE, "rb") as f:
                state = pickle.load(f)
            if not isinstance(state, dict) or any(k not in state for k in _KEYS):
                raise ValueError(f"{_STATE} does not hold {', '.join(_KEYS)}")
        except Exception as e:  # unpickling damaged bytes can raise almost anything
            damaged.append((path, e))
            continue
        state["dir"] = path
        return state
    if damaged:
        path, e = damaged[0]
        raise RunError(f"checkpoint {path}", f"cannot be read: {describe(e)}", _FIX) from e
    return None


def restore_manager(snapshot: dict, group_filter: Any = None, sink: Any = None) -> StalenessManager:
    """The staleness manager of a checkpoint, with every RESERVED entry aborted and its trajectories reported."""
    m = StalenessManager.restore(snapshot, group_filter=group_filter)
    m.drain_aborted()  # their generations died with the old process
    T = m.train_version
    for b in range(T, T + m.staleness + 1):
        for eid in m.blocking(b):
            held = m.entry_members(eid)
            m.abort(eid)
            for traj in held:
                if sink is not None:
                    sink.trajectory(trajectory_record(traj, "aborted", reason="resume"))
    return m


def resume(run_dir: str | Path, trainer: Any, recorder: Any, group_filter: Any = None) -> Optional[dict]:
    """Restore ``run_dir/checkpoint`` into ``trainer`` and ``recorder``; None when there is none.

    Returns the checkpoint state with ``manager`` (the restored staleness manager); the caller
    builds its coordinator with it and hands ``state["agents"]`` to ``agents.load_state``.
    """
    ck = load_checkpoint(run_dir)
    if ck is None:
        return None
    try:
        trainer.load(ck["dir"])
        offsets = {str(k): int(v) for k, v in dict(ck["offsets"]).items()}
        if any(k not in _FILES or v < 0 for k, v in offsets.items()):
            raise ValueError(f"bad JSONL offsets {offsets}")
        recorder.truncate(offsets)  # before the manager reports the aborted trajectories into those files
        ck["manager"] = restore_manager(ck["staleness"], group_filter, recorder)
    except Exception as e:  # a damaged trainer.pt, or a state from another model / config
        raise RunError(f"checkpoint {ck['dir']}", f"cannot be restored: {describe(e)}", _FIX) from e
    return ck
