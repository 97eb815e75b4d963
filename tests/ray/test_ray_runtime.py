"""Ray runtime: a policy in a Ray actor decodes exactly like the local policy with the same weights.

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
    from psrl.models import build_policy
    from psrl.runtime.ray_runtime import build_ray_models
    from psrl.train import build_task_and_policy

    cfg = load_config()
    task, trainer_policy = build_task_and_policy(cfg)
    state = trainer_policy.export_state()
    remote = build_ray_models(cfg, 2, seed=0, initial_state=state, version=4)
    local = [build_policy(cfg.model, task, seed=1 + i) for i in range(2)]
    for p in local:
        p.load_state(state, 4)
    seqs = [[1, 2, 3, 4], [5, 6], [7]]

    async def decode(model):
        return await model.anext_token(seqs, 1.0, 1.0)

    for r, l in zip(remote, local):
        rt, rl = asyncio.run(decode(r))
        lt, ll = l.next_token(seqs, 1.0, 1.0)
        assert rt == lt, (rt, lt)
        assert max(abs(a - b) for a, b in zip(rl, ll)) < 1e-5
        assert r.version == 4
    print("RAY-OK")
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a loopback-only namespace")
def test_ray_actor_matches_local_policy():
    pytest.importorskip("ray")
    cmd = ["unshare", "-rn", "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"$0\"", SCRIPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert "RAY-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
