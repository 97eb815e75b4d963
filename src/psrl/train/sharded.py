"""The driver's side of the sharded trainer (issue #22): :class:`ShardedTrainer` has the interface of
:class:`~psrl.train.Trainer` (``step``, ``publish``, ``save``/``load``, ``warm_start``, ``last_skip``...) and drives
``psrl.deployment.train_ngpus_per_node`` rank processes (:class:`~psrl.train.launch.LocalRanks`) that hold the
FSDP2-sharded model and AdamW.

Per step, in the coordinator's training thread (the event loop keeps serving the rollout side):

1. advantages, then the planner's :func:`~psrl.train.planner.plan` (tokens balanced over the ranks, micro-batches
   under ``trainer.micro_batch_tokens``);
2. ``logprobs`` on every rank: the pre-update log-probs, merged here, so the batch-global statistics (the mismatch
   metric, ``divergence/*``, the rollout corrections' keep mask and learning-rate scale) see the whole batch;
3. ``train_step`` with the global loss weights (:func:`~psrl.train.worker.step_input`);
4. ``publish``: the ranks write ``weights/v{N}`` (:mod:`psrl.train.publish`); the driver reads it back into its
   ``policy`` -- a full copy the rollout engines are replicas of, validation and ``final/`` read, and a checkpoint's
   ``trainer.pt`` holds -- and into the in-memory store the ``hf`` engines load from.

Checkpoints: ``trainer.pt`` (weights, version, generator states, skip counters, ``world_size``) beside ``ranks/``
(model and AdamW with ``torch.distributed.checkpoint``). The ranks write their files between two steps, always
(a collective); with ``trainer.checkpoint_in_background`` (:meth:`state_dict`) the rest -- the driver's
``trainer.pt`` and moving the ranks' files into the checkpoint -- is the writer thread's, while training goes on.

The ranks start once the driver's policy holds its starting weights (after the warm start or a resume), from a
file rank 0 alone reads (:class:`~psrl.models.builder.StateFileModel`).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from psrl.algo.corrections import batch_corrections, rollout_correction_from_config
from psrl.algo.divergence import divergence_metrics
from psrl.config import AlgorithmConfig, TrainerConfig
from psrl.errors import ConfigError
from psrl.models import Policy
from psrl.models.builder import write_start_state
from psrl.train.launch import Launcher, LocalRanks, RankFailure, Ranks
from psrl.train.planner import plan
from psrl.train.publish import read_version
from psrl.train.shard import master_dtype
from psrl.train.trainer import (
    Trainer,
    _mean_metrics,
    _pad,
    batch_advantages,
    logprob_mismatch,
    rng_state,
    set_rng_state,
)
from psrl.train.worker import RankWorker, StepInput, WorkerSpec, step_input
from psrl.types import WeightState, WeightStore

__all__ = ["ShardedTrainer"]

_STAGED = "ranks_staged"
"""The key of :meth:`ShardedTrainer.state_dict` naming the ranks' files written for a background checkpoint."""


