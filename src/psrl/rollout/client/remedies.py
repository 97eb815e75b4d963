"""The proactive filter's remedies: how the :class:`~psrl.rollout.client.agents.AgentManager` acts on a group the
filter (:class:`~psrl.rollout.client.proactive.ProactiveFilter`) picked, by re-dispatching its prompt
(:meth:`ProactiveRemedies.retry`) or force-completing its running members with what they generated so far
(:meth:`ProactiveRemedies.truncate`). Each acts once per group, and only on a group whose entry is not occupied.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import TYPE_CHECKING

from psrl.rollout.client.rewards import run_to_end
from psrl.tasks.base import Episode

if TYPE_CHECKING:
    from psrl.rollout.client.records import Counts, Group, Member
    from psrl.rollout.client.rewards import TaskReward
    from psrl.staleness import StalenessManager
    from psrl.tasks.base import Task
    from psrl.types import Trajectory

__all__ = ["ProactiveRemedies"]


class ProactiveRemedies:
    """The remedies half of :class:`~psrl.rollout.client.agents.AgentManager` (a base class of it): they launch,
    reward and complete members through the manager's own methods, declared here for type checkers."""

    if TYPE_CHECKING:
        task: Task
        manager: StalenessManager
        reward: TaskReward
        counts: Counts
        groups: dict[Hashable, Group]
        _deferred: set[asyncio.Task]

        def _launch(self, g: Group) -> Member: ...
        async def _reward(self, g: Group, m: Member, episode: Episode) -> dict | None: ...
        def _trajectory(self, g: Group, m: Member, episode: Episode, reward: dict) -> Trajectory: ...
        def _complete(self, g: Group, m: Member, traj: Trajectory) -> None: ...

    def retry(self, eid: Hashable) -> bool:
        """Re-dispatch a reserved group's prompt: cancel its running members, each replacement inheriting the
        cancelled member's worker slot. Once per group; False when the group is gone, occupied or acted on."""
        g = self._proactive(eid)
        if g is None:
            return False
        for m in g.live():
            m.keep_slot = True
            m.cancel()
            self.counts.cancelled += 1
            self.counts.retried += 1
            self._launch(g)
        return True

    def truncate(self, eid: Hashable) -> bool:
        """Force-complete a reserved group's running members with what they generated so far (``truncated``).
        Once per group; False when the group is gone, occupied or acted on."""
        g = self._proactive(eid)
        if g is None:
            return False
        for m in g.live():
            if g.eid not in self.groups or self.manager.entry_buffer(g.eid) is not None:
                break  # the group resolved (occupied / ended) on an earlier member
            m.cancel()
            episode = m.session.partial_episode() if m.session is not None else Episode(truncated=True)
            if self.reward.is_async:  # complete it once its reward is in
                t = asyncio.get_running_loop().create_task(self._complete_truncated(g, m, episode))
                self._deferred.add(t)
                t.add_done_callback(self._deferred.discard)
                continue
            # a synchronous reward: _reward's coroutine (the same retries) never suspends, so it runs to its end here
            reward = run_to_end(self._reward(g, m, episode), f"reward_now: the reward of {type(self.task).__name__}")
            if reward is not None:
                self._complete_as_truncated(g, m, episode, reward)
        return True

    def _proactive(self, eid: Hashable) -> Group | None:
        """The group of ``eid`` if the proactive filter may act on it, marked as acted on."""
        g = self.groups.get(eid)
        if g is None or g.proactive or self.manager.entry_buffer(eid) is not None:
            return None
        g.proactive = True
        return g

    async def _complete_truncated(self, g: Group, m: Member, episode: Episode) -> None:
        reward = await self._reward(g, m, episode)
        if reward is None or g.eid not in self.groups or self.manager.entry_buffer(g.eid) is not None:
            return  # failed (recorded), or the group resolved meanwhile: it is one more cancelled member
        self._complete_as_truncated(g, m, episode, reward)

    def _complete_as_truncated(self, g: Group, m: Member, episode: Episode, reward: dict) -> None:
        traj = self._trajectory(g, m, episode, reward)
        traj.truncated = True
        self.counts.truncated += 1
        self._complete(g, m, traj)
