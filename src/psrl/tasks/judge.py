"""``task.reward: judge``: another model scores the answer, through an OpenAI-compatible ``/chat/completions``.

The judge is asked ``task.judge.prompt`` (``{question}``, ``{answer}``, ``{ground_truth}`` and ``{data_source}``
filled in) as one user message; the first match of ``task.judge.parse`` in its reply (group 1, else the whole
match) is the score. At most ``task.judge.concurrency`` requests are in flight at once (a slow judge queues the
rest instead of being flooded); each gets ``task.judge.timeout`` seconds and is retried ``task.judge.retries``
times on an HTTP error, a timeout or a reply the rule cannot parse. After them the call raises
:class:`~psrl.tasks.base.RewardError` naming the cause, which the agent manager retries and then records like
any failing reward (``status: error``; a group that can no longer fill is aborted), so a judge that hangs costs
bounded time and loses nothing. The config check keeps ``(retries + 1) * timeout`` within
``task.reward_timeout``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from psrl.tasks.base import RewardError

__all__ = ["JudgeReward", "SERVED"]


SERVED: dict[str, str] = {}
"""``task.judge.path`` -> the base URL of the judge server psrl started for it (:mod:`psrl.runtime.judge_server`)."""


class JudgeReward:
    """An async verl-style ``compute_score`` that asks the judge of ``task.judge`` (``cfg``): at ``task.judge.url``,
    or the server psrl serves ``task.judge.path`` from (its URL known once the run has started it)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.rule = re.compile(cfg.parse)
        self._gate: asyncio.Semaphore | None = None
        self._http: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests = 0
        self.url = ""

    def _semaphore(self) -> asyncio.Semaphore:
        """The gate of ``task.judge.concurrency`` and one HTTP client (its TLS setup is slow: made once, outside
        any request's timeout), per event loop."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._gate is None or self._loop is not loop:
            base = self.cfg.url or SERVED.get(self.cfg.path)
            if not base:
                raise RewardError(f"task.judge.path={self.cfg.path}: no judge server was started for it")
            self.url = base.rstrip("/") + "/chat/completions"
            self._gate, self._loop = asyncio.Semaphore(int(self.cfg.concurrency)), loop
            self._http = httpx.AsyncClient(timeout=None, headers={"authorization": f"Bearer {self.cfg.api_key}"})
        return self._gate

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
        question = (extra_info or {}).get("question", "") if isinstance(extra_info, dict) else ""
        prompt = self.cfg.prompt.format(
            question=question, answer=solution_str, ground_truth=ground_truth, data_source=data_source
        )
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": int(self.cfg.max_tokens),
            "temperature": 0.0,
        }
        last = "no attempt"
        for _ in range(1 + int(self.cfg.retries)):
            try:
                async with self._semaphore():
                    async with asyncio.timeout(self.cfg.timeout):
                        text = await self._ask(body)
            except TimeoutError:
                last = f"no reply within task.judge.timeout={self.cfg.timeout:g}s"
                continue
            except Exception as e:  # noqa: BLE001 -- an HTTP or protocol error: retried, then reported
                last = f"{type(e).__name__}: {e}"
                continue
            m = self.rule.search(text)
            if m is None:
                last = f"the reply {text[:80]!r} does not match task.judge.parse={self.cfg.parse!r}"
                continue
            try:
                return float(m.group(1) if self.rule.groups else m.group(0))
            except ValueError:
                last = f"task.judge.parse matched {m.group(0)!r}, not a number"
        raise RewardError(f"judge {self.cfg.url} failed {1 + int(self.cfg.retries)} times; last: {last}")

    async def _ask(self, body: dict) -> str:
        self.requests += 1
        r = await self._http.post(self.url, json=body)
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"] or "")
