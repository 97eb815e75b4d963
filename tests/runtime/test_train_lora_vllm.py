"""``psrl train`` with ``model.lora_rank > 0`` on a vLLM server (issue #36: the vLLM path), at 1 and 2 trainer ranks.

Synchronous (``psrl.staleness=0``), so every step's tokens come from the version the trainer just published: after
every update the server's recorded log-probs equal the ranks' merged forward (``engine/logprob_mismatch_max``
<= 1e-4 on every step; an adapter that was not loaded, or an old one put back, would show here: verl #7495), every
step's version is the adapter alone (``weights/bytes`` <= 3 % of the model's file), and the audit is clean. At the
end, the server's prompt log-probs under the adapter's name equal the merged forward of the version it says it serves
(``/weight_info``) within 1e-4 and differ from the base's: the adapter served is the one trained, and it is not a no-op.

Both runs attach to one server (``rollout.vllm.urls``: started once, with ``--enable-lora``); the second run's first
version carries its base, which the server reloads before the adapter. SmolLM2-135M (a Llama; vLLM has no LoRA for
the built-in GPT-2) needs its converted directory (:func:`psrl.models.smollm2.hf_dir`), else skipped. Run under
``-m vllm`` in a loopback-only namespace.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.conftest import vllm_python_or_skip
from tests.rollout.harness import check_bound

pytestmark = pytest.mark.vllm

DATA = [  # rewards that differ within a group (answer-length parity): advantages, and so the adapter, move
    "task.name=dataset",
    "task.reward=tests.tasks.reward_fns:length_parity",
    "data.max_prompt_length=16",
    "data.max_response_length=6",
]
IDS = [1, 504, 3458, 314, 2524, 28, 1115, 314, 253, 1345, 30, 422, 44, 1027]


def _smollm2_dir():
    from psrl.models.smollm2 import hf_dir

    try:
        return hf_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """One vLLM server with ``--enable-lora`` (rank 8) for the module, of the model the runs build (SmolLM2-135M, the
    task's tokens added, if any): ``(url, model_args)``, ``model_args`` the run's model and task keys."""
    import json

    import httpx

    from psrl.config import load_config
    from psrl.rollout.engines.vllm_server import VLLMServer
    from psrl.train import build_task_and_policy

    python = vllm_python_or_skip()
    model_dir = _smollm2_dir()
    root = tmp_path_factory.mktemp("vllm-lora")
    rows = "".join(
        json.dumps({"prompt": f"{a}+1=", "reward_model": {"ground_truth": str(a + 1)}}) + "\n" for a in range(8)
    )
    (root / "rows.jsonl").write_text(rows)
    model_args = [f"model.path={model_dir}", "model.device=cpu", *DATA, f"data.train_files={root / 'rows.jsonl'}"]
    _, policy = build_task_and_policy(load_config(None, model_args))
    policy.save_pretrained(root / "model")
    del policy
    server = VLLMServer(python, root / "model", root / "server.log", max_model_len=512, lora_rank=8)

    async def start() -> str:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await server.start(client)

    try:
        url = asyncio.run(start())
        yield url, model_args
    finally:
        server.stop()


def _served(url: str, model: str) -> list[float]:
    import httpx

    body = {"model": model, "prompt": IDS, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300, trust_env=False)
    r.raise_for_status()
    rows = r.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(row[str(t)]["logprob"]) for row, t in zip(rows, IDS[1:])]


def _merged(run_dir, version: int) -> list[float]:
    """The trainer's merged forward of ``version``: the run's base (``vllm/model``) with the version's adapter."""
    from transformers import AutoModelForCausalLM

    from psrl.weights import read_version
    from psrl.weights.adapter import MergedAdapter

    model = AutoModelForCausalLM.from_pretrained(run_dir / "vllm" / "model", local_files_only=True, dtype=torch.float32)
    MergedAdapter(model).load(read_version(run_dir / "weights" / f"v{version}")[1])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([IDS])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, IDS[i]]) for i in range(1, len(IDS))]


@pytest.mark.timeout(900)  # SmolLM2 at 2 ranks on a loaded CPU box: minutes per step
@pytest.mark.parametrize("world", [1, 2])
def test_a_lora_run_on_vllm_serves_what_it_trains_after_every_update(tmp_path, lora_server, world):
    from psrl.rollout.engines.vllm_lora import ADAPTER

    torch.set_num_threads(1)
    from psrl.models.smollm2 import hf_dir

    url, model_args = lora_server
    run_dir = tmp_path / "run"
    args = [
        "trainer.warm_start_steps=0",
        "psrl.staleness=0",
        "psrl.staleness_buffer_entries=2",
        "psrl.rollout_n=2",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=4",
        "task.tool_latency_median=0.01",
        "trainer.checkpoint_every=100",
        "trainer.lr=0.001",
        "rollout.engine=vllm",
        "psrl.deployment.n_rollout_instances=1",
        f"rollout.vllm.urls=[{url}]",
        *model_args,
        "model.lora_rank=8",
        "model.lora_alpha=16",
        f"psrl.deployment.train_ngpus_per_node={world}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=3",
    ]
    assert main(args) == 0
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "engine/mismatch_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["engine/mismatch_tokens"] > 0 for r in rows)  # every step: tokens of the version just published
    worst = max(r["engine/logprob_mismatch_max"] for r in rows)
    whole = (hf_dir() / "model.safetensors").stat().st_size  # the model's fp32 weights
    sent = max(r["weights/bytes"] for r in rows)
    print(f"world {world}: max engine/logprob_mismatch_max {worst:.2e}; weights/bytes {sent} = {sent / whole:.2%}")
    assert worst <= 1e-4
    assert all(0 < r["weights/bytes"] <= 0.03 * whole for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 0) == 3 * 2 * 2

    import httpx

    label = int(httpx.get(f"{url}/weight_info", trust_env=False).json()["weight_version"])  # the version it serves
    served, base, want = _served(url, ADAPTER), _served(url, "psrl"), _merged(run_dir, label)
    gap = max(abs(a - b) for a, b in zip(served, want))
    print(f"world {world}: served adapter vs the trainer's merged v{label}, prompt log-probs {gap:.2e}")
    assert gap <= 1e-4
    assert max(abs(a - b) for a, b in zip(served, base)) > 1e-4  # the adapter changes what is served
