"""The collective transport (issue #33, item 4): a version sent bucket by bucket over a transfer group -- members in
threads of this process, over loopback -- arrives exact, with the writer's digest; one that breaks off midway, is
damaged or never comes leaves the receiver on the versions it had, and every wait ends."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from psrl.weights import MB, export_state, state_digest
from psrl.weights.collective import (
    GroupAddress,
    TransferFailed,
    TransferGroup,
    first_tags,
    host_store,
    layout,
    send_bucket,
    send_version,
    sent_manifest,
    unpack,
)
from psrl.weights.format import VersionDamaged
from psrl.weights.receivers import CollectiveVersions

BUCKET_MB = 0.001  # ~1 KB: the test model's tensors fall into several buckets


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _address(size: int, timeout_s: float = 30.0) -> tuple[Any, GroupAddress]:
    store, port = host_store(timeout_s=timeout_s)
    return store, GroupAddress("127.0.0.1", port, size, f"test/{port}", timeout_s)


def _threads(targets: list[Callable[[], Any]]) -> list[Any]:
    """Run every target in its own thread; their results (or the exception each raised), in order."""
    out: list[Any] = [None] * len(targets)

    def run(i: int) -> None:
        try:
            out[i] = targets[i]()
        except Exception as exc:  # noqa: BLE001 -- returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _transfer(senders: int, sender: Callable[[TransferGroup, int], Any], dst: CollectiveVersions, version: int):
    """``senders`` sender members (``sender(group, rank)`` each) and ``dst`` as the last member: each sender's
    result, then the receiver's ``(state, digests)`` or its exception."""
    _, address = _address(senders + 1)
    model = _model()
    buckets = layout(model, int(BUCKET_MB * MB))

    def receive() -> Any:
        dst.join(address, senders)
        return dst.receive(version, buckets, senders)

    def send(rank: int) -> Callable[[], Any]:
        return lambda: sender(TransferGroup(address, rank), rank)

    return _threads([send(r) for r in range(senders)] + [receive])


def _honest(world: int) -> Callable[[TransferGroup, int], Any]:
    model = _model()  # built here: the global generator is not for threads to share

    def sender(group: TransferGroup, rank: int) -> Any:
        return send_version(group, model, rank=rank, world=world, receivers=[world], bucket_bytes=int(BUCKET_MB * MB))

    return sender


def test_unpack_gives_exact_views_and_every_tensor_has_its_own_tag():
    """A bucket's bytes side by side in one buffer: unpacking gives views of it, equal to the originals; the tags
    number the version's tensors in order."""
    state = export_state(_model(), BUCKET_MB, torch.bfloat16)
    buckets = layout(_model(), int(BUCKET_MB * MB), torch.bfloat16)
    assert [n for b in buckets for n in b.names] == list(state)
    tags = first_tags(buckets)
    assert tags[0] == 0 and all(tags[i + 1] - tags[i] == len(buckets[i].names) for i in range(len(buckets) - 1))
    for b in buckets:
        flat = torch.cat([state[n].reshape(-1).view(torch.uint8) for n in b.names])
        got = unpack(flat, b)
        assert flat.numel() == b.nbytes
        assert all(torch.equal(got[n], state[n]) and got[n].dtype == state[n].dtype for n in b.names)
        assert all(got[n].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for n in b.names)


