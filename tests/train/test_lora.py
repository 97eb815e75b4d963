"""LoRA on the trainer ranks (issue #36): the keys are checked, only the adapter trains (its AdamW state alone), 2
ranks equal 1, a checkpoint resumes at the other world size, and a version is the adapter -- the base only in the
first version a set of ranks publishes -- which an ``hf`` engine serves as the trainer's merged forward."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import torch

from psrl.config import AlgorithmConfig, ModelConfig, TaskConfig, TrainerConfig, load_config
from psrl.errors import ConfigError
from psrl.models import build_policy
from psrl.models.policy import Policy
from psrl.rollout.engines.hf import HFEngine
from psrl.tasks import get_task
from psrl.train import Trainer
from psrl.train.launch import InProcess, LocalRanks
from psrl.train.lora import LoraSpec, add_adapter, check_targets, lora_spec
from psrl.weights import FileVersions, ParameterStore, read_manifest, read_version
from psrl.weights.adapter import MergedAdapter, is_adapter
from tests.train.test_train_worker import WAIT_S, _max_diff, _spec, _state, _step, build_tiny_gpt2

LORA = LoraSpec(rank=4, alpha=8)


def _lora_spec():
    return dataclasses.replace(_spec("token-mean"), lora=LORA)


@pytest.fixture(scope="module")
def two_lora_ranks(tmp_path_factory):
    ranks = LocalRanks(_lora_spec(), 2, reply_timeout_s=WAIT_S, log_dir=tmp_path_factory.mktemp("lora-ranks"))
    yield ranks
    ranks.close()


def _adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if ".lora_" in k}


def _base(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if ".lora_" not in k}


# ---------------------------------------------------------------------------------------------------- the keys


def test_the_keys_load_and_bad_targets_are_config_errors_naming_the_modules():
    """``model.lora_rank/lora_alpha/target_modules`` load (a single name is a list of one); an empty list, an empty
    name or all-linear beside names are errors of ``model.target_modules``; a name the model lacks is one too,
    naming the linear modules the model has."""
    cfg = load_config(None, ["model.lora_rank=8", "model.lora_alpha=16", "model.target_modules=c_attn"])
    assert lora_spec(cfg.model) == LoraSpec(8, 16, ("c_attn",), "built-in")
    assert lora_spec(load_config(None, []).model) is None  # lora_rank 0: full fine-tuning
    for bad in ("[]", "['']", "[all-linear,q_proj]"):
        with pytest.raises(ConfigError) as e:
            load_config(None, ["model.lora_rank=8", f"model.target_modules={bad}"])
        assert e.value.key == "model.target_modules"
    load_config(None, ["model.lora_rank=8", "rollout.engine=vllm"])  # vLLM serves the adapter (docs/lora.md)
    vllm = ["rollout.engine=vllm", "psrl.deployment.n_rollout_instances=1"]
    for bad in (
        ["model.lora_rank=-1"],
        ["model.lora_rank=8", "runtime.backend=ray", *vllm],  # vLLM in Ray actors: not built
        ["model.lora_rank=513", *vllm],  # above vLLM's largest --max-lora-rank
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, bad)
        assert e.value.key == "model.lora_rank"
    with pytest.raises(ConfigError) as e:  # the transfer group sends whole models
        load_config(None, ["model.lora_rank=8", "weights.transport=collective"])
    assert e.value.key == "weights.transport"
    with pytest.raises(ConfigError, match=r"\['q_proj'\] match no module.*\['c_attn', 'c_fc', 'c_proj'\]") as e:
        check_targets(build_tiny_gpt2("cpu"), LoraSpec(4, 8, ("q_proj", "c_fc")))
    assert e.value.key == "model.target_modules"
    check_targets(build_tiny_gpt2("cpu"), LoraSpec(4, 8, ("c_fc",)))  # a name it has


def test_a_target_the_model_lacks_fails_the_run_build():
    """The run builder checks the targets against the built policy: a config error before any rank starts."""
    from psrl.train import build_task_and_policy

    cfg = load_config(None, ["model.lora_rank=4", "model.target_modules=[q_proj]", "model.device=cpu"])
    with pytest.raises(ConfigError, match="model.target_modules"):
        build_task_and_policy(cfg)


# ---------------------------------------------------------------------------------------------------- training


def test_only_the_adapter_trains_and_holds_optimiser_state():
    """World size 1: after two steps the base is bit for bit the start, the adapter moved; AdamW holds two moments
    of the adapter only; the model the rank was built from (the driver's, at world size 1) keeps plain names."""
    torch.set_num_threads(1)
    plain = build_tiny_gpt2("cpu")
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    spec = dataclasses.replace(_lora_spec(), build=lambda device: plain)
    one = InProcess(spec)
    for step in range(2):
        _step(one, "token-mean", 1, step, None)
    state = one.worker.model.state_dict()
    assert {n.replace(".base_layer.", ".") for n in _base(state)} == set(start)
    assert all(torch.equal(v, start[n.replace(".base_layer.", ".")]) for n, v in _base(state).items())
    assert any(float(v.abs().max()) > 0 for n, v in _adapter(state).items() if "lora_B" in n)
    trained = {n for n, p in one.worker.model.named_parameters() if p.requires_grad}
    assert trained == set(_adapter(state)) and trained
    adapter_bytes = sum(v.numel() * 4 for v in _adapter(state).values())
    usage = one.call("usage")[0]
    assert usage["optim_bytes"] == 2 * adapter_bytes + 4 * len(trained)  # exp_avg, exp_avg_sq (+ a step scalar)
    assert set(plain.state_dict()) == set(start)  # the driver's model: no peft layers


def test_two_lora_ranks_equal_one_and_resume_at_the_other_world_size(two_lora_ranks, tmp_path):
    """Same batches over 2 ranks and 1: pre-update log-probs, loss and weights agree; the ranks' AdamW state
    together is the adapter's. Saved at 1 and continued at 2, and saved at 2 and continued at 1, equals the run
    that did not stop (DCP reshards the adapter and its AdamW state)."""
    torch.set_num_threads(1)
    InProcess(_lora_spec()).call("save", str(tmp_path / "start"))
    two_lora_ranks.call("load", str(tmp_path / "start"))
    one = InProcess(_lora_spec())
    for step in range(2):
        old1, m1 = _step(one, "token-mean", 1, step, None)
        old2, m2 = _step(two_lora_ranks, "token-mean", 2, step, 8 + 8 * step)
        assert max(abs(x - y) for i in old1 for x, y in zip(old1[i], old2[i])) <= 1e-5
        assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-4, abs=1e-7)
    assert _max_diff(_state(one), _state(two_lora_ranks)) <= 1e-5
    usage = two_lora_ranks.call("usage")
    adapter = sum(v.size * 4 for v in _adapter(two_lora_ranks.call("state")[0]).values())
    assert 2 * adapter <= sum(u["optim_bytes"] for u in usage) <= 2 * adapter + 1024

    one.call("save", str(tmp_path / "at1"))
    _step(one, "token-mean", 1, 2, None)
    two_lora_ranks.call("load", str(tmp_path / "at1"))
    _step(two_lora_ranks, "token-mean", 2, 2, 16)
    one_to_two = _max_diff(_state(one), _state(two_lora_ranks))
    two_lora_ranks.call("save", str(tmp_path / "at2"))
    _step(two_lora_ranks, "token-mean", 2, 3, 8)
    back = InProcess(_lora_spec())
    back.call("load", str(tmp_path / "at2"))
    _step(back, "token-mean", 1, 3, None)
    two_to_one = _max_diff(_state(back), _state(two_lora_ranks))
    print(f"LoRA resume 1 -> 2: {one_to_two:.2e}, 2 -> 1: {two_to_one:.2e}")
    assert one_to_two <= 1e-5 and two_to_one <= 1e-5


