"""The trainer: one path at every world size (docs/trainer.md). The driver's :class:`Trainer` plans each step and
computes the batch-global statistics; the rank workers (:class:`~psrl.train.worker.RankWorker`) hold the model and
AdamW and run the forwards, backwards and optimiser steps -- in the driver's own process at world size 1
(:class:`~psrl.train.launch.InProcess`, over the policy's own model), in rank processes
(:class:`~psrl.train.launch.LocalRanks`) or Ray actors (:class:`psrl.runtime.ray_ranks.RayRanks`), FSDP2-sharded.
Per step, in the coordinator's training thread: advantages and the planner's :func:`~psrl.train.planner.plan`;
``logprobs`` on every rank, merged here for the batch-global statistics (mismatch, ``divergence/*``, the rollout
corrections); ``train_step`` with the global loss weights. A NaN or infinite loss or gradient norm skips the step
(``last_skip`` says why). :meth:`Trainer.publish` then makes the new version the engines' (:mod:`psrl.weights`):
files the ranks write from their shards, tensors handed over in memory (world size 1, ``hf`` engines here), or the
collective transport (:mod:`psrl.train.transfer`); with LoRA the adapter alone (:mod:`psrl.train.lora`).
Checkpoints, one format at every world size: ``ranks/`` (DCP, loadable at any world size) beside ``trainer.pt``
(the driver's state, no weights); the earlier world-size-1 layout is converted on load.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from psrl.algo.corrections import batch_corrections, rollout_correction_from_config
from psrl.algo.divergence import divergence_metrics
from psrl.config import AlgorithmConfig, TrainerConfig
from psrl.errors import ConfigError
from psrl.heap import release_freed
from psrl.lifeline import own_directory
from psrl.models import Policy
from psrl.models.builder import DTYPES, write_start_state
from psrl.train.launch import InProcess, Launcher, LocalRanks, RankFailure, Ranks
from psrl.train.lora import LoraSpec
from psrl.train.planner import plan
from psrl.train.shard import master_dtype
from psrl.train.steps import (
    _Same,
    batch_advantages,
    logprob_mismatch,
    mean_metrics,
    pad_rows,
    rng_state,
    set_rng_state,
    warm_start_chunks,
    warm_start_policy,
)
from psrl.train.transfer import CollectivePublisher
from psrl.train.warm import Demos
from psrl.train.worker import RankWorker, StepInput, WorkerSpec, step_input
from psrl.weights import FileVersions, ParameterStore, read_manifest, state_bytes
from psrl.weights.adapter import MergedAdapter, adapter_meta, peft_files
from psrl.weights.receivers import CollectiveVersions, Receiver, SentVersions

__all__ = ["Trainer"]

_STAGED = "ranks_staged"
"""The key of :meth:`Trainer.state_dict` naming the ranks' files written for a background checkpoint."""

Published = ParameterStore | FileVersions | CollectiveVersions | SentVersions
"""Where :meth:`Trainer.publish` puts a version: memory (world size 1, ``hf`` engines here), directories, this
process's collective receiver (``hf`` engines here), or manifests of versions sent to vLLM (:meth:`Trainer.send_to`)."""


