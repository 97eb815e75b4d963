"""One trainer rank (issue #22, item 1): its own model (FSDP2-sharded when the world is larger than 1), AdamW, RNG.

The driver never joins the process group; it sends each rank the same command and the whole batch, and every rank
picks its own rows from the planner's :class:`~psrl.train.planner.Plan`. Commands:

* ``logprobs(inp)`` -- the pre-update log-probs of the rank's rows (no grad), ``{row: [logp per response token]}``;
* ``train_step(inp)`` -- one AdamW step per minibatch that has a token in the loss (a minibatch whose every token
  is masked is not run: ``train/empty_minibatches``): per micro-batch ``sum(weight * token_loss)`` with the global
  weights the driver computed (:func:`step_input`), backward scaled by the world size (FSDP averages gradients), so
  the sharded gradient is the single-process one; clipping over the full norm; a non-finite loss or norm skips the
  step on every rank alike (both are global), undoing the minibatches before it (as the in-process trainer does);
* ``digest()`` -- sha256 of the gathered fp32 state; ``state()`` -- the gathered state as numpy arrays;
  ``usage()`` -- the rank's parameter and optimiser bytes and peak RSS;
* ``publish((version, root, keep, bucket_mb, dtype))`` -- the weights as ``root/v{version}`` for the engines, each
  rank writing the buckets it owns from its shards (:func:`psrl.weights.publish_model`);
* ``export((bucket_mb, dtype))`` -- world size 1, in process: the weights as CPU tensors;
* ``join_transfer(address)``, ``transfer_layout((bucket_mb, dtype))``, ``send((bucket_mb, dtype, receivers))``,
  ``leave_transfer()`` -- ``weights.transport=collective`` (:mod:`psrl.weights.collective`): the rank joins the
  run's transfer group as its rank, and sends its rows of every bucket (and the whole tensors of the buckets
  it owns) to the receivers;
* ``warm_start((demos, chunks, lr))`` -- the supervised warm start of the rank's shards (:mod:`psrl.train.warm`);
* ``save(dir)`` / ``load(dir)`` -- model and optimiser with ``torch.distributed.checkpoint``: saved at one world size,
  loaded at any other.

Every micro-batch is ONE forward on every rank (right-padded rows; a padding micro-batch runs the first row of its
minibatch with weight 0): under FSDP each forward is a round of all-gathers and each backward a round of
reduce-scatters, and ranks that run different numbers of them deadlock.

:class:`RankWorker` is the rank's state; :func:`psrl.train.launch.serve` is the loop a rank process runs over a
pipe; world size 1 runs the same :class:`RankWorker` in the driver, with no process
group and no ``fully_shard`` (a 16-bit model then trains over fp32 masters: :mod:`psrl.train.masters`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from psrl import heap
from psrl.algo.losses import ACTOR_SUMS, actor_metrics, actor_sums, token_loss
from psrl.config import AlgorithmConfig
from psrl.train.lora import LoraSpec, add_adapter, sharing_twin
from psrl.train.masters import Masters, masters_for
from psrl.train.shard import (
    full_state,
    full_value,
    load_full_state,
    mixed_precision,
    shard_model,
    single_process_quiet,
)
from psrl.train.steps import StepInput, _pad, step_input, step_scaled
from psrl.train.warm import Demos, warm_start_shards
from psrl.weights import MB, export_state, publish_model
from psrl.weights.adapter import adapter_meta, published_names
from psrl.weights.collective import BucketLayout, GroupAddress, TransferGroup, layout, send_version
from psrl.weights.format import tied_names

__all__ = ["WorkerSpec", "StepInput", "RankWorker", "step_input", "memory_status", "COMMANDS"]

COMMANDS: tuple[str, ...] = ("logprobs", "train_step", "digest", "state", "save", "load", "publish", "export", "usage")
COMMANDS += ("join_transfer", "transfer_layout", "send", "leave_transfer")  # weights.transport=collective
COMMANDS += ("warm_start",)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build itself (picklable: it crosses to spawned processes)."""

    build: Callable[[str], nn.Module]
    """``device -> model``: called with ``"cpu"``/``"cuda"`` on rank 0 (the weights are read there, once) and with
    ``"meta"`` on the other ranks, which receive rank 0's weights by broadcast."""
    pad_id: int
    algo: AlgorithmConfig
    """Policy loss, clips, ``loss_agg_mode``, rollout correction."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    """``model.dtype``: with a CUDA ``device`` and bf16/fp16, the sharded ranks compute in it over fp32 master weights
    (:func:`psrl.train.shard.mixed_precision`); ``build`` then gives fp32 (:func:`~psrl.train.shard.master_dtype`).
    An unsharded rank given a 16-bit model trains it over fp32 masters on any device (:mod:`psrl.train.masters`)."""
    reshard_after_forward: bool = True
    collective_timeout_s: float = 300.0
    """A collective that waits longer (a peer dead or stuck) raises instead of hanging."""
    lora: LoraSpec | None = None
    """``model.lora_rank > 0``: train a LoRA adapter over the frozen base and publish it (:mod:`psrl.train.lora`)."""
    heartbeat_s: float = 10.0
    """``trainer.rank_heartbeat_s``: a rank process's side thread beats this often; the driver reports a rank that
    misses :data:`psrl.train.launch.SILENT_BEATS` beats as silent (:class:`~psrl.train.launch.LocalRanks`; a Ray
    rank is pinged this often instead: :class:`psrl.runtime.ray_ranks.RayRanks`)."""


class RankWorker:
    """A rank's model and optimiser. Sharded (``shard``, by default when ``world_size > 1``) it needs the default
    process group initialised (see :func:`serve`); world size 1 is a plain module, unless ``shard`` asks for FSDP2
    over a group of one (``benchmarks/gpu_check.py``: the sharded code on one GPU)."""

    def __init__(self, spec: WorkerSpec, rank: int = 0, world_size: int = 1, shard: bool | None = None):
        self.spec, self.rank, self.world = spec, rank, world_size
        torch.manual_seed(spec.seed)
        self.masters: Masters | None = None
        """Unsharded with a 16-bit model: the fp32 weights AdamW steps; the forward runs the 16-bit model."""
        self._base_sent = False
        """LoRA: whether this worker has published the base yet (its first version carries it)."""
        if not (world_size > 1 if shard is None else shard):
            self.model = spec.build(spec.device)
            if spec.lora is not None:  # the policy's own model at world size 1: adapt a twin sharing its tensors
                self.model = add_adapter(sharing_twin(self.model), spec.lora)  # (peft keeps the adapter in fp32)
            else:
                self.masters = masters_for(self.model)
                if self.masters is not None:  # optimiser, checkpoints, publication: fp32; forward: model.dtype
                    self.model = self.masters.model
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(spec.device.split(":")[0], (world_size,))
            self.model = spec.build(spec.device if rank == 0 else "meta")
            if spec.lora is not None:  # before sharding: FSDP2 shards base and adapter alike
                self.model = add_adapter(self.model, spec.lora)
            state = self.model.state_dict() if rank == 0 else None
            shard_model(self.model, mesh, spec.reshard_after_forward, mixed_precision(spec.device, spec.dtype))
            load_full_state(self.model, state, spec.device)
        self.model.eval()  # no dropout: recorded and recomputed log-probs must agree
        if self.masters is not None:
            self.masters.compute.eval()
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter's alone
        self.optimizer = torch.optim.AdamW(trained, lr=spec.lr, weight_decay=spec.weight_decay)
        self.transfer: TransferGroup | None = None
        """This rank's membership of the run's transfer group (``weights.transport=collective``)."""

    def handle(self, cmd: str, arg: Any) -> Any:
        """Run one command (a name of :data:`COMMANDS`): the method of that name, with ``arg`` (a tuple: its
        arguments; ``save`` takes a directory, or (directory, with the optimiser state)), or none."""
        if cmd not in COMMANDS:
            raise ValueError(f"unknown trainer command {cmd!r}, use one of {COMMANDS}")
        method = getattr(self, cmd)
        if cmd in ("digest", "state", "leave_transfer") or (cmd == "usage" and arg is None):
            return method()
        return method(*arg) if isinstance(arg, tuple) else method(arg)

    def _forward(self, inp: StepInput | Demos, rows: tuple[int, ...], temperature: float | None = None) -> Tensor:
        """``[b, T]`` log-probs of the rows' response tokens, one right-padded forward (as
        :meth:`psrl.models.Policy.sequence_logprobs` computes them), at ``temperature`` (default the trainer's)."""
        dev = torch.device(self.spec.device)
        full = [list(inp.prompts[i]) + list(inp.responses[i]) for i in rows]
        n = max(len(s) for s in full)
        ids = torch.full((len(rows), n), self.spec.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), n), dtype=torch.long)
        for j, s in enumerate(full):
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
            attn[j, : len(s)] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = torch.arange(n, device=dev).expand_as(ids)
        model = self.masters.compute if self.masters is not None else self.model
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        width = max(len(inp.responses[i]) for i in rows)
        if width == 0:
            return logits.new_zeros((len(rows), 0)).float()
        starts = torch.tensor([len(inp.prompts[i]) - 1 for i in rows], device=dev)
        where = (starts[:, None] + torch.arange(width, device=dev)[None, :]).clamp(max=n - 1)
        picked = logits.gather(1, where[:, :, None].expand(-1, -1, logits.shape[-1])).float()
        temp = self.spec.temperature if temperature is None else temperature
        temp = temp if temp > 0 else 1.0
        logp = F.log_softmax(picked / temp, dim=-1)
        targets = torch.zeros((len(rows), width), dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.float32)
        for j, i in enumerate(rows):
            r = inp.responses[i]
            targets[j, : len(r)] = torch.tensor(r, dtype=torch.long)
            valid[j, : len(r)] = 1.0
        chosen = logp.gather(2, targets.to(dev)[:, :, None]).squeeze(2)
        return chosen * valid.to(dev)

    def _micro_batches(self, inp: StepInput, k: int) -> list[tuple[tuple[int, ...], bool]]:
        """``(rows to run, is padding)`` of this rank in minibatch ``k``; padding runs the minibatch's first row."""
        first = (inp.plan.rows(k)[0],)
        return [(mb.rows or first, mb.padding) for mb in inp.plan.minibatches[k][self.rank]]

    @torch.no_grad()
    def logprobs(self, inp: StepInput) -> dict[int, list[float]]:
        """Pre-update log-probs of this rank's rows (every rank runs the same number of forwards)."""
        out: dict[int, list[float]] = {}
        for k in range(len(inp.plan.minibatches)):
            for rows, padding in self._micro_batches(inp, k):
                logp = self._forward(inp, rows).cpu()
                if not padding:
                    out.update({i: logp[j, : len(inp.responses[i])].tolist() for j, i in enumerate(rows)})
        heap.release_freed()  # what these forwards freed, before the training forward's activations (psrl/heap.py)
        return out

    def train_step(self, inp: StepInput) -> dict[str, Any]:
        """One optimiser step per minibatch; ``train/loss`` and ``train/grad_norm`` are means over minibatches, the
        loss summed over ranks (the single-process aggregate)."""
        assert inp.old is not None and inp.adv is not None and inp.mask is not None
        dev = torch.device(self.spec.device)
        losses, norms, actor, skipped, empty, why = [], [], [], 0, 0, ""
        before = self._snapshot() if len(inp.plan.minibatches) > 1 else None  # a later minibatch may go NaN
        for k in range(len(inp.plan.minibatches)):
            if not any(v > 0 for row in inp.weights[k].values() for v in row):  # the same on every rank
                empty += 1  # no token in the loss: AdamW would still move the weights (momentum, weight decay)
                losses.append(0.0)  # what its forward would report: a zero loss, a zero gradient
                norms.append(0.0)
                actor.append(actor_metrics(torch.zeros(len(ACTOR_SUMS))))
                continue
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=dev)
            sums = torch.zeros(len(ACTOR_SUMS), device=dev)
            for rows, padding in self._micro_batches(inp, k):
                logp = self._forward(inp, rows)
                width = logp.shape[1]
                old = _pad([inp.old[i] for i in rows], width).to(dev)
                behav = _pad([inp.behav[i] for i in rows], width).to(dev) if inp.behav is not None else None
                adv = torch.tensor([inp.adv[i] for i in rows], dtype=torch.float32, device=dev)
                mask = _pad([inp.mask[i] for i in rows], width).to(dev)
                per_token, _ = token_loss(logp, old, behav, adv, mask, self.spec.algo)
                w = _pad([inp.weights[k][i] for i in rows], width)
                if padding:
                    w.zero_()
                loss = (per_token * w.to(dev)).sum()
                if not padding:
                    sums = sums + actor_sums(logp, old, behav, adv, mask, self.spec.algo)
                (loss * self.world).backward()  # FSDP averages over ranks; the weights already hold 1/N of the sum
                if self.masters is not None:
                    self.masters.accumulate()  # into fp32, micro-batch after micro-batch
                total = total + loss.detach()
            norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip))
            if self.world > 1:
                dist.all_reduce(total)
                dist.all_reduce(sums)
            losses.append(float(total))
            actor.append(actor_metrics(sums.cpu()))
            norms.append(norm)
            if not math.isfinite(norm) or not math.isfinite(float(total)):  # global: every rank stops here
                self._restore(before)
                skipped = k + 1
                why = f"loss is {float(total)!r}" if not math.isfinite(float(total)) else "gradient norm is not finite"
                break
            step_scaled(self.optimizer, inp.lr_scale)
            self._synced()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient memory held between steps
        heap.release_freed()  # nor the freed activations' pages (psrl/heap.py)
        return {
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(norms) / len(norms),
            **{name: sum(m[name] for m in actor) / len(actor) for name in actor[0]},
            "train/empty_minibatches": float(empty),
            "skipped_minibatch": float(skipped),  # not a metric: 0, or the minibatch (1-based) that skipped the step
            "skip_reason": why,  # not a metric: why it skipped ("" when it did not)
        }

    def warm_start(self, demos: Demos, chunks: list[list[int]], lr: float) -> list[float]:
        """The supervised warm start of this rank's shards over the driver's ``chunks`` (:mod:`psrl.train.warm`)."""
        forward = lambda rows: self._forward(demos, rows, temperature=1.0)  # noqa: E731 (as the driver's: at 1)
        return warm_start_shards(self.model, forward, demos.masks, chunks, (self.rank, self.world), lr, self.spec)

    def _snapshot(self) -> tuple[list[Tensor], dict[str, Any]]:
        """This rank's trained parameter shards (LoRA: the adapter's; the frozen base cannot move) and AdamW state,
        copied (local: no collective), taken before the first of several minibatches."""
        with torch.no_grad():
            params = [p.detach().clone() for p in self.model.parameters() if p.requires_grad]
        return params, copy.deepcopy(self.optimizer.state_dict())

    def _restore(self, before: tuple[list[Tensor], dict[str, Any]] | None) -> None:
        """A skipped step leaves no update: the minibatches that did step are undone (``before``: the snapshot of
        several minibatches; with one, nothing stepped)."""
        self.optimizer.zero_grad(set_to_none=True)
        if before is None:
            return
        with torch.no_grad():
            for p, saved in zip((p for p in self.model.parameters() if p.requires_grad), before[0]):
                p.copy_(saved)
        self.optimizer.load_state_dict(before[1])
        self._synced()

    def _synced(self) -> None:
        """After the weights changed: a 16-bit model trained over masters takes their values."""
        if self.masters is not None:
            self.masters.sync()

    def save(self, directory: str, optimizer: bool = True) -> str:
        """Model and AdamW state with ``torch.distributed.checkpoint`` (every rank writes its shards; a collective):
        the files hold the full tensors' layout, so any world size loads them. An optimiser that has not stepped
        yet is left out: DCP's ``get_state_dict`` would initialise it with a zero step (AdamW's step count 1),
        which changes the next update of the run that saved. ``optimizer=False`` (``trainer.save_optimizer``):
        the model only; a run resumed from it restarts AdamW."""
        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if optimizer and self.optimizer.state:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        with single_process_quiet(self.world):
            dcp.save(state, checkpoint_id=directory, no_dist=self.world == 1)
        return directory

    def load(self, directory: str) -> str:
        """Read what :meth:`save` wrote, at this world size (resharded by DCP); without saved optimiser state AdamW
        starts fresh."""
        with single_process_quiet(self.world):
            saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
            model = get_model_state_dict(self.model)
            dcp.load({"model": model}, checkpoint_id=directory, no_dist=self.world == 1)  # fills the dict in place
            set_model_state_dict(self.model, model)
            self.optimizer.state.clear()
            self.optimizer.zero_grad(set_to_none=True)  # else DCP sees gradients and leaves the state uninitialised
            if any(k.startswith("optim.") for k in saved):
                optim = get_optimizer_state_dict(self.model, self.optimizer)
                dcp.load({"optim": optim}, checkpoint_id=directory, no_dist=self.world == 1)
                set_optimizer_state_dict(self.model, self.optimizer, optim)
        self._synced()
        return directory

    def publish(self, version: int, root: str, keep: int, bucket_mb: float, dtype: torch.dtype) -> dict:
        """Write the weights as ``root/v{version}`` (:func:`psrl.weights.publish_model`): bucket by bucket, every rank
        gathering each bucket (collectives, in the same order) and writing the buckets it owns; rank 0 finishes the
        version. On return the version exists, on every rank. ``dtype``: ``model.dtype`` (fp32 masters are cast)."""
        names, meta = self._adapter_names()
        out = publish_model(
            self.model,
            root,
            version,
            rank=self.rank,
            world=self.world,
            bucket_mb=bucket_mb,
            dtype=dtype,
            keep=keep,
            select=names,
            meta=meta,
        )
        self._base_sent = True
        return out

    def export(self, bucket_mb: float, dtype: torch.dtype) -> dict[str, Tensor]:
        """World size 1: the weights as CPU tensors in ``dtype`` (the in-memory store)."""
        if self.world > 1:
            raise RuntimeError("RankWorker.export is world size 1's: sharded ranks publish files (publish)")
        names, _ = self._adapter_names()
        out = export_state(self.model, bucket_mb, dtype, names)
        self._base_sent = True
        return out

    def _adapter_names(self) -> tuple[dict[str, tuple[str, float]] | None, dict | None]:
        """LoRA: the tensors a version publishes (:func:`psrl.weights.adapter.published_names`: the adapter, and the
        base in this worker's first version) and its manifest fields; None, None for full fine-tuning."""
        lora = self.spec.lora
        if lora is None:
            return None, None
        with_base = not self._base_sent
        names = published_names(self.model.state_dict(), lora.scale, with_base)
        return names, adapter_meta(lora.base, lora.rank, lora.alpha, lora.target_modules, with_base)

    def join_transfer(self, address: GroupAddress) -> None:
        """Join the run's transfer group as group rank ``self.rank`` (blocks until every member has joined)."""
        self.leave_transfer()
        self.transfer = TransferGroup(address, self.rank)

    def transfer_layout(self, bucket_mb: float, dtype: torch.dtype) -> tuple[tuple[BucketLayout, ...], dict[str, str]]:
        """The buckets a version is sent in (names, shapes, dtypes: what a receiver allocates before they come) and
        the tied names not sent (:func:`~psrl.weights.format.tied_names`: what the manifest records)."""
        return layout(self.model, int(bucket_mb * MB), dtype), tied_names(self.model.state_dict())

    def send(self, bucket_mb: float, dtype: torch.dtype, receivers: list[int]) -> list[tuple[int, int, int, str]]:
        """Send the weights, bucket by bucket, to the transfer group's ``receivers``: every rank sends its rows of
        each bucket straight from its shard (:func:`~psrl.weights.collective.send_version`). ``(bucket, rank,
        bytes, digest)`` of the parts sent here."""
        if self.transfer is None:
            raise RuntimeError("RankWorker.send: not in a transfer group (join_transfer first)")
        return send_version(
            self.transfer,
            self.model,
            rank=self.rank,
            world=self.world,
            receivers=receivers,
            bucket_bytes=int(bucket_mb * MB),
            dtype=dtype,
        )

    def leave_transfer(self) -> None:
        group, self.transfer = self.transfer, None
        if group is not None:
            group.close()

    def usage(self, reset_peak: bool = False) -> dict[str, int]:
        """Bytes this rank holds of parameters and optimiser state (its shards only), its RSS now (``VmRSS``) and
        its peak RSS (``VmHWM``: the process's own high-water mark; ``getrusage`` would report the spawning
        driver's, kept across exec). ``reset_peak``: then start a new high-water mark from now (Linux
        ``clear_refs``), so a later call measures one phase (``benchmarks/weights_scale.py``: a publish)."""

        def local(t: Tensor) -> int:
            part = t.to_local() if isinstance(t, DTensor) else t
            return part.numel() * part.element_size()

        params = sum(local(p) for p in self.model.parameters())
        optim = sum(local(v) for st in self.optimizer.state.values() for v in st.values() if isinstance(v, Tensor))
        out = {"param_bytes": params, "optim_bytes": optim, **memory_status()}
        if reset_peak:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
        return out

    def state(self) -> dict[str, np.ndarray] | None:
        """The gathered state (a collective), as numpy arrays on rank 0 (None on the others): numpy, because a
        tensor crosses processes as a file descriptor that is gone once the rank exits."""
        full = full_state(self.model)
        return {k: v.float().numpy() for k, v in full.items()} if self.rank == 0 else None

    def digest(self) -> str:
        """sha256 over the gathered state in name order (fp32 bytes; same on every rank)."""
        h = hashlib.sha256()
        for name, t in sorted(full_state(self.model).items()):
            h.update(name.encode())
            h.update(t.float().contiguous().numpy().tobytes())
        return h.hexdigest()


def memory_status() -> dict[str, int]:
    """This process's ``rss_bytes`` (``VmRSS``) and ``peak_rss_bytes`` (``VmHWM``) from ``/proc/self/status`` (0
    where there is none)."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.exists() else []
    field = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines if ln.startswith(("VmRSS:", "VmHWM:"))}
    return {"rss_bytes": field.get("VmRSS", 0), "peak_rss_bytes": field.get("VmHWM", 0)}
