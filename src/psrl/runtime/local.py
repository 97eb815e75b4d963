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
from psrl.runtime.engines import build_engines, object_versions, validation_engines
from psrl.runtime.judge_server import judge_server
from psrl.runtime.recorder import EVENTS_FILE, EventLog, RunRecorder, set_aside_previous_run
from psrl.runtime.validate import ValidationEngines
from psrl.runtime.watch import RunWatch
from psrl.staleness import Event, StalenessManager
from psrl.tasks.base import Task
from psrl.train import Trainer, build_task_and_policy, seed_everything, warm_start
from psrl.train.launch import Launcher, LocalRanks, RankFailure
from psrl.train.lora import lora_spec
from psrl.types import Engine, Sink, StepTrainer, WeightSource, WeightState
from psrl.weights import StreamedVersions, VersionDirectories, write_model_directory, write_streamed_directory

if TYPE_CHECKING:
    from psrl.config import Config

__all__ = ["build", "wire", "train", "progress_line", "publish_first_version", "driver_holds_weights", "write_final"]


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

    def save_pretrained(self, directory: str | Path) -> Path: ...


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
    made: Trainer | None = None  # the trainer built here: the warm start runs on it
    feed = object_versions(cfg)
    if task is None or trainer is None:
        built, policy = build_task_and_policy(cfg, lambda _task: weights is not None or driver_holds_weights(cfg))
        task = task if task is not None else built
        if trainer is None:
            trainer = made = _trainer(cfg, policy, recorder, feed)
    assert trainer is not None
    try:
        return _build(
            cfg, recorder, log, task, trainer, made, engines, weights, sink, manager, on_event, on_bound, feed
        )
    except BaseException:
        trainer.close()  # no rank outlives a run that could not be built
        raise


def driver_holds_weights(cfg: Config) -> bool:
    """Whether the driver's policy is built with weights (issue #33, item 5). It is not when nothing in the driver
    uses them: the trainer's ranks are other processes (world size > 1) and build the model themselves from
    ``model.*`` (and run the supervised warm start on their shards: :mod:`psrl.train.warm`), and there is no LoRA
    (the driver merges the adapters onto its base). The engines then hold the only weights here: vLLM servers and
    Ray actors read the published versions themselves, and ``hf`` engines of this process (rollout and validation)
    are built from the recipe (:meth:`~psrl.models.Policy.replica`) and load each version. The driver's policy
    holds the config, the tokenizer and the architecture on ``meta``; ``final/`` and the servers' start are the
    published versions' files."""
    single = cfg.psrl.deployment.train_world_size == 1
    lora = cfg.model.lora_rank > 0  # the driver merges the adapters onto its base (final/, hf engines)
    return single or lora


def in_memory_versions(cfg: Config) -> bool:
    """Whether versions go from trainer to engines in memory: world size 1 with ``hf`` engines in this process
    (the rank and the engines share it) and ``weights.transport=files``. Otherwise the ranks write
    ``RUN_DIR/weights/v{N}`` (:mod:`psrl.weights`), or send it (``weights.transport=collective``)."""
    local_hf = cfg.rollout.engine == "hf" and cfg.runtime.backend == "local"
    return cfg.psrl.deployment.train_world_size == 1 and local_hf and cfg.weights.transport == "files"


def _trainer(cfg: Config, policy: Policy, recorder: RunRecorder | None, feed: Any = None) -> Trainer:
    """The trainer over ``train_nnodes x train_ngpus_per_node`` ranks (started by :func:`build`): in this process at
    world size 1, else processes of this machine or, with ``runtime.backend=ray``, Ray actors; publishing where
    :func:`in_memory_versions` says."""
    world = cfg.psrl.deployment.train_world_size
    work = recorder.run_dir if recorder is not None else None
    launch: Launcher = LocalRanks
    if cfg.runtime.backend == "ray" and world > 1:  # rank actors in a placement group (runtime/ray_ranks.py)
        from psrl.runtime.ray_ranks import ray_launcher

        launch = ray_launcher(cfg.runtime.ray_address, cfg.runtime.ray_pool_label, feed)
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
        transport=cfg.weights.transport,
        lora=lora_spec(cfg.model),
    )