class ShardedTrainer:
    """``world_size`` trainer ranks on this machine, driven from the coordinator.

    Args:
        policy: the driver's full copy of the policy (starting weights; the engines are built from it).
        algo_cfg, trainer_cfg: ``algorithm.*`` and ``trainer.*``.
        world_size: ranks (``psrl.deployment.train_nnodes x train_ngpus_per_node``), at least 2.
        work_dir: where the published versions (``weights/``), the start weights and the ranks' logs go
            (the run directory; a temporary directory when None).
        dtype: ``model.dtype`` of the ranks' models.
        keep: versions kept under ``weights/`` (``psrl.staleness + 2``, as the in-memory store keeps).
        launcher: starts the ranks: :class:`~psrl.train.launch.LocalRanks` (processes on this machine) or, with
            ``runtime.backend=ray``, :class:`psrl.runtime.ray_ranks.RayRanks` (actors in a placement group).
    """

    def __init__(
        self,
        policy: Policy,
        algo_cfg: AlgorithmConfig,
        trainer_cfg: TrainerConfig,
        world_size: int,
        work_dir: str | Path | None = None,
        dtype: str = "float32",
        keep: int = 2,
        launcher: Launcher = LocalRanks,
    ):
        if world_size < 2:
            raise ValueError(f"ShardedTrainer needs world_size >= 2 (1 is psrl.train.Trainer), got {world_size}")
        device = str(policy.device)
        if launcher is LocalRanks and device.startswith("cuda") and torch.cuda.device_count() < world_size:
            raise ConfigError(
                "psrl.deployment.train_ngpus_per_node",
                f"is {world_size}, but this machine has {torch.cuda.device_count()} GPUs for model.device=cuda",
                "set it to the GPUs of this machine, or model.device=cpu",
            )
        self.policy = policy
        self.algo_cfg, self.cfg = algo_cfg, trainer_cfg
        self.world_size, self.dtype, self.keep = world_size, dtype, max(int(keep), 1)
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="psrl-sharded-"))
        self.weights_dir = self.work_dir / "weights"
        self.rng = random.Random(trainer_cfg.seed)
        torch.manual_seed(trainer_cfg.seed)
        self.launcher = launcher
        self.ranks: Ranks | None = None
        self.last_skip: str | None = None
        self.skipped_steps = 0
        self.skipped_in_a_row = 0
        self._published: tuple[int, WeightState, float] | None = None

    @property
    def version(self) -> int:
        return self.policy.version

    # ------------------------------------------------------------------ ranks

    def start(self) -> Ranks:
        """Start the ranks from the driver's policy weights (once; again after :meth:`close` or a failed load)."""
        if self.ranks is None:
            self.ranks = self.launcher(self._spec(), self.world_size, self.cfg.rank_timeout_s, self.work_dir / "ranks")
        return self.ranks

    def _spec(self) -> WorkerSpec:
        """What each rank builds itself from; writes the policy's weights to ``weights/start.pt`` for rank 0 (in
        fp32 on GPUs with a 16-bit ``model.dtype``: the master weights of the mixed-precision policy)."""
        master = master_dtype(str(self.policy.device), self.dtype)
        return WorkerSpec(
            build=write_start_state(self.policy.model, self.work_dir / "weights" / "start.pt", master),
            pad_id=self.policy.pad_id,
            algo=self.algo_cfg,
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            grad_clip=self.cfg.grad_clip,
            temperature=self.cfg.temperature,
            seed=self.cfg.seed,
            device=str(self.policy.device),
            dtype=self.dtype,
            reshard_after_forward=self.cfg.reshard_after_forward,
            collective_timeout_s=self.cfg.rank_timeout_s,
            heartbeat_s=self.cfg.rank_heartbeat_s,
        )

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close()

    def _call(self, cmd: str, arg: Any = None) -> list[Any]:
        """Every rank's reply; a rank failure has stopped every rank, so forget them (a later call restarts)."""
        ranks = self.start()
        try:
            return ranks.call(cmd, arg)
        except RankFailure:
            self.ranks = None
            raise

    # ------------------------------------------------------------------ RL step

    def step(self, batch: Any) -> dict[str, float]:
        """One training step on ``batch`` across the ranks, then the ranks publish ``batch.version + 1``
        (:meth:`publish` hands it to the store). The metrics are :class:`~psrl.train.Trainer`'s: mismatch,
        divergence and corrections over the whole batch; loss and gradient norm as the ranks report them."""
        trajs, adv = batch_advantages(batch, self.algo_cfg, "ShardedTrainer.step")
        prompts = [list(t.prompt_ids) for t in trajs]
        responses = [list(t.response_ids) for t in trajs]
        lengths = [len(a) + len(b) for a, b in zip(prompts, responses)]
        p = plan(lengths, self.world_size, self.cfg.minibatches, self.cfg.micro_batch_tokens)
        old_rows: dict[int, list[float]] = {}
        for part in self._call("logprobs", StepInput(p, prompts, responses)):
            old_rows.update(part)
        old = _pad([old_rows[i] for i in range(len(trajs))], "cpu")
        behav = _pad([t.logprobs for t in trajs], "cpu")
        mask = _pad([t.loss_mask for t in trajs], "cpu")
        mismatch = logprob_mismatch(old, behav, mask, _pad([t.token_versions for t in trajs], "cpu"), self.version)
        w = old.shape[1]
        behav_w, mask_w = behav[:, :w], mask[:, :w]
        lag = torch.tensor([int(batch.version) - int(t.v_traj) for t in trajs])
        divergence = divergence_metrics(old, behav_w, mask_w, lag)
        keep, lr_scale, corrections = batch_corrections(old, behav_w, mask_w, self.algo_cfg.rollout_correction)
        if keep is not None:  # M2PO: masked tokens leave the loss like padding
            mask_w = mask_w * keep
        masks = [mask_w[i, : len(responses[i])].tolist() for i in range(len(trajs))]
        behav_rows = [list(t.logprobs[: len(t.response_ids)]) for t in trajs]
        inp = step_input(p, prompts, responses, old_rows, behav_rows, adv, masks, self.algo_cfg, lr_scale)
        m = self._call("train_step", inp)[0]
        skipped = int(m.pop("skipped_minibatch", 0))
        self._publish_ranks(int(batch.version) + 1)
        if skipped:  # the ranks undid the minibatches before it: no update of the batch is kept
            where = f" (minibatch {skipped}/{len(p.minibatches)})" if len(p.minibatches) > 1 else ""
            self.last_skip = f"loss or gradient norm is not finite{where}"
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            return {**divergence, "train/skipped_steps": self.skipped_steps}
        self.last_skip = None
        self.skipped_in_a_row = 0
        per_mb = [
            self._correction_metrics(p.rows(k), old, behav_w, mask_w, responses) for k in range(len(p.minibatches))
        ]
        return {
            **_mean_metrics(per_mb),
            **m,
            "loss/policy": m["train/loss"],
            **mismatch,
            **divergence,
            **corrections,
            "train/adv_abs_mean": sum(abs(a) for a in adv) / len(adv),
            "train/skipped_steps": self.skipped_steps,
        }

    def _correction_metrics(
        self, rows: list[int], old: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, responses: list[list[int]]
    ) -> dict[str, float]:
        """``correction/*`` of one minibatch, as :func:`~psrl.algo.losses.policy_loss` reports them in the
        in-process trainer (over the minibatch's rows, cut to its longest response)."""
        idx = torch.tensor(rows)
        width = max(len(responses[i]) for i in rows)
        rc = self.algo_cfg.rollout_correction
        return rollout_correction_from_config(old[idx, :width], behav[idx, :width], mask[idx, :width], rc)[2]

    def _publish_ranks(self, version: int) -> None:
        """The ranks write ``weights/v{version}``; the driver reads it back (checksums verified)."""
        started = time.perf_counter()
        self._call("publish", (version, str(self.weights_dir), self.keep))
        got, state = read_version(self.weights_dir / f"v{version}")
        self._published = (got, state, time.perf_counter() - started)

    def publish(self, version: int, store: WeightStore) -> float:
        """The version the ranks wrote in the last :meth:`step` becomes the policy's and goes into ``store``;
        returns the seconds of the whole publication (the ranks' write included)."""
        started = time.perf_counter()
        if self._published is None or self._published[0] != version:
            self._publish_ranks(version)
        assert self._published is not None
        _, state, ranks_s = self._published
        self._published = None
        self.policy.load_weights(state, version)
        store.publish(version, state)
        return ranks_s + time.perf_counter() - started

    # ------------------------------------------------------------------ warm start

    def warm_start(self, demos: list, steps: int, batch_size: int = 32, lr: float | None = None) -> list[float]:
        """The supervised warm start, in the driver on its policy, before the ranks start from its weights."""
        if self.ranks is not None:
            raise RuntimeError("ShardedTrainer.warm_start: the ranks have started already; warm-start before")
        single = Trainer(self.policy, self.algo_cfg, self.cfg)
        single.rng = self.rng
        return single.warm_start(demos, steps, batch_size, lr)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, copied: bool = True) -> dict:
        """A checkpoint taken now, for :class:`~psrl.runtime.checkpoint.CheckpointSaver`'s writer thread
        (``trainer.checkpoint_in_background``): the ranks write their DCP files now -- the collective runs here,
        between two steps, never in the writer thread -- into ``checkpoint.ranks.tmp`` beside the run's
        checkpoints; the driver's state and weights are copied. :meth:`save` later moves the files into place and
        writes ``trainer.pt``. ``copied`` is accepted for the saver's signature (the state is always a copy)."""
        staged = self.work_dir / "checkpoint.ranks.tmp"
        shutil.rmtree(staged, ignore_errors=True)
        self._call("save", (str(staged), self.cfg.save_optimizer))
        return {**self._driver_state(), _STAGED: str(staged)}

    def _driver_state(self) -> dict:
        return {
            "model": self.policy.export_state(),
            "version": self.policy.version,
            **rng_state(self.rng, self.policy.generator),
            "skipped": (self.skipped_steps, self.skipped_in_a_row),
            "world_size": self.world_size,
        }

    def save(self, directory: str | Path, state: dict | None = None) -> Path:
        """``directory/ranks`` (the ranks' model and AdamW, DCP) and ``directory/trainer.pt`` (the driver's state
        and weights): written now, or, for a ``state`` from :meth:`state_dict`, the ranks' staged files moved into
        place (a rename: no collective; what a writer thread runs)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        if state is None:
            self._call("save", (str(path / "ranks"), self.cfg.save_optimizer))
            driver = self._driver_state()
        else:
            driver = {k: v for k, v in state.items() if k != _STAGED}
            shutil.rmtree(path / "ranks", ignore_errors=True)
            shutil.move(state[_STAGED], path / "ranks")
        torch.save(driver, path / "trainer.pt")
        return path / "trainer.pt"

    def load(self, directory: str | Path) -> int:
        """Restore what :meth:`save` wrote (the ranks start if they have not); returns the restored version."""
        path = Path(directory)
        ckpt = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        self.policy.load_weights(ckpt["model"], ckpt["version"])
        sharded = path / "ranks"
        if not sharded.is_dir():  # the in-process trainer's checkpoint: resumed at N ranks through DCP files
            sharded = self._from_one_rank(ckpt)
        self.skipped_steps, self.skipped_in_a_row = ckpt.get("skipped", (0, 0))
        set_rng_state(ckpt, self.rng, self.policy.generator)
        self.close()  # the ranks start from the restored weights, then read the sharded state
        self._call("load", str(sharded))
        return self.policy.version

    def _from_one_rank(self, ckpt: dict) -> Path:
        """The in-process trainer's weights (already in the policy) and AdamW state, written by a world-size-1
        :class:`~psrl.train.worker.RankWorker` as the DCP files the ranks load (resharded by DCP)."""
        worker = RankWorker(self._spec(), 0, 1)
        if "optimizer" in ckpt:
            worker.optimizer.load_state_dict(ckpt["optimizer"])
        out = self.work_dir / "weights" / "from-one-rank"
        shutil.rmtree(out, ignore_errors=True)
        worker.save(str(out))
        return out
