"""Data and interfaces that cross layers: one trajectory, as the rollout side hands it to the trainer;
the engine seam (:class:`Engine`, :class:`GenRequest`, :class:`EngineLoad`, :class:`Sampling`) a rollout
instance drives, and the per-request random streams it samples from (:func:`stream_seed`,
:func:`stream_uniform`); where published weights are read (:class:`WeightSource`); what the coordinator trains
with (:class:`StepTrainer`) and writes to (:class:`Sink`).

Standard library only. Every field is plain data (picklable, JSON-able), so trajectories
cross Ray processes and land in ``trajectories.jsonl`` unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from psrl.staleness import Batch


@dataclass
class TokenSequence:
    """One training sequence an episode closed before its last one: an agent episode whose chat template rewrote
    the history it had sampled (``task.agent_history: split``) goes on from a freshly rendered prompt, and what it
    held so far becomes one of these. Its fields mean what :class:`Trajectory`'s fields of the same names mean."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)


@dataclass
class Trajectory:
    """One episode of one prompt, generated (possibly in segments) under versions >= ``v_traj``.

    Usually one training sequence (``prompt_ids`` then ``response_ids``). An agent episode whose history was
    rewritten is several (:attr:`earlier`, then this one's own): still one trajectory for the staleness protocol
    (one reservation, one ``V_traj``, one record), and one row per sequence for the trainer (:meth:`rows`)."""

    uid: str
    """Unique id of this trajectory."""
    group: str
    """Id of the group (prompt) it belongs to; all members of a group share it."""
    v_traj: int
    """Policy version when its generation started (V_traj); staleness is measured from it."""
    prompt_ids: list[int]
    """Token ids of the prompt (not trained on)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model tokens and tool-output tokens, in order."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-probability of each response token under the weights that produced it (0.0 for tool tokens)."""
    loss_mask: list[int] = field(default_factory=list)
    """1 for tokens the model generated (trained on), 0 for tool output."""
    token_versions: list[int] = field(default_factory=list)
    """Policy version that produced each response token (-1 for tool tokens)."""
    reward: float = 0.0
    """Scalar reward the advantage uses."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Reward metrics the dynamic sampling filter reads: score, acc, seq_reward, seq_final_reward."""
    instances: list[int] = field(default_factory=list)
    """Rollout instance of each generation segment (more than one after migration)."""
    truncated: bool = False
    """Force-completed with its partial output (proactive ``truncate``, or max length)."""
    gen_seconds: float = 0.0
    """Wall (or injected-clock) time from dispatch to completion."""
    earlier: tuple[TokenSequence, ...] = ()
    """The training sequences the episode closed before its last one (the fields above), oldest first; empty
    unless the history was rewritten under ``task.agent_history: split``. (A class-level default, so trajectories
    pickled before this field existed -- a checkpoint's held groups -- read as one sequence.)"""

    @property
    def segment_versions(self) -> list[int]:
        """Versions of the consecutive generation segments (:func:`segment_versions` of ``token_versions``), over
        every sequence in order: the first is the oldest token's version."""
        return segment_versions([v for s in self.earlier for v in s.token_versions] + self.token_versions)

    def rows(self) -> list[Trajectory]:
        """One trajectory per training sequence, oldest first: each :attr:`earlier` sequence as a copy of this
        trajectory with that sequence's tokens (same uid, group, ``V_traj``, reward), then this one's own."""
        if not self.earlier:
            return [self]
        own = replace(self, earlier=())
        return [
            replace(
                own,
                prompt_ids=list(s.prompt_ids),
                response_ids=list(s.response_ids),
                logprobs=list(s.logprobs),
                loss_mask=list(s.loss_mask),
                token_versions=list(s.token_versions),
            )
            for s in self.earlier
        ] + [own]


def segment_versions(token_versions: list[int]) -> list[int]:
    """Versions of the consecutive generation segments: a new segment starts where the version changes; tool
    tokens (version -1) belong to none."""
    out: list[int] = []
    for v in token_versions:
        if v >= 0 and (not out or out[-1] != v):
            out.append(v)
    return out


# --------------------------------------------------------------------------- the engine seam