@pytest.mark.parametrize("world", [1, 2])
def test_a_version_arrives_exact_with_the_writers_digest(world):
    """1 or 2 senders (bucket b from rank b % world): the received tensors equal the model's, and the manifest of
    what was sent has the digest the files transport would write; nothing is held before the commit."""
    dst = CollectiveVersions()
    *sent, digests = _transfer(world, _honest(world), dst, 4)
    manifest = sent_manifest(4, [rec for part in sent for rec in part])
    assert len(manifest["buckets"]) >= 3 and len(digests) == len(manifest["buckets"])
    assert dst.versions() == [] and _spilled(dst) == ["v4.recv"]
    dst.commit(4, manifest)
    assert _spilled(dst) == ["v4.bin"] and (dst.root / "v4.bin").stat().st_size == manifest["bytes"]
    version, got = dst.get()
    expected = export_state(_model(), BUCKET_MB)
    assert version == 4 and list(got) == list(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert manifest["digest"] == state_digest(expected, BUCKET_MB)


def _held_v1() -> CollectiveVersions:
    """A receiver holding version 1 (received whole, committed)."""
    dst = CollectiveVersions(name="engine-under-test")
    *sent, _ = _transfer(1, _honest(1), dst, 1)
    dst.commit(1, sent_manifest(1, [rec for part in sent for rec in part]))
    dst.close()
    return dst


def _spilled(dst: CollectiveVersions) -> list[str]:
    return sorted(p.name for p in dst.root.iterdir())


def test_a_sender_that_stops_midway_leaves_the_old_version():
    """The sender leaves the group after 2 buckets: the receiver fails naming itself and the version, quickly (the
    connection closes), and still holds version 1 only."""
    dst = _held_v1()

    def two_then_gone(group: TransferGroup, rank: int) -> None:
        state = export_state(_model(), BUCKET_MB)
        buckets = layout(_model(), int(BUCKET_MB * MB))
        for b, bucket in enumerate(buckets[:2]):
            for work in send_bucket(group, {n: state[n] for n in bucket.names}, 1, first_tags(buckets)[b]):
                group.wait(work)
        group.close()

    _, received = _transfer(1, two_then_gone, dst, 2)
    assert isinstance(received, TransferFailed)
    assert "engine-under-test" in str(received) and "version 2" in str(received) and "after 2 of" in str(received)
    assert dst.versions() == [1] and _spilled(dst) == ["v1.bin"]  # the half-received file is gone


def test_a_damaged_bucket_is_refused_and_the_old_version_kept():
    """One byte of bucket 1 flipped on the way: the receiver's digest differs from the writer's, commit refuses it."""
    dst = _held_v1()
    state = export_state(_model(), BUCKET_MB)
    buckets = layout(_model(), int(BUCKET_MB * MB))

    def flips_one_byte(group: TransferGroup, rank: int) -> list:
        from psrl.weights.format import bucket_digest

        sent = []
        for b, bucket in enumerate(buckets):
            tensors = {n: state[n].clone() for n in bucket.names}
            sent.append((b, 0, bucket.nbytes, bucket_digest(tensors)))
            if b == 1:
                next(iter(tensors.values())).reshape(-1).view(torch.uint8)[0] ^= 1
            for work in send_bucket(group, tensors, 1, first_tags(buckets)[b]):
                group.wait(work)
        return sent

    sent, _ = _transfer(1, flips_one_byte, dst, 2)
    with pytest.raises(VersionDamaged, match="engine-under-test: bucket 1 of version 2"):
        dst.commit(2, sent_manifest(2, sent))
    assert dst.versions() == [1] and dst.get()[0] == 1 and _spilled(dst) == ["v1.bin"]


def test_held_versions_are_files_of_the_receiver_and_only_the_newest_keep_stay(tmp_path):
    """Versions are held in files of the receiver's root, ``keep`` of them; a version dropped while an engine
    streams it is still read whole (the reader holds its file); a new receiver over the same root removes what an
    earlier one left."""
    (tmp_path / "v7.bin").write_bytes(b"left by an earlier run")
    dst = CollectiveVersions(tmp_path, keep=2)
    assert _spilled(dst) == []
    expected = export_state(_model(), BUCKET_MB)
    reading = None
    for v in (1, 2, 3):
        *sent, _ = _transfer(1, _honest(1), dst, v)
        dst.commit(v, sent_manifest(v, [rec for part in sent for rec in part]))
        dst.close()
        if v == 2:
            reading = dst.buckets(1)  # an engine about to stream version 1 (its file is open from here)
            first = {}
    assert dst.versions() == [2, 3] and _spilled(dst) == ["v2.bin", "v3.bin"]
    assert reading is not None
    rest = {n: t.clone() for part in reading for n, t in part.items()}
    assert list({**first, **rest}) == list(expected) and all(torch.equal(rest[n], expected[n]) for n in rest)
    assert dst.names(3) == list(expected)
    with pytest.raises(KeyError, match="version 1 is not held"):
        dst.names(1)


def test_a_sender_that_never_sends_ends_in_the_timeout():
    """A member that joins and then stays silent: the receive ends with TransferFailed after the group's timeout
    instead of waiting forever."""
    dst = _held_v1()
    _, address = _address(2, timeout_s=1.0)
    release = threading.Event()

    def silent() -> None:
        group = TransferGroup(address, 0)
        release.wait(30)  # alive, never sending, until the receiver has given up
        group.close()

    def receive() -> Any:
        dst.join(address, 1)
        try:
            return dst.receive(2, layout(_model(), int(BUCKET_MB * MB)), 1)
        finally:
            release.set()

    _, received = _threads([silent, receive])
    assert isinstance(received, TransferFailed) and "after 0 of" in str(received)
    assert dst.versions() == [1]


def test_a_receiver_without_a_root_removes_its_own_directory():
    dst = _held_v1()
    root = dst.root
    assert (root / "v1.bin").exists()
    del dst
    gc.collect()
    assert not root.exists()


def test_receiving_without_a_group_is_an_error_naming_the_receiver():
    with pytest.raises(TransferFailed, match="engine-under-test: version 3: not in a transfer group"):
        _held_v1().receive(3, layout(_model()), 1)


def test_sent_versions_name_what_this_run_published_or_sent(tmp_path):
    """The store of versions sent to other processes: a directory an earlier run left is not one of its versions
    (a resumed run publishes its first version as files again); a version is read from its directory or named to
    the receivers, by how it went; manifests beyond ``keep`` go."""
    from psrl.weights import publish_model
    from psrl.weights.receivers import SentVersions

    publish_model(_model(), tmp_path, 0, bucket_mb=BUCKET_MB)  # an earlier run's
    store = SentVersions(tmp_path, keep=2)
    assert store.versions() == [] and store.latest_version() is None
    publish_model(_model(), tmp_path, 3, bucket_mb=BUCKET_MB)
    store.commit_files(3)
    for v in (4, 5, 6):
        store.commit(v, {"digest": f"d{v}", "buckets": []})
    assert store.versions() == [3, 5, 6] and store.latest_version() == 6
    assert store.sent(6) and not store.sent(3) and store.directory(3).name == "v3"
    assert store.manifest(6)["digest"] == "d6"
    with pytest.raises(KeyError):
        store.manifest(4)
    with pytest.raises(TypeError, match="holds no weights"):
        store.get(6)
    assert store.get(3)[0] == 3  # read from its directory
