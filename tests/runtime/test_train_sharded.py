"""``psrl train`` with ``psrl.deployment.train_ngpus_per_node=2`` (issue #22): two gloo rank processes under psrl's
own process tree train the tiny model; the staleness audit is clean; the ``hf`` engines, reloaded with the
versions the ranks published, score tokens as the trainer does (the mismatch metric, to 1e-5); the run resumes
from its sharded checkpoint; and no rank outlives psrl, whether the run ends, fails or psrl is SIGKILLed."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from psrl.config import load_config
from psrl.metrics import INDEX, METRICS
from psrl.models import Policy, build_policy
from psrl.rollout.engines.hf import HFEngine
from psrl.runtime.recorder import read_jsonl
from psrl.staleness import Batch
from psrl.tasks import get_task
from psrl.train import Trainer
from psrl.train.launch import LocalRanks
from psrl.train.planner import plan
from psrl.train.worker import StepInput
from psrl.train_cli import main
from psrl.types import GenRequest, Trajectory
from psrl.weights import read_version
from tests.rollout.harness import check_bound
from tests.runtime.test_train_cli_e2e import TINY
from tests.train.reference_trainer import ReferenceTrainer

SRC = Path(__file__).resolve().parents[2] / "src"
TWO = "psrl.deployment.train_ngpus_per_node=2"


def _parent(pid: int) -> int:
    """The parent pid of a live process (Linux ``/proc``)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow  # two psrl train runs, each starting 2 rank processes: ~40 s on 2 cores, more when loaded
def test_psrl_train_at_two_ranks_completes_audited_and_resumes(tmp_path, monkeypatch):
    """3 steps at 2 ranks, synchronous (so every token is scored by the trainer at the version that generated it):
    the ranks are children of this (psrl's) process, every trained trajectory is within the bound, each row has
    ``time/publish_s``, the mismatch between the engines' recorded log-probs and the ranks' is below 1e-5 over
    every such token, ``weights/v3`` is what the driver's final weights are; a 4th step resumes from the
    sharded checkpoint; afterwards no rank process is left."""
    seen: list[tuple[int | None, int]] = []
    start = Trainer.start

    def start_and_look(self: Trainer) -> LocalRanks:
        ranks = start(self)
        seen.extend((pid, _parent(pid)) for pid in ranks.pids if pid is not None)
        return ranks

    monkeypatch.setattr(Trainer, "start", start_and_look)
    before = set(multiprocessing.active_children())  # a session's 2-rank fixture (tests/train) may be running
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}", "psrl.staleness=0", TWO]
    assert main(args + ["trainer.total_steps=3"]) == 0
    assert len(seen) >= 2 and all(parent == os.getpid() for _, parent in seen), seen
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["time/publish_s"] > 0 for r in rows)
    assert sum(r["engine/mismatch_tokens"] for r in rows) > 0
    assert max(r["engine/logprob_mismatch_max"] for r in rows) < 1e-5
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 0) == 3 * 2 * 2
    version, published = read_version(run_dir / "weights" / "v3")
    final = build_policy_from(run_dir / "final")
    assert version == 3 and all(torch.equal(published[k], v) for k, v in final.items())
    assert (run_dir / "checkpoint" / "ranks").is_dir()
    assert set(multiprocessing.active_children()) <= before  # the ranks were closed at the end

    families = {f"{m.name[:-1]}{x}" for m in METRICS for x in m.members}
    assert families | set(INDEX) <= set(rows[-1])  # every listed metric is written, as at 1 rank
    assert (run_dir / "checkpoint" / "ranks" / ".metadata").exists()

    assert main(args + ["trainer.total_steps=4", "trainer.save_optimizer=false"]) == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    saved = dcp.FileSystemReader(str(run_dir / "checkpoint" / "ranks")).read_metadata().state_dict_metadata
    assert saved and not any(k.startswith("optim.") for k in saved)  # trainer.save_optimizer=false honoured
    assert set(multiprocessing.active_children()) <= before


