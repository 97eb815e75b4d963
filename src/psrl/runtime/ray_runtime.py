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

Every wait on an actor but a request's has a bound (a request's is its engine's ``rollout.request_timeout_s`` per
token, and Ray's health check when the node goes): its start (the actor's creation and its engine's start, vLLM's
bounded by ``rollout.vllm.startup_timeout_s``) by that plus ``rollout.request_timeout_s``, a control call (pause,
resume, abort) by ``rollout.request_timeout_s``, a weight load (the buckets' fetch and the server's reload) by
twice that. A bound passed is an :class:`EngineStuck` naming the instance, its node and the key, never a hang: at
start it stops the run, later the instance recovers as from any engine fault (a vLLM engine actor restarts its
server, :class:`RestartingRayEngine`; an ``hf`` one, which cannot restart, is given up on, as locally).

An instance given up on (its actor gone with its rollout node, or failed past its restarts) *rejoins* where
``runtime.ray_pool_label`` gives pools: :meth:`RayEngine.rejoin` looks every ``runtime.ray_rejoin_every_s`` for a
rollout node with room (:class:`~psrl.runtime.ray_placement.RolloutSeats`: the node back, or another), puts a new
engine actor there, and the instance starts it and loads the newest version through the object store, as at
start; at most ``runtime.ray_rejoin_attempts`` new actors per instance.

Select it with ``runtime.backend=ray`` (``pip install -e '.[ray]'``). ``runtime.ray_address`` joins an
existing cluster; by default a local one is started with the dashboard off.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.errors import PsrlError, RunError
from psrl.runtime.ray_weights import ObjectVersions
from psrl.types import EngineLoad, GenRequest, WeightSource

if TYPE_CHECKING:
    from psrl.runtime.ray_placement import RolloutSeats

__all__ = ["EngineStuck", "EngineWorker", "RayEngine", "RestartingRayEngine", "build_ray_engines", "ensure_ray"]

CLOSE_S = 30.0
"""How long an engine actor is given to stop its engine before it is killed."""


class EngineStuck(RunError):
    """An engine actor did not answer a call within its bound (see the module docstring)."""


