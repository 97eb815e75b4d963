"""``task.name: verifiers``: train on a `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment,
its rollout played through the agent endpoint and its rubric the reward.

``task.verifiers`` names a function (``module:function`` or ``path/to/file.py:function``) that returns a
``verifiers.Environment`` of verifiers' classic stack (0.3.1: ``import verifiers as vf``; ``vf.ToolEnv``,
``vf.MultiTurnEnv``, ``vf.Rubric``), defined in your own code, so nothing is fetched at run time. The rows are
the environment's dataset (``env.get_dataset()``; validation rows ``env.get_eval_dataset()``), not
``data.train_files``. Each trajectory runs the environment's own ``env.rollout(row, client, model)`` with
verifiers' chat-completions client over the trajectory's ``openai.AsyncOpenAI`` client, exactly as an agent of
``task.name: agent`` (:mod:`psrl.tasks.agent.task`) talks to the endpoint: the capture is token-exact, group
sampling, filters and faults apply as to any agent episode.

The reward is the environment's rubric (``rubric.score_rollout``: the weighted sum of its reward functions; its
metrics ride along as reward keys). It runs off the run's event loop, on one event loop of its own in a daemon
thread, within ``task.reward_timeout``: verifiers calls a synchronous reward function inline, so on the run's loop
one that hangs would stop the run. The rollout itself (the environment's tools and ``env_response``) runs on the
run's loop, as an agent's own code does.

A rollout that ends in a verifiers error the model caused (an empty or invalid reply, a tool call the environment
stops on) is scored like any other; any other error (the endpoint refused a turn, infrastructure) fails the
episode, which is retried ``task.reward_retries`` times and then recorded as failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import threading
from typing import Any

from psrl.errors import ConfigError
from psrl.tasks.agent.endpoint import MODEL
from psrl.tasks.agent.task import AgentError, AgentTask
from psrl.tasks.base import Episode, Prompt
from psrl.tasks.dataset import Row
from psrl.tasks.rewards import load_function

__all__ = ["VerifiersTask", "RubricLoop", "INSTALL"]

log = logging.getLogger(__name__)

INSTALL = "pip install -e '.[agents,verifiers]' (verifiers 0.3.1)"


def require_verifiers() -> None:
    """ConfigError naming ``task.name`` when the verifiers package is not installed."""
    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError("task.name", "task.name is verifiers but the verifiers package is not installed", INSTALL)


class RubricLoop:
    """An event loop on a daemon thread, started on first use, where rubrics score finished rollouts.

    One loop for the whole run, so a rubric's own asynchronous clients (a judge's ``AsyncOpenAI``) always run on
    the loop they were first used on. A synchronous reward function that never returns holds this loop: every
    later score then times out (``task.reward_timeout``) and fails visibly, while the run's own loop goes on.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    async def run(self, coro: Any) -> Any:
        """``await coro`` on this loop; cancelling the caller cancels it there."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, name="psrl-rubric", daemon=True)
            self.thread.start()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        """Stop the loop (a function still running in it keeps its daemon thread until it returns)."""
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


class VerifiersTask(AgentTask):
    """The rows of a verifiers environment's dataset, each played by ``env.rollout`` through the endpoint and
    scored by ``env.rubric``."""

    def __init__(self, task_cfg, seed: int = 0, tokenizer=None, data=None):
        if data is None:
            raise ConfigError("data", "task.name=verifiers needs the data section", "keep the data section")
        self.env = load_environment(task_cfg.verifiers)
        self.rubric_loop = RubricLoop()
        # the rows are the environment's, read under its own column names; messages name task.verifiers
        data = dataclasses.replace(data, prompt_key="prompt", answer_key="answer", train_files=["train"], val_files=[])
        super().__init__(dataclasses.replace(task_cfg, agent=task_cfg.verifiers), seed, tokenizer, data)

    def load_agent(self, task_cfg) -> Any:
        return self.play

    def _rows(self, files: list[str], key: str) -> list[Row]:
        """The environment's training (``data.train_files``) or evaluation rows, checked like a dataset's."""
        split = "eval" if key == "data.val_files" else "train"
        if split == "eval" and self.env.eval_dataset_source is None:
            raise ConfigError(
                "trainer.val_every",
                f"validates on the environment's eval_dataset, but task.verifiers={self.cfg.verifiers} has none",
                "give the environment an eval_dataset, or set trainer.val_every=0",
            )
        ds = self.env.get_eval_dataset() if split == "eval" else self.env.get_dataset()
        rows = []
        for i, raw in enumerate(ds):
            raw = dict(raw)
            raw.setdefault("answer", "")
            row = self._row(f"{self.cfg.verifiers} {split} dataset", i, raw)
            if row is not None:
                rows.append(row)
        return rows

    async def play(self, client: Any, row: dict) -> Any:
        """One ``env.rollout`` of ``row`` with verifiers' chat-completions client over ``client``; its state."""
        import verifiers as vf

        state = await self.env.rollout(row, vf.OpenAIChatCompletionsClient(client), MODEL, dict(self.env.sampling_args))
        err = state.get("error")
        if err is not None and not isinstance(err, (vf.InvalidModelResponseError, vf.ToolError)):
            cause = err.__cause__ or err.__context__
            raise AgentError(
                f"verifiers rollout of {self.cfg.verifiers} failed after {len(state['trajectory'])} turns: {err!r}"
                + (f" (caused by {cause!r})" if cause is not None else "")
            )
        return state

    async def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float]:
        """The rubric's reward of the rollout (its metrics as extra keys), scored on :class:`RubricLoop`; with
        ``tool_calls``, the number of tool calls parsed from the model's turns. A trajectory the proactive filter
        truncated has no finished rollout to score: ``task.reward`` scores it as an empty answer, as for an agent."""
        state = episode.info.get("agent_reward")
        if state is None:
            return await super().reward(prompt, episode)
        await self.rubric_loop.run(self.env.rubric.score_rollout(state))
        out = {**{k: v for k, v in (state.get("metrics") or {}).items()}, "score": state["reward"]}
        metrics = self.reward_fn.as_metrics(out, f" on {prompt.info.get('where', prompt.uid)}", self.cfg.verifiers)
        return {**metrics, "tool_calls": float(episode.tool_calls)}

    async def close(self) -> None:
        await super().close()
        self.rubric_loop.close()


def load_environment(spec: str) -> Any:
    """The ``verifiers.Environment`` that ``spec`` (``task.verifiers``) returns; ConfigError naming the key."""
    if not spec:
        raise ConfigError(
            "task.verifiers", "task.name is verifiers but no environment is named", "set task.verifiers=env.py:load"
        )
    require_verifiers()
    import datasets
    import verifiers as vf

    datasets.disable_progress_bars()  # the environment maps its dataset when built
    make = load_function(spec, key="task.verifiers")
    try:
        env = make()
    except Exception as e:
        raise ConfigError("task.verifiers", f"{spec}() raised {e!r}", "fix the function that builds it") from e
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            "task.verifiers",
            f"{spec}() returned {type(env).__name__}, not a verifiers.Environment",
            "return an environment of the classic stack, e.g. vf.ToolEnv(dataset=..., tools=[...], rubric=...)",
        )
    if env.requires_group_rollouts:
        raise ConfigError(
            "task.verifiers",
            f"the rubric of {spec}() has group-level reward functions; psrl scores each trajectory on its own",
            "use reward functions of one rollout (prompt, completion, answer, state)",
        )
    if env.dataset_source is None:
        raise ConfigError("task.verifiers", f"{spec}() has no training dataset", "pass dataset=... to the environment")
    return env
