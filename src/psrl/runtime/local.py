"""``psrl train`` on one machine: real policy copies, the real trainer, one asyncio loop.

Builds the task, the trainer's policy and one policy copy per rollout instance, warm-starts
(fresh runs only), restores a checkpoint when ``trainer.resume`` finds one, runs the
:class:`~psrl.runtime.coordinator.Coordinator` and writes the run directory: ``config.yaml``,
``metrics.jsonl``, ``trajectories.jsonl``, ``checkpoint/`` (every ``trainer.checkpoint_every``
steps, at the end and on Ctrl-C or SIGTERM, after the training step in progress) and ``final/`` (the final model and tokenizer as a
Hugging Face directory, loadable with ``model.path=RUN_DIR/final``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from psrl.algo.filters import build_group_filter
from psrl.models import Policy
from psrl.rollout.build import build_rollout
from psrl.rollout.engines.base import TokenModel
from psrl.runtime.adaptive import Move, StalenessController
from psrl.runtime.checkpoint import CheckpointSaver, CheckpointWriteError, resume
from psrl.runtime.coordinator import Coordinator, TrainerWait, build_staleness_manager
from psrl.runtime.engines import build_engines
from psrl.runtime.recorder import EventLog, RunRecorder
from psrl.runtime.watch import RunWatch
from psrl.staleness import Event, StalenessManager
from psrl.tasks.base import Task
from psrl.train import Trainer, build_task_and_policy, seed_everything, warm_start
from psrl.train.launch import Launcher, LocalRanks
from psrl.train.lora import lora_spec
from psrl.types import Engine, PublishingTrainer, Sink, StepTrainer, WeightSource, WeightState
from psrl.weights import ParameterStore

if TYPE_CHECKING:
    from psrl.config import Config

__all__ = ["build", "wire", "train", "progress_line", "publish_first_version"]


def progress_line(row: dict, total: int) -> str:
    """One human line per step: step, version, reward, staleness, buffer states, throughput."""
    buffers = " ".join(f"{b}:{s}" for b, s in row["buffers"].items())
    return (
        f"step {row['step']:3d}/{total} v{row['version']:<3d} reward {row['reward/mean']:.3f} "
        f"staleness {row['staleness/mean']:.2f}/{row['staleness/max']} | {buffers} | "
        f"inst v{row['instance_versions']} | {row['throughput/trajectories_per_s']:.1f} traj/s "
        f"{row['time/step_s']:.2f}s/step | gen {row['counts/generated']} abort {row['counts/aborted']} "
        f"cancel {row['counts/cancelled']} filt {row['counts/filtered']} retry {row['counts/retried']} "
        f"trunc {row['counts/truncated']} fail {row['counts/failed']}"
    )


@runtime_checkable
class _LoadsWeights(Protocol):
    """A trainer's policy that takes a state dict (:class:`psrl.models.Policy`, the fakes): ``build(weights=...)``."""

    def load_weights(self, state: WeightState, version: int) -> None: ...


@runtime_checkable
class _SavesPretrained(Protocol):
    """A trainer's policy that writes a Hugging Face directory (:class:`psrl.models.Policy`): ``final/``."""

    def save_pretrained(self, directory: str | Path) -> object: ...


class _StepHook:
    """After each step: show and track it, validate (``trainer.val_every``), put events.jsonl on disk,
    checkpoint every ``trainer.checkpoint_every`` steps and at the end."""

    def __init__(
        self,
        coord: Coordinator,
        run_dir: Path,
        recorder: RunRecorder,
        events: EventLog,
        total: int,
        every: int,
        watch: RunWatch,
        saver: CheckpointSaver,
    ):
        self.coord, self.run_dir, self.recorder, self.events = coord, run_dir, recorder, events
        self.total, self.every, self.watch, self.saver = total, every, watch, saver

    def __call__(self, row: dict) -> None:
        self.watch.after_step(row)  # before the checkpoint, so its validation row is kept by a resume
        self.events.flush()  # a killed run keeps its buffer timeline up to this step
        # The last step is always checkpointed here, *before* the coordinator records the
        # still-held trajectories as ``held``: a resume cuts those records off again.
        if (self.every > 0 and row["step"] % self.every == 0) or row["step"] >= self.total:
            self.saver.save(self.run_dir, self.coord, self.recorder, wait=row["step"] >= self.total)


