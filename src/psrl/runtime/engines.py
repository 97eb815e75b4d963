"""The rollout engines of a run, from ``rollout.*``: one per rollout instance.

``hf``: a KV-cached in-process engine over a copy of the policy (its own sampling seed).
``vllm``: one vLLM server per instance, started and owned by psrl (or attached to with
``rollout.vllm.urls``), driven through :class:`psrl.rollout.engines.vllm.VLLMEngine`.
With ``runtime.backend=ray`` each engine lives in a Ray actor (:mod:`psrl.runtime.ray_runtime`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.rollout.build import sampling_of
from psrl.types import Engine, WeightSource
from psrl.weights import ParameterStore, VersionDirectories

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.tasks.base import Task

__all__ = ["build_engines", "validation_engines", "object_versions"]


def build_engines(
    cfg: Config,
    policy: Any,
    task: Task,
    run_dir: Path | None = None,
    weights: WeightSource | None = None,
    feed: Any = None,
) -> Sequence[Engine]:
    """One engine per rollout instance for ``cfg`` (the policy supplies weights, tokenizer and shape), each
    sampling as :func:`psrl.rollout.sampling_of` says. ``weights``: the published versions (vLLM servers of a
    driver that holds no weights start from the newest). ``feed``: with ``runtime.backend=ray``, the
    :class:`~psrl.runtime.ray_weights.ObjectVersions` the trainer's ranks record their buckets in (a fresh one
    when None: the driver puts each version it finds published)."""
    n, seed, r = cfg.psrl.deployment.n_rollout_instances, cfg.trainer.seed, cfg.rollout
    sampling = sampling_of(cfg, task)
    if cfg.runtime.backend == "ray":
        from psrl.runtime.ray_runtime import build_ray_engines

        feed = feed if feed is not None else object_versions(cfg)
        return build_ray_engines(cfg, n, seed, feed, policy, task, run_dir)
    if r.engine == "vllm":
        from psrl.rollout.engines.vllm_fleet import build_vllm_engines

        return build_vllm_engines(cfg, policy, run_dir, sampling, start=_newest_directory(weights))
    from psrl.rollout.engines.hf import HFEngine

    return [
        HFEngine(policy.replica(seed=seed + 1 + i), kv_after_update=r.kv_after_update, sampling=sampling)
        for i in range(n)
    ]


def object_versions(cfg: Config) -> Any:
    """With ``runtime.backend=ray``: where the ranks record the refs of each version's buckets in Ray's object
    store and the engine actors find them (:class:`psrl.runtime.ray_weights.ObjectVersions`); else None."""
    if cfg.runtime.backend != "ray":
        return None
    from psrl.runtime.ray_weights import ObjectVersions

    return ObjectVersions(keep=cfg.psrl.staleness + 2)


def _newest_directory(weights: WeightSource | None) -> Path | None:
    """The newest published version's directory, where versions are directories (else None)."""
    if not isinstance(weights, VersionDirectories):
        return None
    newest = weights.latest_version()
    return weights.directory(newest) if newest is not None else None


def validation_engines(
    cfg: Config, policy: Any, task: Task, run_dir: Path | None, weights: WeightSource
) -> Callable[[], list[Any]]:
    """What builds the validation instances (:class:`psrl.runtime.validate.ValidationEngines`):
    ``psrl.deployment.n_validate_instances`` engines apart from the rollout ones. ``rollout.engine=vllm``: servers
    psrl starts (also when the rollout attaches to ``rollout.vllm.urls``: those serve the rollout's versions), from
    the newest version; otherwise ``hf`` engines in this process -- over the driver's policy itself where it is
    the trained model (versions in memory: world size 1), else over copies of it, which load each version's files."""
    n, sampling = cfg.psrl.deployment.n_validate_instances, sampling_of(cfg, task)
    if cfg.rollout.engine == "vllm":
        from psrl.rollout.engines.vllm_fleet import build_vllm_engines

        start = _newest_directory(weights)
        return lambda: build_vllm_engines(cfg, policy, run_dir, sampling, start, n=n, name="validate", attach=False)
    from psrl.rollout.engines.hf import HFEngine

    own = isinstance(weights, ParameterStore)  # the policy is the trained model: no copy, no load
    seed = cfg.trainer.seed + 10_000  # the engines' own generators (validation requests carry their own streams)

    def make() -> list[Any]:
        return [
            HFEngine(policy if own and i == 0 else policy.replica(seed=seed + i), sampling=sampling) for i in range(n)
        ]

    return make
