"""The launch recipes of examples/launch (docs/scaling.md): the SLURM batch script passes ``bash -n`` and, run with
stand-ins for ``scontrol``/``srun``/``ray``/``psrl`` that record their arguments, starts Ray's head on the first
node, one labelled ``ray start`` per other node (trainer pool first, then rollout) and one ``psrl train`` with the
pool shape of its node counts; the KubeRay RayJob parses, names the image, resources and entrypoint, and its group
sizes agree with the entrypoint's deployment keys. Neither recipe ran on a real cluster here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from psrl.config import load_config

LAUNCH = Path(__file__).resolve().parents[2] / "examples" / "launch"
SBATCH = LAUNCH / "slurm.sbatch"

STANDINS = {
    # each appends its argv to $LOG, one line per call
    "scontrol": 'echo "scontrol $*" >> "$LOG"; for n in $FAKE_HOSTS; do echo "$n"; done',
    "srun": (
        'echo "srun $*" >> "$LOG"\n'
        'while [ $# -gt 0 ]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done\n'
        'if [ "$1" = hostname ]; then echo "10.0.0.1 fe80::1"; fi'
    ),
    "ray": 'echo "ray $*" >> "$LOG"; if [ "$1" = status ]; then for n in $FAKE_HOSTS; do echo " 1 node_$n"; done; fi',
    "psrl": 'echo "psrl $*" >> "$LOG"',
}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_batch_script_parses():
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _render(tmp_path: Path, train: int, rollout: int, hosts: int | None = None) -> tuple[int, list[str], str]:
    """Run the batch script with the stand-ins; returns its exit status, the recorded calls and its stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STANDINS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    n = train + rollout if hosts is None else hosts
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(log),
        "FAKE_HOSTS": " ".join(f"gpu{i}" for i in range(n)),
        "SLURM_JOB_NODELIST": f"gpu[0-{n - 1}]",
        "TRAIN_NODES": str(train),
        "ROLLOUT_NODES": str(rollout),
        "GPUS_PER_NODE": "4",
    }
    cfg = tmp_path / "run.yaml"
    cfg.write_text("trainer: {total_steps: 3}\n")
    out = subprocess.run(["bash", str(SBATCH), str(cfg), "psrl.staleness=1"], capture_output=True, text=True, env=env)
    calls = log.read_text().splitlines() if log.exists() else []
    return out.returncode, calls, out.stderr


def test_batch_script_for_one_trainer_and_two_rollout_nodes(tmp_path):
    """1 + 2 nodes: the head (trainer pool) on gpu0 at its address, gpu1 and gpu2 join it as the rollout pool, and
    ``psrl train`` gets the config, the user's override and the shape; then every node's Ray is stopped."""
    rc, calls, err = _render(tmp_path, 1, 2)
    assert rc == 0, err
    starts = [c for c in calls if c.startswith("srun") and " ray start " in c]
    head = [c for c in starts if "--head" in c]
    assert len(head) == 1 and "-w gpu0 " in head[0] and "--port=6379" in head[0]
    assert "--node-ip-address=10.0.0.1" in head[0] and "--labels=psrl-pool=trainer" in head[0]
    workers = {c.split("-w ")[1].split()[0]: c for c in starts if "--head" not in c}
    assert sorted(workers) == ["gpu1", "gpu2"]
    assert all("--address=10.0.0.1:6379" in c and "--labels=psrl-pool=rollout" in c for c in workers.values())
    (train,) = [c.split() for c in calls if c.startswith("psrl ")]
    assert train[1:4] == ["train", str(tmp_path / "run.yaml"), "psrl.staleness=1"]
    keys = dict(a.split("=", 1) for a in train[4:])
    assert keys == {
        "model.device": "cuda",
        "runtime.backend": "ray",
        "runtime.ray_address": "10.0.0.1:6379",
        "runtime.ray_pool_label": "psrl-pool",
        "psrl.deployment.train_nnodes": "1",
        "psrl.deployment.train_ngpus_per_node": "4",
        "psrl.deployment.n_rollout_instances": "2",
    }
    stops = sorted(c.split("-w ")[1].split()[0] for c in calls if c.endswith("ray stop --force"))
    assert stops == ["gpu0", "gpu1", "gpu2"]


def test_batch_script_trainer_pool_takes_the_first_nodes(tmp_path):
    """2 + 1 nodes: gpu1 joins as a second trainer node, gpu2 is the rollout pool, train_nnodes=2."""
    rc, calls, err = _render(tmp_path, 2, 1)
    assert rc == 0, err
    labels = {c.split("-w ")[1].split()[0]: c.rsplit("--labels=", 1)[1] for c in calls if " ray start " in c}
    assert labels == {"gpu0": "psrl-pool=trainer", "gpu1": "psrl-pool=trainer", "gpu2": "psrl-pool=rollout"}
    (train,) = [c for c in calls if c.startswith("psrl ")]
    assert "psrl.deployment.train_nnodes=2" in train.split() and "psrl.deployment.n_rollout_instances=1" in train


def test_batch_script_refuses_a_node_count_that_disagrees(tmp_path):
    """An allocation of 2 nodes for 1 + 2 is one line naming the sbatch option, and nothing is started."""
    rc, calls, err = _render(tmp_path, 1, 2, hosts=2)
    assert rc == 2 and "sbatch --nodes=3" in err
    assert not [c for c in calls if not c.startswith("scontrol")]


def test_rayjob_names_image_resources_entrypoint_and_agrees_with_its_keys():
    job = yaml.safe_load((LAUNCH / "kuberay-rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    argv = spec["entrypoint"].split()
    assert argv[:2] == ["psrl", "train"]
    keys = dict(a.split("=", 1) for a in argv[3:])
    cluster = spec["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"trainer", "rollout"}
    pods = [cluster["headGroupSpec"]["template"], *(g["template"] for g in groups.values())]
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert images == {"REGISTRY/psrl:0.1.0"}
    for name, g in groups.items():
        assert g["rayStartParams"]["labels"] == f"{keys['runtime.ray_pool_label']}={name}"
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"]
    trainer_gpus = groups["trainer"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(keys["psrl.deployment.train_nnodes"]) == groups["trainer"]["replicas"]
    assert int(keys["psrl.deployment.train_ngpus_per_node"]) == int(trainer_gpus)
    assert int(keys["psrl.deployment.n_rollout_instances"]) == groups["rollout"]["replicas"]
    assert "rollout" in groups and groups["rollout"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    overrides = [a for a in argv[3:] if not a.startswith("trainer.run_dir")]
    load_config(None, overrides)  # every key the entrypoint sets is a valid psrl key with a valid value


def test_dockerfile_installs_psrl_with_ray_at_the_pinned_version():
    text = (LAUNCH / "Dockerfile").read_text()
    pins = Path(__file__).resolve().parents[2].joinpath("pyproject.toml").read_text()
    ray_pin = pins.split('ray = ["ray==', 1)[1].split('"', 1)[0]
    assert f"rayproject/ray:{ray_pin}-" in text and "'.[ray]'" in text
