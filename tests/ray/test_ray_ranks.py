"""The trainer's ranks as Ray actors (issue #22, the Ray launcher, ``runtime.backend=ray``): ``psrl train`` at 2
ranks completes with the staleness audit clean and the engines scoring tokens as the ranks do; a rank actor that
dies or stops answering is one error naming it, not a hang; a Ray engine loads a version from the directory the
ranks published, not from the driver's store; SIGKILL of psrl leaves no rank actor.

Ray probes outside addresses at start-up, so each check runs in a network namespace with only loopback up
(``unshare -rn``), as ``tests/ray/test_ray_runtime.py`` does: nothing leaves this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from psrl.runtime.recorder import read_jsonl
from psrl.weights import read_version
from tests.rollout.harness import check_bound
from tests.runtime.test_train_cli_e2e import TINY

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a loopback-only namespace"),
]

SRC = Path(__file__).resolve().parents[2] / "src"


def _loopback_only(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python args...`` in a network namespace with only loopback up."""
    pytest.importorskip("ray")
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, *args]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_psrl_train_at_two_ray_ranks_completes_audited(tmp_path):
    """``psrl train psrl.deployment.train_ngpus_per_node=2 runtime.backend=ray``, 3 synchronous steps: every
    trained trajectory is within the bound, every row has ``time/publish_s``, the engines' recorded log-probs equal
    the ranks' (the mismatch metric, below 1e-5, over tokens of the trainer's version), ``weights/v3`` is the final
    model, each rank wrote its log and the sharded checkpoint is complete; a 4th step resumes from it."""
    run_dir = tmp_path / "run"
    args = [*TINY, f"trainer.run_dir={run_dir}", "psrl.staleness=0"]
    args += ["psrl.deployment.train_ngpus_per_node=2", "runtime.backend=ray"]
    out = _loopback_only(["-m", "psrl.cli", "train", *args, "trainer.total_steps=3"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["time/publish_s"] > 0 for r in rows)
    assert sum(r["engine/mismatch_tokens"] for r in rows) > 0
    assert max(r["engine/logprob_mismatch_max"] for r in rows) < 1e-5
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 0) == 3 * 2 * 2
    version, published = read_version(run_dir / "weights" / "v3")
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), local_files_only=True).state_dict()
    assert version == 3 and all(torch.equal(published[k], v) for k, v in final.items())
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank0.log", "rank1.log"]
    assert (run_dir / "checkpoint" / "ranks" / ".metadata").exists()

    resumed = _loopback_only(["-m", "psrl.cli", "train", *args, "trainer.total_steps=4"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_driver_with_ray_engines_and_no_warm_start_writes_no_start_weights(tmp_path):
    """Ray rank actors and Ray engine actors, no warm start (issue #33, item 5): the driver builds no weights, so the
    ranks build the model from ``model.*`` (no ``weights/start.pt``); the engines' log-probs still equal the
    ranks' (the same start weights) and ``final/`` is the last version's tensors."""
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.warm_start_steps=0", f"trainer.run_dir={run_dir}", "psrl.staleness=0"]
    args += ["psrl.deployment.train_ngpus_per_node=2", "runtime.backend=ray", "trainer.total_steps=3"]
    out = _loopback_only(["-m", "psrl.cli", "train", *args])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert not (run_dir / "weights" / "start.pt").exists()
    assert sum(r["engine/mismatch_tokens"] for r in rows) > 0
    assert max(r["engine/logprob_mismatch_max"] for r in rows) < 1e-5
    version, published = read_version(run_dir / "weights" / "v3")
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), local_files_only=True).state_dict()
    assert version == 3 and all(torch.equal(published[k], v) for k, v in final.items())