def _build(
    cfg: Config,
    recorder: RunRecorder | None,
    log: Callable[[str], None],
    task: Task,
    trainer: StepTrainer,
    made: Trainer | None,
    engines: Sequence[Engine | TokenModel] | None,
    weights: WeightState | None,
    sink: Sink | None,
    manager: StalenessManager | None,
    on_event: Callable[[Event], Any] | None,
    on_bound: Callable[[Move], Any] | None,
    feed: Any = None,
) -> Coordinator:
    """:func:`build` once the task and the trainer exist (``made``: the trainer if :func:`build` made it; ``feed``:
    the Ray engines' :func:`~psrl.runtime.engines.object_versions`)."""
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
    elif made is not None:  # a trainer given is used as it is
        warm_start(cfg, task, made, log)
    collective_vllm = cfg.weights.transport == "collective" and cfg.rollout.engine == "vllm"
    if collective_vllm and made is not None:
        made.sends_elsewhere()  # the first version as files: the servers start from it
    versions = publish_first_version(cfg, trainer)
    if engines is None:  # after the first version: a driver without weights starts its vLLM servers from it
        run_dir = recorder.run_dir if recorder is not None else None
        engines = build_engines(cfg, _engine_source(trainer, made), task, run_dir, versions, feed)
    if collective_vllm and made is not None:
        from psrl.rollout.engines.vllm import VLLMEngine
        from psrl.rollout.engines.vllm_receive import VLLMReceiver

        receivers = [VLLMReceiver(e, cfg.trainer.rank_timeout_s) for e in engines if isinstance(e, VLLMEngine)]
        versions = made.send_to(receivers)  # the first version stays files: the servers started from it
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


def _engine_source(trainer: StepTrainer, made: Trainer | None) -> Any:
    """The policy the engines start as copies of, once the first version is published, labelled with a version it
    truly holds: an engine that holds the newest version loads nothing at start. The driver's policy is the trained
    one at world size 1 (full fine-tuning); otherwise (ranks elsewhere: after a resume the driver's policy holds
    the start weights under the resumed version; a weightless driver's replicas are built from the recipe, which
    the ranks' warm start has moved away from; LoRA: the driver's policy is the base) an unlabelled copy, so every
    engine loads the newest version at start (with LoRA it carries the ranks' base: the first of a set of ranks
    does, and the engine keeps that base for the adapters after)."""
    if made is None or (made.world_size == 1 and made.lora is None):
        return trainer.policy
    base = copy.copy(trainer.policy)
    base.version = -1
    return base


def publish_first_version(cfg: Config, trainer: StepTrainer) -> WeightSource:
    """The trainer's starting version, published where the engines read it: the trainer starts (the ranks, from the
    warm-started or resumed weights; a resume has started them already) and publishes it into its ``out``."""
    trainer.start()
    trainer.publish(int(trainer.policy.version))
    return trainer.out


async def train(cfg: Config, run_dir: str | Path, log: Callable[[str], None] = print, **parts: Any) -> list[dict]:
    """Run ``psrl train`` for ``cfg`` into ``run_dir``; returns the metrics rows of this invocation. ``parts``
    go to :func:`build` (a trainer or engines of the caller's, shared start ``weights``)."""
    async with judge_server(cfg, Path(run_dir), log):  # task.judge.path: a judge psrl serves, for the whole run
        return await _train(cfg, Path(run_dir), log, **parts)


