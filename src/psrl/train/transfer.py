"""The trainer's side of ``weights.transport=collective`` (:mod:`psrl.weights.collective`): the driver hosts the
run's transfer group, the ranks send each version over it, and this process's receiver -- the ``hf`` engines' --
takes it in a thread of its own while the ranks send.

The group is made at the first version: the ranks are members ``0 .. W-1``, the driver's receiver ``W``; its
rendezvous store is served from the driver on loopback (the ranks of :class:`~psrl.train.launch.LocalRanks` and the
driver share the machine). Every wait is bounded by ``trainer.rank_timeout_s``. A transfer that fails (a rank gone,
a timeout, a digest that differs) leaves the group -- the next version makes a new one -- and raises; the receiver
holds only versions that arrived whole and checked, so the engines keep theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from psrl.train.launch import RankFailure
from psrl.weights.collective import (
    BucketLayout,
    CollectiveVersions,
    GroupAddress,
    TransferFailed,
    host_store,
    sent_manifest,
)

__all__ = ["CollectivePublisher"]

Call = Callable[[str, Any], list[Any]]
"""``(command, arg) -> every rank's reply``: :meth:`psrl.train.Trainer._call`'s shape."""


class CollectivePublisher:
    """Publish versions through the transfer group into ``out`` (this process's receiver).

    Args:
        out: the receiver the engines here read from.
        world_size: the trainer's ranks (the senders).
        timeout_s: the bound on every wait (``trainer.rank_timeout_s``).
        bucket_mb: ``weights.bucket_mb``.
    """

    def __init__(self, out: CollectiveVersions, world_size: int, timeout_s: float, bucket_mb: float):
        self.out, self.world_size, self.timeout_s, self.bucket_mb = out, world_size, timeout_s, bucket_mb
        self._store: Any = None
        """The group's rendezvous store, served from here while the group lives."""
        self._buckets: tuple[BucketLayout, ...] | None = None

    def publish(self, call: Call, version: int, dtype: torch.dtype) -> int:
        """Send ``version`` from the ranks (``call``: every rank's reply to a command) to the receiver; the bytes it moved. The receiver holds it once its
        digests match what the ranks sent (else ``VersionDamaged``; a broken transfer: :class:`TransferFailed` or
        the ranks' :class:`~psrl.train.launch.RankFailure`)."""
        if self._buckets is None:
            self._buckets = self._join(call, dtype)
        buckets = self._buckets
        got = _in_thread(lambda: self.out.receive(version, buckets, self.world_size), f"psrl-receive-v{version}")
        try:
            sent = call("send", (self.bucket_mb, dtype, [self.world_size]))
        except BaseException:
            self.leave(None)  # the receiver's waits end at once: its group is closed
            raise
        finally:
            result = got()
        if isinstance(result, BaseException):
            self.leave(call)
            raise result
        manifest = sent_manifest(version, [rec for part in sent for rec in part])
        self.out.commit(version, result[0], result[1], manifest)
        return int(manifest["bytes"])

    def _join(self, call: Call, dtype: torch.dtype) -> tuple[BucketLayout, ...]:
        """Make the group (the ranks and the receiver join at once) and learn the buckets' layout from rank 0."""
        self._store, port = host_store("127.0.0.1", self.timeout_s)
        address = GroupAddress("127.0.0.1", port, self.world_size + 1, f"psrl/transfer/{port}", self.timeout_s)
        joined = _in_thread(lambda: self.out.join(address, self.world_size), "psrl-transfer-join")
        try:
            call("join_transfer", address)
        finally:
            failed = joined()
        if isinstance(failed, BaseException):
            raise TransferFailed(f"{self.out.name}: could not join the transfer group: {failed}") from failed
        return tuple(call("transfer_layout", (self.bucket_mb, dtype))[0])

    def leave(self, call: Call | None) -> None:
        """Leave the group, here and, with ``call``, on the ranks (a later version makes a new one); None: the ranks
        failed or stop (their membership ends with them)."""
        if self._buckets is None and self._store is None:
            return
        self._buckets, self._store = None, None
        self.out.close()
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
