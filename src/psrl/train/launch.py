"""Start trainer ranks on this machine and talk to them (issue #22, item 1, the local launcher).

:class:`LocalRanks` spawns ``world_size`` processes running :func:`serve` (a :class:`~psrl.train.worker.RankWorker`
answering commands), one pipe each, and
:meth:`LocalRanks.call` sends every rank the same command and waits -- bounded -- for every reply. A rank that dies
or errs raises :class:`RankFailure` naming the rank, its exit code and the tail of its log, and every rank is then
killed: never a hang, never a rank left behind. Silence is told apart from a long command: each rank's side thread
beats every ``WorkerSpec.heartbeat_s`` (``trainer.rank_heartbeat_s``) into shared memory, so a rank that misses
:data:`SILENT_BEATS` beats (stopped, hung, its machine gone) is named -- alone, not the peers blocked behind it in a
collective, which keep beating -- while a rank that beats may run one command for up to ``reply_timeout_s``
(``trainer.rank_timeout_s``).

The ranks die with the driver, SIGKILL included (:mod:`psrl.lifeline`, what a rank runs before it imports torch):
the kernel kills each one when the driver's thread that started it ends (``PR_SET_PDEATHSIG``), so
:class:`LocalRanks` starts them from a thread of its own that lives as long as they do; each rank also exits when
it finds itself re-parented (its side thread compares ``getppid()`` with the driver's pid, passed in: no race
with a driver that dies while the rank is starting).

:class:`InProcess` is world size 1: the same :class:`~psrl.train.worker.RankWorker` in the driver, no process group.
Both answer ``call`` (blocking) and ``acall`` (awaitable: the blocking wait runs in a thread, so the coordinator's
event loop keeps serving while the ranks train).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol, Self

import torch
import torch.distributed as dist

from psrl import lifeline
from psrl.heap import return_freed_memory
from psrl.train.worker import RankWorker, WorkerSpec

__all__ = [
    "RankFailure",
    "Ranks",
    "Launcher",
    "LocalRanks",
    "RankGroup",
    "InProcess",
    "free_port",
    "serve",
    "SILENT_BEATS",
    "join_group",
    "leave_group",
    "redirect_output",
]

LOG_TAIL = 20
"""Lines of a failed rank's log quoted in the error."""

Beats = Any
"""``beats[rank]``: a shared array of unsigned counters (``multiprocessing``'s ``Array("Q", world_size)``)."""

SILENT_BEATS = 3
"""Heartbeats a rank may miss before the driver reports it silent (``3 x trainer.rank_heartbeat_s``)."""


class RankFailure(RuntimeError):
    """A trainer rank died, failed a command or did not answer in time; ``rank`` says which. ``command_failed``:
    the rank ran the command and it raised (its input may be at fault), not a rank that died or went silent."""

    def __init__(self, rank: int, what: str, tail: str = ""):
        self.rank = rank
        self.command_failed = what == "failed"
        super().__init__(f"trainer rank {rank} {what}" + (f"; its log ends:\n{tail}" if tail else ""))


class Ranks(Protocol):
    """The driver's handle on the trainer ranks, whoever started them (:class:`LocalRanks`, the Ray launcher
    :class:`psrl.runtime.ray_ranks.RayRanks`, :class:`InProcess`): every rank gets the same command, the replies come
    back in rank order; a failure is a :class:`RankFailure` after which no rank is left running."""

    world_size: int

    def call(self, cmd: str, arg: Any = None) -> list[Any]: ...

    async def acall(self, cmd: str, arg: Any = None) -> list[Any]: ...

    def close(self) -> None: ...


Launcher = Callable[[WorkerSpec, int, float, Path], Ranks]
"""How :class:`~psrl.train.Trainer` starts its ranks: ``(spec, world_size, reply_timeout_s,
log_dir) -> Ranks``; :class:`LocalRanks` by default."""


def silence_report(cmd: str, quiet_s: float, heartbeat_s: float, silent: list[int], others: list[int]) -> str:
    """What a rank group reports of ``silent[0]`` (named alone; ``others``: the ranks alive and waiting)."""
    return (
        f"went silent during {cmd!r}: no heartbeat for {quiet_s:.1f} s "
        f"(trainer.rank_heartbeat_s={heartbeat_s:g}; stopped or hung)"
        + (f"; silent ranks: {', '.join(map(str, silent))}" if len(silent) > 1 else "")
        + (f"; alive and waiting: {', '.join(map(str, others))}" if others else "")
    )


