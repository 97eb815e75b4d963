"""Pools and the object-store feed of the Ray back end (docs/scaling.md), without starting Ray: which cluster
shapes ``check_pools`` accepts and the one error it makes of the others; ``receive`` loads a version only when every
bucket matches its writer's digest; ``ObjectVersions`` keeps the newest versions' refs and replaces a re-publish.
Awaitables stand in for Ray's refs (a ref is awaited the same way)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from psrl.config import load_config
from psrl.errors import ConfigError
from psrl.runtime import ray_placement
from psrl.runtime.ray_weights import ObjectVersions, receive
from psrl.weights import VersionDamaged, bucket_digest, version_digest

LABEL = ["runtime.backend=ray", "runtime.ray_pool_label=psrl-pool"]


def _node(nid: str, pool: str | None, cpus: float = 2.0) -> dict:
    labels = {"psrl-pool": pool} if pool else {}
    return {"NodeID": nid, "Alive": True, "Labels": labels, "Resources": {"CPU": cpus}}


def _cluster(monkeypatch: pytest.MonkeyPatch, nodes: list[dict]) -> None:
    def pools(label: str) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for n in nodes:
            out.setdefault(n["Labels"].get(label, ""), []).append(n)
        return out

    monkeypatch.setattr(ray_placement, "pool_nodes", pools)


def test_a_trainer_node_and_a_rollout_node_place_two_ranks_and_two_instances(monkeypatch):
    _cluster(monkeypatch, [_node("a", "trainer", 2), _node("b", "rollout", 1)])
    cfg = load_config(None, [*LABEL, "psrl.deployment.train_ngpus_per_node=2", "psrl.deployment.n_rollout_instances=2"])
    ray_placement.check_pools(cfg)


@pytest.mark.parametrize(
    ("nodes", "keys", "said"),
    [
        # 2 ranks, 1 CPU on the trainer pool (boundary: 2 CPUs pass, above)
        ([_node("a", "trainer", 1), _node("b", "rollout")], ["psrl.deployment.train_ngpus_per_node=2"], "2 ranks"),
        # 2 trainer nodes asked, 1 labelled (its 4 CPUs would hold the ranks: the node count is what fails)
        ([_node("a", "trainer", 4), _node("b", "rollout")], ["psrl.deployment.train_nnodes=2"], "train_nnodes=2"),
        # no rollout pool at all: the nodes are unlabelled
        ([_node("a", "trainer"), _node("b", None)], [], "psrl-pool=rollout"),
    ],
)
def test_an_impossible_placement_is_one_error_naming_the_keys_and_the_pools(monkeypatch, nodes, keys, said):
    _cluster(monkeypatch, nodes)
    with pytest.raises(ConfigError) as err:
        ray_placement.check_pools(load_config(None, [*LABEL, *keys]))
    assert err.value.key == "runtime.ray_pool_label" and said in str(err.value)
    assert "the Ray cluster has" in str(err.value) and "psrl-pool=trainer: 1 node" in str(err.value)
    assert "ray start --labels=psrl-pool=trainer" in err.value.fix


def test_without_a_pool_label_nothing_is_checked(monkeypatch):
    _cluster(monkeypatch, [])  # not even a node: the label is what asks for pools
    ray_placement.check_pools(load_config(None, ["runtime.backend=ray"]))


def _seats(nodes: list[str]) -> tuple[ray_placement.RolloutSeats, list[tuple[int, str]]]:
    made: list[tuple[int, str]] = []
    return ray_placement.RolloutSeats(
        "psrl-pool", nodes, lambda i, n: made.append((i, n)) or f"actor{i}@{n}", 3, 1.0
    ), made


def test_an_instance_rejoins_only_on_a_rollout_node_with_room():
    """Two instances on two rollout nodes (a share of one each): instance 1's node lost, the other node full, so no
    room until a node comes back (a new id); then the new actor goes there, and instance 0 finds no room at all."""
    seats, made = _seats(["head", "lost"])
    assert seats.share == 1
    assert seats.free(1, ["head"]) is None  # instance 0 holds the head: no room
    assert seats.free(1, ["back", "head"]) == "back"
    assert seats.take(1, "back") == "actor1@back" and made == [(1, "back")] and seats.nodes == ["head", "back"]
    assert seats.free(0, ["back", "head"]) == "head"  # its own seat does not count against it
    assert seats.free(0, ["back"]) is None  # instance 1 holds the node back


def test_a_node_holds_as_many_instances_as_at_start():
    """Four instances on two nodes (two each): a node that comes back takes both of the lost node's instances, the
    second only while the first has not filled it."""
    seats, _ = _seats(["a", "b", "a", "b"])
    assert seats.share == 2
    assert seats.free(1, ["a", "c"]) == "c"
    seats.take(1, "c")
    assert seats.free(3, ["a", "c"]) == "c"
    seats.take(3, "c")
    assert seats.free(0, ["c"]) is None and seats.free(0, ["a"]) == "a"


@pytest.mark.parametrize("value", ["a/", "-pool", "pool-", "a b", "x" * 64])
def test_the_pool_label_must_be_a_ray_label_key(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["runtime.backend=ray", f"runtime.ray_pool_label={value}"])
    assert err.value.key == "runtime.ray_pool_label"


def test_vllm_urls_are_not_attached_under_ray():
    """Under Ray each engine actor starts its own vLLM server: URLs to attach to are one error naming the key."""
    with pytest.raises(ConfigError) as err:
        urls = "rollout.vllm.urls=[http://127.0.0.1:1,http://127.0.0.1:2]"
        load_config(None, ["runtime.backend=ray", "rollout.engine=vllm", urls])
    assert err.value.key == "rollout.vllm.urls" and "runtime.backend=local" in err.value.fix


def test_the_pool_label_is_ray_only():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["runtime.ray_pool_label=psrl-pool"])
    assert err.value.key == "runtime.ray_pool_label" and "runtime.backend=ray" in err.value.fix


def _ref(value: object) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def _buckets() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"a": torch.randn(3, 2, generator=g)}, {"b": torch.randn(4, generator=g), "c": torch.ones(2)}]


async def _receive(tamper: str | None) -> list[dict[str, torch.Tensor]]:
    parts = _buckets()
    digests = [bucket_digest(p) for p in parts]
    sent = [dict(p) for p in parts]
    if tamper == "bytes":
        sent[1]["c"] = torch.zeros(2)  # what arrived differs from what the writer put
    refs = [(i, d, _ref(t)) for i, (d, t) in enumerate(zip(digests, sent))]
    if tamper == "missing":
        refs = refs[1:]
    digest = version_digest(digests) if tamper != "version" else version_digest(digests[::-1])
    return await receive(digest, refs[::-1])  # any order: received in bucket order


def test_receive_loads_a_version_whose_buckets_match_their_writers_digests():
    got, want = asyncio.run(_receive(None)), _buckets()
    assert [list(b) for b in got] == [list(b) for b in want]
    assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w)


@pytest.mark.parametrize("tamper", ["bytes", "missing", "version"])
def test_receive_refuses_a_changed_bucket_a_missing_one_or_a_wrong_version_digest(tamper):
    with pytest.raises(VersionDamaged):
        asyncio.run(_receive(tamper))


def test_object_versions_keep_the_newest_and_a_republish_replaces():
    feed = ObjectVersions(keep=2)
    for v in (1, 2, 3):
        feed.record(v, f"d{v}", [(0, f"b{v}", f"ref{v}")])
    feed.record(3, "d3'", [(1, "y", "r1"), (0, "x", "r0")])

    class Unpublished:  # a version no rank recorded would be put from here: none is asked for
        def directory(self, version: int):
            raise KeyError(version)

    assert feed.buckets(3, Unpublished()) == ("d3'", [(0, "x", "r0"), (1, "y", "r1")])
    assert feed.buckets(2, Unpublished()) == ("d2", [(0, "b2", "ref2")])
    with pytest.raises(KeyError):
        feed.buckets(1, Unpublished())  # pruned: not in the feed, and not published