def build(
    cfg: Config,
    recorder: RunRecorder | None = None,
    log: Callable[[str], None] = print,
    *,
    task: Task | None = None,
    trainer: StepTrainer | None = None,
    engines: Sequence[Engine | TokenModel] | None = None,
    weights: WeightState | None = None,
    sink: Sink | None = None,
    manager: StalenessManager | None = None,
    on_event: Callable[[Event], Any] | None = None,
    on_bound: Callable[[Move], Any] | None = None,
) -> Coordinator:
    """The one builder of a run: task, trainer, rollout engines, staleness manager and coordinator for ``cfg``.

    ``psrl train``, the tests, the benchmarks and the simulator's ``coordinator`` policy all build here; a part
    given is used as it is (a fake task, trainer or engines; the simulator's sink and manager), the others are
    built from ``cfg``. Where the run starts: ``recorder.run_dir/checkpoint`` when ``trainer.resume`` finds one,
    else ``weights`` (a state dict, e.g. one shared warm start across benchmark runs), else the warm start of a
    real :class:`~psrl.train.Trainer`. ``on_event`` hears every transition of the staleness manager built or
    restored here (``events.jsonl``; a ``manager`` given keeps its own listener), ``on_bound`` every move of
    the adaptive controller's bound (:class:`~psrl.runtime.coordinator.Coordinator`).
    """
    if engines is None and cfg.rollout.engine == "vllm" and not cfg.rollout.vllm.urls:
        from psrl.rollout.engines.vllm_server import find_vllm_python

        find_vllm_python(cfg.rollout.vllm.python)  # before the warm start: a missing environment is said at once
    seed_everything(cfg.trainer.seed)
    if task is None or trainer is None:
        built, policy = build_task_and_policy(cfg)
        task = task if task is not None else built
        trainer = trainer if trainer is not None else _trainer(cfg, policy, recorder)
    assert trainer is not None
    try:
        return _build(cfg, recorder, log, task, trainer, engines, weights, sink, manager, on_event, on_bound)
    except BaseException:
        if isinstance(trainer, Trainer):
            trainer.close()  # no rank outlives a run that could not be built
        raise


def in_memory_versions(cfg: Config) -> bool:
    """Whether versions go from trainer to engines in memory: world size 1 with ``hf`` engines in this process
    (the rank and the engines share it). Otherwise the ranks write ``RUN_DIR/weights/v{N}`` (:mod:`psrl.weights`)."""
    return cfg.psrl.deployment.train_world_size == 1 and cfg.rollout.engine == "hf" and cfg.runtime.backend == "local"


def _trainer(cfg: Config, policy: Policy, recorder: RunRecorder | None) -> StepTrainer:
    """The trainer over ``train_nnodes x train_ngpus_per_node`` ranks (started by :func:`build`): in this process at
    world size 1, else processes of this machine or, with ``runtime.backend=ray``, Ray actors; publishing where
    :func:`in_memory_versions` says."""
    world = cfg.psrl.deployment.train_world_size
    work = recorder.run_dir if recorder is not None else None
    launch: Launcher = LocalRanks
    if cfg.runtime.backend == "ray" and world > 1:  # rank actors in a placement group (runtime/ray_ranks.py)
        from psrl.runtime.ray_ranks import ray_launcher

        launch = ray_launcher(cfg.runtime.ray_address)
    return Trainer(
        policy,
        cfg.algorithm,
        cfg.trainer,
        world,
        work,
        cfg.model.dtype,
        in_memory=in_memory_versions(cfg),
        keep=cfg.psrl.staleness + 2,
        bucket_mb=cfg.weights.bucket_mb,
        launcher=launch,
        lora=lora_spec(cfg.model),
    )


