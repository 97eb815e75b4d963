"""The multi-node run of ``tests/ray/multinode.py`` with every Ray node in its own network namespace, so that the
weights and every call really cross a network interface (issue #37). Run as ``python -m tests.ray.netns RUN_DIR
AUDIT_DIR`` inside ``unshare -rn`` (a user namespace owning a fresh network namespace: the head's); it prints one
``RESULT {...}`` line, as ``multinode.py`` does.

Set up: in the head's namespace a bridge ``psrlbr0`` at 10.77.0.1/24 and loopback; each other node is a
``unshare -n`` child (its own network namespace, nothing but loopback and one end of a veth pair whose other end
is on the bridge) at 10.77.0.2, 10.77.0.3, ... running ``ray start --block`` with its pool label. The head runs
``ray start --head`` on the bridge's address and the driver; the filesystem is shared (one machine), the network
is not. Torn down: each node's ``ray start`` process group is terminated (never ``ray stop``: it would end every
Ray process of this user on the machine), then the namespaces go with their last process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.ray.multinode import LABEL, MB, SHARED_MACHINE_ENV, actors, train

NET = "10.77.0"
PORT = 6379
NODES = [("trainer", 2), ("rollout", 1)]
"""The nodes besides the head (a rollout node with 1 CPU, where the driver runs): pool and CPUs."""


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def start_nodes(audit_dir: Path, run_dir: Path, temp: Path) -> list[subprocess.Popen]:
    """The bridge, Ray's head on it, and one ``unshare -n`` node per :data:`NODES` joined to it by a veth pair;
    returns the nodes' ``ray start --block`` processes (head first). Each node keeps its sessions under ``temp``
    (Ray's default ``/tmp/ray`` would give the nodes of one machine the same socket paths)."""
    os.environ["PSRL_AUDIT_ROOT"] = str(run_dir.resolve())
    os.environ["PSRL_AUDIT_DIR"] = str(audit_dir)
    os.environ["RAY_health_check_period_ms"] = "500"
    os.environ.update(SHARED_MACHINE_ENV)
    # no token: nothing outside these namespaces can reach the bridge (Ray's clients of `ray start` nodes sent no
    # token under RAY_AUTH_MODE=token here; a real cluster keeps token authentication on)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", "name", "psrlbr0", "type", "bridge")
    _sh("ip", "addr", "add", f"{NET}.1/24", "dev", "psrlbr0")
    _sh("ip", "link", "set", "psrlbr0", "up")
    common = ["--block", "--disable-usage-stats", f"--object-store-memory={80 * MB}"]
    head = [_ray(), "start", "--head", f"--node-ip-address={NET}.1", f"--port={PORT}", "--include-dashboard=false"]
    head += [*common, "--num-cpus=1", f"--labels={LABEL}=rollout", f"--temp-dir={temp / 'n1'}"]
    procs = [subprocess.Popen(head, start_new_session=True)]
    _reachable(f"{NET}.1", PORT, 120)
    for i, (pool, cpus) in enumerate(NODES, start=2):
        inner, outer = f"veth{i}n", f"veth{i}b"
        # the child waits for its end of the link, gives it its address, then becomes the Ray node
        script = (
            f"while ! ip link show {inner} >/dev/null 2>&1; do sleep 0.05; done; ip link set lo up; "
            f'ip addr add {NET}.{i}/24 dev {inner}; ip link set {inner} up; exec "$@"'
        )
        node = [_ray(), "start", f"--address={NET}.1:{PORT}", f"--node-ip-address={NET}.{i}"]
        node += [*common, f"--num-cpus={cpus}", f"--labels={LABEL}={pool}", f"--temp-dir={temp / f'n{i}'}"]
        proc = subprocess.Popen(["unshare", "-n", "sh", "-c", script, "sh", *node], start_new_session=True)
        _own_namespace(proc.pid, 30)  # else the link would move into this namespace, where the child still is
        _sh("ip", "link", "add", "name", outer, "type", "veth", "peer", "name", inner)
        _sh("ip", "link", "set", "dev", inner, "netns", str(proc.pid))
        _sh("ip", "link", "set", "dev", outer, "master", "psrlbr0")
        _sh("ip", "link", "set", "dev", outer, "up")
        procs.append(proc)
    return procs


def _reachable(host: str, port: int, within_s: float) -> None:
    """Return once ``host:port`` accepts a connection (Ray's head is up), or raise after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _own_namespace(pid: int, within_s: float) -> None:
    """Return once process ``pid`` is in a network namespace other than this one's (``unshare -n`` has run)."""
    here = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + within_s
    while os.readlink(f"/proc/{pid}/ns/net") == here:
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not enter its own network namespace within {within_s:g} s")
        time.sleep(0.02)


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    """The other nodes first, then the head: SIGTERM to each node's process group (``ray start --block`` ends
    its node's processes), SIGKILL to what is left after a bounded wait."""
    for p in reversed(procs):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=45)
                break
            except subprocess.TimeoutExpired:
                continue


def main(run_dir: Path, audit_dir: Path) -> None:
    import ray

    temp = Path(tempfile.mkdtemp(prefix="psrl-ns-"))
    procs = start_nodes(audit_dir, run_dir, temp)
    result: dict = {"mode": "netns"}
    try:
        ray.init(
            address=f"{NET}.1:{PORT}",
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"worker_process_setup_hook": "tests.ray.multinode.audit_opens"},
        )
        deadline = time.monotonic() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < 1 + len(NODES) and time.monotonic() < deadline:
            time.sleep(0.5)  # the nodes join on their own; psrl would otherwise find a smaller cluster
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        result["nodes"] = {"head": by_ip.get(f"{NET}.1"), "trainer": by_ip.get(f"{NET}.2")}
        result["nodes"]["rollout"] = by_ip.get(f"{NET}.3")
        result["addresses"] = sorted(by_ip)
        result.update(train(f"{NET}.1:{PORT}", "netns", run_dir, lambda line: print(line, flush=True)))
    except Exception as exc:  # noqa: BLE001 -- reported in the RESULT line
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result.setdefault("actors", actors() if ray.is_initialized() else [])
    finally:
        ray.shutdown()
        stop_nodes(procs)
        shutil.rmtree(temp, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