# ---------------------------------------------------------------------------------------------------- publication


def test_a_version_is_the_adapter_and_the_first_carries_the_base(two_lora_ranks, tmp_path):
    """2 ranks publish: the first version holds the base under plain names and the adapter, later ones the adapter
    alone (B times alpha / r); the manifest says ``kind: lora``, the base and the settings; the files equal the
    in-process worker's publication of the same weights, digest for digest."""
    torch.set_num_threads(1)
    two_lora_ranks.call("save", str(tmp_path / "ckpt"))
    one = InProcess(_lora_spec())
    one.call("load", str(tmp_path / "ckpt"))
    two_lora_ranks.call("load", str(tmp_path / "ckpt"))  # a fresh set of ranks: their first version has the base
    for v in range(2):
        two_lora_ranks.call("publish", (v, str(tmp_path / "w2"), 2, 0.01, torch.float32))
        one.call("publish", (v, str(tmp_path / "w1"), 2, 0.01, torch.float32))
    first, later = read_manifest(tmp_path / "w2" / "v0"), read_manifest(tmp_path / "w2" / "v1")
    assert first["kind"] == later["kind"] == "lora" and first["base"] == "built-in"
    assert first["base_included"] and not later["base_included"]
    assert later["lora"] == {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["all-linear"], "lora_B_scaled": True}
    _, v1 = read_version(tmp_path / "w2" / "v1")
    state = _state(two_lora_ranks)
    assert set(v1) == {n.replace(".default", "") for n in _adapter(state)}
    for n, t in v1.items():
        assert torch.equal(t, state[n.replace(".weight", ".default.weight")] * (2.0 if "lora_B" in n else 1.0))
    _, v0 = read_version(tmp_path / "w2" / "v0")
    assert {n for n in v0 if not is_adapter(n)} == set(build_tiny_gpt2("cpu").state_dict())
    assert later["bytes"] < first["bytes"] / 3
    for v in (0, 1):
        assert read_manifest(tmp_path / "w1" / f"v{v}")["digest"] == read_manifest(tmp_path / "w2" / f"v{v}")["digest"]


