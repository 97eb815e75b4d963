"""Ray runtime: an hf engine in a Ray actor generates exactly like the local hf engine with the same weights,
one Ray call per request (never per token), and takes weight updates through the parameter store.

Ray probes outside addresses at start-up, so the check runs in a network namespace with only
loopback up (``unshare -rn``): nothing leaves this machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ray

SCRIPT = textwrap.dedent(
    """
    import asyncio, torch
    torch.set_num_threads(1)
    from psrl.config import load_config
    from psrl.rollout.engines.hf import HFEngine
    from psrl.runtime.ray_runtime import build_ray_engines
    from psrl.train import build_task_and_policy
    import tempfile
    from psrl.weights import FileVersions, publish_model
    from psrl.types import Engine, GenRequest, Sampling

    cfg = load_config(None, ["trainer.temperature=0"])
    task, policy = build_task_and_policy(cfg)
    store = FileVersions(tempfile.mkdtemp(prefix="psrl-ray-test-"))  # what the trainer's ranks write
    publish_model(policy.model, store.root, 4)
    from psrl.runtime.ray_weights import ObjectVersions
    remote = build_ray_engines(cfg, 2, 0, ObjectVersions())  # nothing recorded: the driver puts what it published
    local = [HFEngine(policy.replica(1 + i), sampling=Sampling(temperature=0, stop_ids=frozenset(task.stop_ids)))
             for i in range(2)]

    async def gen(engine):
        await engine.start()
        await engine.update_weights(4, store)
        reqs = [GenRequest([1, 2, 3, 4], 12), GenRequest([5, 6], 7), GenRequest([7], 9)]
        await asyncio.gather(*(engine.generate(r) for r in reqs))
        calls = getattr(engine, "steps", None)
        await engine.close()
        return reqs, engine.version, calls

    for r, l in zip(remote, local):
        assert isinstance(r, Engine)
        rr, rv, rcalls = asyncio.run(gen(r))
        lr, _, _ = asyncio.run(gen(l))
        for a, b in zip(rr, lr):
            assert a.tokens == b.tokens and a.versions == b.versions, (a, b)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        assert rv == 4 and rcalls == 3  # three requests, three Ray calls
    print("RAY-OK")
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a loopback-only namespace")
def test_ray_actor_matches_local_policy():
    pytest.importorskip("ray")
    cmd = ["unshare", "-rn", "sh", "-c", f'ip link set lo up && exec {sys.executable} -c "$0"', SCRIPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert "RAY-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
