"""Trainer ranks as Ray actors (issue #22, item 1, the Ray launcher): ``runtime.backend=ray`` with a world size
(``psrl.deployment.train_nnodes x train_ngpus_per_node``) above 1.

:class:`RayRanks` is :class:`~psrl.train.launch.LocalRanks`' sibling behind the same
:class:`~psrl.train.launch.Ranks` interface, so :class:`~psrl.train.Trainer` is the same trainer
under either launcher. It reserves one placement-group bundle per rank (:func:`rank_bundles`: one GPU each with
``model.device=cuda``, one CPU each otherwise), starts one :class:`RankActor` per bundle, asks rank 0 for the
rendezvous address (its node's address and a port free there) and gives it to every rank, which then joins the
process group and builds its :class:`~psrl.train.worker.RankWorker` exactly as a local rank process does
(:func:`~psrl.train.launch.join_group`). A command is one remote call per rank, awaited together in an asyncio
loop (:meth:`RayRanks.acall`; :meth:`RayRanks.call` runs that loop in a helper thread, so it may be called from
the coordinator's training thread or, while a run is built, from the driver's own loop thread).

Faults are :class:`~psrl.train.launch.RankFailure` naming the rank, never a hang: every command is bounded by
``reply_timeout_s`` (``trainer.rank_timeout_s``); silence is told apart from a long command as
:class:`~psrl.train.launch.LocalRanks` does, with a heartbeat: while a command runs the driver pings each rank that
has not answered every ``WorkerSpec.heartbeat_s`` (``trainer.rank_heartbeat_s``; the actor runs two threads, so a
ping is answered while the command computes or waits in a collective), and a rank whose pings go unanswered for
:data:`~psrl.train.launch.SILENT_BEATS` periods (stopped, hung, its node gone: Ray's own checks see a dead actor
process, not a stopped one) is named alone, its peers blocked behind it named as alive and waiting; a dead actor is reported as soon as Ray sees it, even when a
peer's collective failed first (the peers of a dead rank are waited for a few seconds more to tell cause from
effect); then every actor is killed and the placement group removed. Each rank's stdout and stderr go to
``log_dir/rank{r}.log``; on one node the error quotes its tail (across nodes the file is on the rank's node).

The Ray processes are Ray's: a rank is a worker of the raylet, not a child of psrl; a cluster ``psrl`` started
itself (no ``runtime.ray_address``) ends with the driver.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from psrl.errors import ConfigError
from psrl.runtime.ray_placement import TRAINER, describe, pool_nodes
from psrl.runtime.ray_runtime import ensure_ray
from psrl.runtime.ray_weights import Bucket, ObjectVersions, put_owned
from psrl.train.launch import (
    SILENT_BEATS,
    Launcher,
    RankFailure,
    RankGroup,
    join_group,
    leave_group,
    redirect_output,
    silence_report,
)
from psrl.train.worker import RankWorker, WorkerSpec

__all__ = ["RayRanks", "RankActor", "rank_bundles", "ray_launcher"]

GRACE_S = 10.0
"""After one rank fails, how long the others are still waited for, so that a rank that died is named rather than
the peer whose collective failed because of it."""


def rank_bundles(world_size: int, device: str) -> list[dict[str, float]]:
    """The placement group of ``world_size`` ranks: one bundle per rank, one GPU (and one CPU) each on CUDA, one
    CPU each otherwise (a CPU rank runs one torch thread)."""
    if world_size < 1:
        raise ValueError(f"rank_bundles: world_size must be >= 1, got {world_size}")
    one = {"CPU": 1.0, "GPU": 1.0} if device.startswith("cuda") else {"CPU": 1.0}
    return [dict(one) for _ in range(world_size)]


class RankActor:
    """One trainer rank in a Ray actor process (a plain class, wrapped with ``ray.remote`` where it is created)."""

    def __init__(self, spec: WorkerSpec, rank: int, world_size: int, log: str | None):
        redirect_output(log)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.worker: RankWorker | None = None
        self.puts: dict[int, list[Bucket]] = {}
        """The refs of the buckets this rank put, for the newest versions (they live while this holds them)."""

    def pid(self) -> int:
        import os

        return os.getpid()

    def where(self) -> tuple[str, int]:
        """This actor's Ray node id and process id."""
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def read(self, path: str) -> str | None:
        """The text of ``path`` on this rank's node (None if it cannot be read here)."""
        try:
            return Path(path).read_text()
        except OSError:
            return None

    def ping(self) -> bool:
        """The heartbeat: answered by the actor's second thread while a command runs in the first."""
        return True

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's choice of the process group's address: this node's address and a port free on it."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def start(self, host: str, port: int) -> str:
        """Join the process group at ``host:port`` (Ray gives each GPU actor its one GPU as ``cuda:0``), then
        build the rank's model and optimizer."""
        join_group(self.spec, self.rank, self.world_size, f"tcp://{host}:{port}", cuda_index=0)
        self.worker = RankWorker(self.spec, self.rank, self.world_size)
        return "ready"

    def handle(self, cmd: str, arg: Any = None) -> Any:
        """One command of :data:`~psrl.train.worker.COMMANDS`; an error is printed to the rank's log and raised
        (the driver gets it with the traceback)."""
        if self.worker is None:
            raise RuntimeError(f"trainer rank {self.rank}: a command before start()")
        try:
            out = self.worker.handle(cmd, arg)
            if cmd == "publish":  # the buckets this rank wrote, into its node's object store (ray_weights.py)
                version, root, keep = int(arg[0]), arg[1], int(arg[2])
                _, digest, mine = put_owned(Path(root) / f"v{version}", self.rank, self.world_size)
                self.puts[version] = mine
                for old in sorted(self.puts)[: -max(keep, 1)]:
                    del self.puts[old]
                out = {**out, "digest": digest, "buckets": mine}
            return out
        except Exception:
            print(traceback.format_exc(), flush=True)
            raise

    def close(self) -> None:
        leave_group()


