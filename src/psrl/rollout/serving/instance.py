"""A rollout instance: one inference engine, its version, and the sync strategy's decisions.

The instance drives an :class:`psrl.types.Engine` (in-process ``hf`` with a KV cache, a vLLM
server, or the no-cache twin over a fake model in tests). The engine batches continuously (a
request joins or leaves at any token boundary) and records, for each generated token, the version
of the weights that produced it, so a trajectory's ``token_versions`` say exactly which policy
wrote what.

Weight sync (when to pull is the sync strategy's call, :mod:`psrl.rollout.serving.sync`):

* **partial rollout on**: the instance pauses the engine at the next token boundary (in-flight
  requests kept), loads, resumes: requests continue under the new weights. With
  **interrupt_as_prompt** in-flight requests are instead aborted and handed back (``interrupted``,
  tokens kept) so their sessions continue them as new requests (context + tokens so far), routed
  again, possibly to another instance while this one loads.
* **partial rollout off**: the instance stops admitting requests, lets the running ones finish
  under the old weights, then loads. A request never mixes versions.

**Migration** (load balancing, :mod:`psrl.rollout.serving.sync`) interrupts single requests the same way
(:meth:`RolloutInstance.migrate`); their sessions re-route them away from this instance.

Requests beyond ``max_batch`` (``routing_strategy.max_concurrent_seqs_per_instance``) wait here and
are admitted oldest ``V_traj`` first with the multi-level queue, then by ``request_sort_indicator``.

Either way an instance's version only grows, and a request is only ever submitted to an
instance whose version is ``>= V_traj``, so no segment is older than its trajectory's ``V_traj``.

Faults: a request the engine fails (``finish == "error"``: the engine died or stopped answering
within ``rollout.request_timeout_s``) is handed back like a migrated one -- same ``V_traj``, the
tokens the engine returned kept -- and its session re-runs the rest elsewhere. The instance then
restarts its engine (up to ``rollout.max_restarts`` times) or, past that, marks itself ``dead``:
the router stops choosing it, and the run stops only when no instance is left. A dead instance whose engine can
``rejoin`` (a Ray engine actor's instance: a new actor on a rollout node with room) waits for that, starts it, loads
the newest version and serves again (one line per attempt).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psrl.types import Engine, EngineLoad, GenRequest, WeightSource

if TYPE_CHECKING:
    from psrl.rollout.types import SyncStrategy

__all__ = ["InstanceRequest", "RolloutInstance"]


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class InstanceRequest(GenRequest):
    """A :class:`psrl.types.GenRequest` as a rollout instance keeps it: the engine sees the request, the session
    awaits ``future`` and reads whether it was handed back."""

    future: asyncio.Future = field(default_factory=_future)
    """Resolves to this request once it finished or was handed back."""
    interrupted: bool = False
    """Handed back unfinished (a sync with interrupt_as_prompt, migration, a failed engine): the session may
    continue it elsewhere."""
    rerouted: bool = False
    """Interrupted by migration (load balancing): the session continues it on another instance than this one."""


class RolloutInstance:
    """One inference engine serving many trajectories at once.

    Args:
        index: instance id (recorded per segment in ``Trajectory.instances``).
        engine: the :class:`psrl.types.Engine` it drives (it samples with the run's ``Sampling``).
        weights: where new versions come from (a :class:`psrl.train.ParameterStore`).
        sync: the sync strategy, ``should_pull(instance, latest_version) -> bool``.
        on_version: called after the instance loaded weights (or tried to), so the pool's version waits re-check.
        on_round: called after every round of the loop in which it did not pull (the pool's migration check).
        log: where engine failures and restarts are reported.
        partial_rollout, interrupt_as_prompt: see the module docstring.
        max_batch: most requests in the engine at once (None: all); the rest queue here.
        multi_priority_queue: admit queued requests oldest ``V_traj`` first.
        request_sort: order of queued requests (after ``V_traj``): small_id | short_length | long_length.
        max_new_tokens: the cap on any request's budget (``trainer.max_new_tokens``).
        max_restarts: engine restarts after failures before the instance is ``dead``.
    """

    def __init__(
        self,
        index: int,
        engine: Engine,
        weights: WeightSource,
        sync: SyncStrategy,
        *,
        on_version: Callable[[RolloutInstance], None] = lambda _inst: None,
        on_round: Callable[[RolloutInstance], None] = lambda _inst: None,
        log: Callable[[str], None] = print,
        partial_rollout: bool = False,
        interrupt_as_prompt: bool = False,
        max_batch: int | None = None,
        max_new_tokens: int | None = None,
        max_restarts: int = 0,
        multi_priority_queue: bool = False,
        request_sort: str = "small_id",
    ):
        self.index = int(index)
        self.engine = engine
        self.weights = weights
        self.sync = sync
        self.on_version = on_version
        self.on_round = on_round
        self.log = log
        self.partial_rollout = bool(partial_rollout)
        self.interrupt_as_prompt = bool(interrupt_as_prompt) and self.partial_rollout
        self.max_batch = max_batch
        self.multi_priority_queue = bool(multi_priority_queue)
        if request_sort not in ("small_id", "short_length", "long_length"):
            raise ValueError(f"unknown request_sort {request_sort!r}")
        self.request_sort = request_sort
        self.max_new_tokens = max_new_tokens
        self.max_restarts = int(max_restarts)
        self.running = 0
        """Trajectories (sessions) bound to this instance, in a model turn or a tool call."""
        self.syncing = False
        self.dead = False
        """Failed more than ``max_restarts`` times: the router no longer picks it."""
        self._queue: list[InstanceRequest] = []
        self._active: list[InstanceRequest] = []
        self._serving: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failed: str | None = None
        self.ready = asyncio.Event()
        """Set once the engine is started and holds the newest published version."""
        self.loads = 0
        self.interrupted = 0
        self.migrated = 0
        """Requests moved off this instance by migration (load balancing)."""
        self.continued = 0
        """Requests that kept generating across a weight load (partial rollout, not interrupt_as_prompt)."""
        self.failed = 0
        """Requests the engine failed, handed back to be re-run elsewhere."""
        self.restarts = 0
        self.rejoins = 0
        """Times it served again after it was dead (its engine's ``rejoin``)."""

    # ------------------------------------------------------------------ reading

    @property
    def version(self) -> int:
        return int(self.engine.version)

    @property
    def model(self) -> Any:
        """The wrapped model of a no-cache engine (tests read its counters)."""
        return getattr(self.engine, "model", None)

    @property
    def steps(self) -> int:
        return int(getattr(self.engine, "steps", 0))

    @property
    def tokens(self) -> int:
        return int(getattr(self.engine, "tokens", 0))

    @property
    def active(self) -> int:
        """Requests in the engine now."""
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Requests at this instance: generating in the engine or waiting to be admitted."""
        return sum(not r.rerouted for r in self._active) + len(self._queue)

    def load(self) -> EngineLoad:
        """The engine's load figures, with this instance's own queue added."""
        inner = self.engine.load()
        return EngineLoad(inner.running, inner.queued + len(self._queue), inner.tokens_per_s, inner.kv_usage)

    # ------------------------------------------------------------------ requests

    def submit(self, context: list[int], max_new_tokens: int, v_min: int, seed: int | None = None) -> InstanceRequest:
        """Queue a generation; await ``req.future``. ``v_min`` (the trajectory's V_traj) must not exceed the version;
        ``seed``: the request's own random stream (:attr:`psrl.types.GenRequest.seed`)."""
        if v_min > self.version:
            raise ValueError(f"instance {self.index} holds version {self.version} < V_traj {v_min}")
        if self.max_new_tokens is not None:
            max_new_tokens = min(int(max_new_tokens), int(self.max_new_tokens))
        req = InstanceRequest(list(context), int(max_new_tokens), int(v_min), seed=seed)
        if req.max_new_tokens <= 0:
            req.finish = "length"
            req.future.set_result(req)
            return req
        if self.dead:
            self._hand_back(req, "error")
            return req
        self._queue.append(req)
        self._wake.set()
        return req

    def cancel(self, req: InstanceRequest) -> None:
        """Drop ``req`` now (its trajectory was cancelled): the engine stops spending on it."""
        if not req.future.done():
            req.future.cancel()
        if req in self._queue:
            self._queue.remove(req)
        if req in self._active:
            self.engine.abort(req)
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

    async def load_initial(self) -> None:
        """Start the engine; load the newest published version unless it holds a published one already."""
        await self.engine.start()
        latest = self.weights.latest_version()
        if latest is not None and self.version not in self.weights.versions():  # a fresh server holds none
            await self.engine.update_weights(latest, self.weights)
        self.ready.set()
        self.on_version(self)

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name=f"rollout-instance-{self.index}")
        return self._task

    async def stop(self) -> None:
        """Stop the loop and the engine; pending requests are cancelled."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for req in self._queue + self._active:
            if not req.future.done():
                req.future.cancel()
        self._queue.clear()
        try:
            await self.engine.close()
        finally:
            for t in list(self._serving):
                t.cancel()
            await asyncio.gather(*self._serving, return_exceptions=True)
            self._active.clear()

    async def run(self) -> None:
        """Admit, sync, recover; forever (until cancelled). Decoding happens in the engine."""
        if not self.ready.is_set():
            await self.load_initial()
        rejoin = getattr(self.engine, "rejoin", None)
        this = asyncio.current_task()
        while True:
            if this is not None and this.cancelling():  # stop() asked, and an engine call dropped the cancel
                raise asyncio.CancelledError()
            if self.dead and rejoin is not None:
                rejoin = rejoin if await self._rejoin(rejoin) else None
                continue
            if self._failed is not None:
                await self._recover()
                continue
            pull = self.wants_pull()
            if pull and (self.partial_rollout or not self._active):
                await self._pull()
                continue
            if not pull:
                self._admit()
                self.on_round(self)
            self._wake.clear()
            await self._wake.wait()

    def wants_pull(self) -> bool:
        """A newer version exists and the sync strategy says pull now."""
        if self.dead:
            return False
        latest = self.weights.latest_version()
        return latest is not None and latest > self.version and bool(self.sync.should_pull(self, latest))

    def _next_queued(self) -> InstanceRequest:
        """The queued request to admit next: oldest V_traj first (multi-level queue), then request_sort."""
        if not self.multi_priority_queue and self.request_sort == "small_id":
            return self._queue[0]
        sign = {"small_id": 0, "short_length": 1, "long_length": -1}[self.request_sort]

        def key(k: int) -> tuple:
            r = self._queue[k]
            return (r.v_min if self.multi_priority_queue else 0, sign * (len(r.context) + len(r.tokens)), k)

        return self._queue[min(range(len(self._queue)), key=key)]

    def _admit(self) -> None:
        while self._queue and not self.dead and (self.max_batch is None or len(self._active) < self.max_batch):
            req = self._next_queued()
            self._queue.remove(req)
            if req.future.done():
                continue
            self._active.append(req)
            task = asyncio.get_running_loop().create_task(self._serve(req))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, req: InstanceRequest) -> None:
        """One request through the engine; resolves its future (finished, handed back, or failed)."""
        try:
            if req.rerouted:  # migrated before its task ran: the engine never saw it
                req.finish = "abort"
            else:
                await self.engine.generate(req)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- an engine fault: hand the request back, recover the engine
            req.finish, req.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            if req in self._active:
                self._active.remove(req)
            self._wake.set()
        if req.future.done():
            return
        if req.finish == "error":
            self._failed = self._failed or req.error
            self._hand_back(req, "error")
        elif req.finish == "abort":
            self._hand_back(req, "abort")
        else:
            req.future.set_result(req)

    def migrate(self, n: int) -> list[InstanceRequest]:
        """Interrupt up to ``n`` requests (queued first, then those with the fewest tokens) so their sessions
        re-route them away from this instance, tokens and ``V_traj`` kept; returns them."""
        moved: list[InstanceRequest] = []
        for req in list(self._queue)[:n]:
            self._queue.remove(req)
            req.rerouted = True
            self._hand_back(req, "abort")
            moved.append(req)
        active = [r for r in self._active if not r.rerouted and not r.finish]
        for req in sorted(active, key=lambda r: len(r.tokens))[: n - len(moved)]:
            req.rerouted = True
            self.engine.abort(req)  # _serve hands it back with its tokens
            moved.append(req)
        self.migrated += len(moved)
        return moved

    def _hand_back(self, req: InstanceRequest, why: str) -> None:
        """Resolve ``req`` as interrupted (tokens kept): its session continues it on an eligible instance."""
        req.interrupted = True
        if why == "error":
            self.failed += 1
        else:
            self.interrupted += 1
        if not req.future.done():
            req.future.set_result(req)

    async def _pull(self) -> None:
        """Load the newest weights at a token boundary (see the module docstring)."""
        self.syncing = True
        try:
            await self.engine.pause()
            if self.interrupt_as_prompt:
                for req in list(self._queue):
                    self._queue.remove(req)
                    self._hand_back(req, "abort")
                await self.engine.abort_all()
            else:
                self.continued += len(self._active)
            latest = self.weights.latest_version()
            if latest is None:  # wants_pull saw a published version, and a store keeps its newest
                raise RuntimeError("no published version to load")
            await self.engine.update_weights(latest, self.weights)
            await self.engine.resume()
            self.loads += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the engine failed to load: recover it
            self._failed = self._failed or f"weight update failed: {type(exc).__name__}: {exc}"
        finally:
            self.syncing = False
        self.on_version(self)

    async def _rejoin(self, rejoin: Callable[[], Awaitable[str | None]]) -> bool:
        """Dead: wait for the engine's ``rejoin`` (a new engine elsewhere), start it, load the newest version and
        serve again; False once the engine says no more (then it stays dead)."""
        where: str | None = "with a new engine"
        try:
            where = await rejoin()
            if where is None:
                return False
            await self.engine.start()
            latest = self.weights.latest_version()
            if latest is not None:
                await self.engine.update_weights(latest, self.weights)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the new engine failed too: the next attempt, if any
            self.log(f"rollout instance {self.index} could not rejoin {where}: {type(exc).__name__}: {exc}")
            return True
        self.dead = False
        self.rejoins += 1
        self.log(f"rollout instance {self.index} rejoined {where}, holding version {self.version}")
        self.on_version(self)
        return True

    async def _recover(self) -> None:
        """The engine failed: hand back everything in it, restart it (or give up on this instance)."""
        reason, self._failed = self._failed, None
        await self.engine.abort_all()
        if self.restarts >= self.max_restarts or not hasattr(self.engine, "restart"):
            self.dead = True
            for req in list(self._queue):
                self._queue.remove(req)
                self._hand_back(req, "error")
            self.log(f"rollout instance {self.index} is dead after {self.restarts} restarts: {reason}")
        else:
            self.restarts += 1
            self.log(
                f"rollout instance {self.index}: restarting its engine ({self.restarts}/{self.max_restarts}): {reason}"
            )
            try:
                await self.engine.restart()
                latest = self.weights.latest_version()
                if latest is not None:  # none published yet: it holds the initial weights (as load_initial)
                    await self.engine.update_weights(latest, self.weights)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._failed = f"restart failed: {type(exc).__name__}: {exc}"
        self.on_version(self)
