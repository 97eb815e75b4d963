"""The Ray launcher's pure parts, without starting Ray: the placement group's bundles per rank, and which trainer
shapes each ``runtime.backend`` accepts (``train_nnodes > 1`` only where a cluster can place the ranks)."""

from __future__ import annotations

import pytest

from psrl.config import load_config
from psrl.errors import ConfigError
from psrl.runtime.ray_ranks import rank_bundles


@pytest.mark.parametrize(
    ("world", "device", "bundle"),
    [(2, "cpu", {"CPU": 1.0}), (4, "cuda", {"CPU": 1.0, "GPU": 1.0}), (8, "cuda:0", {"CPU": 1.0, "GPU": 1.0})],
)
def test_one_bundle_per_rank_a_gpu_each_on_cuda_a_cpu_each_otherwise(world, device, bundle):
    bundles = rank_bundles(world, device)
    assert bundles == [bundle] * world
    bundles[0]["CPU"] = 9.0  # each bundle is its own dict: Ray may be handed them separately
    assert bundles[1] == bundle


def test_rank_bundles_refuses_an_empty_world():
    with pytest.raises(ValueError, match="world_size"):
        rank_bundles(0, "cpu")


def test_more_than_one_trainer_node_is_a_ray_cluster_shape():
    """``train_nnodes=2`` loads with ``runtime.backend=ray`` (world size 2 x 1); with the local launcher it is one
    error naming the key, and the fix mentions the Ray backend."""
    cfg = load_config(None, ["psrl.deployment.train_nnodes=2", "runtime.backend=ray"])
    assert cfg.psrl.deployment.train_world_size == 2
    with pytest.raises(ConfigError) as err:
        load_config(None, ["psrl.deployment.train_nnodes=2"])
    assert err.value.key == "psrl.deployment.train_nnodes" and "runtime.backend=ray" in err.value.fix
