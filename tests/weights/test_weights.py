"""A published version (issue #33, items 2-4): buckets planned from names and sizes only, a round trip that is
exact, a digest every reader checks, a version that appears (and is replaced) in one rename, and an engine that
keeps serving its old version when the new one is damaged."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.weights import (
    MANIFEST,
    FileVersions,
    VersionDamaged,
    bucket_digest,
    export_state,
    plan_buckets,
    publish_model,
    read_manifest,
    read_version,
    state_digest,
    version_digest,
    versions,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=40), st.integers(min_value=1, max_value=150)
)
def test_buckets_keep_the_order_and_the_bound(sizes, bound):
    """Every name once, in order; a bucket over the bound holds exactly one (too large) tensor."""
    named = [(f"t{i}", n) for i, n in enumerate(sizes)]
    buckets = plan_buckets(named, bound)
    assert [n for b in buckets for n in b] == [n for n, _ in named]
    size = dict(named)
    for b in buckets:
        assert sum(size[n] for n in b) <= bound or len(b) == 1


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_a_published_version_reads_back_exactly_in_several_buckets(tmp_path):
    """Small buckets: several files, the manifest's digest is that of the in-memory export's tensors, the tensors exact."""
    model = _model()
    info = publish_model(model, tmp_path, 3, bucket_mb=0.001)
    manifest = read_manifest(tmp_path / "v3")
    assert len(manifest["buckets"]) >= 3 and info["digest"] == manifest["digest"]
    state = export_state(model, bucket_mb=0.001)
    digest = state_digest(state, bucket_mb=0.001)
    assert digest == manifest["digest"]
    version, got = read_version(tmp_path / "v3")
    assert version == 3 and all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_a_damaged_bucket_is_refused_by_every_reader(tmp_path):
    publish_model(_model(), tmp_path, 1, bucket_mb=0.001)
    victim = tmp_path / "v1" / read_manifest(tmp_path / "v1")["buckets"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the tensor data
    victim.write_bytes(bytes(data))
    with pytest.raises(VersionDamaged, match="damaged"):
        read_version(tmp_path / "v1")


def test_a_version_appears_whole_and_a_republish_replaces_it_in_one_rename(tmp_path):
    """``v{N}`` is a link made by one ``os.replace``: before it there is no ``v{N}``, after it a complete one; a
    second publish of the same version swaps the link (the old data pruned later), pruning keeps ``keep``."""
    a, b = _model(0), _model(1)
    publish_model(a, tmp_path, 5, keep=2)
    first = os.readlink(tmp_path / "v5")
    publish_model(b, tmp_path, 5, keep=2)
    assert os.readlink(tmp_path / "v5") != first and (tmp_path / "v5" / MANIFEST).exists()
    _, got = read_version(tmp_path / "v5")
    assert all(torch.equal(got[k], v) for k, v in b.state_dict().items())
    for v in (6, 7):
        publish_model(a, tmp_path, v, keep=2)
    assert versions(tmp_path) == [6, 7] and not list(tmp_path.glob("v5*")) and not list(tmp_path.glob("*.tmp"))


def test_an_hf_engine_keeps_serving_its_version_when_the_next_is_damaged(tiny, tmp_path):
    """The engine loads v1 from the directory (streamed, checked), then v2 with a damaged last bucket: the load
    fails before any weight changes, the engine still holds v1's weights and says version 1, and still generates."""
    from psrl.rollout.engines.hf import HFEngine
    from psrl.types import GenRequest

    policy = copy.deepcopy(tiny[2])
    engine = HFEngine(policy.replica(seed=1))
    source = FileVersions(tmp_path)
    publish_model(policy.model, tmp_path, 1, bucket_mb=0.01)
    with torch.no_grad():
        for w in policy.model.parameters():
            w.add_(0.1)
    publish_model(policy.model, tmp_path, 2, bucket_mb=0.01)
    last = tmp_path / "v2" / read_manifest(tmp_path / "v2")["buckets"][-1]["file"]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))

    async def go() -> GenRequest:
        await engine.update_weights(1, source)
        held = {k: v.clone() for k, v in engine.policy.model.state_dict().items()}
        with pytest.raises(VersionDamaged):
            await engine.update_weights(2, source)
        assert engine.version == 1
        assert all(torch.equal(held[k], v) for k, v in engine.policy.model.state_dict().items())
        try:
            return await engine.generate(GenRequest([1, 2, 3], 4))
        finally:
            await engine.close()

    req = asyncio.run(go())
    assert req.tokens and req.versions == [1] * len(req.tokens)


def test_a_version_written_with_sha256_digests_still_reads_and_is_still_checked(tmp_path):
    """Digests are CRC-32 now (``crc32:`` prefix); a version whose manifest carries the sha256 digests psrl wrote
    before reads back exactly, checked with sha256: a flipped byte in it is still refused."""
    model = _model()
    publish_model(model, tmp_path, 1, bucket_mb=0.001)
    manifest = read_manifest(tmp_path / "v1")
    assert all(b["digest"].startswith("crc32:") for b in manifest["buckets"])
    _, state = read_version(tmp_path / "v1")
    for b in manifest["buckets"]:
        b["digest"] = bucket_digest({n: state[n] for n in b["names"]}, like="sha256")
        assert len(b["digest"]) == 64
    manifest["digest"] = version_digest([b["digest"] for b in manifest["buckets"]])
    (tmp_path / "v1" / MANIFEST).write_text(json.dumps(manifest))
    version, got = read_version(tmp_path / "v1")
    assert version == 1 and all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    victim = tmp_path / "v1" / manifest["buckets"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(VersionDamaged, match="damaged"):
        read_version(tmp_path / "v1")
