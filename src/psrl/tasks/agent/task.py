"""``task.name: agent``: train the agent you already have, written against the ``openai`` SDK.

``task.agent`` names ``async def agent(client, row)`` (``module:function`` or ``path/to/file.py:function``; the file
needs no psrl import). Each trajectory calls it once with an ``openai.AsyncOpenAI`` client whose base URL is the
trajectory's own (:mod:`psrl.tasks.agent.endpoint`) and the dataset row as read (verl's layout, as
``task.name: dataset`` reads it: the chat messages under ``data.prompt_key``). The agent talks to the model as many
turns as it likes, runs its own tools, and returns its reward: a number, a dict with ``score``, or None -- then
``task.reward`` scores the last assistant message against the row's answer, as for a dataset task.

The trajectory is what :class:`~psrl.tasks.agent.capture.Conversation` captured: the first request's context as
the prompt, then every sampled turn (loss mask 1, its log-probs and versions) and the context the agent added
between turns (tool results, user turns: mask 0). An agent that raises, outlives ``task.agent_timeout`` or returns
without one request fails the episode, which the agent manager retries ``task.reward_retries`` times and then
records as failed.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import random
import re
from typing import Any

from psrl.errors import ConfigError
from psrl.tasks.agent.capture import Conversation
from psrl.tasks.agent.chat import ChatTemplate
from psrl.tasks.agent.demos import demo_tokens
from psrl.tasks.agent.endpoint import Endpoint
from psrl.tasks.base import Demo, Episode, GenerateFn, Prompt
from psrl.tasks.dataset import DatasetTask
from psrl.tasks.rewards import load_function

__all__ = ["AgentTask", "AgentError"]

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """The agent raised, hung past ``task.agent_timeout``, or never called the endpoint."""


class AgentTask(DatasetTask):
    """Rows of ``data.train_files``, each played by the user's agent through the endpoint."""

    def __init__(self, task_cfg, seed: int = 0, tokenizer=None, data=None):
        super().__init__(task_cfg, seed=seed, tokenizer=tokenizer, data=data)
        self.agent = self.load_agent(task_cfg)
        self.template = ChatTemplate(self.tokenizer, task_cfg.chat_template)
        self.demonstration = (
            load_function(task_cfg.demonstration, key="task.demonstration") if task_cfg.demonstration else None
        )
        self.endpoint: Endpoint | None = None
        self._http: Any = None
        self._ids = itertools.count()

    def load_agent(self, task_cfg) -> Any:
        """The async ``agent(client, row)`` each trajectory runs: ``task.agent`` (a subclass may supply its own,
        as :class:`psrl.tasks.verifiers.VerifiersTask` does)."""
        if not task_cfg.agent:
            raise ConfigError("task.agent", "task.name is agent but no agent is named", "set task.agent=file.py:agent")
        agent = load_function(task_cfg.agent, key="task.agent")
        if not asyncio.iscoroutinefunction(agent):
            raise ConfigError(
                "task.agent", f"{task_cfg.agent} is not an async function", "write it as async def agent(client, row)"
            )
        return agent

    async def start_endpoint(self) -> Endpoint:
        """The endpoint of the running event loop (started on first use; a new loop gets a new one)."""
        import openai

        loop = asyncio.get_running_loop()
        if self.endpoint is None or self.endpoint.loop is not loop:
            self.endpoint = Endpoint()
            await self.endpoint.start()
            # one connection pool for every trajectory's client: making one per client costs ~50 ms (TLS setup)
            self._http = openai.DefaultAsyncHttpxClient()
            log.info("agent endpoint on http://127.0.0.1:%d/t/<trajectory>/v1", self.endpoint.port)
        return self.endpoint

    async def close(self) -> None:
        """Stop the endpoint (the run's end; tests)."""
        if self.endpoint is not None:
            await self.endpoint.close()
            self.endpoint = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def conversation(self, uid: str, generate: GenerateFn) -> Conversation:
        return Conversation(
            self.tokenizer,
            self.template,
            generate,
            set(self.stop_ids),
            self.max_context,
            parser=self.cfg.tool_parser,
            uid=uid,
            turn_tokens=self.turn_tokens,
            history=self.cfg.agent_history,
        )

    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        """Run the agent on the prompt's row with a client bound to a fresh trajectory URL; its captured turns."""
        import openai

        endpoint = await self.start_endpoint()
        uid = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prompt.uid}-{next(self._ids)}")
        conv = self.conversation(uid, generate)
        url = endpoint.open(conv)
        client = openai.AsyncOpenAI(
            base_url=url, api_key="psrl", max_retries=0, timeout=self.cfg.agent_timeout, http_client=self._http
        )
        row = copy.deepcopy(prompt.info.get("row") or {})
        try:
            async with asyncio.timeout(self.cfg.agent_timeout):  # not wait_for: 3.11's can drop a cancel
                out = await self.agent(client, row)
        except TimeoutError:
            raise AgentError(
                f"agent {self.cfg.agent} did not return within task.agent_timeout={self.cfg.agent_timeout:g}s "
                f"on {prompt.info.get('where', prompt.uid)} (after {len(conv.turns)} turns)"
            ) from None
        finally:
            endpoint.finish(uid)  # the shared connection pool stays open for the next trajectory
        if not conv.turns:
            raise AgentError(
                f"agent {self.cfg.agent} returned without calling the endpoint on {prompt.info.get('where', uid)}: "
                "an episode needs at least one model turn"
            )
        return self._episode(conv, out)

    def demonstrations(self, n: int, rng: random.Random) -> list[Demo]:
        """``task.demonstration`` of ``n`` random rows, tokenised as the endpoint captures a conversation
        (:mod:`psrl.tasks.agent.demos`), for ``trainer.warm_start_steps > 0``."""
        if self.demonstration is None:
            raise ConfigError(
                "task.demonstration",
                "an agent task's warm start (trainer.warm_start_steps > 0) needs demonstrations, and none is named",
                "set task.demonstration=file.py:function, or trainer.warm_start_steps=0",
            )
        out = []
        for _ in range(n):
            row = self.rows[rng.randrange(len(self.rows))]
            demo = self.demonstration(copy.deepcopy(row.raw))
            out.append(demo_tokens(self.tokenizer, self.template, self.eos_id, self.cfg.tool_parser, demo, row.where))
        return out

    @staticmethod
    def _episode(conv: Conversation, out: Any) -> Episode:
        ep = conv.episode
        ep.prompt_ids = list(conv.prompt_ids or [])
        last = conv.turns[-1]
        ep.truncated = last.finish == "length"
        ep.info["agent_reward"] = out
        ep.info["solution"] = last.parsed.content
        return ep

    async def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float]:
        """The agent's own reward when it returned one, else ``task.reward`` on its last assistant message; with
        ``tool_calls``, the number of tool calls parsed from the model's turns."""
        out = episode.info.get("agent_reward")
        if out is None:
            metrics = await super().reward(prompt, episode)
        else:
            metrics = self.reward_fn.as_metrics(out, f" on {prompt.info.get('where', prompt.uid)}", self.cfg.agent)
        return {**metrics, "tool_calls": float(episode.tool_calls)}