class EngineWorker:
    """One rollout instance's engine in a worker process on its node, built from plain config data (picklable):
    ``rollout.engine=hf``, a KV-cached engine over a policy copy; ``vllm``, a vLLM server this actor starts and
    owns (a child process, ended with it), from the policy saved into a directory of this node's own, to which each
    received version is written for the server's ``reload_weights``."""

    def __init__(self, cfg_data: dict, seed: int, threads: int = 1):
        import torch

        torch.set_num_threads(threads)
        from psrl.config import config_from_dict
        from psrl.models import build_policy, load_tokenizer
        from psrl.rollout.build import sampling_of
        from psrl.tasks import get_task
        from psrl.weights import tied_names

        cfg = config_from_dict(cfg_data)
        tok = load_tokenizer(cfg.model)
        task = get_task(cfg.task, seed=cfg.trainer.seed, tokenizer=tok, data=cfg.data)  # dataset / agent tasks
        policy = build_policy(cfg.model, task, seed=seed)
        self.tied = tied_names(policy.model.state_dict())
        """The model's tied names: a version's buckets hold each tied tensor once (:func:`psrl.weights.untie`)."""
        self.local: Path | None = None
        """vLLM: this node's directory of the server's model and of the versions received."""
        self.engine: Any
        if cfg.rollout.engine == "vllm":
            from psrl.rollout.engines.vllm import VLLMEngine
            from psrl.rollout.engines.vllm_fleet import server_of

            self.local = Path(tempfile.mkdtemp(prefix="psrl-vllm-actor-"))
            policy.save_pretrained(self.local / "model")
            server = server_of(cfg, policy, self.local / "model", self.local / "server.log")
            r = cfg.rollout
            self.engine = VLLMEngine(
                server=server, sampling=sampling_of(cfg, task), request_timeout_s=r.request_timeout_s
            )
        else:
            from psrl.rollout.engines.hf import HFEngine

            sampling = sampling_of(cfg, task)
            self.engine = HFEngine(policy, kv_after_update=cfg.rollout.kv_after_update, sampling=sampling)
        self.reqs: dict[str, GenRequest] = {}

    async def start(self) -> None:
        """Start the engine (vLLM: the server, bounded by ``rollout.vllm.startup_timeout_s``)."""
        await self.engine.start()

    async def restart(self) -> None:
        """vLLM: stop the server and start it again (its weights: none of psrl's until the next load)."""
        await self.engine.restart()

    async def close(self) -> None:
        """Stop the engine (vLLM: the server) and remove this node's directory."""
        try:
            await self.engine.close()
        finally:
            if self.local is not None:
                shutil.rmtree(self.local, ignore_errors=True)

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
        from psrl.runtime.ray_weights import receive, write_local
        from psrl.weights import FileVersions, ParameterStore, with_tied

        received = await receive(digest, buckets)
        store: FileVersions | ParameterStore
        if self.local is not None:  # vLLM reads a directory: this node's own
            store = FileVersions(self.local / "weights")
            await asyncio.to_thread(write_local, store.root, int(version), received, 2, self.tied)
        else:  # a tied tensor came once: put back under its aliases
            state = {k: v for b in received for k, v in b.items()}
            store = ParameterStore(keep=1)
            store.publish(int(version), with_tied(state, {a: c for a, c in self.tied.items() if a not in state}))
        del received
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
    """Client side of an :class:`EngineWorker` actor: a :class:`psrl.types.Engine`, one Ray call per request.

    Args:
        actor: the :class:`EngineWorker` actor.
        feed: the refs of the published versions' buckets.
        name: the instance and its node, for messages (``rollout instance 1 on node 5f3a...``).
        start_s: bound on the actor's creation and its engine's start.
        call_s: bound on a control call (a weight load: twice this).
        start_key: the key that sets the engine's own start-up bound (named when ``start_s`` is passed).
        seats: where the run's engine actors are (:meth:`rejoin`); None: the instance never rejoins.
        index: this instance's index among the seats.
    """

    def __init__(
        self,
        actor: Any,
        feed: ObjectVersions,
        version: int = -1,
        *,
        name: str = "a Ray engine actor",
        start_s: float = 600.0,
        call_s: float = 300.0,
        start_key: str = "rollout.request_timeout_s",
        seats: RolloutSeats | None = None,
        index: int = 0,
    ):
        self.actor = actor
        self.feed = feed
        self.version = int(version)
        self.name, self.start_s, self.call_s, self.start_key = name, float(start_s), float(call_s), start_key
        self.steps = 0
        self.tokens = 0
        self._ids = itertools.count()
        self._running: dict[str, GenRequest] = {}
        self.seats, self.index = seats, int(index)
        self.rejoins = 0
        """New engine actors this instance got (:meth:`rejoin`)."""

    async def _within(self, ref: Any, bound: float, what: str, key: str) -> Any:
        """``await ref``, or :class:`EngineStuck` after ``bound`` seconds (``key`` sets it). Not ``asyncio.wait_for``:
        on Python 3.11 a cancel that comes while the reply is arriving returns the reply and drops the cancel, and a
        rollout instance stopped during a weight load (its pause, load or resume answered just then) kept waiting
        for work that never came, so the run hung after its last step, the engine actors alive."""
        try:
            async with asyncio.timeout(bound):
                return await ref
        except TimeoutError:
            raise EngineStuck(self.name, f"no answer to {what} within {bound:g} s", f"raise {key}") from None
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # Ray's RayTaskError: the actor's own error, its message first
            if isinstance(cause, PsrlError):
                raise cause from exc
            raise

    async def start(self) -> None:
        await self._within(self.actor.start.remote(), self.start_s, "start", self.start_key)

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
            await self._within(self.actor.abort_all.remote(), self.call_s, "abort_all", "rollout.request_timeout_s")
        except ray.exceptions.RayActorError:  # the actor (or its node) is gone, and its requests with it
            pass

    async def pause(self) -> None:
        await self._within(self.actor.pause.remote(), self.call_s, "pause", "rollout.request_timeout_s")

    async def resume(self) -> None:
        await self._within(self.actor.resume.remote(), self.call_s, "resume", "rollout.request_timeout_s")

    async def update_weights(self, version: int, store: WeightSource) -> None:
        from psrl.weights import VersionDirectories

        if not isinstance(store, VersionDirectories):
            raise TypeError(f"Ray engine actors load what the ranks published: {type(store).__name__} is not that")
        store.directory(int(version))  # a version not published is a KeyError here, as before the actor is asked
        digest, buckets = self.feed.buckets(int(version), store)
        ref = self.actor.update_weights_from_refs.remote(int(version), digest, list(buckets))
        what = f"the load of version {int(version)}"
        self.version = int(await self._within(ref, 2 * self.call_s, what, "rollout.request_timeout_s"))

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), queued=0, tokens_per_s=0.0)

    async def rejoin(self) -> str | None:
        """Once a rollout node has room (looked for every ``seats.every_s``), a new engine actor there, which this
        engine then drives (to be started and loaded; the old actor is killed: gone with its node, or failed);
        returns where, and which attempt. None without seats or with their attempts spent: no new actor."""
        import ray

        seats = self.seats
        if seats is None or self.rejoins >= seats.attempts:
            return None
        while (node := seats.free(self.index, await asyncio.to_thread(seats.alive))) is None:
            await asyncio.sleep(seats.every_s)
        was = seats.nodes[self.index]
        self.rejoins += 1  # an attempt, whatever becomes of it
        self.version = -1
        ray.kill(self.actor)
        self.actor = seats.take(self.index, node)
        self.name = f"rollout instance {self.index} on node {node[:12]}"
        return (
            f"on node {node[:12]} with a new engine actor (attempt {self.rejoins}/{seats.attempts}; "
            f"the last one was on node {was[:12]})"
        )

    async def close(self) -> None:
        """Ask the actor to stop its engine (a vLLM server stops with its actor anyway), then end it."""
        import ray

        try:
            async with asyncio.timeout(CLOSE_S):
                await self.actor.close.remote()
        except (TimeoutError, ray.exceptions.RayError):
            pass  # gone already, or stuck: killed below
        ray.kill(self.actor)


