"""Engines under test: the fake (no-cache twin over FakeEngine), ``hf`` and ``vllm``, built alike.

The vLLM servers (two, of the built-in default model) start once per test session and are shared;
every test attaches to them through ``rollout.vllm.urls``-style engines and loads its own weights.
Without the vLLM environment (docs/engines.md) the ``vllm`` cases are skipped with the reason.
Run the whole ``-m vllm`` suite in a loopback-only network namespace (``.ci/run`` does).
"""

import asyncio
import os

import pytest
import torch

torch.set_num_threads(1)

from psrl.config import load_config  # noqa: E402
from psrl.train import build_task_and_policy  # noqa: E402

CONTEXT = 4096
TINY_MODEL = [f"model.n_positions={CONTEXT}"]
"""The session's vLLM servers serve this shape; runs that attach to them build the same. The context is long
so that a request can run for many seconds: a pause or an abort sent to a fast server, from a test process
that may get little CPU, still reaches it mid-request."""


@pytest.fixture(scope="session")
def tiny():
    """The default task and its built-in model (the shape vLLM serves) with a 4096-token context, and the config."""
    cfg = load_config(None, TINY_MODEL)
    task, policy = build_task_and_policy(cfg)
    return cfg, task, policy


def vllm_python_or_skip() -> str:
    from psrl.rollout.engines.vllm_server import EngineSetupError, find_vllm_python

    try:
        return find_vllm_python(os.environ.get("PSRL_VLLM_PYTHON"))
    except EngineSetupError as exc:
        pytest.skip(f"no vLLM environment: {exc}")


@pytest.fixture(scope="session")
def vllm_urls(vllm_servers):
    """URLs of the session's two vLLM servers."""
    return vllm_servers[0]


@pytest.fixture(scope="session")
def vllm_servers(tiny, tmp_path_factory):
    """Two vLLM servers of the default model for the whole session (started once, stopped at the end):
    ``(urls, model_dir)``, the directory they started from (the untrained default model)."""
    import httpx

    from psrl.rollout.engines.vllm_server import VLLMServer

    python = vllm_python_or_skip()
    _, _, policy = tiny
    root = tmp_path_factory.mktemp("vllm")
    policy.save_pretrained(root / "model")
    servers = [VLLMServer(python, root / "model", root / f"server-{i}.log", max_model_len=CONTEXT) for i in range(2)]

    async def start_all():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await asyncio.gather(*(s.start(client) for s in servers))

    try:
        urls = asyncio.run(start_all())
    except BaseException:
        for s in servers:
            s.stop()
        raise
    yield urls, root / "model"
    for s in servers:
        s.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """On a failed run, the errors in every vLLM server log under the session's temporary directory (the shared
    servers', the module ones', the ones psrl started in a run directory): a server that died shows its own stack
    trace here, where CI's output keeps it, not only the client's 'EngineCore encountered an issue' (errors after
    the server began to shut down are left out: every stop logs some)."""
    if exitstatus == 0 or not hasattr(config, "_tmp_path_factory"):
        return
    try:
        base = config._tmp_path_factory.getbasetemp()
    except Exception:  # noqa: BLE001 -- no temporary directory was made: no server ran
        return
    for log in sorted(base.rglob("server*.log")):
        lines = log.read_text(errors="replace").splitlines()
        end = next((i for i, line in enumerate(lines) if "[shutdown]" in line or "Shutting down" in line), len(lines))
        first = next((i for i, line in enumerate(lines[:end]) if "Traceback" in line or " ERROR " in line), None)
        if first is None:  # none, or only those of its stop at the end of the session
            continue
        terminalreporter.section(f"vLLM server log {log.relative_to(base)} from its first error", sep="-")
        terminalreporter.write_line("\n".join(lines[max(0, first - 5) : first + 60]))
