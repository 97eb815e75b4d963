"""``task.judge.path``: the judge of ``task.reward=judge`` served by psrl itself (issue #35, item 5).

A vLLM server of the run's own, started before the run is built and stopped when it ends (and, like psrl's
rollout servers, dying with psrl: :class:`~psrl.rollout.engines.vllm_server.VLLMServer`), serving the directory's
weights as they are -- the judge is never trained -- under the name ``task.judge.model`` on loopback. It runs in
``rollout.vllm.python``'s environment with ``rollout.vllm.kv_cache_gb`` of KV cache; its log is
``RUN_DIR/judge-server.log``. :class:`~psrl.tasks.judge.JudgeReward` finds its URL in
:data:`psrl.tasks.judge.SERVED`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

__all__ = ["judge_server", "MAX_JUDGE_LEN"]

MAX_JUDGE_LEN = 4096
"""The judge server's context: the model's own, at most this (a judge prompt is one question and one answer)."""


@contextlib.asynccontextmanager
async def judge_server(cfg: Any, run_dir: Path, log: Callable[[str], None] = print) -> AsyncIterator[str | None]:
    """The judge server's base URL (``.../v1``) while the block runs; None when ``task.judge.path`` is not set."""
    judge = cfg.task.judge
    if cfg.task.reward != "judge" or not judge.path:
        yield None
        return
    import httpx

    from psrl.rollout.engines.vllm_server import VLLMServer, find_vllm_python
    from psrl.tasks.judge import SERVED

    own = json.loads((Path(judge.path) / "config.json").read_text()).get("max_position_embeddings") or MAX_JUDGE_LEN
    server = VLLMServer(
        find_vllm_python(cfg.rollout.vllm.python),
        judge.path,
        Path(run_dir) / "judge-server.log",
        dtype="float32",
        max_model_len=min(int(own), MAX_JUDGE_LEN),
        kv_cache_gb=cfg.rollout.vllm.kv_cache_gb,
        startup_timeout_s=cfg.rollout.vllm.startup_timeout_s,
        name=judge.model,
    )
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            url = await server.start(client) + "/v1"
        SERVED[judge.path] = url
        log(f"judge: {judge.path} served as {judge.model!r} at {url} (task.judge.path; frozen weights)")
        yield url
    finally:
        SERVED.pop(judge.path, None)
        server.stop()
