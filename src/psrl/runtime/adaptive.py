"""The adaptive staleness controller (``psrl.adaptive_staleness``): the bound of new reservations, from measurements.

``psrl.staleness`` is the ceiling; :meth:`psrl.staleness.StalenessManager.set_staleness` is the operation.
Every ``every`` steps the controller reads the mean of the window's step rows and moves the bound by at most one:

* **down** (not below ``min``) when the divergence of the trained batches left its limits: ``divergence/ess``
  below ``ess_min``, or ``divergence/m2`` above ``m2_max``, or ``divergence/kl`` above ``kl_max``;
* **up** (not above the ceiling) when the divergence is inside its limits and the trainer spent at least
  ``idle_frac`` of the window waiting for its buffer: ``(time/step_s - time/train_s - time/publish_s) /
  time/step_s`` summed over the window;
* otherwise it stays.

A move applies to reservations made after it (the core's rule, ``docs/staleness.md``): the window after a
move still trains data reserved under the old bound, so the controller waits a whole window between moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from psrl.config import AdaptiveStalenessConfig

__all__ = ["Move", "StalenessController"]


@dataclass(frozen=True)
class Move:
    """One change of the bound: ``old`` -> ``new`` at ``step``, and why (the measured figure and its limit)."""

    step: int
    old: int
    new: int
    reason: str


class StalenessController:
    """Moves the bound within ``[cfg.min, ceiling]``; ``set_bound(new)`` applies it (the manager's
    ``set_staleness``) and returns the old one."""

    def __init__(self, cfg: AdaptiveStalenessConfig, ceiling: int, set_bound: Callable[[int], int]):
        self.cfg = cfg
        self.ceiling = ceiling
        self._set_bound = set_bound
        self.bound = min(cfg.min, ceiling)
        self._set_bound(self.bound)
        self._window: list[Mapping[str, object]] = []

    def observe(self, row: Mapping[str, object]) -> Move | None:
        """Take one step row; at the end of a window, the move it justifies (applied already), or None."""
        self._window.append(row)
        if len(self._window) < self.cfg.every:
            return None
        window, self._window = self._window, []
        step = int(_num(window[-1], "step") or 0)
        down = self._divergence_out(window)
        if down is not None:
            return self._move(step, self.bound - 1, down) if self.bound > self.cfg.min else None
        idle = idle_fraction(window)
        if idle >= self.cfg.idle_frac and self.bound < self.ceiling:
            return self._move(step, self.bound + 1, f"trainer idle {idle:.2f} >= idle_frac {self.cfg.idle_frac}")
        return None

    def _divergence_out(self, window: list[Mapping[str, object]]) -> str | None:
        """Why the window's divergence is outside its limits, or None when it is inside (or not measured)."""
        c = self.cfg
        ess, m2, kl = (_mean(window, f"divergence/{k}") for k in ("ess", "m2", "kl"))
        if ess is not None and ess < c.ess_min:
            return f"divergence/ess {ess:.3f} < ess_min {c.ess_min}"
        if m2 is not None and m2 > c.m2_max:
            return f"divergence/m2 {m2:.3f} > m2_max {c.m2_max}"
        if kl is not None and kl > c.kl_max:
            return f"divergence/kl {kl:.3f} > kl_max {c.kl_max}"
        return None

    def _move(self, step: int, new: int, reason: str) -> Move:
        old = self._set_bound(new)
        self.bound = new
        return Move(step, old, new, reason)

    def state_dict(self) -> dict:
        """The bound and the window so far (a resumed run continues the same judgement)."""
        return {"bound": self.bound, "window": [dict(r) for r in self._window]}

    def load_state_dict(self, state: Mapping) -> None:
        self.bound = max(self.cfg.min, min(int(state["bound"]), self.ceiling))
        self._set_bound(self.bound)
        self._window = [dict(r) for r in state.get("window", [])]


def idle_fraction(window: list[Mapping[str, object]]) -> float:
    """The fraction of the window's wall time the trainer waited for its buffer (neither training nor publishing)."""
    total = sum(_num(r, "time/step_s") or 0.0 for r in window)
    busy = sum((_num(r, "time/train_s") or 0.0) + (_num(r, "time/publish_s") or 0.0) for r in window)
    return max(0.0, total - busy) / total if total > 0 else 0.0


def _num(row: Mapping[str, object], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _mean(window: list[Mapping[str, object]], key: str) -> float | None:
    vals = [v for v in (_num(r, key) for r in window) if v is not None]
    return sum(vals) / len(vals) if vals else None
