"""In-process engines: continuous batching in this event loop, and the no-cache twin over a bare model.

An engine implements :class:`psrl.types.Engine`. :class:`BatchingEngine` is the in-process
skeleton: requests join and leave at any token boundary, one decode step advances every running
request by one token, ``pause`` takes effect at the next token boundary. Subclasses say how a
step is computed:

* :class:`NoCacheEngine` wraps any :class:`TokenModel` (:class:`psrl.models.Policy`,
  :class:`psrl.rollout.fakes.FakeEngine`): every step re-runs whole sequences. It is the slow,
  obvious twin the cached engine is tested against, and the engine of the virtual-time tests.
* :class:`psrl.rollout.engines.hf.HFEngine` keeps a KV cache (``rollout.engine: hf``).

Models are synchronous and CPU/GPU heavy, so their calls run in a worker thread
(``asyncio.to_thread``). A model may instead offer ``anext_token`` / ``aload_weights`` coroutines,
awaited directly: :class:`~psrl.rollout.fakes.FakeEngine` does, so on the virtual-time loop
(:mod:`psrl.runtime.vloop`) a test controls how long every decode step and every weight load
takes, without sleeping.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from psrl.types import (
    Engine,
    EngineLoad,
    GenRequest,
    Sampling,
    WeightSource,
    WeightState,
    stream_seed,
    stream_uniform,
)
from psrl.weights import StreamedVersions, VersionDirectories, read_version

if TYPE_CHECKING:
    from psrl.tasks.base import GenerateFn

__all__ = [
    "BatchingEngine",
    "NoCacheEngine",
    "TokenModel",
    "TokenRate",
    "as_engine",
    "row_uniforms",
    "turns",
]


class TokenModel(Protocol):
    """What the no-cache engine needs of a model: one sampled token per sequence, and weights by version.

    A model may also offer ``anext_token`` / ``aload_weights``, the same calls as coroutines: they are awaited
    instead of running in a worker thread (:class:`psrl.rollout.fakes.FakeEngine`'s virtual-time costs).
    """

    version: int
    """The version of the weights it holds."""

    def next_token(
        self, seqs: list[list[int]], temperature: float, top_p: float, uniforms: Sequence[float | None] | None = None
    ) -> tuple[list[int], list[float]]:
        """The next token of every sequence and its log-prob; a row with a number in ``uniforms`` draws its token
        with it (:func:`row_uniforms`, :func:`psrl.models.policy.sample`), a model that does not sample ignores it."""

    def load_weights(self, state: WeightState, version: int) -> None:
        """Hold ``state`` as ``version``."""


class TokenRate:
    """Tokens per second over a sliding window of ``window_s`` seconds of the running loop's clock."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = float(window_s)
        self._recent: collections.deque = collections.deque()

    def add(self, n: int) -> None:
        self._recent.append((asyncio.get_running_loop().time(), int(n)))

    def per_s(self) -> float:
        if not self._recent:
            return 0.0
        now = asyncio.get_running_loop().time()
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        return sum(n for _, n in self._recent) / max(now - self._recent[0][0], 1e-9)


class BatchingEngine:
    """Continuous batching in this process (see the module docstring); subclasses implement ``_decode``/``_load``.

    Args:
        sampling: temperature, top_p, and the stop ids that end a request (kept in its output).
        max_batch: most requests per decode step (None: all); the rest wait, counted as queued.
    """

    def __init__(self, *, sampling: Sampling = Sampling(), max_batch: int | None = None):
        self.sampling = sampling
        self.max_batch = max_batch
        self.steps = 0
        self.tokens = 0
        self._rows: list[GenRequest] = []
        self._waiting: list[GenRequest] = []
        self._done: dict[int, asyncio.Future] = {}
        self._paused = False
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._rate = TokenRate()

    # ------------------------------------------------------------------ the Engine interface

    async def start(self) -> None:
        self._events()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{type(self).__name__}-loop")

    async def generate(self, req: GenRequest) -> GenRequest:
        if req.max_new_tokens <= 0:
            req.finish = "length"
            return req
        await self.start()
        fut = asyncio.get_running_loop().create_future()
        self._done[id(req)] = fut
        self._waiting.append(req)
        wake, _ = self._events()
        wake.set()
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(req)
            raise
        return req

    def abort(self, req: GenRequest) -> None:
        self._finish(req, "abort")

    async def abort_all(self) -> None:
        for req in self._waiting + self._rows:
            self._finish(req, "abort")

    async def pause(self) -> None:
        _, idle = self._events()
        self._paused = True
        await idle.wait()

    async def resume(self) -> None:
        wake, _ = self._events()
        self._paused = False
        wake.set()

    async def update_weights(self, version: int, store: WeightSource) -> None:
        if self._rows and not self._paused:
            raise RuntimeError("update_weights while generating: pause() first")
        if isinstance(store, VersionDirectories):
            await self._load_directory(store.directory(version), int(version))
            return
        if isinstance(store, StreamedVersions):
            await self._load_streamed(store, int(version))
            return
        version, state = store.get(version)
        await self._load(state, int(version))

    async def _load_streamed(self, store: StreamedVersions, version: int) -> None:
        """Load a version a source gives bucket by bucket: read whole (an engine that can stream buckets into its
        model overrides this)."""
        got, state = await asyncio.to_thread(store.get, version)
        await self._load(state, got)

    async def _load_directory(self, directory: Path, version: int) -> None:
        """Load a published directory (:mod:`psrl.weights`): whole, checked (an engine that can stream buckets into
        its model overrides this)."""
        got, state = await asyncio.to_thread(read_version, directory)
        await self._load(state, got)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._rows),
            queued=len(self._waiting),
            tokens_per_s=self._rate.per_s(),
            kv_usage=self._kv_usage(),
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.abort_all()

    # ------------------------------------------------------------------ subclass hooks

    @property
    def version(self) -> int:
        """Weight version held now (the model's: a subclass says where it is)."""
        raise NotImplementedError

    async def _decode(self, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        """Next token and its log-prob for every row (``context + tokens``)."""
        raise NotImplementedError

    async def _load(self, state: WeightState, version: int) -> None:
        raise NotImplementedError

    def _kv_usage(self) -> float | None:
        return None

    # ------------------------------------------------------------------ the loop

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        """``(wake, idle)``, made on first use."""
        if self._wake is None or self._idle is None:
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()
        return self._wake, self._idle

    async def _run(self) -> None:
        wake, _ = self._events()
        while True:
            self._admit()
            if self._paused or not self._rows:
                wake.clear()
                await wake.wait()
                continue
            await self._step()
            await asyncio.sleep(0)  # a step that never suspended (a free fake step) must not starve the loop

    def _admit(self) -> None:
        while self._waiting and (self.max_batch is None or len(self._rows) < self.max_batch):
            self._rows.append(self._waiting.pop(0))

    async def _step(self) -> None:
        """One token for every running row; a failing step fails its rows (``finish == "error"``), not the engine."""
        rows = list(self._rows)
        version = int(self.version)
        _, idle = self._events()
        idle.clear()
        try:
            toks, lps = await self._decode(rows)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- reported on every request of the step
            for req in rows:
                req.error = f"{type(exc).__name__}: {exc}"
                self._finish(req, "error")
            return
        finally:
            idle.set()
        self.steps += 1
        self.tokens += len(rows)
        self._rate.add(len(rows))
        for req, tok, lp in zip(rows, toks, lps):
            if req.finish:  # aborted while the step ran: its token is discarded
                continue
            req.tokens.append(int(tok))
            req.logprobs.append(float(lp))
            req.versions.append(version)
            if int(tok) in self.sampling.stop_ids:
                self._finish(req, "stop")
            elif len(req.tokens) >= req.max_new_tokens:
                self._finish(req, "length")

    def _finish(self, req: GenRequest, why: str) -> None:
        if req.finish:
            return
        req.finish = why
        for lst in (self._rows, self._waiting):
            if req in lst:
                lst.remove(req)
        fut = self._done.pop(id(req), None)
        if fut is not None and not fut.done():
            fut.set_result(req)


class NoCacheEngine(BatchingEngine):
    """A :class:`BatchingEngine` over a ``next_token`` model: every step re-runs whole sequences (no cache)."""

    def __init__(self, model: TokenModel, *, sampling: Sampling = Sampling(), max_batch: int | None = None):
        super().__init__(sampling=sampling, max_batch=max_batch)
        self.model = model

    @property
    def version(self) -> int:
        return int(self.model.version)

    async def _decode(self, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        seqs, sp, us = [r.context + r.tokens for r in rows], self.sampling, row_uniforms(rows)
        fast = getattr(self.model, "anext_token", None)  # awaited; else next_token runs in a worker thread
        if fast is not None:
            return await fast(seqs, sp.temperature, sp.top_p, us)
        return await asyncio.to_thread(self.model.next_token, seqs, sp.temperature, sp.top_p, us)

    async def _load(self, state: WeightState, version: int) -> None:
        fast = getattr(self.model, "aload_weights", None)
        if fast is not None:
            await fast(state, version)
        else:
            await asyncio.to_thread(self.model.load_weights, state, version)


def row_uniforms(rows: Sequence[GenRequest]) -> list[float | None] | None:
    """The number each row draws its next token with: ``stream_uniform(seed, tokens so far)`` of a seeded request
    (:attr:`psrl.types.GenRequest.seed`), None for an unseeded one; None when no row is seeded."""
    if all(r.seed is None for r in rows):
        return None
    return [None if r.seed is None else stream_uniform(r.seed, len(r.tokens)) for r in rows]


def as_engine(model_or_engine: Engine | TokenModel, sampling: Sampling = Sampling()) -> Engine:
    """An engine as is; a bare :class:`TokenModel` wrapped in a :class:`NoCacheEngine` with ``sampling``."""
    if isinstance(model_or_engine, Engine):
        return model_or_engine
    return NoCacheEngine(model_or_engine, sampling=sampling)


def turns(engine: Engine, seed: int | None = None) -> GenerateFn:
    """``generate(context_ids, max_new_tokens) -> Segment`` over ``engine``: what a task's ``run_episode`` calls for
    a model turn, when episodes run straight on an engine (validation, tests) rather than through the
    coordinator's sessions (which add routing, sync and migration around the same call). With ``seed`` (one
    episode's), turn ``k`` samples from stream ``stream_seed(seed, k, 0)``, as a session's would."""
    from psrl.tasks.base import Segment

    count = itertools.count()

    async def generate(context_ids: list[int], max_new_tokens: int) -> Segment:
        own = None if seed is None else stream_seed(seed, next(count), 0)
        req = await engine.generate(GenRequest(list(context_ids), int(max_new_tokens), seed=own))
        return Segment(req.tokens, req.logprobs, req.versions)

    return generate