def _merged_forward_logprobs(rank_model, prompts, responses) -> torch.Tensor:
    """The trainer's merged forward: peft merges B A into a copy of the rank's model."""
    from peft.tuners.lora import LoraLayer

    twin = copy.deepcopy(rank_model)
    for m in twin.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    from psrl.models.tokenizer import CharTokenizer  # a pad id is all sequence_logprobs needs of it

    with torch.no_grad():
        return Policy(twin, CharTokenizer(), "cpu").sequence_logprobs(prompts, responses, 0.9)


def test_the_hf_engine_serves_the_published_adapter_after_every_update(tmp_path):
    """A short run (4 steps, publish after each) through both stores -- in memory and files -- into an ``hf``
    engine: after every update the engine's log-probs of fresh sequences, and of its own generation, are the
    trainer's merged forward's within 1e-5 (what verl #7495 lost silently cannot go unseen here)."""
    torch.set_num_threads(1)
    from psrl.models.tokenizer import CharTokenizer

    one = InProcess(_lora_spec())
    store, files = ParameterStore(), FileVersions(tmp_path / "w")
    engines = [HFEngine(Policy(build_tiny_gpt2("cpu"), CharTokenizer(), "cpu")) for _ in range(2)]
    for e in engines:
        e.sampling = dataclasses.replace(e.sampling, temperature=0.9)
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for v in range(4):
        if v:
            _step(one, "token-mean", 1, v, None)
        store.publish(v, one.call("export", (256, torch.float32))[0])
        one.call("publish", (v, str(files.root), 2, 256, torch.float32))
        prompts = [torch.randint(1, 40, (5,), generator=g).tolist() for _ in range(3)]
        responses = [torch.randint(1, 40, (6,), generator=g).tolist() for _ in range(3)]
        want = _merged_forward_logprobs(one.worker.model, prompts, responses)
        for engine, source in zip(engines, (store, files)):
            asyncio.run(engine.update_weights(v, source))
            assert engine.version == v
            with torch.no_grad():
                got = engine.policy.sequence_logprobs(prompts, responses, 0.9)
            worst = max(worst, float((got - want).abs().max()))
            toks, lps = engine.policy.generate([prompts[0]], 6, temperature=0.9)[0]
            again = _merged_forward_logprobs(one.worker.model, [prompts[0]], [toks])[0]
            worst = max(worst, max(abs(a - b) for a, b in zip(lps, again.tolist())))
    print(f"max |engine - trainer merged| log-prob over 4 versions, 2 stores: {worst:.2e}")
    assert worst <= 1e-5
    assert float((want - _merged_forward_logprobs(build_tiny_gpt2("cpu"), prompts, responses)).abs().max()) > 1e-3