def _build(
    cfg: Config,
    recorder: RunRecorder | None,
    log: Callable[[str], None],
    task: Task,
    trainer: StepTrainer,
    engines: Sequence[Engine | TokenModel] | None,
    weights: WeightState | None,
    sink: Sink | None,
    manager: StalenessManager | None,
    on_event: Callable[[Event], Any] | None,
    on_bound: Callable[[Move], Any] | None,
) -> Coordinator:
    """:func:`build` once the task and the trainer exist."""
    ck = None
    if recorder is not None and cfg.trainer.resume:
        ck = resume(recorder.run_dir, trainer, recorder, build_group_filter(cfg.psrl, cfg.algorithm), log, on_event)
    if ck is not None:
        manager = ck["manager"]
        log(f"resumed from {ck['dir']} at version {trainer.policy.version}")
    elif weights is not None:
        start = trainer.policy
        if not isinstance(start, _LoadsWeights):
            raise TypeError(f"build(weights=...) loads them into the trainer's policy: {type(start).__name__} cannot")
        start.load_weights(weights, 0)
    elif isinstance(trainer, Trainer):
        warm_start(cfg, task, trainer, log)
    versions = publish_first_version(cfg, trainer)
    if engines is None:
        engines = build_engines(cfg, _engine_source(trainer), task, recorder.run_dir if recorder is not None else None)
    if manager is None:
        manager = build_staleness_manager(cfg, int(trainer.policy.version), on_event)
    sink = sink if sink is not None else recorder
    coord = wire(cfg, task, trainer, engines, versions, manager, sink=sink, log=log, on_bound=on_bound)
    if ck is not None:
        coord.load_state_dict(ck)
    return coord


def wire(
    cfg: Config,
    task: Task,
    trainer: StepTrainer,
    engines: Sequence[Engine | TokenModel],
    weights: WeightSource,
    manager: StalenessManager | None = None,
    *,
    sink: Sink | None = None,
    log: Callable[[str], None] = print,
    on_bound: Callable[[Move], Any] | None = None,
) -> Coordinator:
    """Make the coordinator's parts and wire them, every wire here: the staleness manager (``manager``, else a fresh
    one at the trainer's version), the adaptive controller over it (``psrl.adaptive_staleness``), the trainer's
    wait, and the rollout side (:func:`psrl.rollout.build_rollout`) over ``engines`` and ``weights``."""
    manager = manager if manager is not None else build_staleness_manager(cfg, int(trainer.policy.version))
    adaptive = cfg.psrl.adaptive_staleness
    controller = StalenessController(adaptive, cfg.psrl.staleness, manager.set_staleness) if adaptive.enable else None
    idle = TrainerWait()
    pool, agents = build_rollout(cfg, engines, weights, manager, task=task, sink=sink, log=log, trainer=idle)
    return Coordinator(
        cfg, trainer, weights, manager, pool, agents, idle, controller=controller, sink=sink, log=log, on_bound=on_bound
    )


def _engine_source(trainer: StepTrainer) -> Any:
    """The policy the engines start as copies of, once the first version is published, labelled with a version it
    truly holds: an engine that holds the newest version loads nothing at start. After a resume the driver's own
    policy holds the start weights under the resumed version (world size > 1): the newest version's policy is
    copied instead. With LoRA the driver's policy (the base) unlabelled: every engine then loads the newest version,
    which carries the ranks' base (the first of a set of ranks does), and keeps that base for the adapters after."""
    if isinstance(trainer, Trainer) and trainer.lora is not None:
        base = copy.copy(trainer.policy)
        base.version = -1
        return base
    return trainer.latest_policy() if isinstance(trainer, PublishingTrainer) else trainer.policy


def publish_first_version(cfg: Config, trainer: StepTrainer) -> WeightSource:
    """The trainer's starting version, published where the engines read it: the real trainer's ranks start (from
    the warm-started or resumed weights; a resume has started them already) and publish it; a trainer without
    ``publish`` (the fakes) has its policy's state put into an in-memory store."""
    version = int(trainer.policy.version)
    if isinstance(trainer, Trainer):
        trainer.start()
        trainer.publish(version)
        return trainer.out
    store = ParameterStore(keep=cfg.psrl.staleness + 2)
    store.publish(version, trainer.policy.export_state())
    return store


