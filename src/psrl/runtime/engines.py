"""The rollout engines of a run, from ``rollout.*``: one per rollout instance.

``hf``: a KV-cached in-process engine over a copy of the policy (its own sampling seed).
``vllm``: one vLLM server per instance, started and owned by psrl (or attached to with
``rollout.vllm.urls``), driven through :class:`psrl.rollout.engines.vllm.VLLMEngine`.
With ``runtime.backend=ray`` each engine lives in a Ray actor (:mod:`psrl.runtime.ray_runtime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.rollout.build import sampling_of
from psrl.types import Engine

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.tasks.base import Task

__all__ = ["build_engines"]


def build_engines(
    cfg: Config, policy: Any, task: Task, run_dir: Path | None = None, feed: Any = None
) -> Sequence[Engine]:
    """One engine per rollout instance for ``cfg`` (the policy supplies weights, tokenizer and shape), each
    sampling as :func:`psrl.rollout.sampling_of` says. ``feed``: with ``runtime.backend=ray``, the
    :class:`~psrl.runtime.ray_weights.ObjectVersions` the trainer's ranks record their buckets in (a fresh one
    when None: the driver puts each version it finds published)."""
    n, seed, r = cfg.psrl.deployment.n_rollout_instances, cfg.trainer.seed, cfg.rollout
    sampling = sampling_of(cfg, task)
    if cfg.runtime.backend == "ray":
        from psrl.runtime.ray_runtime import build_ray_engines
        from psrl.runtime.ray_weights import ObjectVersions

        feed = feed if feed is not None else ObjectVersions(keep=cfg.psrl.staleness + 2)
        return build_ray_engines(cfg, n, seed, feed, policy, task, run_dir)
    if r.engine == "vllm":
        from psrl.rollout.engines.vllm import build_vllm_engines

        return build_vllm_engines(cfg, policy, run_dir, sampling)
    from psrl.rollout.engines.hf import HFEngine

    return [
        HFEngine(policy.replica(seed=seed + 1 + i), kv_after_update=r.kv_after_update, sampling=sampling)
        for i in range(n)
    ]
