"""Ray at the edges: each rollout instance's engine lives in its own Ray actor process.

The coordinator does not change. A rollout instance drives a :class:`psrl.types.Engine`;
:class:`RayEngine` is one, forwarding each *request* (never each token) to an
:class:`EngineWorker` actor that runs the KV-cached ``hf`` engine in its own event loop
(slime's habit: a plain class, wrapped with ``ray.remote`` where the actor is created).
Weights: the trainer's ranks publish each version as ``RUN_DIR/weights/v{N}`` (:mod:`psrl.weights`) and put the
buckets they own into Ray's object store; the driver hands the actors the refs (:mod:`psrl.runtime.ray_weights`),
never a state, and each actor fetches the buckets from the ranks' nodes and checks them against their writers'
digests: the rollout nodes need no path of the trainer's. The worker process calls ``torch.set_num_threads``
itself. Actors take no CPU (``num_cpus=0``, so instances fit beside the trainer on a laptop); with
``runtime.ray_pool_label`` each is pinned to a rollout node in turn (:mod:`psrl.runtime.ray_placement`).

A request's tokens come back when it finishes or is aborted, so the proactive ``truncate`` filter
sees the tokens of a Ray request in flight only once it is aborted (the tokens are kept then).

Select it with ``runtime.backend=ray`` (``pip install -e '.[ray]'``). ``runtime.ray_address`` joins an
existing cluster; by default a local one is started with the dashboard off.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from psrl.runtime.ray_weights import ObjectVersions
from psrl.types import EngineLoad, GenRequest, WeightSource

__all__ = ["EngineWorker", "RayEngine", "build_ray_engines", "ensure_ray"]


class EngineWorker:
    """An ``hf`` engine over a policy copy in a worker process, built from plain config data (picklable)."""

    def __init__(self, cfg_data: dict, seed: int, threads: int = 1):
        import torch

        torch.set_num_threads(threads)
        from psrl.config import config_from_dict
        from psrl.models import build_policy, load_tokenizer
        from psrl.rollout.build import sampling_of
        from psrl.rollout.engines.hf import HFEngine
        from psrl.tasks import get_task

        cfg = config_from_dict(cfg_data)
        tok = load_tokenizer(cfg.model)
        task = get_task(cfg.task, seed=cfg.trainer.seed, tokenizer=tok)
        policy = build_policy(cfg.model, task, seed=seed)
        self.engine = HFEngine(policy, kv_after_update=cfg.rollout.kv_after_update, sampling=sampling_of(cfg, task))
        self.reqs: dict[str, GenRequest] = {}

    async def generate(self, rid: str, context: list[int], max_new_tokens: int, seed: int | None = None) -> tuple:
        req = GenRequest(list(context), int(max_new_tokens), rid=rid, seed=seed)
        self.reqs[rid] = req
        try:
            await self.engine.generate(req)
        finally:
            self.reqs.pop(rid, None)
        return req.tokens, req.logprobs, req.versions, req.finish, req.error

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is not None:
            self.engine.abort(req)

    async def abort_all(self) -> None:
        await self.engine.abort_all()

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights_from_refs(self, version: int, digest: str, buckets: list) -> int:
        """Load ``version`` from its buckets in the object store (:func:`psrl.runtime.ray_weights.receive`: fetched
        from the ranks' nodes, each checked against its writer's digest); returns the version the engine then
        holds."""
        from psrl.runtime.ray_weights import receive
        from psrl.weights import ParameterStore

        store = ParameterStore(keep=1)
        store.publish(int(version), await receive(digest, buckets))
        await self.engine.update_weights(int(version), store)
        return self.engine.version

    def where(self) -> tuple[str, int]:
        """This actor's Ray node id and process id."""
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def load(self) -> tuple:
        ld = self.engine.load()
        return ld.running, ld.queued, ld.tokens_per_s


class RayEngine:
    """Client side of an :class:`EngineWorker` actor: a :class:`psrl.types.Engine`, one Ray call per request."""

    def __init__(self, actor: Any, feed: ObjectVersions, version: int = -1):
        self.actor = actor
        self.feed = feed
        self.version = int(version)
        self.steps = 0
        self.tokens = 0
        self._ids = itertools.count()
        self._running: dict[str, GenRequest] = {}

    async def start(self) -> None:
        return None

    async def generate(self, req: GenRequest) -> GenRequest:
        if req.max_new_tokens <= 0:
            req.finish = "length"
            return req
        req.rid = req.rid or f"r{next(self._ids)}"
        self._running[req.rid] = req
        try:
            toks, lps, vers, finish, error = await self.actor.generate.remote(
                req.rid, req.context, req.max_new_tokens, req.seed
            )
        except asyncio.CancelledError:
            self.abort(req)
            raise
        finally:
            self._running.pop(req.rid, None)
        if not req.finish:  # an abort decided here wins; its tokens still come back from the actor
            req.finish = finish
        req.tokens += toks
        req.logprobs += lps
        req.versions += vers
        req.error = error
        self.steps += 1
        self.tokens += len(toks)
        return req

    def abort(self, req: GenRequest) -> None:
        if req.rid:
            self.actor.abort.remote(req.rid)

    async def abort_all(self) -> None:
        import ray

        try:
            await self.actor.abort_all.remote()
        except ray.exceptions.RayActorError:  # the actor (or its node) is gone, and its requests with it
            pass

    async def pause(self) -> None:
        await self.actor.pause.remote()

    async def resume(self) -> None:
        await self.actor.resume.remote()

    async def update_weights(self, version: int, store: WeightSource) -> None:
        from psrl.weights import VersionDirectories

        if not isinstance(store, VersionDirectories):
            raise TypeError(f"Ray engine actors load what the ranks published: {type(store).__name__} is not that")
        store.directory(int(version))  # a version not published is a KeyError here, as before the actor is asked
        digest, buckets = self.feed.buckets(int(version), store)
        self.version = int(await self.actor.update_weights_from_refs.remote(int(version), digest, list(buckets)))

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), queued=0, tokens_per_s=0.0)

    async def close(self) -> None:
        import ray

        ray.kill(self.actor)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join) Ray once; local clusters bind to loopback with the dashboard off."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)


def build_ray_engines(
    cfg: Any, n: int, seed: int, feed: ObjectVersions, policy: Any = None, task: Any = None, run_dir: Any = None
) -> list[RayEngine]:
    """``n`` engine actors (sampling seeds ``seed + 1 + i``), placed by ``runtime.ray_pool_label``
    (:func:`~psrl.runtime.ray_placement.rollout_strategies`); the instances load each version from ``feed``, the
    refs of the buckets the trainer's ranks put into the object store."""
    import ray
    from psrl.config import config_to_dict
    from psrl.runtime.ray_placement import check_pools, rollout_strategies

    if cfg.rollout.engine != "hf":
        raise NotImplementedError(
            "runtime.backend=ray runs the hf engine in its actors; for vLLM under Ray attach "
            "to the servers with rollout.engine=vllm and rollout.vllm.urls"
        )
    ensure_ray(cfg.runtime.ray_address)
    check_pools(cfg)
    remote_cls = ray.remote(num_cpus=0, max_restarts=0)(EngineWorker)
    data = config_to_dict(cfg)
    engines = []
    for i, where in enumerate(rollout_strategies(cfg.runtime.ray_pool_label, n)):
        opts = {"scheduling_strategy": where} if where is not None else {}
        engines.append(RayEngine(remote_cls.options(**opts).remote(data, seed + 1 + i), feed))
    return engines