def build_policy_from(directory: Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face directory ``psrl train`` wrote (``final/``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _batch(policy: Policy, version: int) -> Batch:
    """Two groups of three, skewed response lengths, non-zero advantages, behaviour log-probs off the policy's
    by noise (so the rollout corrections act), one tool token masked out, tokens of two versions."""
    g = torch.Generator().manual_seed(7 + version)
    groups = []
    for k, lengths in enumerate([[3, 17, 5], [2, 9, 12]]):
        group = []
        for j, n in enumerate(lengths):
            prompt = torch.randint(1, 20, (4,), generator=g).tolist()
            response = torch.randint(1, 20, (n,), generator=g).tolist()
            with torch.no_grad():
                logp = policy.sequence_logprobs([prompt], [response])[0]
            behav = (logp + 0.2 * torch.randn(n, generator=g)).tolist()
            mask = [1] * n
            mask[n // 2] = 0
            versions = [version - (j % 2)] * n
            t = Trajectory(f"{k}-{j}", f"g{k}", min(versions), prompt, response, behav, mask, versions, float(j))
            group.append(t)
        groups.append(group)
    return Batch(version, groups, ["a", "b"], [version - 1, version - 1])


def test_two_ranks_step_as_one_process_and_the_hf_engine_scores_their_published_version(tmp_path):
    """The same 2 batches, 2 minibatches, token budget 16, the rollout corrections on: the trainer's metrics at 2
    ranks (loss, grad norm, actor/*, correction/*, divergence/*, mismatch) equal the one-process reference trainer's
    to 1e-4 relative and the published weights its weights to 1e-5; then an ``hf`` engine, reloaded with that
    version from the ranks' files, generates tokens whose recorded log-probs equal the ranks' within 1e-5."""
    overrides = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "task.name=arith", "trainer.minibatches=2"]
    overrides += [
        "trainer.micro_batch_tokens=16",
        "algorithm.rollout_correction.is=token",
        "algorithm.rollout_correction.is_threshold=1.1",
    ]
    overrides += ["algorithm.rollout_correction.rs=token", "algorithm.rollout_correction.rs_threshold=1.2"]
    cfg = load_config(None, overrides)
    policy = build_policy(cfg.model, get_task(cfg.task, seed=0), seed=0)
    single = ReferenceTrainer(policy.replica(seed=0), cfg.algorithm, cfg.trainer)
    single.policy.model.requires_grad_(True)
    engine = HFEngine(policy.replica(seed=1))
    trainer = Trainer(policy, cfg.algorithm, cfg.trainer, 2, tmp_path)
    store = trainer.out
    try:
        trainer.start()
        for v in range(2):
            batch = _batch(single.policy, v)
            want, got = single.step(batch), trainer.step(batch)
            assert got.pop("train/empty_minibatches") == 0  # the one key the reference trainer does not report
            assert sorted(want) == sorted(got)
            for k in want:
                assert math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6), (k, got[k], want[k])
            single.policy.version = v + 1
            assert trainer.publish(v + 1)["weights/bytes"] > 0
        mine = single.policy.model.state_dict()
        assert max(float((store.get(2)[1][k] - mine[k]).abs().max()) for k in mine) < 1e-5

        async def generate() -> GenRequest:
            await engine.update_weights(2, store)
            try:
                return await engine.generate(GenRequest([1, 2, 3, 4], 8))
            finally:
                await engine.close()

        req = asyncio.run(generate())
        assert req.versions == [2] * len(req.tokens) and req.tokens
        inp = StepInput(plan([4 + len(req.tokens)], 2, 1, None), [[1, 2, 3, 4]], [req.tokens])
        trained = {i: lp for part in trainer.start().call("logprobs", inp) for i, lp in part.items()}[0]
        diff = (torch.tensor(trained) - torch.tensor(req.logprobs)).abs().max()
        assert diff < 1e-5, diff
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("psrl.deployment.train_nnodes=2", "psrl.deployment.train_nnodes"),
        ("psrl.deployment.train_ngpus_per_node=4096", "psrl.deployment.train_ngpus_per_node"),
    ],
)
def test_a_trainer_shape_this_machine_cannot_run_is_one_line_naming_the_key(capsys, override, key):
    """More nodes than the local launcher has, or more CPU ranks than cores: exit 2 before anything starts."""
    assert main([override]) == 2
    err = capsys.readouterr().err
    assert key in err and "fix" in err and len(err.strip().splitlines()) == 1


