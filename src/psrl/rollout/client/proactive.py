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

It runs after every change of the protocol state (a completion, an abort, a consume), so no
polling loop and no timer is involved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psrl.staleness import BufferState

if TYPE_CHECKING:
    from psrl.rollout.client.agents import AgentManager

__all__ = ["ProactiveFilter"]


class ProactiveFilter:
    """Watches STUCK buffers and has the :class:`~psrl.rollout.client.agents.AgentManager` act on their last groups.

    Args:
        agents: the agent manager (its staleness manager, and ``retry`` / ``truncate`` of a group).
        method: ``retry`` | ``truncate`` | None (off): ``psrl.proactive_filter_strategy.method``.
        threshold: reserved entries a STUCK buffer may have left for the filter to act (``.threshold``).
        staleness: eta (buffers ``T .. T + eta`` are watched).
    """

    def __init__(self, agents: AgentManager, method: str | None, threshold: int, staleness: int):
        self.agents = agents
        self.method = method
        self.threshold = int(threshold)
        self.eta = int(staleness)
        self._busy = False

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

    def _sweep(self) -> bool:
        """One pass over buffers ``T .. T + eta``; True when the state changed and needs another pass."""
        sm = self.agents.manager
        changed = False
        T = sm.train_version
        for b in range(T, T + self.eta + 1):
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
