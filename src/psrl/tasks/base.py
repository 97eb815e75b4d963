"""The task interface: prompts, an (async, possibly multi-turn) episode, a verifiable reward, demos.

A task never samples tokens itself: :meth:`Task.run_episode` receives ``generate``, an async
callable supplied by whoever runs the episode (the rollout coordinator's sessions, or `psrl.rollout.engines.base.turns`),
so the same task code runs batched, distributed or under a virtual clock. Tool latency is an
``await asyncio.sleep(...)``: the event loop's clock *is* the injected clock, so a test on a
virtual-time loop never waits, and a task must never call ``time.time`` / ``time.sleep``.
"""

from __future__ import annotations

import abc
import inspect
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from psrl.types import TokenSequence, Trajectory

__all__ = [
    "RewardError",
    "Prompt",
    "Segment",
    "Episode",
    "Task",
    "GenerateFn",
    "Demo",
    "lognormal_latency",
    "episode_to_trajectory",
    "compute_reward",
]


class RewardError(RuntimeError):
    """A reward call raised, timed out or returned something that is not a score."""


@dataclass
class Prompt:
    """One problem: its id, the prompt token ids, the reference answer and a readable text.

    ``info`` carries what a reward needs besides the answer (a dataset row's ``data_source``,
    ``extra_info`` and where it came from).
    """

    uid: str
    ids: list[int]
    answer: Any
    text: str = ""
    info: dict = field(default_factory=dict)


@dataclass
class Segment:
    """What one ``generate`` call returns: sampled tokens, their behaviour log-probs and versions."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


GenerateFn = Callable[[list[int], int], Awaitable[Segment]]
"""``async generate(context_ids, max_new_tokens) -> Segment``; stops after one of ``task.stop_ids``."""

Demo = tuple[list[int], list[int], list[int]]
"""A scripted demonstration: (prompt_ids, response_ids, loss_mask)."""


@dataclass
class Episode:
    """The response side of one trajectory: model tokens and tool tokens, in order.

    Model tokens have ``loss_mask`` 1, their behaviour log-prob and the version that produced
    them; tool tokens have mask 0, log-prob 0.0 and version -1.
    """

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    truncated: bool = False
    turns: int = 0
    tool_calls: int = 0
    info: dict = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    """The trajectory's prompt when the episode brought its own (an agent renders its first request itself);
    None: the :class:`Prompt`'s ids. After :meth:`split`, the prompt of the last sequence."""
    earlier: list[TokenSequence] = field(default_factory=list)
    """Training sequences closed by :meth:`split`, oldest first (:attr:`psrl.types.Trajectory.earlier`)."""

    def add_model(self, seg: Segment) -> None:
        """Append a model turn (trained on)."""
        self.response_ids += seg.tokens
        self.logprobs += seg.logprobs
        self.loss_mask += [1] * len(seg.tokens)
        self.token_versions += seg.versions
        self.turns += 1

    def add_tool(self, ids: list[int]) -> None:
        """Append tool output (context only: masked out of the loss)."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.token_versions += [-1] * len(ids)

    def split(self, prompt_ids: list[int]) -> None:
        """Close the sequence so far -- ``prompt_ids`` (its prompt) and the response held -- into :attr:`earlier`,
        and start an empty one: the context was rewritten, so the next tokens no longer extend these. A sequence
        without a sampled token is dropped (it has nothing to train). Turn and tool-call counts go on."""
        if any(self.loss_mask):
            self.earlier.append(
                TokenSequence(list(prompt_ids), self.response_ids, self.logprobs, self.loss_mask, self.token_versions)
            )
        self.response_ids, self.logprobs, self.loss_mask, self.token_versions = [], [], [], []


class Task(abc.ABC):
    """A verifiable task. Subclasses set ``tokenizer`` and ``stop_ids`` in ``__init__``.

    ``warm_start_steps`` is the task's default number of supervised steps on
    :meth:`demonstrations` before RL (``trainer.warm_start_steps: null`` means use it, ``0`` skips the warm start).
    """

    tokenizer: Any
    stop_ids: set[int]
    warm_start_steps: int = 0
    max_context: int = 64

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A task written for the old verbs would silently lose its position at a resume: say the new names."""
        super().__init_subclass__(**kwargs)
        old = [name for name in ("state", "load_state") if callable(cls.__dict__.get(name))]
        if old:
            raise TypeError(
                f"task {cls.__qualname__} defines {' and '.join(old)}(): a task's saved state is now "
                "state_dict() / load_state_dict(state) (as in torch); rename the methods"
            )

    @abc.abstractmethod
    def sample_prompt(self, rng: random.Random) -> Prompt:
        """Draw one problem using only ``rng`` (so prompt streams are reproducible)."""

    @abc.abstractmethod
    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        """Play one episode: call ``generate`` for each model turn, run tools, return the episode.

        Randomness (tool latency, tool noise) comes only from ``rng``.
        """

    @abc.abstractmethod
    def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float] | Awaitable[dict[str, float]]:
        """Verifiable reward: ``score`` (used for training), ``acc``, ``seq_reward``, ``seq_final_reward``.

        May be ``async`` (a user's reward function that calls out); callers use :func:`compute_reward`.
        """

    def val_prompts(self, n: int) -> list[Prompt]:
        """The validation set: by default ``n`` prompts of a fixed held-out draw (the same at every step)."""
        rng = random.Random("psrl/validation")
        return [self.sample_prompt(rng) for _ in range(n)]

    def state_dict(self) -> dict:
        """What a checkpoint must keep of the task (a dataset's position); stateless tasks keep nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 -- an optional hook: stateless tasks keep nothing
        """Restore :meth:`state_dict`."""

    async def close(self) -> None:  # noqa: B027 -- an optional hook: most tasks open nothing
        """Release what the task opened on the run's event loop (the agent endpoint and its HTTP pool), at the
        run's end, before that loop closes."""

    @abc.abstractmethod
    def demonstrations(self, n: int, rng: random.Random) -> list[Demo]:
        """``n`` scripted (prompt_ids, response_ids, loss_mask) demos for a short supervised warm start."""


