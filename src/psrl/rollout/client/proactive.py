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

from typing import Any

from psrl.staleness import BufferState
from psrl.tasks.base import Episode

__all__ = ["ProactiveFilter"]


class ProactiveFilter:
    """Watches STUCK buffers for an :class:`~psrl.rollout.client.agents.AgentManager`."""

    def __init__(self, agents: Any, cfg: Any, staleness: int):
        self.agents = agents
        self.method = cfg.method
        self.threshold = int(cfg.threshold)
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
                g = self.agents.groups.get(eid)
                if g is None or g.proactive or sm.entry_buffer(g.eid) is not None:
                    continue
                g.proactive = True
                if self.method == "retry":
                    self._retry(g)
                else:
                    self._truncate(g)
                    changed = True
        return changed

    def _retry(self, g: Any) -> None:
        """Cancel the running members; each replacement inherits the cancelled member's worker slot."""
        agents = self.agents
        for m in g.live():
            m.cancelled = True
            m.keep_slot = True
            m.task.cancel()
            agents.counts.cancelled += 1
            agents.counts.retried += 1
            agents._launch(g)

    def _truncate(self, g: Any) -> None:
        """Force-complete the running members with what they generated so far."""
        agents = self.agents
        for m in g.live():
            if g.eid not in agents.groups or agents.manager.entry_buffer(g.eid) is not None:
                return  # the group resolved (occupied / ended) on an earlier member
            m.cancelled = True
            m.task.cancel()
            episode = m.session.partial_episode() if m.session is not None else Episode(truncated=True)
            if agents.reward_is_async:
                agents.complete_truncated_later(g, m, episode)
                continue
            reward = agents.reward_now(g, m, episode)
            if reward is None:
                continue
            traj = agents._trajectory(g, m, episode, reward)
            traj.truncated = True
            agents.counts.truncated += 1
            agents._complete(g, m, traj)
