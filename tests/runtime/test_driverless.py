"""A driver that holds no model it does not use (issue #33, item 5): with vLLM or Ray engines at world size > 1
(a warm start then runs on the ranks), the driver's policy is built on ``meta`` (config, shapes, tokenizer); the
ranks build the weights from ``model.*`` themselves -- the same start weights as a policy built in the driver, bit
for bit -- and ``final/`` (and a vLLM server's start) is a published version's files with the config and tokenizer
beside them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from psrl.config import load_config
from psrl.models import build_policy
from psrl.models.builder import is_weightless
from psrl.runtime.local import driver_holds_weights
from psrl.tasks import get_task
from psrl.train import Trainer, build_task_and_policy
from psrl.weights import VERSION_FILE, FileVersions, publish_model, write_model_directory

SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.device=cpu"]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


@pytest.mark.parametrize(
    ("extra", "holds"),
    [
        (["rollout.engine=vllm", "psrl.deployment.train_ngpus_per_node=2", "trainer.warm_start_steps=0"], False),
        (["runtime.backend=ray", "psrl.deployment.train_ngpus_per_node=2", "trainer.warm_start_steps=0"], False),
        # hf engines here are built from the recipe and load each version: the driver holds theirs only
        (["psrl.deployment.train_ngpus_per_node=2", "trainer.warm_start_steps=0"], False),
        # a warm start runs on the ranks' shards
        (["rollout.engine=vllm", "psrl.deployment.train_ngpus_per_node=2", "trainer.warm_start_steps=5"], False),
        (["psrl.deployment.train_ngpus_per_node=2", "trainer.warm_start_steps=5"], False),
        # one rank trains the driver's own model; LoRA merges onto it
        (["rollout.engine=vllm", "trainer.warm_start_steps=0"], True),
        (["psrl.deployment.train_ngpus_per_node=2", "trainer.warm_start_steps=0", "model.lora_rank=4"], True),
    ],
)
def test_the_driver_builds_weights_only_where_something_in_it_uses_them(extra, holds):
    """The run builder's rule, and the policy it builds by it: on ``meta`` (no parameter on a real device) exactly
    where the rule says the driver holds no weights."""
    cfg = _cfg(*extra)
    task, policy = build_task_and_policy(cfg, lambda _task: driver_holds_weights(cfg))
    assert driver_holds_weights(cfg) is holds
    assert policy.weightless is (not holds)
    assert all(p.is_meta for p in policy.model.parameters()) is (not holds)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_recipe_builds_the_drivers_start_weights_bit_for_bit(dtype):
    """What rank 0 builds (``policy.recipe(device)``) is what a policy built with weights holds, every tensor
    equal; on ``meta`` the same names, shapes and dtypes, and no storage."""
    cfg = _cfg(f"model.dtype={dtype}")
    task = get_task(cfg.task, seed=0)
    held = build_policy(cfg.model, task, seed=7)
    light = build_policy(cfg.model, task, seed=7, weights=False)
    assert light.weightless and not held.weightless and light.recipe is not None
    ranks = light.recipe("cpu").state_dict()
    reference = held.model.state_dict()
    assert list(ranks) == list(reference)
    assert all(torch.equal(ranks[k], reference[k]) and ranks[k].dtype == reference[k].dtype for k in reference)
    meta = light.model.state_dict()
    assert [(k, v.shape, v.dtype) for k, v in meta.items()] == [(k, v.shape, v.dtype) for k, v in reference.items()]
    assert is_weightless(light.model)
    other = build_policy(cfg.model, task, seed=8, weights=False).recipe("cpu").state_dict()
    assert not torch.equal(other["lm_head.weight"], reference["lm_head.weight"])  # the seed is what decides


def test_a_weightless_policys_replica_is_built_from_its_recipe():
    """An ``hf`` engine of a driver that holds no weights (world size 2): its replica has the start weights the
    ranks build (a policy built with weights holds the same, bit for bit), on a real device and untrainable, while
    the driver's policy stays on ``meta``."""
    cfg = _cfg()
    task = get_task(cfg.task, seed=0)
    held = build_policy(cfg.model, task, seed=7)
    light = build_policy(cfg.model, task, seed=7, weights=False)
    engine = light.replica(seed=3)
    assert light.weightless and not engine.weightless
    reference = held.model.state_dict()
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in reference.items())
    assert not any(p.requires_grad for p in engine.model.parameters())