class RayRanks(RankGroup):
    """``world_size`` trainer ranks as Ray actors in one placement group (see the module docstring).

    Args:
        spec: what every rank builds itself from.
        world_size: ranks, at least 2.
        reply_timeout_s: bound on the placement, on the start and on every command's replies.
        log_dir: where ``rank{r}.log`` go (a temporary directory when None).
        address: ``runtime.ray_address`` (None: the Ray cluster this process runs, or a local one started here).
        pool_label: ``runtime.ray_pool_label``: the ranks go to nodes labelled ``<label>=trainer`` (None: anywhere).
        feed: where the refs of each published version's buckets are recorded for the engine actors.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        world_size: int,
        reply_timeout_s: float = 300.0,
        log_dir: str | Path | None = None,
        address: str | None = None,
        pool_label: str | None = None,
        feed: ObjectVersions | None = None,
    ):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        import ray

        super().__init__(world_size, reply_timeout_s, log_dir)
        self.heartbeat_s = spec.heartbeat_s
        ensure_ray(address)
        bundles = rank_bundles(world_size, spec.device)
        self.feed = feed
        selector = [{pool_label: TRAINER} for _ in bundles] if pool_label else None
        self.pg: Any = placement_group(bundles, strategy="PACK", bundle_label_selector=selector)
        self.actors: list[Any] = []
        self.nodes: list[str] = []
        if not ray.wait([self.pg.ready()], timeout=reply_timeout_s)[0]:
            have = ray.cluster_resources()
            pools = (
                ""
                if pool_label is None
                else f" on nodes labelled {pool_label}={TRAINER} ({describe(pool_nodes(pool_label), pool_label)})"
            )
            self.kill()
            raise ConfigError(
                "psrl.deployment.train_ngpus_per_node",
                f"asks for {world_size} ranks of {bundles[0]}{pools}, which the Ray cluster "
                f"(CPU {have.get('CPU', 0):g}, GPU {have.get('GPU', 0):g}) could not place within "
                f"{reply_timeout_s:g} s",
                "set fewer ranks (train_nnodes x train_ngpus_per_node), or add nodes to the cluster",
            )
        gpus = bundles[0].get("GPU", 0.0)
        remote = ray.remote(RankActor)
        try:  # whatever stops the start (a rank killed, Ray's OutOfMemoryError): no actor or placement group stays
            for rank in range(world_size):
                where = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
                # two threads: a command in one, the heartbeat's ping in the other (the driver sends one at a time)
                opts = dict(num_cpus=1, num_gpus=gpus, scheduling_strategy=where, max_restarts=0, max_concurrency=2)
                log = str(self.log_path(rank))
                self.actors.append(remote.options(**opts).remote(spec, rank, world_size, log))
            self.nodes = [node for node, _ in self._run(lambda: [a.where.remote() for a in self.actors])]
            self._check_shared()
            host, port = self._run(lambda: [self.actors[0].rendezvous.remote()])[0]
            self._run(lambda: [a.start.remote(host, port) for a in self.actors])
        except BaseException:
            self.kill()
            raise

    def _check_shared(self) -> None:
        """Every rank must see the run directory the driver writes (``weights/start.pt``, ``weights/``,
        ``checkpoint/``): a file written here, read by each rank on its node; one ConfigError naming the nodes
        that do not see it."""
        token = uuid.uuid4().hex
        probe = self.log_dir / f".shared-{token}"
        probe.write_text(token)
        try:
            seen = self._run(lambda: [a.read.remote(str(probe)) for a in self.actors])
        finally:
            probe.unlink(missing_ok=True)
        blind = [r for r, text in enumerate(seen) if text != token]
        if blind:
            self.kill()
            nodes = ", ".join(sorted({self.nodes[r][:12] for r in blind}))
            raise ConfigError(
                "trainer.run_dir",
                f"{self.log_dir.parent} is not visible from the trainer node(s) {nodes} (ranks "
                f"{', '.join(map(str, blind))}): the ranks read weights/start.pt and write weights/ and checkpoint/ "
                "there",
                "put trainer.run_dir on a filesystem that the driver's node and every trainer node mount",
            )

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (on their nodes)."""
        return [int(p) for p in self._run(lambda: [a.pid.remote() for a in self.actors])]

    def call(self, cmd: str, arg: Any = None) -> list[Any]:
        """Every rank's result of ``(cmd, arg)``, in rank order (blocking: :meth:`acall` in a helper thread)."""
        with ThreadPoolExecutor(1, thread_name_prefix="psrl-ray-ranks") as pool:
            return pool.submit(asyncio.run, self.acall(cmd, arg)).result()

    async def acall(self, cmd: str, arg: Any = None) -> list[Any]:
        """Every rank's result of ``(cmd, arg)``: one remote call per rank, awaited together."""
        import ray

        shared = ray.put(arg)  # one copy of the batch in the object store, not one per rank
        replies = await self._gather([a.handle.remote(cmd, shared) for a in self.actors], cmd)
        if cmd == "publish":  # the refs of every rank's buckets, for the engine actors; the trainer sees the summary
            buckets = [b for reply in replies for b in reply.pop("buckets")]
            if self.feed is not None:
                self.feed.record(int(arg[0]), replies[0]["digest"], buckets)
        return replies

    def _run(self, refs: Any) -> list[Any]:
        """:meth:`_gather` of the remote calls ``refs()`` makes, from synchronous code."""

        async def go() -> list[Any]:
            return await self._gather(refs())

        with ThreadPoolExecutor(1, thread_name_prefix="psrl-ray-ranks") as pool:
            return pool.submit(asyncio.run, go()).result()

    async def _gather(self, refs: list[Any], cmd: str | None = None) -> list[Any]:
        """Every reply within one ``reply_timeout_s`` deadline, waking on each reply or failure and, for a command
        (``cmd``; not while the actors start: importing torch may hold a process for seconds), every heartbeat
        period to look for a rank whose pings went unanswered for :data:`~psrl.train.launch.SILENT_BEATS` periods."""
        waits = {asyncio.ensure_future(_outcome(ref)): r for r, ref in enumerate(refs)}
        got: dict[int, tuple[str, Any]] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reply_timeout_s
        heard = {r: loop.time() for r in range(len(refs))}  # when each rank last answered a ping
        pings = [asyncio.ensure_future(self._pings(r, heard)) for r in range(len(refs))] if cmd is not None else []
        pending = set(waits)
        try:
            while pending:
                wake = deadline - loop.time() if cmd is None else min(deadline - loop.time(), self.heartbeat_s)
                done, pending = await asyncio.wait(pending, timeout=max(0.0, wake), return_when=asyncio.FIRST_COMPLETED)
                got.update({waits[t]: t.result() for t in done})
                if any(status != "ok" for status, _ in got.values()):
                    if pending:  # a peer of a dead rank fails its collective first: wait a little for the cause
                        done, pending = await asyncio.wait(pending, timeout=min(GRACE_S, deadline - loop.time()))
                        got.update({waits[t]: t.result() for t in done})
                    for t in pending:
                        t.cancel()
                    self._fail_from(got)
                waiting = sorted(waits[t] for t in pending)
                if cmd is not None and waiting:
                    self._check_silence(waiting, heard, loop.time(), cmd)
                if waiting and loop.time() >= deadline:
                    names = ", ".join(map(str, waiting))
                    what = f"did not finish {cmd!r}" if cmd is not None else "did not answer"
                    self._fail(waiting[0], f"{what} within {self.reply_timeout_s:g} s (still working: {names})")
        finally:
            for ping in pings:
                ping.cancel()
        return [got[r][1] for r in range(len(refs))]

    async def _pings(self, rank: int, heard: dict[int, float]) -> None:
        """Ping ``rank`` every heartbeat period while a command runs; ``heard[rank]``: when it last answered."""
        loop = asyncio.get_running_loop()
        actor = self.actors[rank]
        while True:
            if (await _outcome(actor.ping.remote()))[0] == "ok":
                heard[rank] = loop.time()
            await asyncio.sleep(self.heartbeat_s)

    def _check_silence(self, waiting: list[int], heard: dict[int, float], now: float, cmd: str) -> None:
        """Fail naming the first rank of ``waiting`` unheard for :data:`~psrl.train.launch.SILENT_BEATS` heartbeat
        periods; the others are named as alive and waiting (behind it, in a collective)."""
        silent = [r for r in waiting if now - heard[r] > SILENT_BEATS * self.heartbeat_s]
        if silent:
            others = [r for r in waiting if r not in silent]
            self._fail(silent[0], silence_report(cmd, now - heard[silent[0]], self.heartbeat_s, silent, others))

    def _fail_from(self, got: dict[int, tuple[str, Any]]) -> NoReturn:
        """Raise for the first dead rank, else for the first that failed."""
        for want in ("died", "failed"):
            for rank in sorted(got):
                status, what = got[rank]
                if status == want:
                    if want == "died":
                        node = self._node(rank, wait=what == "ActorUnavailableError")
                        self._fail(rank, f"died ({what}) with its node {node}")
                    self._fail(rank, "failed", what)
        raise AssertionError(f"_fail_from: no failed rank in {sorted(got)}")

    def _node(self, rank: int, wait: bool = False) -> str:
        """Rank ``rank``'s Ray node: its id, its address and whether Ray counts it alive. A node that stopped
        answering is declared dead by Ray's health check (``health_check_period_ms`` x
        ``health_check_failure_threshold``), which may come after the actor is reported unavailable: its verdict is
        waited for up to :data:`GRACE_S`."""
        import ray

        nid = self.nodes[rank] if rank < len(self.nodes) else "?"
        deadline = time.monotonic() + (GRACE_S if wait else 0.0)
        while True:
            node: dict = next((n for n in ray.nodes() if n["NodeID"] == nid), {})
            if not node.get("Alive") or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        state = "alive" if node.get("Alive") else "dead"
        return f"{nid[:12]} at {node.get('NodeManagerAddress', '?')} ({state})"

    def _fail(self, rank: int, what: str, tail: str | None = None) -> NoReturn:
        self.kill()
        raise RankFailure(rank, what, tail if tail is not None else self._tail(rank))

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to leave the group, then end the actors and free the placement group."""
        import ray

        if self.actors:
            ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """End every actor (a rank blocked in a collective cannot be asked) and remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


async def _outcome(ref: Any) -> tuple[str, Any]:
    """``("ok", value)``, ``("died", why)`` (the actor is gone) or ``("failed", traceback)`` of one remote call."""
    import ray

    try:
        return "ok", await ref
    except ray.exceptions.RayActorError as e:
        return "died", type(e).__name__
    except ray.exceptions.RayTaskError as e:
        return "failed", str(e).strip()


def ray_launcher(address: str | None, pool_label: str | None = None, feed: ObjectVersions | None = None) -> Launcher:
    """The :data:`~psrl.train.launch.Launcher` of ``runtime.backend=ray``: :class:`RayRanks` on the cluster at
    ``address`` (``runtime.ray_address``; None: a local one), on the trainer pool of ``pool_label``, recording
    each version's bucket refs in ``feed``."""
    return functools.partial(RayRanks, address=address, pool_label=pool_label, feed=feed)
