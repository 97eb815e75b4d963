"""The adaptive staleness controller (``psrl.adaptive_staleness``): the bound of new reservations, from measurements.

``psrl.staleness`` is the ceiling; :meth:`psrl.staleness.StalenessManager.set_staleness` is the operation.
The controller starts at ``start`` (taken into ``[min, ceiling]``) and judges windows of ``every`` step rows (their
mean):

* **down** (not below ``min``) when the divergence of the trained batches left its limits: ``divergence/ess``
  below ``ess_min``, or ``divergence/m2`` above ``m2_max``, or ``divergence/kl`` above ``kl_max`` (over the
  tokens of lag at most the bound in force: "own data" below). The bound about halves (:func:`lowered`: 8 -> 4,
  4 -> 2, 2 -> 1): on the agentic task of ``docs/learning.md`` the divergence shows a too-large bound only a few
  steps before learning breaks, so the way down is fast;
* **up by one** (not above the ceiling) when the divergence is inside its limits and the trainer spent at least
  ``idle_frac`` of the window waiting for its buffer: ``(time/step_s - time/train_s - time/publish_s) /
  time/step_s`` summed over the window -- in as many windows in a row as the next bound's *hold*;
* otherwise it stays.

Three rules keep it from chasing its own tail (``docs/staleness.md``):

* **Settle.** A move applies to reservations made after it, so the ``old`` steps after a move from bound
  ``old`` may still train data reserved under it: a window holding one of those rows can lower the bound but
  not raise it, so a raise is judged only on data reserved under the bound in force.
* **Own data.** The way down is judged on the tokens of lag at most the bound in force (:func:`within_bound`),
  so data reserved under a bound already left does not send it down a second time.
* **Hold.** A bound the divergence sent it down from is one it should not retry at once: each time that
  happens, that bound's hold doubles (1, 2, 4, ... windows in a row that justify a raise). Without it the
  controller alternates between the last bound inside the limits and the first outside, and the run's mean
  divergence sits above the limit (``docs/simulate.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from psrl.config import AdaptiveStalenessConfig
from psrl.metrics import levels

__all__ = ["Move", "StalenessController", "lowered", "within_bound"]


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
        self.bound = min(max(cfg.start, cfg.min), ceiling)
        self._set_bound(self.bound)
        self._window: list[Mapping[str, object]] = []
        self._settle = 0
        """Rows still to come that may train data reserved before the last move (a window holding one cannot
        justify a raise)."""
        self._mixed = False
        """Whether the window so far holds such a row."""
        self._hold: dict[int, int] = {}
        """Per bound the divergence sent the controller down from: windows in a row needed to rise to it again."""
        self._ready = 0
        """Windows in a row, at the current bound, that justified a raise."""

    def observe(self, row: Mapping[str, object]) -> Move | None:
        """Take one step row; at the end of a window, the move it justifies (applied already), or None."""
        self._window.append(row)
        if self._settle > 0:
            self._settle -= 1
            self._mixed = True
        if len(self._window) < self.cfg.every:
            return None
        window, self._window = self._window, []
        mixed, self._mixed = self._mixed, False
        step = int(_num(window[-1], "step") or 0)
        down = self._divergence_out(window)
        if down is not None:
            self._ready = 0
            if self.bound <= self.cfg.min:
                return None
            self._hold[self.bound] = 2 * self.hold(self.bound)
            return self._move(step, max(self.cfg.min, lowered(self.bound)), down)
        if mixed:  # it may hold data reserved under the previous bound: it can lower the bound, not raise it
            return None
        idle = idle_fraction(window)
        if idle < self.cfg.idle_frac or self.bound >= self.ceiling:
            self._ready = 0
            return None
        self._ready += 1
        need = self.hold(self.bound + 1)
        if self._ready < need:
            return None
        why = f"trainer idle {idle:.2f} >= idle_frac {self.cfg.idle_frac}"
        return self._move(step, self.bound + 1, why + (f" in {need} windows in a row" if need > 1 else ""))

    def hold(self, bound: int) -> int:
        """Windows in a row that must justify a raise before the controller rises to ``bound``."""
        return self._hold.get(bound, 1)

    def _divergence_out(self, window: list[Mapping[str, object]]) -> str | None:
        """Why the window's divergence is outside its limits, or None when it is inside (or not measured)."""
        c = self.cfg
        own = [r for r in (within_bound(row, self.bound) for row in window) if r is not None]
        ess, m2, kl = (_mean(own, f"divergence/{k}") for k in ("ess", "m2", "kl"))
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
        self._settle = old
        self._ready = 0
        return Move(step, old, new, reason)

    def state_dict(self) -> dict:
        """The bound, the window so far, the rows still to settle (and whether the window holds one), the holds
        and the count towards a raise (a resumed run continues the same judgement)."""
        return {
            "bound": self.bound,
            "window": [dict(r) for r in self._window],
            "settle": self._settle,
            "mixed": self._mixed,
            "hold": {str(b): n for b, n in self._hold.items()},
            "ready": self._ready,
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.bound = max(self.cfg.min, min(int(state["bound"]), self.ceiling))
        self._set_bound(self.bound)
        self._window = [dict(r) for r in state.get("window", [])]
        self._settle = int(state.get("settle", 0))
        self._mixed = bool(state.get("mixed", False))
        self._hold = {int(b): int(n) for b, n in state.get("hold", {}).items()}
        self._ready = int(state.get("ready", 0))


def lowered(bound: int) -> int:
    """The bound after the divergence left its limits at ``bound``: about half (8 -> 4, 4 -> 2, 3 -> 2, 1 -> 0).
    Additive increase, multiplicative decrease: the damage of a too-stale batch shows a few steps late, so the
    way down is fast."""
    return min(bound - 1, (bound + 1) // 2)


def within_bound(row: Mapping[str, object], bound: int) -> Mapping[str, object] | None:
    """The row's ``divergence/*`` over its tokens of lag ``<= bound`` -- the data the bound in force is responsible
    for -- or None when it trained none. A row holds lags above the bound only after the bound came down (data
    reserved under the old one); without this, those rows would send the bound down a second time for what the
    first move already answered. From the per-lag figures (``divergence/*@s<k>``, ``staleness/tokens@s<k>``):
    ``m2`` and ``kl`` are token means, so exact; ``ess`` does not add across levels, and the token-weighted mean
    of the levels' is used. A row without per-lag figures, or with none above the bound, is taken as it is."""
    shares = levels(row, "staleness/tokens")
    if not shares or max(shares) <= bound:
        return row
    own = {k: f for k, f in shares.items() if k <= bound and isinstance(f, (int, float)) and f > 0}
    total = sum(own.values())
    if total <= 0:
        return None
    return {
        f"divergence/{name}": sum(f * (_num(row, f"divergence/{name}@s{k}") or 0.0) for k, f in own.items()) / total
        for name in ("ess", "m2", "kl")
    }


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
