"""The trainer's side of ``weights.transport=collective`` (:mod:`psrl.weights.collective`): the driver hosts the
run's transfer group, the ranks send each version over it, and the receivers -- this process's own
(:class:`~psrl.weights.receivers.CollectiveVersions`, for the ``hf`` engines here) or the vLLM servers'
(:mod:`psrl.weights.vllm_receiver`, driven through their engines) -- take it, each in a thread of its own here,
while the ranks send.

The group is made at the first version sent: the ranks are members ``0 .. W-1``, the receivers ``W ..``; its
rendezvous store is served from the driver on loopback (the ranks of :class:`~psrl.train.launch.LocalRanks`, the
driver and the servers psrl starts share the machine). Every wait is bounded by ``trainer.rank_timeout_s``. A
version is committed (:meth:`CollectivePublisher.publish`) only once every receiver's digests match what the ranks
sent; a transfer that fails (a rank or a receiver gone, a timeout, a digest that differs) leaves the group -- the
next version makes a new one -- and raises, and the engines keep the version they serve.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from psrl.train.launch import RankFailure
from psrl.weights.collective import (
    BucketLayout,
    GroupAddress,
    TransferFailed,
    check_received,
    host_store,
    sent_manifest,
)
from psrl.weights.receivers import CollectiveVersions, Receiver, SentVersions

__all__ = ["CollectivePublisher"]

Call = Callable[[str, Any], list[Any]]
"""``(command, arg) -> every rank's reply``: :meth:`psrl.train.Trainer._call`'s shape."""


class CollectivePublisher:
    """Publish versions through the transfer group to ``receivers``; ``out`` (what the engines read) holds a version
    once every receiver has it, checked.

    Args:
        out: :class:`CollectiveVersions` (itself the one receiver) or :class:`SentVersions` (manifests only).
        receivers: the group's receiving members, in group-rank order after the ranks.
        world_size: the trainer's ranks (the senders).
        timeout_s: the bound on every wait (``trainer.rank_timeout_s``).
        bucket_mb: ``weights.bucket_mb``.
    """

    def __init__(
        self,
        out: CollectiveVersions | SentVersions,
        receivers: Sequence[Receiver],
        world_size: int,
        timeout_s: float,
        bucket_mb: float,
    ):
        if not receivers:
            raise ValueError("the collective transport needs at least one receiver")
        self.out, self.receivers = out, list(receivers)
        self.world_size, self.timeout_s, self.bucket_mb = world_size, timeout_s, bucket_mb
        self._store: Any = None
        """The group's rendezvous store, served from here while the group lives."""
        self._buckets: tuple[BucketLayout, ...] | None = None
        self._tied: dict[str, str] = {}
        """The model's tied names (sent once, under the canonical name): the manifest's ``tied``."""

    def publish(self, call: Call, version: int, dtype: torch.dtype) -> int:
        """Send ``version`` from the ranks (``call``: every rank's reply to a command) to every receiver; the bytes
        one receiver got. ``VersionDamaged`` when a receiver's digests differ from the ranks';
        :class:`TransferFailed` or the ranks' :class:`~psrl.train.launch.RankFailure` when the transfer broke."""
        if self._buckets is None:
            self._buckets = self._join(call, dtype)
        buckets, world = self._buckets, self.world_size
        got = [
            _in_thread(lambda r=r: r.receive(version, buckets, world), f"psrl-receive-v{version}")  # type: ignore[misc]
            for r in self.receivers
        ]
        try:
            sent = call("send", (self.bucket_mb, dtype, [world + i for i in range(len(self.receivers))]))
        except BaseException:
            self.leave(None)  # the receivers' waits end at once: their groups are closed
            raise
        finally:
            results = [wait() for wait in got]
        manifest = sent_manifest(version, [rec for part in sent for rec in part], self._tied)
        try:
            for r, digests in zip(self.receivers, results):
                if isinstance(digests, BaseException):
                    raise TransferFailed(f"{r.name}: version {version}: {digests}") from digests
                check_received(r.name, version, digests, manifest)
        except BaseException:
            self.leave(call)
            raise
        self.out.commit(version, manifest)
        return int(manifest["bytes"])

    def _join(self, call: Call, dtype: torch.dtype) -> tuple[BucketLayout, ...]:
        """Make the group (the ranks and every receiver join at once) and learn the buckets' layout from rank 0."""
        self._store, port = host_store("127.0.0.1", self.timeout_s)
        size = self.world_size + len(self.receivers)
        address = GroupAddress("127.0.0.1", port, size, f"psrl/transfer/{port}", self.timeout_s)
        joined = [
            _in_thread(lambda i=i, r=r: r.join(address, self.world_size + i), "psrl-transfer-join")  # type: ignore[misc]
            for i, r in enumerate(self.receivers)
        ]
        try:
            call("join_transfer", address)
        finally:
            failed = [(r, wait()) for r, wait in zip(self.receivers, joined)]
        for r, exc in failed:
            if isinstance(exc, BaseException):
                self.leave(call)
                raise TransferFailed(f"{r.name}: could not join the transfer group: {exc}") from exc
        buckets, self._tied = call("transfer_layout", (self.bucket_mb, dtype))[0]
        return tuple(buckets)

    def leave(self, call: Call | None) -> None:
        """Leave the group, here and, with ``call``, on the ranks (a later version makes a new one); None: the ranks
        failed or stop (their membership ends with them)."""
        if self._buckets is None and self._store is None:
            return
        self._buckets, self._store = None, None
        for r in self.receivers:
            try:
                r.close()
            except Exception:  # noqa: BLE001 -- a receiver that is gone has left already
                pass
        if call is not None:
            try:
                call("leave_transfer", None)
            except RankFailure:
                pass  # the ranks are gone: so is their membership


def _in_thread(fn: Callable[[], Any], name: str) -> Callable[[], Any]:
    """Start ``fn`` in a thread; returns a function that waits for it and gives its result or the exception it
    raised (its waits are bounded, so the join is)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            out.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        return out[0]

    return wait