FAULTS = textwrap.dedent(
    """
    import asyncio, os, signal, sys, tempfile
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from psrl.config import load_config
    from psrl.errors import ConfigError
    from psrl.models import build_policy
    from psrl.models.builder import write_start_state
    from psrl.runtime.ray_ranks import RayRanks
    from psrl.runtime.ray_runtime import build_ray_engines, ensure_ray
    from psrl.tasks import get_task
    from psrl.train.launch import RankFailure
    from psrl.train.worker import WorkerSpec

    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "runtime.backend=ray",
                             "psrl.deployment.train_ngpus_per_node=2"])
    work = Path(sys.argv[1])
    ensure_ray(None, num_cpus=2)
    policy = build_policy(cfg.model, get_task(cfg.task, seed=0), seed=0)
    spec = WorkerSpec(build=write_start_state(policy.model, work / "start.pt", "float32"), pad_id=policy.pad_id,
                      algo=cfg.algorithm, collective_timeout_s=60)

    from psrl.weights import FileVersions, read_manifest

    from psrl.runtime.ray_weights import ObjectVersions

    class NoStore(FileVersions):  # the engine gets the ranks' buckets: the driver must not read the state
        def get(self, version=None):
            raise AssertionError("the engine asked the store for the state")

    feed = ObjectVersions()
    ranks = RayRanks(spec, 2, 120, work / "ranks", feed=feed)
    ranks.call("publish", (1, str(work / "weights"), 2, 0.001, torch.float32))  # a bucket per tensor: both ranks own
    class NoDirectory(NoStore):  # the refs come from the ranks' replies: the driver puts nothing itself
        def directory(self, version):
            raise AssertionError("the driver went to the directory")

    digest, buckets = feed.buckets(1, NoDirectory(work / "weights"))
    assert len(buckets) > 2 and digest == read_manifest(work / "weights" / "v1")["digest"]
    engine = build_ray_engines(cfg, 1, 0, feed)[0]
    asyncio.run(engine.update_weights(1, NoStore(work / "weights")))
    assert engine.version == 1, engine.version
    os.kill(ranks.pids[1], signal.SIGKILL)
    try:
        ranks.call("digest")
        raise AssertionError("a dead rank went unnoticed")
    except RankFailure as e:
        assert e.rank == 1 and "trainer rank 1 died" in str(e), str(e)
        print("DIED:", str(e).splitlines()[0])

    import dataclasses
    ranks = RayRanks(dataclasses.replace(spec, heartbeat_s=1.0), 2, 120, work / "ranks")
    stopped = ranks.pids[1]
    os.kill(stopped, signal.SIGSTOP)
    try:  # rank 0 waits in the gather behind rank 1, answering its pings: rank 1 alone is silent, long before 120 s
        ranks.call("digest")
        raise AssertionError("a silent rank went unnoticed")
    except RankFailure as e:
        first = str(e).splitlines()[0]
        assert e.rank == 1 and first.startswith("trainer rank 1 went silent during 'digest'"), first
        assert first.endswith("; alive and waiting: 0; its log ends:") or first.endswith("alive and waiting: 0"), first
        print("SILENT:", first)
    finally:
        os.kill(stopped, signal.SIGCONT)
    ranks = RayRanks(dataclasses.replace(spec, heartbeat_s=1.0), 2, 120, work / "ranks")
    ranks.reply_timeout_s = 1e-3  # a command longer than rank_timeout_s (a save is): not finished, not silent
    try:
        ranks.call("save", str(work / "ckpt"))
        raise AssertionError("a command past rank_timeout_s went unnoticed")
    except RankFailure as e:
        assert "did not finish 'save' within 0.001 s" in str(e) and "went silent" not in str(e), str(e)
        print("TIMEOUT:", str(e).splitlines()[0])
    try:  # a 2-CPU cluster (Ray counts this machine's cores) cannot place 3 CPU ranks
        RayRanks(spec, 3, 3.0, work / "ranks")
        raise AssertionError("an unplaceable placement group went unnoticed")
    except ConfigError as e:
        assert e.key == "psrl.deployment.train_ngpus_per_node" and "could not place" in str(e), str(e)
        print("PLACEMENT:", e)
    print("FAULTS-OK")
    """
)


def test_a_dead_or_silent_ray_rank_is_named_and_an_engine_reads_the_published_directory(tmp_path):
    """A Ray engine loads ``weights/v1`` the 2 rank actors published without asking the store; then rank 1's
        process SIGKILLed makes the next command a ``RankFailure`` naming rank 1 as dead, and rank 1 SIGSTOPped one
        naming it alone as silent (no answer to the heartbeat's pings for 3 periods; rank 0, blocked behind it in a
        collective, answers and is named as waiting) long before the reply timeout; a command longer than
        ``trainer.rank_timeout_s`` is reported as not finished, not as silent: all end the actors instead of hanging; 3 ranks on a 2-CPU cluster are
    one config error naming the key."""
    out = _loopback_only(["-c", FAULTS, str(tmp_path)])
    assert "FAULTS-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_sigkill_of_psrl_train_leaves_no_ray_rank_actor(tmp_path):
    """``psrl train`` at 2 Ray ranks (its own local cluster) SIGKILLed after its first step: the rank actors'
    processes end too (Ray's cluster shares psrl's fate), waited for with a bound."""
    pytest.importorskip("ray")
    args = [*TINY, f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=200"]
    args += ["psrl.deployment.train_ngpus_per_node=2", "runtime.backend=ray"]
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, "-m", "psrl.cli"]
    mark = f"PSRL_TEST_RUN={tmp_path}"  # Ray's processes inherit it: this run's, not another job's on the machine
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PSRL_TEST_RUN": str(tmp_path)}
    err = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([*cmd, "train", *args], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # the first step's line: the rank actors are up and have trained
        if line.startswith("step "):
            break
    else:
        proc.wait(timeout=30)
        raise AssertionError("psrl train ended before its first step: " + (tmp_path / "stderr").read_text()[-3000:])
    ranks = _rank_actors(mark)
    assert len(ranks) == 2, ranks
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while _rank_actors(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    err.close()
    assert _rank_actors(mark) == []


def _rank_actors(mark: str) -> list[int]:
    """Live processes of this machine running a :class:`~psrl.runtime.ray_ranks.RankActor` with ``mark`` (``K=V``)
    in their environment."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or mark.encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
            if b"RankActor" in (d / "cmdline").read_bytes():
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d.name))
        except OSError:
            continue
    return out
