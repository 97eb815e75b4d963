"""Ray at the edges: each rollout instance's model lives in its own Ray actor process.

The coordinator does not change. A rollout instance awaits ``model.anext_token`` /
``model.aload_state`` when a model offers them (see :mod:`psrl.rollout.engine`), and
:class:`RayModel` offers exactly that, forwarding to a plain :class:`PolicyWorker` wrapped
with ``ray.remote`` where the actor is created (slime's habit: no Ray inside the classes).
Weights cross as CPU tensors through Ray's object store; the worker process calls
``torch.set_num_threads`` itself.

Select it with ``psrl.runtime=ray`` (``pip install -e '.[ray]'``). ``ray_address`` joins an
existing cluster; by default a local one is started with the dashboard off.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["PolicyWorker", "RayModel", "build_ray_models", "ensure_ray"]


class PolicyWorker:
    """A policy copy in a worker process, built from plain config data (picklable across Ray)."""

    def __init__(self, cfg_data: dict, seed: int, threads: int = 1):
        import torch

        torch.set_num_threads(threads)
        from psrl.config import Config, _build
        from psrl.models import build_policy
        from psrl.tasks import get_task
        from psrl.models import load_tokenizer

        cfg = _build(Config, cfg_data)
        tok = load_tokenizer(cfg.model)
        task = get_task(cfg.task, seed=cfg.trainer.seed, tokenizer=tok)
        self.policy = build_policy(cfg.model, task, seed=seed)

    def next_token(self, seqs: list[list[int]], temperature: float, top_p: float) -> tuple[list[int], list[float]]:
        return self.policy.next_token(seqs, temperature, top_p)

    def load_state(self, state: dict, version: int) -> int:
        self.policy.load_state(state, version)
        return version

    def version(self) -> int:
        return self.policy.version


class RayModel:
    """Client side of a :class:`PolicyWorker` actor, with the coroutine interface instances await."""

    def __init__(self, actor: Any, version: int = 0):
        self.actor = actor
        self.version = version

    async def anext_token(self, seqs: list[list[int]], temperature: float, top_p: float):
        return await self.actor.next_token.remote(seqs, temperature, top_p)

    async def aload_state(self, state: dict, version: int) -> None:
        await self.actor.load_state.remote(state, version)
        self.version = version

    def load_state(self, state: dict, version: int) -> None:
        """Blocking variant (checkpoint restore, start-up)."""
        import ray

        ray.get(self.actor.load_state.remote(state, version))
        self.version = version


def ensure_ray(address: Optional[str] = None, num_cpus: Optional[int] = None) -> None:
    """Start (or join) Ray once; local clusters bind to loopback with the dashboard off."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)


def build_ray_models(cfg: Any, n: int, seed: int, initial_state: Optional[dict] = None, version: int = 0) -> list[RayModel]:
    """``n`` policy actors (seeds ``seed + 1 + i``), optionally loaded with ``initial_state``."""
    import ray

    from psrl.config import config_to_dict

    ensure_ray(getattr(cfg.psrl, "ray_address", None))
    remote_cls = ray.remote(num_cpus=0)(PolicyWorker)
    data = config_to_dict(cfg)
    actors = [remote_cls.remote(data, seed + 1 + i) for i in range(n)]
    models = [RayModel(a) for a in actors]
    if initial_state is not None:
        ref = ray.put(initial_state)
        ray.get([a.load_state.remote(ref, version) for a in actors])
        for m in models:
            m.version = version
    return models
