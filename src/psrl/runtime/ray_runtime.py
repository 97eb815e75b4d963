"""Ray at the edges: each rollout instance's engine lives in its own Ray actor process.

The coordinator does not change. A rollout instance drives a :class:`psrl.types.Engine`;
:class:`RayEngine` is one, forwarding each *request* (never each token) to an
:class:`EngineWorker` actor that runs the KV-cached ``hf`` engine in its own event loop
(slime's habit: a plain class, wrapped with ``ray.remote`` where the actor is created).
Weights: the trainer's ranks publish each version as ``RUN_DIR/weights/v{N}`` (:mod:`psrl.weights`) and the
actors read that directory themselves (every bucket checked against the manifest), so the driver sends a path,
never a state, and holds no copy. That is a local path, so the actors must see the run directory: one node, or a
path shared by every node. The worker process calls ``torch.set_num_threads`` itself. Actors are placed by resources
(``num_cpus`` per actor, 0 on a laptop so both instances fit beside the trainer).

A request's tokens come back when it finishes or is aborted, so the proactive ``truncate`` filter
sees the tokens of a Ray request in flight only once it is aborted (the tokens are kept then).

Select it with ``runtime.backend=ray`` (``pip install -e '.[ray]'``). ``runtime.ray_address`` joins an
existing cluster; by default a local one is started with the dashboard off.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

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

    async def update_weights_from(self, root: str, version: int) -> int:
        """Load ``version`` of the versions the ranks publish under ``root`` (``RUN_DIR/weights``; every bucket
        checked against its manifest); returns the version the engine then holds."""
        from psrl.weights import FileVersions

        await self.engine.update_weights(int(version), FileVersions(root))
        return self.engine.version

    def load(self) -> tuple:
        ld = self.engine.load()
        return ld.running, ld.queued, ld.tokens_per_s


class RayEngine:
    """Client side of an :class:`EngineWorker` actor: a :class:`psrl.types.Engine`, one Ray call per request."""

    def __init__(self, actor: Any, version: int = -1):
        self.actor = actor
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
        await self.actor.abort_all.remote()

    async def pause(self) -> None:
        await self.actor.pause.remote()

    async def resume(self) -> None:
        await self.actor.resume.remote()

    async def update_weights(self, version: int, store: WeightSource) -> None:
        from psrl.weights import VersionDirectories

        if not isinstance(store, VersionDirectories):
            raise TypeError(f"Ray engine actors read a published directory: {type(store).__name__} has none")
        store.directory(int(version))  # a version not published is a KeyError here, as before the actor is asked
        self.version = int(await self.actor.update_weights_from.remote(str(store.root), int(version)))

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
    cfg: Any, n: int, seed: int, policy: Any = None, task: Any = None, run_dir: Any = None
) -> list[RayEngine]:
    """``n`` engine actors (sampling seeds ``seed + 1 + i``); the instances load the first version at start, from
    the directories the trainer's ranks publish (``run_dir/weights``)."""
    import ray
    from psrl.config import config_to_dict

    if cfg.rollout.engine != "hf":
        raise NotImplementedError(
            "runtime.backend=ray runs the hf engine in its actors; for vLLM under Ray attach "
            "to the servers with rollout.engine=vllm and rollout.vllm.urls"
        )
    ensure_ray(cfg.runtime.ray_address)
    remote_cls = ray.remote(num_cpus=0)(EngineWorker)
    data = config_to_dict(cfg)
    return [RayEngine(remote_cls.remote(data, seed + 1 + i)) for i in range(n)]