def free_port() -> int:
    """A free TCP port on the loopback interface (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class InProcess:
    """World size 1: the rank worker in the driver's own process (what the default job runs)."""

    world_size = 1

    def __init__(self, spec: WorkerSpec):
        self.worker = RankWorker(spec, 0, 1)

    def call(self, cmd: str, arg: Any = None) -> list[Any]:
        """``[result]``: the same shape as :meth:`LocalRanks.call`."""
        return [self.worker.handle(cmd, arg)]

    async def acall(self, cmd: str, arg: Any = None) -> list[Any]:
        """:meth:`call` in a worker thread, so an asyncio driver's loop keeps running while the step does."""
        return await asyncio.to_thread(self.call, cmd, arg)

    def close(self) -> None:
        """Nothing to stop."""


class RankGroup:
    """What both multi-rank launchers share (:class:`LocalRanks`, :class:`psrl.runtime.ray_ranks.RayRanks`): the
    rank count, the bound on every reply, one log file per rank (quoted in a :class:`RankFailure`)."""

    def __init__(self, world_size: int, reply_timeout_s: float, log_dir: str | Path | None):
        if world_size < 2:
            raise ValueError(f"{type(self).__name__} needs world_size >= 2 (1 runs InProcess), got {world_size}")
        self.world_size = world_size
        self.reply_timeout_s = reply_timeout_s
        self.log_dir = Path(log_dir) if log_dir is not None else lifeline.own_directory(self, "psrl-ranks-")
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, rank: int) -> Path:
        """Where rank ``rank``'s stdout and stderr go (on its node)."""
        return self.log_dir / f"rank{rank}.log"

    def _tail(self, rank: int) -> str:
        try:
            lines = self.log_path(rank).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL:])

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRanks(RankGroup):
    """``world_size`` rank processes on this machine (spawned, so nothing of the driver's state is inherited),
    started from a thread of their own that ends only after they do (``PR_SET_PDEATHSIG`` follows that thread)."""

    def __init__(
        self,
        spec: WorkerSpec,
        world_size: int,
        reply_timeout_s: float = 300.0,
        log_dir: str | Path | None = None,
    ):
        super().__init__(world_size, reply_timeout_s, log_dir)
        self.heartbeat_s = spec.heartbeat_s
        ctx = mp.get_context("spawn")
        self.beats: Beats = ctx.Array("Q", world_size, lock=False)
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        self._released = threading.Event()
        started = threading.Event()
        failed: list[BaseException] = []
        self._holder = threading.Thread(
            target=self._start_and_hold, args=(ctx, spec, started, failed), name="psrl-ranks", daemon=True
        )
        self._holder.start()
        started.wait()
        if failed:
            self.kill()
            raise failed[0]
        self._gather("start", heartbeats=False)  # "ready" once a rank's model is built and loaded; importing
        # torch holds the interpreter's lock for seconds at a time (its libraries loading): no beats then

    def _start_and_hold(self, ctx: Any, spec: WorkerSpec, started: threading.Event, failed: list) -> None:
        """The ranks' parent thread: spawn them, then wait until :meth:`kill` has reaped them. Were this thread to
        end first, the kernel would SIGKILL the ranks (their parent-death signal fires when the thread that forked
        them exits, not the process)."""
        try:
            port = free_port()
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe()
                log = str(self.log_path(rank))
                payload = pickle.dumps((serve, (spec, rank, self.world_size, port, log)))
                args = (os.getpid(), self.beats, rank, spec.heartbeat_s, payload, theirs)
                p = ctx.Process(target=lifeline.run, args=args, daemon=True, name=f"psrl-rank{rank}")
                p.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(p)
        except BaseException as exc:  # noqa: BLE001 -- handed to the constructor, which raises it
            failed.append(exc)
        finally:
            started.set()
        self._released.wait()

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def call(self, cmd: str, arg: Any = None) -> list[Any]:
        """Send ``(cmd, arg)`` to every rank, then every rank's result, in rank order."""
        for rank, c in enumerate(self.conns):
            try:
                c.send((cmd, arg))
            except (BrokenPipeError, OSError):
                self._fail(rank, f"is gone (exit code {self.procs[rank].exitcode})")
        return self._gather(cmd)

    async def acall(self, cmd: str, arg: Any = None) -> list[Any]:
        """:meth:`call` in a worker thread: the driver's event loop is not blocked while the ranks work."""
        return await asyncio.to_thread(self.call, cmd, arg)

    def _gather(self, cmd: str, heartbeats: bool = True) -> list[Any]:
        """Every rank's reply to ``cmd`` within one ``reply_timeout_s`` deadline. The wait wakes on a reply, on a
        rank's death (its process sentinel: reported at once) and every heartbeat period, to look for a rank
        whose beats stopped for :data:`SILENT_BEATS` periods (with ``heartbeats``; else the deadline alone)."""
        out: dict[int, Any] = {}
        now = time.monotonic()
        deadline = now + self.reply_timeout_s
        silence = SILENT_BEATS * self.heartbeat_s
        heard = {r: (self.beats[r], now) for r in range(self.world_size)}  # last beat count, when it changed
        while len(out) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in out]
            ready = wait(
                [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                timeout=max(0.0, min(deadline - time.monotonic(), self.heartbeat_s)),
            )
            for r in pending:
                c, p = self.conns[r], self.procs[r]
                if c.poll():
                    try:
                        status, value = c.recv()
                    except (EOFError, OSError):
                        p.join(timeout=5)
                        self._fail(r, f"died (exit code {p.exitcode})")
                    if status != "ok":
                        self._fail(r, "failed", str(value).strip())
                    out[r] = value
                elif not p.is_alive():
                    self._fail(r, f"died (exit code {p.exitcode})")
            if ready:
                continue
            now = time.monotonic()
            for r in pending:
                if self.beats[r] != heard[r][0]:
                    heard[r] = (self.beats[r], now)
            silent = [r for r in pending if heartbeats and r not in out and now - heard[r][1] > silence]
            if silent:
                others = [r for r in pending if r not in out and r not in silent]
                self._fail(silent[0], silence_report(cmd, now - heard[silent[0]][1], self.heartbeat_s, silent, others))
            if now >= deadline:
                names = ", ".join(str(r) for r in pending if r not in out)
                self._fail(
                    pending[0],
                    f"did not finish {cmd!r} within {self.reply_timeout_s:g} s (trainer.rank_timeout_s; "
                    f"still working: {names})",
                )
        return [out[r] for r in range(self.world_size)]

    def _fail(self, rank: int, what: str, tail: str | None = None) -> None:
        """Kill every rank and raise, naming the rank that died first if one did: a peer's death makes the
        others' collectives fail too, and the error should point at the cause."""
        dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and p.exitcode not in (None, 0)]
        if dead and rank not in dead:
            rank, what, tail = dead[0], f"died (exit code {self.procs[dead[0]].exitcode})", None
        self.kill()
        raise RankFailure(rank, what, tail if tail is not None else self._tail(rank))

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to stop; kill those that have not within ``timeout_s``."""
        for c in self.conns:
            try:
                c.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still alive (a rank blocked in a collective cannot be asked); then the thread that
        started them may end."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for c in self.conns:
            c.close()
        self._released.set()


def serve(conn: Connection, spec: WorkerSpec, rank: int, world_size: int, port: int, log: str | None) -> None:
    """The rank process (started through :func:`psrl.lifeline.run`: it dies with the driver and beats): join the
    group, then answer ``(command, arg)`` messages with ``("ok", result)`` or ``("error", traceback)`` until
    ``("close", None)`` or the driver goes away (pipe closed). ``log``: a file that takes its stdout and stderr."""
    redirect_output(log)
    join_group(spec, rank, world_size, f"tcp://127.0.0.1:{port}", cuda_index=rank)
    try:
        try:
            worker = RankWorker(spec, rank, world_size)
            conn.send(("ok", "ready"))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return
        _loop(conn, worker)
    finally:
        leave_group()


def redirect_output(log: str | None) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to the file ``log`` (appended)."""
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)


def join_group(spec: WorkerSpec, rank: int, world_size: int, init_method: str, cuda_index: int) -> None:
    """What every rank process does before building its :class:`~psrl.train.worker.RankWorker`, whichever launcher
    started it: one thread for torch, then (world size > 1) the process group -- NCCL on CUDA (``cuda_index``: this
    rank's GPU as the process sees it), gloo on CPU -- with ``spec.collective_timeout_s`` on every collective; its
    heap returns what it frees (:mod:`psrl.heap`)."""
    return_freed_memory()
    torch.set_num_threads(1)
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    if world_size > 1:
        if backend == "nccl":
            torch.cuda.set_device(cuda_index)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )


def leave_group() -> None:
    """The end of a rank process: the process group destroyed, its output flushed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def _loop(conn: Connection, worker: RankWorker) -> None:
    while True:
        try:
            cmd, arg = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if cmd == "close":
            conn.send(("ok", None))
            return
        try:
            result = worker.handle(cmd, arg)
        except Exception:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))
