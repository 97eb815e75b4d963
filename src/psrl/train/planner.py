"""The trainer planner: how one batch is split over the ranks of a sharded trainer (issue #22, item 3).

The driver sees the whole batch, so it decides, for every minibatch (``trainer.minibatches``):

* which rank trains which trajectories -- balanced by tokens (longest first, onto the lightest rank);
* how each rank's share is packed into micro-batches under a token budget per micro-batch -- a budget of the
  *padded* area, rows x longest row, since a micro-batch is one right-padded forward (first-fit decreasing; a
  trajectory longer than the budget gets a micro-batch of its own);
* the same number of micro-batches on every rank: the short ranks get empty, zero-weight micro-batches
  that the worker still runs forward and backward, so no rank does one collective fewer (verl #6176);
* per-token loss weights with the minibatch's **global** denominators, so that
  ``sum over ranks, micro-batches and tokens of weight * loss_token`` equals
  :func:`psrl.algo.losses.aggregate` of the whole minibatch for every ``algorithm.loss_agg_mode``
  (the per-rank denominators of verl PR #5641 are the bug this avoids).

A rank's loss is then a plain weighted *sum*; FSDP averages gradients over the ranks, so the worker multiplies its
loss by the world size (or sets the gradient divide factor to 1) to get the single-process gradient.

Weights are computed from the *effective* masks (loss mask times the rejection-sampling keep mask), which the
driver knows once the pre-update log-probs (``logprobs(plan)``) are back; :func:`plan` itself needs only lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from psrl.algo.losses import AGG_MODES

__all__ = ["MicroBatch", "Plan", "plan", "loss_weights", "balance", "pack"]


@dataclass(frozen=True)
class MicroBatch:
    """Trajectory indices (into the batch) one rank runs in one forward/backward; empty = zero-weight padding."""

    rows: tuple[int, ...]

    @property
    def padding(self) -> bool:
        return not self.rows


@dataclass(frozen=True)
class Plan:
    """``minibatches[k][rank]`` -- the micro-batches rank ``rank`` runs for minibatch ``k`` (the same count on
    every rank of a minibatch)."""

    world_size: int
    minibatches: tuple[tuple[tuple[MicroBatch, ...], ...], ...]

    def rows(self, k: int) -> list[int]:
        """Every trajectory of minibatch ``k``, in batch order."""
        return sorted(i for per_rank in self.minibatches[k] for mb in per_rank for i in mb.rows)


def balance(lengths: dict[int, int], world_size: int) -> list[list[int]]:
    """Split trajectory ``index -> tokens`` over ``world_size`` ranks, longest first onto the lightest rank;
    each rank's indices come back sorted. Deterministic (ties break on index, then rank)."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(lengths, key=lambda j: (-lengths[j], j)):
        r = min(range(world_size), key=lambda q: (loads[q], q))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(x) for x in out]


def pack(lengths: dict[int, int], budget: int | None) -> list[list[int]]:
    """First-fit decreasing of ``index -> tokens`` into micro-batches whose padded area (rows x longest row: what a
    right-padded forward allocates) is at most ``budget`` (None: one micro-batch); a trajectory over the budget is
    alone in its micro-batch. Rows go in longest first, so a micro-batch's first row is its longest and it holds
    ``budget // that length`` rows."""
    if not lengths:
        return []
    if budget is None:
        return [sorted(lengths)]
    bins: list[list[int]] = []
    room: list[int] = []  # rows each micro-batch can still take
    for i in sorted(lengths, key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if free > 0:
                bins[b].append(i)
                room[b] -= 1
                break
        else:
            bins.append([i])
            room.append(budget // max(lengths[i], 1) - 1)
    return [sorted(b) for b in bins]


def plan(lengths: list[int], world_size: int, minibatches: int, token_budget: int | None) -> Plan:
    """The plan of a batch whose trajectory ``i`` has ``lengths[i]`` tokens (prompt + response: what a forward
    costs). Minibatches are the trainer's contiguous chunks (:func:`psrl.train.trainer._split`'s rule), so 1 rank
    and N ranks see the same minibatches."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token budget must be >= 1 or None, got {token_budget}")
    n = len(lengths)
    parts = min(max(minibatches, 1), n) if n else 0
    chunks = _contiguous(n, parts)
    out = []
    for idx in chunks:
        shares = balance({i: lengths[i] for i in idx}, world_size)
        packed = [pack({i: lengths[i] for i in share}, token_budget) for share in shares]
        depth = max(1, max(len(p) for p in packed))  # every rank runs >= 1 micro-batch (maybe padding)
        out.append(tuple(tuple(MicroBatch(tuple(m)) for m in p + [[]] * (depth - len(p))) for p in packed))
    return Plan(world_size, tuple(out))


def _contiguous(n: int, parts: int) -> list[list[int]]:
    """``torch.arange(n).tensor_split(parts)`` without torch: the first ``n % parts`` chunks one longer."""
    if parts == 0:
        return []
    size, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + size + (1 if k < extra else 0)
        if stop > start:
            out.append(list(range(start, stop)))
        start = stop
    return out


def loss_weights(masks: dict[int, list[float]], mode: str) -> dict[int, list[float]]:
    """Per-token weights of one minibatch (``index -> effective mask``) such that the weighted sum of any per-token
    loss equals :func:`psrl.algo.losses.aggregate` over the whole minibatch: the denominators are global."""
    if mode not in AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode: unknown mode {mode!r}, use one of {AGG_MODES}")
    on = {i: [float(v) if v > 0 else 0.0 for v in m] for i, m in masks.items()}  # as aggregate() reads a mask
    if mode == "token-mean":
        total = max(sum(sum(m) for m in on.values()), 1.0)
        return {i: [v / total for v in m] for i, m in on.items()}
    seqs = max(sum(1 for m in on.values() if sum(m) > 0), 1)
    if mode == "seq-mean-token-sum":
        return {i: [v / seqs for v in m] for i, m in on.items()}
    return {i: [v / (max(sum(m), 1.0) * seqs) for v in m] for i, m in on.items()}
