"""What a rollout instance needs from a model, and a fake one for tests.

A model is anything with ``next_token(seqs, temperature, top_p) -> (tokens, logprobs)``,
``load_state(state, version)`` and ``version`` (:class:`psrl.models.Policy` is one). Those are
synchronous and CPU/GPU heavy, so the instance runs them in a worker thread
(``asyncio.to_thread``) and the event loop keeps serving tool calls and the trainer meanwhile.

A model may instead offer ``anext_token`` / ``aload_state`` coroutines; the instance then
awaits them directly. :class:`FakeEngine` does that: its costs are ``asyncio.sleep`` calls, so
on the virtual-time loop (:mod:`psrl.runtime.vloop`) a test controls exactly how long every
decode step and every weight load takes, without sleeping for real.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

__all__ = ["decode_step", "load_weights", "FakeEngine"]


async def decode_step(model: Any, seqs: list[list[int]], temperature: float, top_p: float) -> tuple[list[int], list[float]]:
    """One decode step of ``model`` over ``seqs`` without blocking the event loop."""
    fast = getattr(model, "anext_token", None)
    if fast is not None:
        return await fast(seqs, temperature, top_p)
    return await asyncio.to_thread(model.next_token, seqs, temperature, top_p)


async def load_weights(model: Any, state: Any, version: int) -> None:
    """Load ``state`` as ``version`` into ``model`` without blocking the event loop."""
    fast = getattr(model, "aload_state", None)
    if fast is not None:
        await fast(state, version)
        return
    await asyncio.to_thread(model.load_state, state, version)


class FakeEngine:
    """A deterministic stand-in for a policy whose costs are virtual-time sleeps.

    The token of a row is a pure function of the row (``(len(seq) + salt) % vocab``, shifted so
    it never hits a stop id unless ``stop_at`` says so), so continuing a generation on another
    instance or after a weight load gives the same tokens as uninterrupted generation.

    Args:
        token_cost: seconds per row of a decode step (a batch of ``n`` rows costs
            ``step_cost + n * token_cost``).
        step_cost: fixed seconds per decode step.
        sync_cost: seconds one ``load_state`` takes.
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

    def load_state(self, state: Any, version: int) -> None:
        self.loads += 1
        self.state = state
        self.version = int(version)

    async def aload_state(self, state: Any, version: int) -> None:
        """``load_state`` after ``sync_cost`` seconds; the version changes only at the end."""
        if self.sync_cost > 0:
            await asyncio.sleep(self.sync_cost)
        self.load_state(state, version)

    def export_state(self) -> dict:
        return {"version": self.version}
