"""The vLLM engines of a run (``rollout.engine=vllm``): attached to ``rollout.vllm.urls`` or each with a server psrl
starts and owns (:class:`~psrl.rollout.engines.vllm_server.VLLMServer`), from the Hugging Face directory it serves."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from psrl.rollout.engines.vllm import VLLMEngine
from psrl.rollout.engines.vllm_lora import ServedAdapter
from psrl.rollout.engines.vllm_server import VLLMServer, find_vllm_python
from psrl.types import Sampling
from psrl.weights import write_model_directory

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.models import Policy

__all__ = ["build_vllm_engines", "server_of"]


def build_vllm_engines(
    cfg: Config,
    policy: Policy,
    run_dir: Path | None,
    sampling: Sampling,
    start: Path | None = None,
    n: int | None = None,
    name: str = "server",
    attach: bool = True,
) -> list[VLLMEngine]:
    """``n`` engines (default: one per rollout instance): attached to ``rollout.vllm.urls`` or each with a server
    psrl starts (its log ``run_dir/vllm/{name}-{i}.log``; always with ``attach=False``).

    The servers start from a Hugging Face directory in the run directory: the published version ``start`` (its
    files linked, the policy's config and tokenizer beside them: :func:`psrl.weights.write_model_directory`) when
    the driver's policy holds no weights, else the policy itself, saved (so a task's added tokens and a dequantized
    GGUF model are served as the trainer sees them); every version after that arrives through ``reload_weights``.
    With LoRA (``model.lora_rank > 0``) each engine serves an adapter whose files live in ``run_dir/vllm/{name}-{i}``
    (:class:`~psrl.rollout.engines.vllm_lora.ServedAdapter`).
    """
    r = cfg.rollout
    n = cfg.psrl.deployment.n_rollout_instances if n is None else n
    root = Path(run_dir if run_dir is not None else ".") / "vllm"
    model_dir = root / "model"
    engine = functools.partial(
        VLLMEngine,
        request_timeout_s=r.request_timeout_s,
        sampling=sampling,
    )
    if not (model_dir / "config.json").exists():
        if policy.weightless:
            if start is None:
                raise ValueError("build_vllm_engines: a weightless policy's servers start from a published version")
            write_model_directory(start, model_dir, policy.model, policy.tokenizer)
        else:
            policy.save_pretrained(model_dir)
    lora = cfg.model.lora_rank > 0
    if r.vllm.urls and attach:
        return [
            engine(url=u, adapter=ServedAdapter(root / f"attached-{i}") if lora else None)
            for i, u in enumerate(r.vllm.urls)
        ]
    return [
        engine(
            server=server_of(cfg, policy, model_dir, root / f"{name}-{i}.log"),
            adapter=ServedAdapter(root / f"{name}-{i}") if lora else None,
        )
        for i in range(n)
    ]


def server_of(cfg: Config, policy: Policy, model_dir: Path, log_path: Path) -> VLLMServer:
    """The vLLM server ``rollout.vllm.*`` describes for ``policy``'s shape, started from ``model_dir`` (a server
    psrl owns: here, or in a Ray actor on a rollout node, ``psrl.runtime.ray_runtime``)."""
    r = cfg.rollout
    mcfg = policy.model.config
    max_len = r.vllm.max_model_len or getattr(mcfg, "max_position_embeddings", None) or mcfg.n_positions
    return VLLMServer(
        find_vllm_python(r.vllm.python),
        model_dir,
        log_path,
        dtype=cfg.model.dtype,
        max_model_len=max_len,
        kv_cache_gb=r.vllm.kv_cache_gb,
        extra_args=r.vllm.args,
        receiver=cfg.weights.transport == "collective",
        startup_timeout_s=r.vllm.startup_timeout_s,
        lora_rank=cfg.model.lora_rank,
    )
