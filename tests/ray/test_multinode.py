"""psrl on a multi-node Ray cluster of this machine (issue #37; ``tests/ray/multinode.py`` runs it): three Ray
nodes with their own CPUs and bounded object stores, labelled into a trainer pool and a rollout pool
(``runtime.ray_pool_label``). The trainer's rank actors run on the trainer node, the two rollout instances on the
two rollout nodes (checked through the actors' node ids); 10 steps with the staleness audit clean; every version
reaches the engine actors through Ray's object store, and no engine actor opens a file of ``run_dir`` (an audit
hook on ``open`` in every Ray worker process). Losing the second rollout node after step 3: the run finishes on the
other instance, nothing lost. Losing the trainer node: one line naming the rank, its node and that the node is
dead, bounded by Ray's health check (0.5 s x 4 here) and ``trainer.rank_timeout_s`` (60 s), enforced by
pytest-timeout; then the same command on a rebuilt cluster resumes. After each, no actor is alive and no placement
group remains.

Each runs in a network namespace with only loopback up (``unshare -rn``): nothing leaves this machine. The nodes
share this machine's filesystem, so the audit hook, not the filesystem, is what shows the engines did not read it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psrl.runtime.recorder import read_jsonl
from tests.rollout.harness import check_bound

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a loopback-only namespace"),
]

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, run_dir: Path, audit: Path, timeout: float = 420, module: str = "tests.ray.multinode") -> dict:
    """``tests/ray/multinode.py MODE`` (or ``module``, which takes no mode) in a loopback-only namespace; its
    RESULT line. Its whole output is kept as ``MODE.out`` beside ``run_dir``."""
    pytest.importorskip("ray")
    audit.mkdir(exist_ok=True)
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, "-m", module]
    cmd += [mode, str(run_dir), str(audit)] if module == "tests.ray.multinode" else [str(run_dir), str(audit)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    env["PSRL_HANG_S"] = str(timeout - 60)  # multinode.hang_guard: stacks and logs before this timeout strikes
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    (run_dir.parent / f"{mode}.out").write_text(out.stdout + out.stderr)  # in full: a failure shows only its tail
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["stdout"] = out.stdout
    return result


def _opened(audit: Path, pids: set[int]) -> list[str]:
    """The run-directory files the processes ``pids`` opened."""
    return [line for p in audit.iterdir() if int(p.name) in pids for line in p.read_text().splitlines()]


def _check_placement_and_reads(result: dict, audit: Path, rollout: tuple[str, ...] = ("head", "rollout")) -> None:
    """Ranks on the trainer node, one engine actor on each ``rollout`` node; no engine actor opened a run_dir file
    (while the ranks did: the hook works); nothing alive, no placement group left."""
    nodes = result["nodes"]
    ranks = [a for a in result["actors"] if a["cls"] == "RankActor"]
    engines = [a for a in result["actors"] if a["cls"] == "EngineWorker"]
    assert len(ranks) == 2 and {a["node"] for a in ranks} == {nodes["trainer"]}, ranks
    assert sorted(a["node"] for a in engines) == sorted(nodes[k] for k in rollout), engines
    assert _opened(audit, {a["pid"] for a in engines}) == []
    assert any("/weights/" in f for f in _opened(audit, {a["pid"] for a in ranks}))
    assert {a["state"] for a in result["actors"]} == {"DEAD"}, result["actors"]
    assert result["placement_groups"] in ([], ["REMOVED"])
    assert _leftovers(audit) == []


@pytest.mark.timeout(600)
def test_three_nodes_trainer_and_rollout_pools_weights_through_the_object_store(tmp_path):
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    result = _run("run", run_dir, audit)
    assert result.get("steps") == list(range(1, 11)), (result.get("error"), result["stdout"][-3000:])
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 1) == 10 * 2 * 2
    _check_placement_and_reads(result, audit)
    synced = [r.get("weights/synced_version", -1) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert max(synced) >= 8  # the engines loaded the newer versions, not only the first


@pytest.mark.timeout(600)
def test_losing_a_rollout_node_finishes_on_the_other_instance(tmp_path):
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    result = _run("rollout-loss", run_dir, audit)
    assert result.get("steps") == list(range(1, 11)), (result.get("error"), result["stdout"][-3000:])
    assert result["dead_engines"] == 1
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 1) == 10 * 2 * 2
    _check_placement_and_reads(result, audit)


@pytest.mark.timeout(600)
def test_an_instance_rejoins_when_its_lost_node_comes_back(tmp_path):
    """The second rollout node removed after step 3; once its instance is dead, a node with the same label joins
    (Ray gives it a new id): the instance gets a new engine actor there (one line naming it and the node), loads a
    later version through the object store and serves again -- trajectories reserved at or after that version ran
    on it and were trained. 40 steps, audit clean, no engine actor read run_dir, nothing left behind."""
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    result = _run("rollout-back", run_dir, audit)
    assert result.get("steps") == list(range(1, 41)), (result.get("error"), result["stdout"][-3000:])
    back = result["nodes"]["back"]
    assert result["dead_engines"] == 1 and result["rejoins"] == 1, result["stdout"][-3000:]
    said = re.findall(r"rollout instance (\d) rejoined on node (\w+) .*, holding version (\d+)", result["stdout"])
    assert len(said) == 1 and said[0][1] == back[:12], result["stdout"][-3000:]
    index, version = int(said[0][0]), int(said[0][2])
    assert version > 3  # the node went after step 3: what it loads on rejoining is newer
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(trajectories, 1) == 40 * 2 * 2
    served = [r for r in trajectories if r["status"] == "trained" and index in r["instances"]]
    assert any(r["v_traj"] >= version for r in served)  # only the new actor held a version that new
    _check_placement_and_reads(result, audit, rollout=("head", "rollout", "back"))


@pytest.mark.timeout(900)
def test_losing_the_trainer_node_is_one_line_naming_it_then_a_rebuilt_cluster_resumes(tmp_path):
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    result = _run("trainer-loss", run_dir, audit)
    trainer = result["nodes"]["trainer"]
    assert "steps" not in result, result["stdout"][-3000:]
    assert "trainer rank" in result["error"] and "died" in result["error"], result["error"]
    assert trainer[:12] in result["error"] and "(dead)" in result["error"], result["error"]
    assert {a["state"] for a in result["actors"]} == {"DEAD"} and result["placement_groups"] in ([], ["REMOVED"])
    assert _leftovers(audit) == []
    done = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert done[:3] == [1, 2, 3]  # the node went after step 3 (during that step's checkpoint or the next step)

    resumed = _run("resume", run_dir, audit)
    assert "resumed from" in resumed["stdout"]
    assert resumed["steps"][-1] == 10 and 2 <= resumed["steps"][0] <= done[-1] + 1, resumed["stdout"][-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 11))
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 1) == 10 * 2 * 2
    assert {a["state"] for a in resumed["actors"]} == {"DEAD"} and _leftovers(audit) == []


def _leftovers(audit: Path, within_s: float = 30.0) -> list[int]:
    """Processes of this machine started by the cluster of the run that used ``audit`` (they carry it in their
    environment: raylets, GCS, workers, vLLM servers) still alive after up to ``within_s`` seconds: a vLLM server's
    watcher ends its process group within ~10 s of its actor's end, which may come just before the driver exits
    (one was still there at an immediate look)."""
    deadline = time.monotonic() + within_s
    while (alive := _alive(audit)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def _alive(audit: Path) -> list[int]:
    mark = f"PSRL_AUDIT_DIR={audit}".encode()
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and mark in (d / "environ").read_bytes().split(b"\0"):
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d.name))
        except OSError:
            continue
    return out


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_three_nodes_with_vllm_servers_owned_by_the_rollout_actors(tmp_path):
    """The same shape with ``rollout.engine=vllm``: each engine actor starts its vLLM server on its rollout node and
    writes each received version into a directory of its own for ``reload_weights``; 10 steps, audit clean, no
    engine actor opens a run_dir file. Needs the vLLM environment (``-m "ray and vllm"``)."""
    from tests.conftest import vllm_python_or_skip

    os.environ.setdefault("PSRL_VLLM_PYTHON", vllm_python_or_skip())
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    result = _run("vllm", run_dir, audit, timeout=840)
    if result.get("steps") != list(range(1, 11)):  # the error, the run's output, what Ray's logs say: in full
        pytest.fail(f"{result.get('error')}\n{result['stdout'][-6000:]}\n{result.get('logs', '')[-8000:]}")
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 1) == 10 * 2 * 2
    _check_placement_and_reads(result, audit)
    rows = read_jsonl(run_dir / "metrics.jsonl")  # the servers score as the ranks do: the versions really loaded
    scored = [r for r in rows if r.get("engine/mismatch_tokens", 0) > 0]  # a row may hold no such token
    assert scored and max(r["engine/logprob_mismatch_max"] for r in scored) < 1e-3


@pytest.mark.timeout(600)
def test_nodes_in_separate_network_namespaces_joined_by_veth(tmp_path):
    """Every Ray node in its own network namespace (``tests/ray/netns.py``: a bridge, one veth pair per node, each
    node its own address and loopback, nothing else), so the buckets and calls cross an interface: the same checks
    as the 3-node run, the nodes at their own addresses; ``time/sync_s`` per version is printed."""
    run_dir, audit = tmp_path / "run", tmp_path / "audit"
    result = _run("netns", run_dir, audit, module="tests.ray.netns")
    assert result["addresses"] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"], result
    assert result.get("steps") == list(range(1, 11)), (result.get("error"), result["stdout"][-3000:])
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 1) == 10 * 2 * 2
    _check_placement_and_reads(result, audit)
    print("time/sync_s per version over veth:", result["sync_s"])
    assert len(result["sync_s"]) >= 8