class RestartingRayEngine(RayEngine):
    """A :class:`RayEngine` whose actor's engine restarts after a fault (vLLM: its server, as
    :meth:`psrl.rollout.engines.vllm.VLLMEngine.restart` locally); the instance loads the newest version after."""

    async def restart(self) -> None:
        await self._within(self.actor.restart.remote(), self.start_s, "restart", self.start_key)
        self.version = -1


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join) Ray once; local clusters bind to loopback with the dashboard off. No ``address``
    (``runtime.ray_address: null``) starts a cluster of this run's own even where another runs on the machine: Ray's
    default would join that one (``ray start``'s, or another run's)."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)


def build_ray_engines(
    cfg: Any, n: int, seed: int, feed: ObjectVersions, policy: Any = None, task: Any = None, run_dir: Any = None
) -> list[RayEngine]:
    """``n`` engine actors (sampling seeds ``seed + 1 + i``), placed by ``runtime.ray_pool_label`` (instance ``i``
    on the ``i mod k``-th of the ``k`` rollout nodes, its seat in :class:`~psrl.runtime.ray_placement.RolloutSeats`,
    from which it may rejoin; without the label where Ray puts them, no rejoin); the instances load each version from ``feed``, the
    refs of the buckets the trainer's ranks put into the object store."""
    import ray
    from psrl.config import config_to_dict
    from psrl.runtime.ray_placement import RolloutSeats, check_pools, pinned, rollout_nodes

    ensure_ray(cfg.runtime.ray_address)
    check_pools(cfg)
    remote_cls = ray.remote(num_cpus=0, max_restarts=0)(EngineWorker)
    data = config_to_dict(cfg)
    r = cfg.rollout
    vllm = r.engine == "vllm"
    kind = RestartingRayEngine if vllm else RayEngine
    bounds: dict[str, Any] = dict(start_s=r.request_timeout_s, call_s=r.request_timeout_s)
    if vllm:
        bounds.update(
            start_s=r.vllm.startup_timeout_s + r.request_timeout_s, start_key="rollout.vllm.startup_timeout_s"
        )
    label, rt = cfg.runtime.ray_pool_label, cfg.runtime
    if label is None:  # no pools: Ray places the actors, and an instance given up on stays so
        named = [(f"rollout instance {i}", remote_cls.remote(data, seed + 1 + i)) for i in range(n)]
        return [kind(actor, feed, name=name, **bounds) for name, actor in named]

    def spawn(i: int, node: str) -> Any:
        return remote_cls.options(scheduling_strategy=pinned(node)).remote(data, seed + 1 + i)

    seats = RolloutSeats(label, rollout_nodes(label, n), spawn, rt.ray_rejoin_attempts, rt.ray_rejoin_every_s)
    return [
        kind(spawn(i, node), feed, name=f"rollout instance {i} on node {node[:12]}", seats=seats, index=i, **bounds)
        for i, node in enumerate(seats.nodes)
    ]