async def compute_reward(task: Task, prompt: Prompt, episode: Episode) -> dict[str, float]:
    """``task.reward(...)``, awaited when the task's reward is async."""
    out = task.reward(prompt, episode)
    return await out if inspect.isawaitable(out) else out


def lognormal_latency(rng: random.Random, median: float, sigma: float) -> float:
    """A heavy-tailed tool latency: lognormal with the given median (``exp(mu)``) and sigma.

    One draw is always consumed from ``rng`` (even for ``median <= 0``, which gives 0), so
    scaling latencies to zero does not change the rest of the random stream.
    """
    z = rng.gauss(0.0, 1.0)
    if median <= 0:
        return 0.0
    return median * math.exp(sigma * z)


def episode_to_trajectory(
    prompt: Prompt,
    episode: Episode,
    reward: dict[str, float],
    *,
    uid: str,
    group: str,
    v_traj: int,
    instances: list[int] | None = None,
    gen_seconds: float = 0.0,
) -> Trajectory:
    """Package a finished episode and its reward as the :class:`psrl.types.Trajectory` the trainer reads."""
    return Trajectory(
        uid=uid,
        group=group,
        v_traj=int(v_traj),
        prompt_ids=list(prompt.ids if episode.prompt_ids is None else episode.prompt_ids),
        response_ids=list(episode.response_ids),
        logprobs=list(episode.logprobs),
        loss_mask=list(episode.loss_mask),
        token_versions=list(episode.token_versions),
        reward=float(reward["score"]),
        metrics={k: float(v) for k, v in reward.items()},
        instances=list(instances or []),
        truncated=bool(episode.truncated),
        gen_seconds=float(gen_seconds),
        earlier=tuple(episode.earlier),
    )