def _fresh(cfg: Any) -> Policy:
    return build_policy(cfg.model, get_task(cfg.task, seed=0), seed=0)


@pytest.mark.slow  # two 2-rank starts
def test_a_run_saved_at_one_world_size_resumes_at_the_other(tmp_path):
    """Step 1 at one world size, checkpoint, step 2 at the other (1 -> 2 and 2 -> 1, AdamW state carried over):
    the weights equal an uninterrupted in-process run's within 1e-4."""
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "task.name=arith"])
    ref = _fresh(cfg)
    batches = [_batch(ref, v) for v in range(2)]
    single = ReferenceTrainer(_fresh(cfg), cfg.algorithm, cfg.trainer)
    for v, b in enumerate(batches):
        single.step(b)
        single.policy.version = v + 1
    want = single.policy.model.state_dict()

    first = Trainer(_fresh(cfg), cfg.algorithm, cfg.trainer, 1, tmp_path / "one")  # 1 -> 2
    first.step(batches[0])
    first.publish(1)
    first.save(tmp_path / "at1")
    two = Trainer(_fresh(cfg), cfg.algorithm, cfg.trainer, 2, tmp_path / "two")
    try:
        assert two.load(tmp_path / "at1") == 1
        two.step(batches[1])
        two.publish(2)
        got = two.latest_policy().model.state_dict()
        assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-4

        back = Trainer(_fresh(cfg), cfg.algorithm, cfg.trainer, 2, tmp_path / "back")  # 2 -> 1
        try:
            back.step(batches[0])
            back.publish(1)
            back.save(tmp_path / "at2")
        finally:
            back.close()
    finally:
        two.close()
    one = Trainer(_fresh(cfg), cfg.algorithm, cfg.trainer, 1, tmp_path / "back1")
    assert one.load(tmp_path / "at2") == 1 and one.start().worker.optimizer.state  # type: ignore[attr-defined]
    one.step(batches[1])
    got = one.policy.model.state_dict()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-4


@pytest.mark.slow
def test_psrl_train_continues_a_run_at_another_world_size(tmp_path):
    """The same run directory at 1 rank, then 2, then 1 again: each resumes the checkpoint the other wrote."""
    before = set(multiprocessing.active_children())  # a session's 2-rank fixture (tests/train) may be running
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}"]
    assert main(args + ["trainer.total_steps=1"]) == 0
    assert main(args + ["trainer.total_steps=2", TWO]) == 0
    assert (run_dir / "checkpoint" / "ranks").is_dir()
    assert main(args + ["trainer.total_steps=3"]) == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 2) == 3 * 2 * 2
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.slow
def test_sigkill_of_psrl_train_leaves_no_rank_process(tmp_path):
    """``psrl train`` at 2 ranks SIGKILLed after its first step: its rank processes exit too (they watch
    their parent), waited for with a bound."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "psrl.cli", "train", *TINY, f"trainer.run_dir={run_dir}", TWO]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd + ["trainer.total_steps=50"], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # the first step's line: the ranks are up and have trained
        if line.startswith("step "):
            break
    ranks = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _alive_child(int(p.name), proc.pid) and b"spawn_main" in _cmdline(int(p.name))
    ]
    assert len(ranks) == 2, ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in ranks)


def _alive_child(pid: int, parent: int) -> bool:
    try:
        return _parent(pid) == parent
    except (OSError, IndexError, ValueError):
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