@dataclass(eq=False)
class GenRequest:
    """One generation on one engine: context and budget in, tokens with their log-probs and versions out.

    The engine appends to ``tokens`` / ``logprobs`` / ``versions`` as tokens arrive (so a partial
    output is always readable) and sets ``finish`` when it is done: ``"stop"`` (a stop token, kept),
    ``"length"`` (the budget) or ``"abort"`` (aborted: what was generated so far is kept).
    Compared by identity: two requests with the same context are different requests.
    """

    context: list[int]
    """Token ids the model continues (prompt, earlier turns, tool output, and any kept prefix)."""
    max_new_tokens: int
    """Most tokens to generate (capped by ``trainer.max_new_tokens``)."""
    v_min: int = 0
    """The trajectory's V_traj: the engine must hold a version >= this when the request starts."""
    tokens: list[int] = field(default_factory=list)
    """Generated token ids, in order."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-prob of each generated token under the weights that produced it."""
    versions: list[int] = field(default_factory=list)
    """Weight version that produced each generated token."""
    finish: str = ""
    """Empty while running; then stop | length | abort | error."""
    error: str = ""
    """Why the engine failed this request (finish == "error")."""
    rid: str = ""
    """Engine-side request id (set by engines that need one)."""
    seed: int | None = None
    """Seed of this request's own random stream (:func:`stream_seed`): its ``i``-th generated token is drawn with
    ``stream_uniform(seed, i)`` (``hf`` and the no-cache engine) or vLLM's per-request ``seed``, so what it samples
    does not depend on which other requests it was batched with. None: the engine's shared generator (what it
    samples then depends on the batch). A session derives it from ``trainer.seed``, the trajectory's identity
    and the tokens of the turn so far (:class:`psrl.rollout.serving.session.Session`)."""


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a bijective 64-bit mix, every input bit reaching every
    output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(*parts: int) -> int:
    """A seed in ``[0, 2**63)`` that depends on every one of ``parts`` and on their order: how a random stream is
    named by what it is for (``trainer.seed``, a group, a member, a turn, a token count) instead of by when it
    was asked for. Pure, so a resumed or re-run process derives the same seeds (Python's ``hash`` is salted)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


def stream_uniform(seed: int, index: int) -> float:
    """The ``index``-th number of stream ``seed``: a float in ``[0, 1)`` with 53 random bits."""
    return (stream_seed(seed, index) >> 10) / float(1 << 53)


@dataclass(frozen=True)
class Sampling:
    """How an engine samples (``trainer.temperature``, ``trainer.top_p``, the task's stop ids): built once per run
    (:func:`psrl.rollout.sampling_of`) and handed to every engine."""

    temperature: float = 1.0
    """Softmax temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus mass kept (1: all)."""
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end a request; kept in its output."""


WeightState = dict[str, Any]
"""One version's weights as the trainer exports them: parameter name to tensor (torch is not imported here)."""


class WeightSource(Protocol):
    """Where published weights are read, by version (:mod:`psrl.weights`): a rollout instance asks
    which versions exist, an engine loads one."""

    def latest_version(self) -> int | None:
        """The newest published version (None before the first)."""

    def versions(self) -> list[int]:
        """The versions that can still be read, oldest first."""

    def get(self, version: int | None = None) -> tuple[int, WeightState]:
        """``(version, weights)`` of ``version`` (default: the newest)."""


@dataclass(frozen=True)
class EngineLoad:
    """What an engine reports about its own load: the router and the sync strategies read this."""

    running: int
    """Requests generating now."""
    queued: int
    """Requests accepted but not yet generating."""
    tokens_per_s: float
    """Generated tokens per second over the engine's recent window (0.0 before any token)."""
    kv_usage: float | None = None
    """Fraction of the KV cache in use, where the engine has one (None otherwise)."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine a rollout instance drives: the only thing above it that knows about engines.

    All methods are coroutines except ``abort`` and ``load``; an engine is used from one event loop.
    Weight updates happen only while the engine is paused or idle, so every token carries exactly
    one version: the version the engine held when that token was produced.
    """

    @property
    def version(self) -> int:
        """Weight version held now."""

    async def start(self) -> None:
        """Start serving (spawn or attach to servers, start the decode loop)."""

    async def generate(self, req: GenRequest) -> GenRequest:
        """Generate for ``req`` until it finishes or is aborted; returns ``req`` with ``finish`` set."""

    def abort(self, req: GenRequest) -> None:
        """Stop ``req`` now; its ``generate`` returns with ``finish == "abort"`` and the tokens so far (or, had it
        finished before the abort reached the engine, as finished)."""

    async def abort_all(self) -> None:
        """Abort every request in flight (each keeps its tokens so far)."""

    async def pause(self) -> None:
        """Stop generating at the next token boundary, keeping in-flight requests; returns once idle."""

    async def resume(self) -> None:
        """Continue the kept requests (their next tokens carry the current version)."""

    async def update_weights(self, version: int, store: WeightSource) -> None:
        """Load ``version`` from ``store``; only while paused or idle."""

    def load(self) -> EngineLoad:
        """Running and queued requests, tokens/s and KV use."""

    async def close(self) -> None:
        """Stop serving and release what :meth:`start` took (servers psrl started are stopped)."""


class Sink(Protocol):
    """Where a run's records go: ``trajectories.jsonl`` and ``metrics.jsonl`` (:class:`psrl.runtime.recorder.RunRecorder`),
    or memory in tests and the simulator."""

    def trajectory(self, rec: dict) -> None:
        """One trajectory record (trained, filtered, aborted, error, ...)."""

    def metric(self, row: dict) -> None:
        """One step's metrics row (names: :mod:`psrl.metrics`)."""


class TrainedPolicy(Protocol):
    """The policy a trainer trains, as the coordinator sees it: the version of its weights."""

    version: int
    """The version of the trainer's weights: :meth:`StepTrainer.publish` sets it."""


class StepTrainer(Protocol):
    """The trainer of a run, as the run builder, the coordinator, checkpointing and validation see it
    (:class:`psrl.train.Trainer`, or a fake in tests and the simulator): one protocol, no optional parts, so no
    caller asks which kind of trainer it holds.

    The life of one: ``start`` (the ranks), ``publish`` of the starting version, then ``step`` and ``publish`` per
    batch; ``state_dict`` / ``save`` between steps (a checkpoint), ``load`` on resume, ``close`` at the end.
    ``step`` may be a plain method (run in a worker thread, off the event loop) or a coroutine (awaited);
    ``publish`` is a plain method (run in a worker thread).
    """

    @property
    def policy(self) -> TrainedPolicy:
        """The trained policy (read-only here, so a trainer may hold a more specific one)."""

    @property
    def out(self) -> WeightSource:
        """Where :meth:`publish` puts each version: what the engines and the validation instances read."""

    last_skip: str | None
    """Why the last step was skipped (a NaN / infinite loss or gradient), None when it trained."""
    skipped_in_a_row: int
    """Steps skipped in a row up to the last one (the run stops at ``trainer.max_skipped_steps``)."""

    def start(self) -> object:
        """Be ready to step (start the ranks; idempotent)."""

    def step(self, batch: Batch) -> dict[str, float] | Awaitable[dict[str, float]]:
        """Train on a consumed batch; returns the ``train/*`` (and loss) metrics."""

    def publish(self, version: int) -> dict[str, float]:
        """Make the weights as they are now ``version`` in :attr:`out` (and the policy's version); returns
        ``time/publish_s`` and ``weights/bytes``."""

    def state_dict(self, copied: bool = True) -> dict:
        """The trainer's state taken now, between two steps, for :meth:`save` to write later (a checkpoint written
        in the background)."""

    def save(self, directory: str | Path, state: dict | None = None) -> Path:
        """Write a checkpoint of the trainer into ``directory``: now, or ``state`` from :meth:`state_dict`."""

    def load(self, directory: str | Path) -> int:
        """Restore what :meth:`save` wrote; returns the restored version."""

    def close(self) -> None:
        """Stop what :meth:`start` started (idempotent)."""


@runtime_checkable
class WeightStore(WeightSource, Protocol):
    """Where versions are put in memory for the engines (:class:`psrl.weights.ParameterStore`)."""

    def publish(self, version: int, state: WeightState) -> None:
        """Hold ``state`` as ``version`` (versions strictly increase)."""
