"""The proactive filter on RESERVED entries (``psrl.proactive_filter_strategy``).

A buffer is STUCK when it is full (``E_b == 0``) but not trainable (``O_b < B``): it waits on
its last reserved groups, typically one agent caught in a slow tool loop. When a STUCK
buffer has at most ``threshold`` reserved entries left, the filter acts on each of them once:

* ``retry``: cancel the group's running members and re-dispatch the prompt to fresh agent
  workers (same entry, same worker slots). A retried member gets the *current* instance
  version as its ``V_traj``, which is ``>=`` the entry's reserve version, so the staleness
  bound still holds.
* ``truncate``: cancel the running members and complete them at once with their partial
  output (``truncated: true``); the buffer can fill immediately.

Which buffers (``scope``, psrl's own key): ``window`` watches every buffer in ``T .. T + eta`` and
acts as soon as one is down to ``threshold``; ``head`` acts only on buffer ``T``, only while the
trainer is idle waiting for it (the :class:`~psrl.rollout.types.TrainerIdle` signal of the
coordinator), and only once it has waited ``grace`` seconds. Head scope cuts only what holds the
trainer up, and later, so less (``docs/simulate.md``); it is the simulator's ``psrl`` policy rule
(:mod:`psrl.sim.psrl_policy`).

It runs after every change of the protocol state (a completion, an abort, a consume) and, for
head scope, when the trainer starts waiting, so no polling loop is involved; the one timer is
head scope's grace (one per buffer ``T``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from psrl.staleness import BufferState

if TYPE_CHECKING:
    from psrl.rollout.client.agents import AgentManager
    from psrl.rollout.types import TrainerIdle

__all__ = ["ProactiveFilter"]


class ProactiveFilter:
    """Watches STUCK buffers and has the :class:`~psrl.rollout.client.agents.AgentManager` act on their last groups.

    Args:
        agents: the agent manager (its staleness manager, and ``retry`` / ``truncate`` of a group).
        method: ``retry`` | ``truncate`` | None (off): ``psrl.proactive_filter_strategy.method``.
        threshold: reserved entries a STUCK buffer may have left for the filter to act (``.threshold``).
        scope: ``window`` | ``head`` (``.scope``).
        grace: head scope: seconds the trainer must have waited for buffer ``T`` first (``.grace``).
        trainer: the trainer loop's idle state (the coordinator's); head scope needs it.
    """

    def __init__(
        self,
        agents: AgentManager,
        method: str | None,
        threshold: int,
        *,
        scope: str = "window",
        grace: float = 0.0,
        trainer: TrainerIdle | None = None,
    ):
        if scope not in ("window", "head"):
            raise ValueError(f"psrl.proactive_filter_strategy.scope: unknown value {scope!r} (use window or head)")
        if scope == "head" and method is not None and trainer is None:
            raise ValueError("proactive filter scope head reads the trainer's idle state: pass trainer=")
        self.agents = agents
        self.method = method
        self.threshold = int(threshold)
        self.scope = scope
        self.grace = float(grace)
        self.trainer = trainer
        self._busy = False
        self._armed = -1  # head scope: the buffer T whose grace timer is set

    def check(self) -> None:
        """Act on the STUCK buffers that are down to ``threshold`` reserved entries (re-entrant safe)."""
        if self.method is None or self._busy:
            return
        self._busy = True
        try:
            while self._sweep():
                pass
        finally:
            self._busy = False

    def _buffers(self, T: int) -> range:
        """The buffers this check may act on: ``T .. T + eta`` (window), ``T`` or none (head)."""
        if self.scope == "window":  # the bound in force (the adaptive controller may have moved it)
            return range(T, T + self.agents.manager.staleness + 1)
        assert self.trainer is not None, "checked in __init__"
        waiting = self.trainer.waiting()
        if waiting is None or waiting.buffer != T:
            return range(0)  # the trainer is training (or has not started): nothing holds it up
        if self.grace > 0:
            loop = asyncio.get_running_loop()
            due = waiting.since + self.grace
            if loop.time() < due:
                if self._armed != T:
                    self._armed = T
                    loop.call_at(due, self.check)
                return range(0)
        return range(T, T + 1)

    def _sweep(self) -> bool:
        """One pass over the watched buffers; True when the state changed and needs another pass."""
        sm = self.agents.manager
        changed = False
        T = sm.train_version
        for b in self._buffers(T):
            if sm.train_version != T or sm.state(b) != BufferState.STUCK:
                continue
            blocking = sm.blocking(b)
            if len(blocking) > self.threshold:
                continue
            for eid in blocking:
                if self.method == "retry":
                    self.agents.retry(eid)
                elif self.agents.truncate(eid):
                    changed = True
        return changed
