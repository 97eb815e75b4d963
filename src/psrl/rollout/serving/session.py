"""One trajectory's view of the rollout side: the ``generate`` function a task's episode calls.

A session is bound to one instance (its ``V_traj`` is that instance's version when the
session opens, routed with the trajectory's group for group stickiness) and keeps that affinity
for every turn (``enable_trajectory_sticky``; without it every later turn is routed again). If the
instance hands a request back mid-generation (a sync with ``interrupt_as_prompt``, migration, a
failed engine), the session continues it as a new request -- context plus the tokens so far, the
remaining budget, the same ``V_traj`` -- on whichever eligible instance the router picks (never the
one migration moved it off while another will do); ``instances`` then lists more than one instance.

Every request samples from its own random stream (:attr:`psrl.types.GenRequest.seed`), named by the
trajectory's seed (``trainer.seed`` and its identity: group and member), the turn, and the tokens the turn
already has: a request continued after an interruption gets the stream of that point, so a trajectory samples
the same tokens whichever requests it shares an engine with, and a continuation is as reproducible as the
interruption that caused it.

The session also keeps a running copy of the response (model tokens, tool tokens inferred from
the growing context, and the tokens of the request in flight), so the proactive ``truncate``
filter can force-complete a trajectory with its partial output after cancelling the episode. A context that
does not extend what it holds (an agent's rewritten history, ``task.agent_history: split``) starts a new training
sequence there, as the episode's own capture does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import TYPE_CHECKING

from psrl.tasks.base import Episode, Segment
from psrl.types import stream_seed

if TYPE_CHECKING:
    from psrl.rollout.serving.instance import InstanceRequest, RolloutInstance
    from psrl.rollout.types import Pool

__all__ = ["Session"]


class Session:
    """Generation for one trajectory of ``V_traj = instance.version`` at open time."""

    def __init__(
        self, pool: Pool, v_min: int, prompt_ids: list[int], group: Hashable | None = None, seed: int | None = None
    ):
        self.pool = pool
        self.seed = seed
        """The trajectory's stream seed (None: the engines' shared generators, batch-dependent samples)."""
        self.turn = 0
        """Model turns (``generate`` calls) begun so far."""
        self.instance = pool.route(v_min, group)
        self.instance.attach()
        self.v_traj = self.instance.version
        self.instances: list[int] = []
        self.migrations = 0
        self._given = list(prompt_ids)
        self._prompt = list(prompt_ids)
        self._ep = Episode()
        self._req: InstanceRequest | None = None
        self._closed = False

    async def generate(self, context_ids: list[int], max_new_tokens: int) -> Segment:
        """``GenerateFn``: up to ``max_new_tokens`` tokens after ``context_ids`` (stops after a stop id)."""
        self._note_context(context_ids)
        if self._ep.turns and not self.pool.trajectory_sticky:
            self._move(self.pool.route(self.v_traj))
        seg = Segment()
        remaining = int(max_new_tokens)
        turn, self.turn = self.turn, self.turn + 1
        moved = None  # a request migration interrupted: it has landed once its rest is submitted here
        try:
            while remaining > 0:
                seed = None if self.seed is None else stream_seed(self.seed, turn, len(seg.tokens))
                req = self.instance.submit(list(context_ids) + seg.tokens, remaining, self.v_traj, seed)
                if moved is not None:
                    self.pool.landed(moved)
                    moved = None
                self._req = req
                try:
                    await req.future
                except asyncio.CancelledError:
                    self.instance.cancel(req)
                    raise
                finally:
                    self._req = None
                self._take(seg, req)
                remaining -= len(req.tokens)
                if not req.interrupted:
                    break
                moved = req if req.rerouted else None
                self._move(self.pool.route(self.v_traj, avoid=self.instance if req.rerouted else None))
        finally:
            if moved is not None:
                self.pool.landed(moved)
        return seg

    @property
    def in_model_turn(self) -> bool:
        """Waiting on a request at an instance (else the episode is in a tool call, or done)."""
        return self._req is not None

    def _take(self, seg: Segment, req: InstanceRequest) -> None:
        """Append a request's output to the segment and to the running record."""
        if req.tokens and (not self.instances or self.instances[-1] != self.instance.index):
            self.instances.append(self.instance.index)
        seg.tokens += req.tokens
        seg.logprobs += req.logprobs
        seg.versions += req.versions
        self._ep.add_model(Segment(list(req.tokens), list(req.logprobs), list(req.versions)))

    def _move(self, target: RolloutInstance) -> None:
        """Bind to ``target`` (after an interruption or for a new turn; it may be the same instance)."""
        if target is not self.instance:
            self.instance.detach()
            target.attach()
            self.instance = target
            self.migrations += 1

    def _note_context(self, context: list[int]) -> None:
        """Tokens the context gained since the last call are tool output (masked, version -1)."""
        known = self._prompt + self._ep.response_ids
        if context[: len(known)] == known:
            extra = list(context[len(known) :])
        elif not self._ep.response_ids:  # the first turn brings its own prompt (an agent renders its own request)
            self._prompt, extra = list(context), []
        else:  # the task rewrote its context (task.agent_history: split): a new sequence starts from it
            self._ep.split(self._prompt)
            self._prompt, extra = list(context), []
        if extra:
            self._ep.add_tool(extra)

    def partial_episode(self) -> Episode:
        """What this trajectory produced so far, including the request in flight, marked truncated."""
        ep = Episode(
            list(self._ep.response_ids),
            list(self._ep.logprobs),
            list(self._ep.loss_mask),
            list(self._ep.token_versions),
            truncated=True,
            turns=self._ep.turns,
            prompt_ids=None if self._prompt == self._given else list(self._prompt),
            earlier=list(self._ep.earlier),
        )
        req = self._req
        if req is not None and req.tokens:
            ep.add_model(Segment(list(req.tokens), list(req.logprobs), list(req.versions)))
            if not self.instances or self.instances[-1] != self.instance.index:
                self.instances.append(self.instance.index)
        ep.info["partial"] = True
        return ep

    def close(self) -> None:
        """Unbind from the instance (idempotent)."""
        if not self._closed:
            self._closed = True
            self.instance.detach()
