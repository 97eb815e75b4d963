"""In-process engines: continuous batching in this event loop, and a fake model for tests.

An engine implements :class:`psrl.types.Engine`. :class:`BatchingEngine` is the in-process
skeleton: requests join and leave at any token boundary, one decode step advances every running
request by one token, ``pause`` takes effect at the next token boundary. Subclasses say how a
step is computed:

* :class:`NoCacheEngine` wraps any *model* with ``next_token(seqs, temperature, top_p)``,
  ``load_weights(state, version)`` and ``version`` (:class:`psrl.models.Policy`, :class:`FakeEngine`):
  every step re-runs whole sequences. It is the slow, obvious twin the cached engine is tested
  against, and the engine of the virtual-time tests.
* :class:`psrl.rollout.engines.hf.HFEngine` keeps a KV cache (``rollout.engine: hf``).

Models are synchronous and CPU/GPU heavy, so their calls run in a worker thread
(``asyncio.to_thread``). A model may instead offer ``anext_token`` / ``aload_weights`` coroutines,
awaited directly: :class:`FakeEngine` does, so on the virtual-time loop (:mod:`psrl.runtime.vloop`)
a test controls how long every decode step and every weight load takes, without sleeping.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Iterable, Optional, Sequence

from psrl.types import EngineLoad, GenRequest

__all__ = ["BatchingEngine", "NoCacheEngine", "TokenRate", "FakeEngine", "decode_step", "load_weights_into", "as_engine",
           "turns"]


async def decode_step(model: Any, seqs: list[list[int]], temperature: float, top_p: float) -> tuple[list[int], list[float]]:
    """One decode step of ``model`` over ``seqs`` without blocking the event loop."""
    fast = getattr(model, "anext_token", None)
    if fast is not None:
        return await fast(seqs, temperature, top_p)
    return await asyncio.to_thread(model.next_token, seqs, temperature, top_p)


async def load_weights_into(model: Any, state: Any, version: int) -> None:
    """Load ``state`` as ``version`` into ``model`` without blocking the event loop."""
    fast = getattr(model, "aload_weights", None)
    if fast is not None:
        await fast(state, version)
        return
    await asyncio.to_thread(model.load_weights, state, version)


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
        stop_ids: tokens that end a request (kept in its output).
        temperature, top_p: sampling.
        max_batch: most requests per decode step (None: all); the rest wait, counted as queued.
    """

    def __init__(self, *, stop_ids: Iterable[int] = (), temperature: float = 1.0, top_p: float = 1.0,
                 max_batch: Optional[int] = None):
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_batch = max_batch
        self.steps = 0
        self.tokens = 0
        self._rows: list[GenRequest] = []
        self._waiting: list[GenRequest] = []
        self._done: dict[int, asyncio.Future] = {}
        self._paused = False
        self._wake: Optional[asyncio.Event] = None
        self._idle: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
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
        self._wake.set()
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
        self._events()
        self._paused = True
        await self._idle.wait()

    async def resume(self) -> None:
        self._events()
        self._paused = False
        self._wake.set()

    async def update_weights(self, version: int, store: Any) -> None:
        if self._rows and not self._paused:
            raise RuntimeError("update_weights while generating: pause() first")
        version, state = store.get(version)
        await self._load(state, int(version))

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._rows), queued=len(self._waiting), tokens_per_s=self._rate.per_s(),
                          kv_usage=self._kv_usage())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.abort_all()

    # ------------------------------------------------------------------ subclass hooks

    async def _decode(self, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        """Next token and its log-prob for every row (``context + tokens``)."""
        raise NotImplementedError

    async def _load(self, state: Any, version: int) -> None:
        raise NotImplementedError

    def _kv_usage(self) -> Optional[float]:
        return None

    # ------------------------------------------------------------------ the loop

    def _events(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()

    async def _run(self) -> None:
        while True:
            self._admit()
            if self._paused or not self._rows:
                self._wake.clear()
                await self._wake.wait()
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
        self._idle.clear()
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
            self._idle.set()
        self.steps += 1
        self.tokens += len(rows)
        self._rate.add(len(rows))
        for req, tok, lp in zip(rows, toks, lps):
            if req.finish:  # aborted while the step ran: its token is discarded
                continue
            req.tokens.append(int(tok))
            req.logprobs.append(float(lp))
            req.versions.append(version)
            if int(tok) in self.stop_ids:
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

    def __init__(self, model: Any, **kw: Any):
        super().__init__(**kw)
        self.model = model

    @property
    def version(self) -> int:
        return int(self.model.version)

    async def _decode(self, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        return await decode_step(self.model, [r.context + r.tokens for r in rows], self.temperature, self.top_p)

    async def _load(self, state: Any, version: int) -> None:
        await load_weights_into(self.model, state, version)


def as_engine(model_or_engine: Any, **kw: Any) -> Any:
    """An engine as is; a bare ``next_token`` model wrapped in a :class:`NoCacheEngine` with ``kw``."""
    if hasattr(model_or_engine, "generate") and hasattr(model_or_engine, "update_weights"):
        return model_or_engine
    return NoCacheEngine(model_or_engine, **kw)


def turns(engine: Any) -> Any:
    """``generate(context_ids, max_new_tokens) -> Segment`` over ``engine``: what a task's ``run_episode`` calls for
    a model turn, when episodes run straight on an engine (validation, tests) rather than through the
    coordinator's sessions (which add routing, sync and migration around the same call)."""
    from psrl.tasks.base import Segment

    async def generate(context_ids: list[int], max_new_tokens: int) -> Any:
        req = await engine.generate(GenRequest(list(context_ids), int(max_new_tokens)))
        return Segment(req.tokens, req.logprobs, req.versions)

    return generate


class FakeEngine:
    """A deterministic stand-in for a policy whose costs are virtual-time sleeps.

    The token of a row is a pure function of the row (``(len(seq) + salt) % vocab``, shifted so
    it never hits a stop id unless ``stop_at`` says so), so continuing a generation on another
    instance or after a weight load gives the same tokens as uninterrupted generation.

    Args:
        token_cost: seconds per row of a decode step (a batch of ``n`` rows costs
            ``step_cost + n * token_cost``).
        step_cost: fixed seconds per decode step.
        sync_cost: seconds one ``load_weights`` takes.
        vocab: token range.
        stop_id: token emitted when a row reaches length ``stop_at`` (None: never).
        stop_at: sequence length at which ``stop_id`` is emitted.
        version: initial weight version.

    Counters (for tests): ``calls`` decode steps, ``rows`` rows decoded, ``loads`` weight loads;
    with ``record`` True also ``seen`` (row lengths of every batch) and ``times`` (loop time at the
    start of every async decode step).
    """

    def __init__(self, token_cost: float = 0.01, step_cost: float = 0.0, sync_cost: float = 0.0,
                 vocab: int = 97, stop_id: Optional[int] = None, stop_at: Optional[int] = None,
                 version: int = 0, record: bool = False):
        self.token_cost = float(token_cost)
        self.step_cost = float(step_cost)
        self.sync_cost = float(sync_cost)
        self.vocab = int(vocab)
        self.stop_id = stop_id
        self.stop_at = stop_at
        self.version = int(version)
        self.state: Any = None
        self.calls = 0
        self.rows = 0
        self.loads = 0
        self.record = record
        self.seen: list[list[int]] = []
        self.times: list[float] = []

    def token_for(self, seq: Sequence[int]) -> int:
        """The deterministic next token of ``seq``."""
        if self.stop_id is not None and self.stop_at is not None and len(seq) + 1 >= self.stop_at:
            return int(self.stop_id)
        tok = (len(seq) * 7 + 3) % self.vocab
        if self.stop_id is not None and tok == self.stop_id:
            tok = (tok + 1) % self.vocab
        return tok

    def next_token(self, seqs: list[list[int]], temperature: float = 1.0, top_p: float = 1.0) -> tuple[list[int], list[float]]:
        """Tokens of every row; the log-prob encodes the version (``-1 - version / 100``) for tests."""
        self.calls += 1
        self.rows += len(seqs)
        if self.record:
            self.seen.append([len(s) for s in seqs])
        toks = [self.token_for(s) for s in seqs]
        return toks, [-1.0 - self.version / 100.0] * len(seqs)

    async def anext_token(self, seqs: list[list[int]], temperature: float = 1.0, top_p: float = 1.0) -> tuple[list[int], list[float]]:
        """``next_token`` after ``step_cost + len(seqs) * token_cost`` seconds of (virtual) time."""
        cost = self.step_cost + self.token_cost * len(seqs)
        if self.record:
            self.times.append(asyncio.get_running_loop().time())
        if cost > 0:
            await asyncio.sleep(cost)
        return self.next_token(seqs, temperature, top_p)

    def load_weights(self, state: Any, version: int) -> None:
        self.loads += 1
        self.state = state
        self.version = int(version)

    async def aload_weights(self, state: Any, version: int) -> None:
        """``load_weights`` after ``sync_cost`` seconds; the version changes only at the end."""
        if self.sync_cost > 0:
            await asyncio.sleep(self.sync_cost)
        self.load_weights(state, version)

    def export_state(self) -> dict:
        return {"version": self.version}