def test_final_is_a_published_version_that_transformers_and_model_path_load(tmp_path):
    """``final/`` made from a version's files and a weightless policy's config and tokenizer: ``from_pretrained``
    loads the version's tensors exactly, and ``model.path=final/`` builds a policy holding them."""
    cfg = _cfg()
    task = get_task(cfg.task, seed=0)
    trained = build_policy(cfg.model, task, seed=3)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.25)  # "trained": not the start weights a recipe would rebuild
    publish_model(trained.model, tmp_path / "weights", 5, bucket_mb=0.01)  # several buckets
    light = build_policy(cfg.model, task, seed=3, weights=False)
    final = write_model_directory(
        FileVersions(tmp_path / "weights").directory(5), tmp_path / "final", light.model, light.tokenizer
    )
    assert (final / VERSION_FILE).read_text().strip() == "5"
    # a config built in code names no architecture, and vLLM picks its model class by it (else: a pooling model)
    assert not light.model.config.architectures
    assert json.loads((final / "config.json").read_text())["architectures"] == [type(trained.model).__name__]
    loaded = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True).state_dict()
    want = trained.model.state_dict()
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    again = build_policy(load_config(None, ["model.device=cpu", f"model.path={final}"]).model, task, seed=0)
    assert all(torch.equal(again.model.state_dict()[k], want[k]) for k in want)


@pytest.mark.slow  # two rank processes
def test_ranks_of_a_weightless_driver_start_from_model_config_without_start_pt(tmp_path):
    """World size 2 over a weightless policy: no ``weights/start.pt`` is written, the ranks' gathered state is the
    start weights a driver would have built, and the driver's policy still holds nothing after publishing."""
    cfg = _cfg()
    task = get_task(cfg.task, seed=0)
    light = build_policy(cfg.model, task, seed=0, weights=False)
    trainer = Trainer(light, cfg.algorithm, cfg.trainer, 2, tmp_path)
    try:
        state = trainer.start().call("state")[0]
        trainer.publish(0)
    finally:
        trainer.close()
    assert not (tmp_path / "weights" / "start.pt").exists()
    reference = build_policy(cfg.model, task, seed=0).model.state_dict()
    assert all(torch.equal(torch.from_numpy(state[k]), reference[k]) for k in reference)
    assert light.weightless and FileVersions(tmp_path / "weights").latest_version() == 0


def test_validation_engines_load_the_newest_version_before_validating(tmp_path):
    """Validation instances over files (what world size > 1 with ``hf`` engines builds): a copy of the policy at its
    start weights loads the newest published version first -- the row's ``version`` is that version, the engine's
    weights are its tensors -- and a second validation with nothing new published loads nothing again."""
    from psrl.rollout.engines.hf import HFEngine
    from psrl.runtime.validate import ValidationEngines
    from psrl.weights import read_version

    cfg = _cfg("task.name=arith")
    task = get_task(cfg.task, seed=0)
    policy = build_policy(cfg.model, task, seed=0)
    trained = build_policy(cfg.model, task, seed=1)  # "trained": other weights than the policy's
    root = tmp_path / "weights"
    publish_model(trained.model, root, 0)
    publish_model(trained.model, root, 3)
    copy = policy.replica(seed=5)
    loads: list[int] = []

    class Counted(HFEngine):
        async def update_weights(self, version, store):
            loads.append(version)
            await super().update_weights(version, store)

    validator = ValidationEngines(lambda: [Counted(copy)], FileVersions(root))
    try:
        first = validator.validate(task, task.val_prompts(3), 2, 1.0, 1.0, seed=0)
        second = validator.validate(task, task.val_prompts(3), 2, 1.0, 1.0, seed=0)
    finally:
        validator.close()
    assert first["version"] == second["version"] == 3 and first["val/prompts"] == 3
    assert {k: v for k, v in first.items() if k != "val/seconds"} == {
        k: v for k, v in second.items() if k != "val/seconds"
    }
    _, want = read_version(root / "v3")
    assert all(torch.equal(copy.model.state_dict()[k], want[k]) for k in want)
    assert copy.version == 3 and loads == [3]


@pytest.mark.parametrize(("world", "weightless", "loads"), [(1, False, False), (2, True, True), (2, False, True)])
def test_engines_built_from_a_weightless_driver_load_the_first_version(world, weightless, loads):
    """The engines' start copy is labelled with a version only where it holds that version: at one rank the
    driver's policy is the trained model; a weightless driver's replicas are built from the recipe, which a warm
    start on the ranks moves away from (the first step's log-probs differed by 0.31 when they were labelled 0), so
    its copy is unlabelled and every engine loads the first version at start."""
    from types import SimpleNamespace

    from psrl.runtime.local import _engine_source

    policy = SimpleNamespace(version=0, weightless=weightless)
    made = SimpleNamespace(world_size=world, lora=None, policy=policy)
    source = _engine_source(SimpleNamespace(policy=policy), made)  # type: ignore[arg-type]
    assert (source.version == -1) is loads and policy.version == 0