def test_a_version_for_another_model_leaves_the_engine_as_it_was():
    """Adapter tensors of modules the engine's model lacks are refused before anything changes."""
    model = build_tiny_gpt2("cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {"transformer.h.9.attn.c_attn.lora_A.weight": torch.ones(4, 32)}
    bad["transformer.h.9.attn.c_attn.lora_B.weight"] = torch.ones(96, 4)
    with pytest.raises(ValueError, match="does not have"):
        MergedAdapter(model).load(bad)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------- the driver


def test_the_trainer_publishes_adapters_and_final_loads_with_transformers_and_peft(tmp_path):
    """The Trainer at world size 1 with LoRA: ``weights/bytes`` of a step's version is the adapter's (a few % of
    the model); ``latest_policy`` is a plain model with the adapter merged (the driver's own keeps the base);
    ``save_pretrained`` of it loads with transformers alone, and ``save_adapter``'s directory with peft on the
    base gives the same log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from psrl.rollout.fakes import random_batch

    torch.set_num_threads(1)
    task = get_task(TaskConfig(name="arith"), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=64, n_head=2, device="cpu"), task, seed=0)
    base = {k: v.clone() for k, v in policy.model.state_dict().items()}
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=1e-2), lora=LoraSpec(4, 8))
    first = trainer.publish(0)["weights/bytes"]
    batch = random_batch(task)
    for v in (1, 2):
        trainer.step(batch)
        out = trainer.publish(v)
    whole = sum(t.numel() * 4 for t in base.values())
    assert first >= whole and out["weights/bytes"] < 0.2 * whole
    assert isinstance(trainer.out, ParameterStore)
    merged = trainer.latest_policy()
    assert merged is not policy and merged.version == 2
    assert all(torch.equal(v, base[k]) for k, v in policy.model.state_dict().items())  # the driver's: the base
    prompts, responses = [[3, 4, 5]], [[6, 7, 8, 9]]
    with torch.no_grad():
        want = _merged_forward_logprobs(trainer.ranks.worker.model, prompts, responses)
        assert float((merged.sequence_logprobs(prompts, responses, 0.9) - want).abs().max()) <= 1e-5
        merged.save_pretrained(tmp_path / "final")
        trainer.save_adapter(tmp_path / "final" / "adapter")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", local_files_only=True)
        lp = Policy(loaded, policy.tokenizer, "cpu").sequence_logprobs(prompts, responses, 0.9)
        assert float((lp - want).abs().max()) <= 1e-5
        on_base = copy.deepcopy(policy.model)
        peft_model = PeftModel.from_pretrained(on_base, tmp_path / "final" / "adapter")
        lp = Policy(peft_model, policy.tokenizer, "cpu").sequence_logprobs(prompts, responses, 0.9)
        assert float((lp - want).abs().max()) <= 1e-5
    trainer.close()


def test_add_adapter_on_a_llama_targets_named_projections():
    """Named targets on a Llama-shaped model: only those modules get adapters, every other weight is frozen."""
    from tests.train.test_train_worker import build_tiny_llama_tied

    model = add_adapter(build_tiny_llama_tied("cpu"), LoraSpec(2, 4, ("q_proj", "v_proj")))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all((".q_proj.lora_" in n or ".v_proj.lora_" in n) for n in trained)


def test_a_nan_in_a_later_minibatch_rolls_the_adapter_back(monkeypatch):
    """LoRA with 3 minibatches and a NaN loss in the third: the adapter and AdamW are as before the step (the
    snapshot holds the adapter alone; the base cannot move), and the next finite step trains the adapter."""
    from psrl.rollout.fakes import random_batch
    from tests.train.test_trainer_faults import _nan_loss_at

    torch.set_num_threads(1)
    task = get_task(TaskConfig(name="arith"), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=0)
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(minibatches=3, lr=1e-2), lora=LoraSpec(4, 8))
    tr.step(random_batch(task, version=0))  # B nonzero from here: a later update moves every adapter tensor
    rank = tr.start().worker  # type: ignore[attr-defined]
    before = {k: v.clone() for k, v in rank.model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in rank.optimizer.state.items()}
    _nan_loss_at(monkeypatch, {2})
    tr.step(random_batch(task, version=1, seed=1))
    assert "minibatch 3/3" in tr.last_skip
    assert all(torch.equal(v, before[k]) for k, v in rank.model.state_dict().items())
    assert all(torch.equal(v, moments[id(p)][k]) for p, s in rank.optimizer.state.items() for k, v in s.items())
    monkeypatch.undo()
    tr.step(random_batch(task, version=2, seed=2))
    after = rank.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in _base(before))
    assert not all(torch.equal(after[k], before[k]) for k in _adapter(before))


def test_after_a_warm_start_the_versions_name_the_warm_started_base(tmp_path):
    """The warm start trains every weight in the driver: a version's manifest and ``final/adapter/``'s config then
    name the base as model.path after the warm start, not model.path alone."""
    import json
    import random

    torch.set_num_threads(1)
    task = get_task(TaskConfig(name="arith"), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=0)
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(), 1, tmp_path, in_memory=False, lora=LoraSpec(4, 8))
    tr.warm_start(task.demonstrations(8, random.Random(0)), 2, batch_size=4)
    tr.publish(0)
    assert read_manifest(tr.out.directory(0))["base"] == "built-in after a 2-step warm start"  # type: ignore[union-attr]
    tr.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "built-in after a 2-step warm start"
    tr.close()