async def _train(cfg: Config, run_dir: Path, log: Callable[[str], None], **parts: Any) -> list[dict]:
    torch.set_num_threads(1)
    if not cfg.trainer.resume and (aside := set_aside_previous_run(run_dir)) is not None:
        log(f"trainer.resume=false: starting over in {run_dir}; the earlier run's logs and checkpoints -> {aside}")
    recorder = RunRecorder(run_dir)
    recorder.write_config(cfg)
    events = EventLog(run_dir / EVENTS_FILE, clock=asyncio.get_running_loop().time)  # the timeline of `psrl viz`
    try:
        coord = build(cfg, recorder, log, on_event=events, on_bound=events.bound, **parts)
    except BaseException:
        events.close()
        raise
    total = cfg.trainer.total_steps
    try:
        validator = _validator(cfg, coord, run_dir)
    except BaseException:
        _close_ranks(coord)
        events.close()
        raise
    watch = RunWatch(cfg, run_dir, coord, recorder, log, progress_line, validator=validator)
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
            # between steps the state is consistent: make the run resumable from here (unless saving is what failed,
            # or a rank: the ranks hold the trained weights, and ranks started again would hold the start's)
            try:
                if not coord.in_step and not isinstance(exc, (CheckpointWriteError, RankFailure)):
                    saver.save(run_dir, coord, recorder, wait=True)
            finally:
                saver.close()
                _close_ranks(coord)
            watch.close()
            _close(validator)
            events.close()
            recorder.close()
            with contextlib.suppress(Exception):
                await coord.agents.task.close()
            if terminated() and isinstance(exc, asyncio.CancelledError):
                raise Terminated("SIGTERM") from None
            raise
    saver.close()
    write_final(coord, run_dir / "final", coord.trainer if isinstance(coord.trainer, Trainer) else None)
    _close_ranks(coord)
    watch.close()
    _close(validator)
    events.close()
    recorder.close()
    await coord.agents.task.close()  # on this loop: a later run in the process (benchmarks) gets no stale pool
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


def write_final(coord: Coordinator, out: Path, made: Trainer | None = None) -> Path:
    """``final/``: the newest version as a Hugging Face directory (``AutoModelForCausalLM.from_pretrained``, or
    ``model.path``). Where versions are directories, made from the version's files
    (:func:`psrl.weights.write_model_directory`: nothing is loaded into the driver); in memory (world size 1, ``hf``
    engines), the trained policy's own ``save_pretrained``. With LoRA (versions are adapters): the base with the
    newest adapter merged, and ``final/adapter/`` the peft adapter."""
    store, policy = coord.store, coord.trainer.policy
    newest = store.latest_version()
    if made is not None and made.lora is not None:
        made.latest_policy().save_pretrained(out)
        made.save_adapter(out / "adapter")
        return out
    model, tokenizer = getattr(policy, "model", None), getattr(policy, "tokenizer", None)
    if isinstance(store, VersionDirectories) and newest is not None:
        return write_model_directory(store.directory(newest), out, model, tokenizer)
    if isinstance(store, StreamedVersions) and newest is not None:  # the driver's collective receiver
        return write_streamed_directory(store, newest, out, model, tokenizer)
    if not isinstance(policy, _SavesPretrained):
        raise TypeError(f"psrl train writes final/ with the policy's save_pretrained: {type(policy).__name__} has none")
    return Path(policy.save_pretrained(out))


def _validator(cfg: Config, coord: Coordinator, run_dir: Path) -> ValidationEngines | None:
    """The validation instances (``trainer.val_every > 0``): engines of their own over the published versions."""
    if cfg.trainer.val_every <= 0:
        return None
    make = validation_engines(cfg, coord.trainer.policy, coord.agents.task, run_dir, coord.store)
    return ValidationEngines(make, coord.store)


def _close(validator: ValidationEngines | None) -> None:
    if validator is not None:
        validator.close()


def _close_ranks(coord: Coordinator) -> None:
    """Stop the trainer's rank processes (nothing at world size 1)."""
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
