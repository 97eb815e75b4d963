"""Fakes of the real interfaces: a model (:class:`FakeEngine`), a task and a trainer; and a random consumed batch
for a real trainer (:func:`random_batch`).

They implement the real interfaces (the no-cache engine's model, :class:`psrl.tasks.Task`'s methods,
``Trainer.step``), so tests and the simulator run the *real* coordinator on them, in virtual time, with
every latency and reward chosen by the test. Everything here is deterministic given the seeds.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from psrl.staleness import Batch
from psrl.tasks.base import Episode, GenerateFn, Prompt, Task
from psrl.types import Trajectory, WeightState
from psrl.weights import ParameterStore

__all__ = ["FakeEngine", "FakeTask", "FakeTrainer", "random_batch"]

LatencyFn = Callable[[Prompt, int, int], float]
ScoreFn = Callable[[Prompt, Episode], float]


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

    def __init__(
        self,
        token_cost: float = 0.01,
        step_cost: float = 0.0,
        sync_cost: float = 0.0,
        vocab: int = 97,
        stop_id: int | None = None,
        stop_at: int | None = None,
        version: int = 0,
        record: bool = False,
    ):
        self.token_cost = float(token_cost)
        self.step_cost = float(step_cost)
        self.sync_cost = float(sync_cost)
        self.vocab = int(vocab)
        self.stop_id = stop_id
        self.stop_at = stop_at
        self.version = int(version)
        self.state: WeightState | None = None
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

    def next_token(
        self,
        seqs: list[list[int]],
        temperature: float = 1.0,
        top_p: float = 1.0,
        uniforms: Sequence[float | None] | None = None,
    ) -> tuple[list[int], list[float]]:
        """Tokens of every row; the log-prob encodes the version (``-1 - version / 100``) for tests. Nothing is
        sampled, so ``uniforms`` is not read."""
        self.calls += 1
        self.rows += len(seqs)
        if self.record:
            self.seen.append([len(s) for s in seqs])
        toks = [self.token_for(s) for s in seqs]
        return toks, [-1.0 - self.version / 100.0] * len(seqs)

    async def anext_token(
        self,
        seqs: list[list[int]],
        temperature: float = 1.0,
        top_p: float = 1.0,
        uniforms: Sequence[float | None] | None = None,
    ) -> tuple[list[int], list[float]]:
        """``next_token`` after ``step_cost + len(seqs) * token_cost`` seconds of (virtual) time."""
        cost = self.step_cost + self.token_cost * len(seqs)
        if self.record:
            self.times.append(asyncio.get_running_loop().time())
        if cost > 0:
            await asyncio.sleep(cost)
        return self.next_token(seqs, temperature, top_p, uniforms)

    def load_weights(self, state: WeightState, version: int) -> None:
        self.loads += 1
        self.state = state
        self.version = int(version)

    async def aload_weights(self, state: WeightState, version: int) -> None:
        """``load_weights`` after ``sync_cost`` seconds; the version changes only at the end."""
        if self.sync_cost > 0:
            await asyncio.sleep(self.sync_cost)
        self.load_weights(state, version)

    def export_state(self) -> dict:
        return {"version": self.version}


class FakeTask:
    """``turns`` model turns of ``turn_tokens`` tokens separated by tool calls of chosen latency.

    Args:
        turns: model turns per episode (``turns - 1`` tool calls in between).
        turn_tokens: ``max_new_tokens`` of every turn.
        tool_latency: seconds of every tool call (when ``latency_fn`` is None).
        latency_fn: ``(prompt, episode_no, call_index) -> seconds``, called once per tool call;
            ``episode_no`` counts episodes in start order (0, 1, ...), so a test can make exactly
            one attempt slow (a retry is a new episode).
        score_fn: ``(prompt, episode) -> score``; default: a coin drawn from the episode rng
            (``episode.info["coin"]``), so members of a group differ.
        reward_fn: replaces :meth:`reward` entirely (may raise, to test error handling).
        episode_fn: called as ``episode_fn(prompt)`` at the start of every episode (may raise).
    """

    stop_ids: set = set()
    max_context = 10**6

    def __init__(
        self,
        turns: int = 2,
        turn_tokens: int = 4,
        tool_latency: float = 0.0,
        latency_fn: LatencyFn | None = None,
        score_fn: ScoreFn | None = None,
        reward_fn: Callable[[Prompt, Episode], dict] | None = None,
        episode_fn: Callable[[Prompt], None] | None = None,
    ):
        self.turns = int(turns)
        self.turn_tokens = int(turn_tokens)
        self.tool_latency = float(tool_latency)
        self.latency_fn = latency_fn
        self.score_fn = score_fn
        self.reward_fn = reward_fn
        self.episode_fn = episode_fn
        self.prompts = 0
        self.episodes_started = 0
        self.reward_calls = 0

    def sample_prompt(self, rng: random.Random) -> Prompt:
        n = self.prompts
        self.prompts += 1
        return Prompt(uid=f"p{n}", ids=[1, 2, 3 + n % 50], answer=n, text=f"prompt {n}")

    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        episode_no = self.episodes_started
        self.episodes_started += 1
        if self.episode_fn is not None:
            self.episode_fn(prompt)
        ep = Episode()
        ep.info["coin"] = rng.random()
        for turn in range(self.turns):
            seg = await generate(list(prompt.ids) + ep.response_ids, self.turn_tokens)
            ep.add_model(seg)
            if turn + 1 < self.turns:
                latency = self.latency_fn(prompt, episode_no, turn) if self.latency_fn else self.tool_latency
                if latency > 0:
                    await asyncio.sleep(latency)
                ep.add_tool([5, 5])
                ep.tool_calls += 1
        return ep

    def reward(self, prompt: Prompt, episode: Episode) -> dict:
        self.reward_calls += 1
        if self.reward_fn is not None:
            return self.reward_fn(prompt, episode)
        if self.score_fn is not None:
            score = float(self.score_fn(prompt, episode))
        else:
            score = float(episode.info.get("coin", 0.0) > 0.5)
        return {"score": score, "acc": score, "seq_reward": score, "seq_final_reward": score}

    def demonstrations(self, n: int, rng: random.Random) -> list:
        return []


class FakeTrainer:
    """``step`` takes ``train_time`` (virtual) seconds and bumps the version.

    ``batches`` keeps every batch; ``intervals`` the (start, end) loop time of every step, so a
    test can check what generation did while training ran. ``save`` / ``load`` write the version. It never
    skips a step.
    """

    def __init__(self, policy: FakeEngine | None = None, train_time: float = 0.1, keep: int = 2):
        self.policy = policy if policy is not None else FakeEngine()
        self.train_time = float(train_time)
        self.out = ParameterStore(keep)
        """Where :meth:`publish` puts the policy's state."""
        self.batches: list = []
        self.intervals: list[tuple[float, float]] = []
        self.last_skip: str | None = None
        self.skipped_in_a_row = 0

    def start(self) -> None:
        """Nothing to start."""

    def publish(self, version: int) -> dict[str, float]:
        """The policy's state, as it is, as ``version``."""
        self.policy.version = int(version)
        self.out.publish(int(version), self.policy.export_state())
        return {}

    def state_dict(self, copied: bool = True) -> dict:
        return {"version": self.version}

    def close(self) -> None:
        """Nothing to stop."""

    @property
    def version(self) -> int:
        return int(self.policy.version)

    async def step(self, batch: Batch) -> dict:
        start = asyncio.get_running_loop().time()
        if self.train_time > 0:
            await asyncio.sleep(self.train_time)
        self.batches.append(batch)
        self.intervals.append((start, asyncio.get_running_loop().time()))
        self.policy.version = int(batch.version) + 1
        return {"train/loss": 0.0}

    def save(self, directory: str | Path, state: dict | None = None) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / "trainer.json").write_text(json.dumps(state if state is not None else self.state_dict()))
        return path / "trainer.json"

    def load(self, directory: str | Path) -> int:
        self.policy.version = int(json.loads((Path(directory) / "trainer.json").read_text())["version"])
        return self.version


def random_batch(
    task: Task, version: int = 0, groups: int = 3, n: int = 3, seed: int = 0, lengths: tuple[int, int] = (1, 5)
) -> Batch:
    """A consumed batch for a real trainer (its tests, the checkpoint-cost benchmark): ``groups`` of the task's
    prompts, ``n`` random responses each of ``lengths`` tokens (inclusive), rewards that differ inside every group
    (non-zero advantages)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = task.sample_prompt(rng)
        members = []
        for i in range(n):
            resp = [rng.randrange(task.tokenizer.vocab_size) for _ in range(rng.randint(*lengths))]
            members.append(
                Trajectory(
                    uid=f"{g}/{i}",
                    group=str(g),
                    v_traj=version,
                    prompt_ids=prompt.ids,
                    response_ids=resp,
                    logprobs=[-1.0] * len(resp),
                    loss_mask=[1] * len(resp),
                    reward=float(rng.random() < 0.5) + 0.1 * i,
                )
            )
        out.append(members)
    return Batch(version, out, [], [])