async def train(cfg: Config, run_dir: str | Path, log: Callable[[str], None] = print, **parts: Any) -> list[dict]:
    """Run ``psrl train`` for ``cfg`` into ``run_dir``; returns the metrics rows of this invocation. ``parts``
    go to :func:`build` (a trainer or engines of the caller's, shared start ``weights``)."""
    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    recorder = RunRecorder(run_dir)
    recorder.write_config(cfg)
    events = EventLog(run_dir / "events.jsonl", clock=asyncio.get_running_loop().time)  # the timeline of `psrl viz`
    try:
        coord = build(cfg, recorder, log, on_event=events, on_bound=events.bound, **parts)
    except BaseException:
        events.close()
        raise
    total = cfg.trainer.total_steps
    watch = RunWatch(cfg, run_dir, coord, recorder, log, progress_line)
    saver = CheckpointSaver(background=cfg.trainer.checkpoint_in_background)
    on_step = _StepHook(coord, run_dir, recorder, events, total, cfg.trainer.checkpoint_every, watch, saver)
    p = cfg.psrl
    log(
        f"psrl train: staleness {p.staleness}, B={p.batch_size} (B'={p.redundant_batch_size}), N={p.group_size} "
        f"(N'={p.redundant_group_size}), {p.deployment.n_rollout_instances} instances x {p.routing_strategy.max_concurrent_seqs_per_instance} workers, "
        f"task {cfg.task.name}, {total} steps -> {run_dir}"
    )
    started = time.perf_counter()
    this = asyncio.current_task()
    assert this is not None, "a coroutine runs in a task"
    with _sigterm_cancels(this) as terminated:
        try:
            rows = await coord.run(total, on_step)
        except BaseException as exc:
            # between steps the state is consistent: make the run resumable from here (unless saving is what failed)
            try:
                if not coord.in_step and not isinstance(exc, CheckpointWriteError):
                    saver.save(run_dir, coord, recorder, wait=True)
            finally:
                saver.close()
                _close_ranks(coord)
            watch.close()
            events.close()
            recorder.close()
            if terminated() and isinstance(exc, asyncio.CancelledError):
                raise Terminated("SIGTERM") from None
            raise
    saver.close()
    trainer = coord.trainer
    final = trainer.latest_policy() if isinstance(trainer, PublishingTrainer) else trainer.policy
    if not isinstance(final, _SavesPretrained):
        raise TypeError(f"psrl train writes final/ with the policy's save_pretrained: {type(final).__name__} has none")
    final.save_pretrained(run_dir / "final")  # a Hugging Face directory: usable as model.path
    if isinstance(trainer, Trainer):
        trainer.save_adapter(run_dir / "final" / "adapter")  # LoRA: the peft adapter, on the base
    _close_ranks(coord)
    watch.close()
    events.close()
    recorder.close()
    if rows:
        w = min(10, len(rows))  # window means: a single step's reward of a batch of 32 wanders by +-0.2
        first = sum(r["reward/mean"] for r in rows[:w]) / w
        last = sum(r["reward/mean"] for r in rows[-w:]) / w
        log(
            f"done: {len(rows)} steps in {time.perf_counter() - started:.1f}s, "
            f"reward {first:.3f} -> {last:.3f} (mean of the first -> last {w} steps), "
            f"max staleness {max(r['staleness/max'] for r in rows)} (bound {p.staleness}); run dir {run_dir}"
        )
    return rows


def _close_ranks(coord: Coordinator) -> None:
    """Stop the trainer's rank processes (nothing at world size 1)."""
    if isinstance(coord.trainer, Trainer):
        coord.trainer.close()


class Terminated(KeyboardInterrupt):
    """``psrl train`` got SIGTERM (a scheduler pre-empting the job): handled like Ctrl-C."""


@contextlib.contextmanager
def _sigterm_cancels(task: asyncio.Task) -> Iterator[Callable[[], bool]]:
    """While inside, SIGTERM cancels ``task`` (the same path as Ctrl-C); yields "has SIGTERM arrived?"."""
    loop = asyncio.get_running_loop()
    fired = []

    def on_term() -> None:
        fired.append(True)
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_term)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        installed = False
    try:
        yield lambda: bool(fired)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGTERM)


def run(cfg: Config, run_dir: str | Path, log: Callable[[str], None] = print, **parts: Any) -> list[dict]:
    """Synchronous entry point: ``asyncio.run(train(...))``."""
    return asyncio.run(train(cfg, run_dir, log, **parts))
