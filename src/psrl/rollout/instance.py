"""A rollout instance: its own weights and version, and a token-level batching loop.

Every decode step runs all active requests of the instance as one batch (continuous batching:
a request joins or leaves at any token boundary). Each generated token records the version of
the weights that produced it, so a trajectory's ``token_versions`` say exactly which policy
wrote what.

Weight sync (when to pull is the sync strategy's call, :mod:`psrl.rollout.router`):

* **partial rollout on**: the instance pulls at the next token boundary. In-flight requests
  keep their tokens and continue under the new weights; with **migration** they are instead
  handed back (``interrupted``) so their sessions may continue them on another instance while
  this one loads.
* **partial rollout off**: the instance stops admitting requests, lets the running ones finish
  under the old weights, then pulls. A request never mixes versions.

Either way an instance's version only grows, and a request is only ever submitted to an
instance whose version is ``>= V_traj``, so no segment is older than its trajectory's ``V_traj``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable, Optional

from psrl.rollout.engine import decode_step, load_weights

__all__ = ["GenRequest", "RolloutInstance"]


class GenRequest:
    """One ``generate`` call on one instance: context, budget and the tokens produced so far.

    ``future`` resolves to the request itself when it finished (stop token or budget) or was
    ``interrupted`` (handed back at a token boundary for migration).
    """

    __slots__ = ("context", "max_new_tokens", "v_min", "tokens", "logprobs", "versions", "interrupted", "future")

    def __init__(self, context: list[int], max_new_tokens: int, v_min: int, future: asyncio.Future):
        self.context = context
        self.max_new_tokens = int(max_new_tokens)
        self.v_min = int(v_min)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.interrupted = False
        self.future = future


class RolloutInstance:
    """One inference engine (a model copy) serving many trajectories at once.

    Args:
        index: instance id (recorded per segment in ``Trajectory.instances``).
        model: ``next_token`` / ``load_state`` / ``version`` (see :mod:`psrl.rollout.engine`).
        weights: where new versions come from: ``latest_version()`` and ``get() -> (version, state)``
            (a :class:`psrl.train.ParameterStore`).
        sync: the sync strategy, ``should_pull(instance, latest_version) -> bool``.
        partial_rollout, migration: see the module docstring.
        stop_ids: tokens that end a request (kept in its output).
        max_batch: most requests per decode step (None: all active ones).
    """

    def __init__(self, index: int, model: Any, weights: Any, sync: Any, *, partial_rollout: bool = False,
                 migration: bool = False, stop_ids: Iterable[int] = (), temperature: float = 1.0,
                 top_p: float = 1.0, max_batch: Optional[int] = None):
        self.index = int(index)
        self.model = model
        self.weights = weights
        self.sync = sync
        self.partial_rollout = bool(partial_rollout)
        self.migration = bool(migration) and self.partial_rollout
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_batch = max_batch
        self.running = 0
        """Trajectories (sessions) bound to this instance, in a model turn or a tool call."""
        self.syncing = False
        self.on_version: Optional[Callable[["RolloutInstance"], None]] = None
        self._queue: list[GenRequest] = []
        self._active: list[GenRequest] = []
        self._wake = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self.steps = 0
        self.tokens = 0
        self.loads = 0
        self.interrupted = 0
        self.continued = 0
        """Requests that kept generating across a weight load (partial rollout without migration)."""

    # ------------------------------------------------------------------ reading

    @property
    def version(self) -> int:
        return int(self.model.version)

    @property
    def active(self) -> int:
        """Requests in the decode batch now."""
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ requests

    def submit(self, context: list[int], max_new_tokens: int, v_min: int) -> GenRequest:
        """Queue a generation; await ``req.future``. ``v_min`` (the trajectory's V_traj) must not exceed the version."""
        if v_min > self.version:
            raise ValueError(f"instance {self.index} holds version {self.version} < V_traj {v_min}")
        req = GenRequest(list(context), max_new_tokens, v_min, asyncio.get_running_loop().create_future())
        if req.max_new_tokens <= 0:
            req.future.set_result(req)
            return req
        self._queue.append(req)
        self._wake.set()
        return req

    def cancel(self, req: GenRequest) -> None:
        """Drop ``req`` now (its trajectory was cancelled): the engine stops spending on it."""
        if not req.future.done():
            req.future.cancel()
        for lst in (self._queue, self._active):
            if req in lst:
                lst.remove(req)
        self._wake.set()

    def attach(self) -> None:
        self.running += 1

    def detach(self) -> None:
        self.running -= 1
        self._wake.set()  # the sync strategy may now want to pull

    def wake(self) -> None:
        """Re-check the sync strategy (a new version was published)."""
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name=f"rollout-instance-{self.index}")
        return self._task

    async def stop(self) -> None:
        """Stop the loop; pending requests are cancelled."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for req in self._queue + self._active:
            if not req.future.done():
                req.future.cancel()
        self._queue.clear()
        self._active.clear()

    async def run(self) -> None:
        """Batch, decode, sync; forever (until cancelled)."""
        while True:
            pull = self._wants_pull()
            if pull and (self.partial_rollout or not self._active):
                await self._pull()
                continue
            if not pull:
                self._admit()
            self._prune()
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step()

    def _wants_pull(self) -> bool:
        latest = self.weights.latest_version()
        return latest is not None and latest > self.version and bool(self.sync.should_pull(self, latest))

    def _admit(self) -> None:
        room = None if self.max_batch is None else self.max_batch - len(self._active)
        while self._queue and (room is None or room > 0):
            req = self._queue.pop(0)
            if not req.future.done():
                self._active.append(req)
                room = None if room is None else room - 1

    def _prune(self) -> None:
        if any(r.future.done() for r in self._active):
            self._active = [r for r in self._active if not r.future.done()]

    async def _step(self) -> None:
        """One decode step for every active request; finished ones resolve."""
        batch = list(self._active)
        version = self.version
        toks, lps = await decode_step(self.model, [r.context + r.tokens for r in batch], self.temperature, self.top_p)
        self.steps += 1
        self.tokens += len(batch)
        for req, tok, lp in zip(batch, toks, lps):
            if req.future.done():  # cancelled while the step ran: its token is discarded
                continue
            req.tokens.append(int(tok))
            req.logprobs.append(float(lp))
            req.versions.append(version)
            if tok in self.stop_ids or len(req.tokens) >= req.max_new_tokens:
                req.future.set_result(req)
        self._prune()

    async def _pull(self) -> None:
        """Load the newest weights at a token boundary."""
        self.syncing = True
        try:
            if self.migration:
                self._interrupt_all()
            else:
                self.continued += len(self._active)
            version, state = self.weights.get()
            await load_weights(self.model, state, version)
            self.loads += 1
        finally:
            self.syncing = False
        if self.on_version is not None:
            self.on_version(self)

    def _interrupt_all(self) -> None:
        """Hand every unfinished request back with its tokens so far (sessions may migrate them)."""
        for req in self._active + self._queue:
            if not req.future.done():
                req.interrupted = True
                req.future.set_result(req)
                self.interrupted += 1
        self._active.clear()
        self._queue.clear()
