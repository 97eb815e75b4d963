"""Versioned weights for the rollout side to pull: the trainer publishes, instances ``get``.

Thread-safe (one lock around every read and write). Keeps only the newest ``keep`` versions
so memory stays bounded; the staleness bound means nobody needs weights older than that
(``keep >= 1``; pick ``staleness + 1`` or so when instances may lag).

States are shared, not copied, on ``get``: treat them as read-only (``load_state_dict`` copies
into the model, so the normal use is safe).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

from torch import Tensor

__all__ = ["ParameterStore"]


class ParameterStore:
    """``publish(version, state)``, ``latest_version()``, ``get(version=None) -> (version, state)``."""

    def __init__(self, keep: int = 2):
        if keep < 1:
            raise ValueError(f"ParameterStore keep must be >= 1, got {keep}")
        self.keep = int(keep)
        self._lock = threading.Lock()
        self._states: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        self._disk_lock = threading.Lock()

    def publish(self, version: int, state: dict[str, Tensor]) -> None:
        """Store ``state`` as ``version``; versions must strictly increase. Evicts beyond ``keep``."""
        with self._lock:
            latest = next(reversed(self._states)) if self._states else None
            if latest is not None and version <= latest:
                raise ValueError(f"publish version {version} <= latest published version {latest}")
            self._states[int(version)] = state
            while len(self._states) > self.keep:
                self._states.popitem(last=False)

    def latest_version(self) -> int | None:
        """Newest published version, or None before the first publish."""
        with self._lock:
            return next(reversed(self._states)) if self._states else None

    def versions(self) -> list[int]:
        """The versions still held, oldest first."""
        with self._lock:
            return list(self._states)

    def get(self, version: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """``(version, state)`` of ``version`` (default: the newest); ``KeyError`` if not held."""
        with self._lock:
            if not self._states:
                raise KeyError("ParameterStore is empty: nothing has been published yet")
            if version is None:
                version = next(reversed(self._states))
            if version not in self._states:
                raise KeyError(f"version {version} is not held (held: {list(self._states)})")
            return version, self._states[version]

    def path(self, version: int, root: str | Path, config_dir: str | Path | None = None) -> Path:
        """``root/v{version}``: the weights of ``version`` as safetensors in Hugging Face layout, for engines that
        load from disk (vLLM's ``reload_weights``). Written once per version, atomically (a temporary directory
        renamed into place), with ``config.json`` from ``config_dir``; directories of versions this store no longer
        holds are deleted. Safe to call from several threads and instances at once."""
        from safetensors.torch import save_file

        root = Path(root)
        final = root / f"v{int(version)}"
        with self._disk_lock:
            if final.exists():
                return final
            _, state = self.get(version)
            tmp = root / f".tmp-v{int(version)}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
            if config_dir is not None and (Path(config_dir) / "config.json").exists():
                shutil.copy(Path(config_dir) / "config.json", tmp / "config.json")
            os.replace(tmp, final)
            held = {f"v{v}" for v in self.versions()}
            for old in root.glob("v*"):
                if old.name not in held and old != final:
                    shutil.rmtree(old, ignore_errors=True)
            return final
