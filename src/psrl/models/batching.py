"""Batch the decode steps of concurrent episodes: many ``await generate(...)``, one forward per step.

Episodes run as asyncio tasks; each model turn awaits :meth:`DecodeBatcher.generate`. The
batcher keeps every waiting request in one active set and a single driver task advances the
whole set by one :meth:`Policy.next_token` call per step (continuous batching at token level:
a request that arrives joins at the next step, a finished one leaves at once). While episodes
wait on a tool, the others keep decoding.

Determinism: requests are served in arrival order, and asyncio's scheduling is deterministic
for a deterministic program, so with deterministic tool latencies (e.g. zero) a run repeats
exactly given the policy's generator seed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from psrl.tasks.base import Segment

__all__ = ["DecodeBatcher"]


@dataclass
class _Request:
    ids: list[int]
    max_new_tokens: int
    future: asyncio.Future
    segment: Segment = field(default_factory=Segment)


class DecodeBatcher:
    """``generate(context_ids, max_new_tokens) -> Segment`` for many coroutines, batched per step.

    ``max_batch`` caps the rows of one forward (None: no cap). Tokens carry ``policy.version``
    at the step that produced them.
    """

    def __init__(self, policy, temperature: float, top_p: float, stop_ids, max_batch: Optional[int] = None):
        self.policy = policy
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.stop_ids = set(stop_ids)
        self.max_batch = max_batch
        self._active: list[_Request] = []
        self._driver: Optional[asyncio.Task] = None
        self.forward_calls = 0

    async def generate(self, context_ids: list[int], max_new_tokens: int) -> Segment:
        """Sample one model turn after ``context_ids``; stops after a stop token (kept) or the budget."""
        if max_new_tokens <= 0:
            return Segment()
        fut = asyncio.get_running_loop().create_future()
        self._active.append(_Request(list(context_ids), int(max_new_tokens), fut))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        return await fut

    async def _drive(self) -> None:
        """Advance all active requests one token per iteration until none is left."""
        while self._active:
            await asyncio.sleep(0)  # let every runnable episode enqueue its turn first
            batch = self._active if self.max_batch is None else self._active[: self.max_batch]
            batch = [r for r in batch if not r.future.cancelled()]
            self._active = [r for r in self._active if not r.future.cancelled()]
            if not batch:
                continue
            toks, lps = self.policy.next_token([r.ids for r in batch], self.temperature, self.top_p)
            self.forward_calls += 1
            for req, tok, lp in zip(batch, toks, lps):
                self._advance(req, tok, lp)

    def _advance(self, req: _Request, tok: int, lp: float) -> None:
        req.ids.append(tok)
        req.segment.tokens.append(tok)
        req.segment.logprobs.append(lp)
        req.segment.versions.append(self.policy.version)
        if tok in self.stop_ids or len(req.segment.tokens) >= req.max_new_tokens:
            self._active.remove(req)
            if not req.future.done():
                req.future.set_result(req.segment)