class Trainer:
    """The trainer of a run, driven from the coordinator, at any world size.

    Args:
        policy: the driver's policy (starting weights, tokenizer; at world size 1 the trained model itself).
        algo_cfg, trainer_cfg: ``algorithm.*`` and ``trainer.*``.
        world_size: ranks (``psrl.deployment.train_nnodes x train_ngpus_per_node``).
        work_dir: the run directory: published versions (``weights/``), the start weights and the ranks' logs
            (when None, a temporary directory removed with the trainer).
        dtype: ``model.dtype`` (published in it; the ranks keep fp32 masters under mixed precision, and so does
            the in-process rank at world size 1 for a 16-bit policy model).
        in_memory: publish into a :class:`~psrl.weights.ParameterStore` (world size 1 with ``hf`` engines in this
            process; the default at world size 1), else as files under ``work_dir/weights``.
        keep: versions kept on disk (engines may lag by ``psrl.staleness``).
        bucket_mb: ``weights.bucket_mb``: the most a rank gathers at once to publish.
        transport: ``weights.transport``: ``files`` (or memory, per ``in_memory``), or ``collective``: the ranks
            send each version over a transfer group to this process's receiver (:mod:`psrl.weights.collective`),
            which holds it for the ``hf`` engines here.
        launcher: starts ranks at world size > 1: :class:`~psrl.train.launch.LocalRanks` (processes here) or,
            with ``runtime.backend=ray``, :class:`psrl.runtime.ray_ranks.RayRanks`.
        lora: ``model.lora_rank > 0`` (:func:`psrl.train.lora.lora_spec`): the ranks train and publish an adapter;
            :meth:`latest_policy` is then the base with the newest adapter merged (:meth:`_lora_policy`).
    """

    def __init__(
        self,
        policy: Policy,
        algo_cfg: AlgorithmConfig,
        trainer_cfg: TrainerConfig,
        world_size: int = 1,
        work_dir: str | Path | None = None,
        dtype: str = "float32",
        in_memory: bool | None = None,
        keep: int = 2,
        bucket_mb: float = 256,
        launcher: Launcher = LocalRanks,
        transport: str = "files",
        lora: LoraSpec | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"Trainer needs world_size >= 1, got {world_size}")
        device = str(policy.device)
        if world_size > 1 and launcher is LocalRanks and device.startswith("cuda"):
            if torch.cuda.device_count() < world_size:
                raise ConfigError(
                    "psrl.deployment.train_ngpus_per_node",
                    f"is {world_size}, but this machine has {torch.cuda.device_count()} GPUs for model.device=cuda",
                    "set it to the GPUs of this machine, or model.device=cpu",
                )
        self.policy = policy
        self.algo_cfg, self.cfg = algo_cfg, trainer_cfg
        self.world_size, self.dtype, self.keep, self.bucket_mb = world_size, dtype, max(int(keep), 1), bucket_mb
        self.work_dir = Path(work_dir) if work_dir is not None else own_directory(self, "psrl-trainer-")
        in_memory = world_size == 1 if in_memory is None else in_memory
        if in_memory and world_size > 1:
            raise ValueError("versions in memory are handed over in this process: world size 1 only")
        self.out: Published = ParameterStore() if in_memory else FileVersions(self.work_dir / "weights")
        self._collective: CollectivePublisher | None = None
        if transport == "collective":
            self.out = CollectiveVersions(self.work_dir / "received")
            self._collective = CollectivePublisher(
                self.out, [self.out], world_size, trainer_cfg.rank_timeout_s, bucket_mb
            )
        elif transport != "files":
            raise ValueError(f"weights.transport is files or collective, got {transport!r}")
        """Where :meth:`publish` puts each version; the run builder gives it to the engines."""
        self.rng = random.Random(trainer_cfg.seed)
        torch.manual_seed(trainer_cfg.seed)
        self.launcher = launcher
        self.ranks: Ranks | None = None
        self.last_skip: str | None = None
        self.skipped_steps = self.skipped_in_a_row = 0
        self._loaded = policy.version
        """The version whose weights the driver's policy holds (at world size 1: always the trained one)."""
        self.lora = lora
        self._merged: tuple[MergedAdapter, Policy] | None = None  # LoRA: the merged policy, by version
        self._merged_version: int | None = None

    @property
    def version(self) -> int:
        return self.policy.version

    def start(self) -> Ranks:
        """Start the ranks from the driver's policy weights (once; again after :meth:`close` or a failed load)."""
        if self.ranks is None:
            if self.world_size == 1:
                with torch.random.fork_rng(devices=[]):  # the rank seeds torch: the driver's generators stay
                    self.ranks = InProcess(self._spec(in_process=True))
            else:
                spec = self._spec(in_process=False)
                self.ranks = self.launcher(spec, self.world_size, self.cfg.rank_timeout_s, self.work_dir / "ranks")
        return self.ranks

    def _spec(self, in_process: bool) -> WorkerSpec:
        """What each rank builds itself from (in fp32 on GPUs with a 16-bit ``model.dtype``: the master weights of
        mixed precision): in process, the policy's own model; from ``model.*`` (the policy's recipe: rank 0 builds
        the weights, bit for bit those a driver's policy would hold) when the driver's policy is weightless; else
        ``weights/start.pt``, the driver's weights (warm-started or given), which rank 0 reads."""
        model = self.policy.model
        master = master_dtype(str(self.policy.device), self.dtype)
        if in_process:
            if self.policy.weightless:
                raise ValueError(
                    "Trainer: world size 1 trains the driver's own policy, which was built without weights"
                )
            build: Any = _Same(model)
        elif self.policy.weightless:
            if self.policy.recipe is None:
                raise ValueError("Trainer: a weightless policy needs the recipe its ranks build from (build_policy)")
            build = dataclasses.replace(self.policy.recipe, dtype=master)
        else:
            build = write_start_state(model, self.work_dir / "weights" / "start.pt", master)
        return WorkerSpec(
            build=build,
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
            lora=self.lora,
        )

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        if self._collective is not None:
            self._collective.leave(self.ranks.call if self.ranks is not None else None)
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
        """One training step on ``batch`` across the ranks. Metrics: mismatch, divergence and corrections over the
        whole batch; loss, gradient norm and ``actor/*`` as the ranks report them."""
        trajs, adv = batch_advantages(batch, self.algo_cfg, "Trainer.step")
        prompts = [list(t.prompt_ids) for t in trajs]
        responses = [list(t.response_ids) for t in trajs]
        lengths = [len(a) + len(b) for a, b in zip(prompts, responses)]
        p = plan(lengths, self.world_size, self.cfg.minibatches, self.cfg.micro_batch_tokens)
        old_rows: dict[int, list[float]] = {}
        for part in self._call("logprobs", StepInput(p, prompts, responses)):
            old_rows.update(part)
        old = pad_rows([old_rows[i] for i in range(len(trajs))])
        behav = pad_rows([t.logprobs for t in trajs])
        mask = pad_rows([t.loss_mask for t in trajs])
        mismatch = logprob_mismatch(old, behav, mask, pad_rows([t.token_versions for t in trajs]), self.version)
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
        if self.world_size > 1:  # each rank gave back what its step freed (psrl/heap.py); the driver does too
            release_freed()
        skipped, why = int(m.pop("skipped_minibatch", 0)), str(m.pop("skip_reason", ""))
        if skipped:  # the ranks undid the minibatches before it: no update of the batch is kept
            where = f" (minibatch {skipped}/{len(p.minibatches)})" if len(p.minibatches) > 1 else ""
            self.last_skip = f"{why or 'loss or gradient norm is not finite'}{where}"
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            return {**divergence, "train/skipped_steps": self.skipped_steps}
        self.last_skip = None
        self.skipped_in_a_row = 0
        per_mb = [
            self._correction_metrics(p.rows(k), old, behav_w, mask_w, responses) for k in range(len(p.minibatches))
        ]
        return {
            **mean_metrics(per_mb),
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
        """``correction/*`` of one minibatch (over the minibatch's rows, cut to its longest response)."""
        idx = torch.tensor(rows)
        width = max(len(responses[i]) for i in rows)
        rc = self.algo_cfg.rollout_correction
        return rollout_correction_from_config(old[idx, :width], behav[idx, :width], mask[idx, :width], rc)[2]

    # ------------------------------------------------------------------ warm start

    def warm_start(self, demos: list, steps: int, batch_size: int = 32, lr: float | None = None) -> list[float]:
        """The supervised warm start: on the driver's policy before the ranks start, or on the ranks' shards where the
        driver holds no weights (:mod:`psrl.train.warm`). With LoRA it trains every weight (the versions say so)."""
        if self.policy.weightless and self.lora is None:
            chunks = warm_start_chunks(self.rng, len(demos), steps, batch_size) if demos else []
            rate = self.cfg.warm_start_lr if lr is None else lr
            return self._call("warm_start", (Demos.of(demos), chunks, rate))[0] if chunks else []
        if self.ranks is not None or self.policy.weightless:
            raise RuntimeError("Trainer.warm_start: the ranks have started, or the driver's policy holds no weights")
        if self.lora is not None and steps > 0:
            self.lora = dataclasses.replace(self.lora, base=f"{self.lora.base} after a {steps}-step warm start")
        return warm_start_policy(self.policy, self.cfg, self.rng, demos, steps, batch_size, lr)

    # ------------------------------------------------------------------ publication

    def publish(self, version: int) -> dict[str, float]:
        """Make ``version`` the newest published one (the weights as they are now): the ranks write it from their
        shards, or the in-process rank hands its tensors to the in-memory store. Returns ``time/publish_s`` and
        ``weights/bytes`` (what the version moved)."""
        started = time.perf_counter()
        dtype = DTYPES[self.dtype]
        first = isinstance(self.out, SentVersions) and self.out.latest_version() is None
        if self._collective is not None and not first:
            nbytes = self._collective.publish(self._call, int(version), dtype)
        elif isinstance(self.out, ParameterStore):
            state = self._call("export", (self.bucket_mb, dtype))[0]
            self.out.publish(int(version), state)
            nbytes = state_bytes(state)  # a tied tensor once
        else:
            assert isinstance(self.out, FileVersions | SentVersions)  # SentVersions: the first version, as files
            root = str(self.out.root)
            nbytes = self._call("publish", (int(version), root, self.keep, self.bucket_mb, dtype))[0]["bytes"]
            if isinstance(self.out, SentVersions):
                self.out.commit_files(int(version))
        self.policy.version = int(version)
        if self.lora is not None and isinstance(self.out, FileVersions):
            if read_manifest(self.out.directory(int(version))).get("base_included"):  # the ranks' base: take it now
                self._lora_policy(int(version))  # (a later adapter-only version is merged when asked for)
        elif self.world_size == 1:
            self._loaded = int(version)  # the policy's model is the trained one
        return {"time/publish_s": round(time.perf_counter() - started, 6), "weights/bytes": float(nbytes)}

    def sends_elsewhere(self) -> SentVersions:
        """``weights.transport=collective`` into engines of other processes (vLLM servers): the driver keeps the
        versions' manifests only (:class:`~psrl.weights.SentVersions`). Until :meth:`send_to` names the receivers
        (once their servers run, started from it) a version is published as files."""
        if self._collective is None:
            raise ValueError("Trainer.sends_elsewhere: weights.transport is not collective")
        if not isinstance(self.out, SentVersions):
            self.out = SentVersions(self.work_dir / "weights", keep=self.keep)
            self.out.write_files = self._write_files
        return self.out

    def send_to(self, receivers: Sequence[Receiver]) -> SentVersions:
        """``weights.transport=collective`` into engines of other processes (vLLM servers): the ranks send every
        version from now on to ``receivers`` (the first, published before the servers run, is files:
        :meth:`sends_elsewhere`); the engines read the returned store (:attr:`out`). Called by the run builder once
        the engines exist."""
        out = self.sends_elsewhere()
        self._collective = CollectivePublisher(out, receivers, self.world_size, self.cfg.rank_timeout_s, self.bucket_mb)
        return out

    def _write_files(self, version: int) -> None:
        """Write sent ``version`` as files (``final/`` and vLLM validation servers read directories): the ranks
        write it from their shards, so they must hold it still -- the newest version, between steps."""
        if int(version) != self.policy.version:
            raise KeyError(f"version {version} was sent and the ranks hold {self.policy.version}: no files of it")
        out = self.out
        assert isinstance(out, SentVersions)
        self._call("publish", (int(version), str(out.root), self.keep, self.bucket_mb, DTYPES[self.dtype]))
        out.commit_files(int(version))

    def latest_policy(self) -> Policy:
        """The driver's policy holding the newest published weights (once per version), for tests and benchmarks;
        a run validates on engines (with LoRA: the base with the newest adapter merged, :meth:`_lora_policy`)."""
        if self.lora is not None:
            return self._lora_policy(self.policy.version)
        if self.policy.weightless:
            raise RuntimeError("Trainer.latest_policy: the driver's policy was built without weights")
        if self._loaded != self.policy.version and isinstance(self.out, SentVersions):  # no copy here: the ranks'
            state = {k: torch.from_numpy(v) for k, v in self._call("state")[0].items()}
            self.policy.load_weights(state, self.policy.version)
            self._loaded = self.policy.version
        elif self._loaded != self.policy.version and not isinstance(self.out, ParameterStore):
            version, state = self.out.get(self.policy.version)
            self.policy.load_weights(state, version)
            self._loaded = version
        return self.policy

    def _lora_policy(self, version: int) -> Policy:
        """LoRA: a plain policy holding the base with ``version``'s adapter merged (:class:`MergedAdapter`), a copy of
        the driver's: that one stays the base (at world size 1 its tensors are the rank's), which the engines copy."""
        if self._merged is None:
            policy = self.policy.replica(seed=self.cfg.seed)
            self._merged = MergedAdapter(policy.model), policy
        merger, policy = self._merged
        if self._merged_version != version:
            merger.load(self.out.get(version)[1])
            policy.version = self._merged_version = int(version)
        return policy

    def save_adapter(self, directory: str | Path) -> Path | None:
        """LoRA: the newest version's adapter as a peft adapter directory (``final/adapter/``); None otherwise."""
        if self.lora is None:
            return None
        lora, (_, state) = self.lora, self.out.get(self.policy.version)
        return peft_files(state, adapter_meta(lora.base, lora.rank, lora.alpha, lora.target_modules, False), directory)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, copied: bool = True) -> dict:
        """A checkpoint taken now, for :class:`~psrl.runtime.checkpoint.CheckpointSaver`'s writer thread: the ranks
        write their DCP files now (the collective runs here, between steps) into ``checkpoint.ranks.tmp``;
        :meth:`save` later moves them into place and writes ``trainer.pt``. ``copied``: the saver's signature."""
        staged = self.work_dir / "checkpoint.ranks.tmp"
        shutil.rmtree(staged, ignore_errors=True)
        self._call("save", (str(staged), self.cfg.save_optimizer))
        return {**self._driver_state(), _STAGED: str(staged)}

    def _driver_state(self) -> dict:
        return {
            "version": self.policy.version,
            **rng_state(self.rng, self.policy.generator),
            "skipped": (self.skipped_steps, self.skipped_in_a_row),
            "world_size": self.world_size,
        }

    def save(self, directory: str | Path, state: dict | None = None) -> Path:
        """``directory/ranks`` (the ranks' model and AdamW, DCP) and ``directory/trainer.pt`` (the driver's state,
        no weights): written now, or, for a ``state`` from :meth:`state_dict`, the ranks' staged files moved into
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
        sharded = path / "ranks"
        if not sharded.is_dir():  # the earlier world-size-1 layout: its weights and AdamW, converted to DCP files
            if "model" not in ckpt:
                raise ValueError(f"{path}: no ranks/ beside trainer.pt and no weights in it: not a psrl checkpoint")
            self.policy.load_weights(ckpt["model"], ckpt["version"])
            sharded = self._from_one_rank(ckpt)
        self.policy.version = int(ckpt["version"])
        self.skipped_steps, self.skipped_in_a_row = ckpt.get("skipped", (0, 0))
        set_rng_state(ckpt, self.rng, self.policy.generator)
        self.close()  # the ranks start again, then read the sharded state
        self._call("load", str(sharded))
        self._loaded = self.policy.version if self.world_size == 1 else -1
        self._merged, self._merged_version = None, None  # LoRA: the next version brings the loaded base
        return self.policy.version

    def _from_one_rank(self, ckpt: dict) -> Path:
        """An earlier world-size-1 checkpoint's AdamW state (its weights are in the policy already), written by a
        world-size-1 :class:`~psrl.train.worker.RankWorker` as the DCP files the ranks load (resharded by DCP)."""
        with torch.random.fork_rng(devices=[]):
            worker = RankWorker(self._spec(in_process=True), 0, 1)
        if "optimizer" in ckpt:
            worker.optimizer.load_state_dict(ckpt["optimizer"])
        out = self.work_dir / "weights" / "from-one-rank"
        shutil.rmtree(out, ignore_errors=True)
        worker.save(str(out))
        return out
