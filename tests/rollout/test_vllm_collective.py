"""The collective transport into a vLLM server (issue #33, item 4): psrl's worker extension
(:mod:`psrl.weights.vllm_receiver`) joins a transfer group through ``/collective_rpc``, receives a version from a
sender (the trainer's ranks' code, :func:`~psrl.weights.collective.send_version`, in a thread here) apart from the
model, and loads it between pause and resume only after the version digest matched: afterwards the server's
log-probs are the new weights' to 1e-4. A damaged version or a sender gone midway leaves the server serving the
weights it had. Run in a loopback-only namespace (``-m vllm``)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
from typing import Any

import pytest
import torch

from psrl.rollout.engines.vllm import VLLMEngine
from psrl.rollout.engines.vllm_server import VLLMServer
from psrl.types import GenRequest, Sampling
from psrl.weights import MB, tied_names
from psrl.weights.collective import (
    GroupAddress,
    TransferGroup,
    check_received,
    first_tags,
    host_store,
    layout,
    send_bucket,
    send_version,
    sent_manifest,
)
from psrl.weights.receivers import SentVersions
from tests.conftest import CONTEXT, vllm_python_or_skip

pytestmark = pytest.mark.vllm

BUCKET = int(0.05 * MB)


def _sender(
    address: GroupAddress, model: torch.nn.Module, out: list, stop_after: int | None = None
) -> threading.Thread:
    """Group rank 0 (a trainer of one rank) sending ``model`` to the server (group rank 1), in a thread."""

    def run() -> None:
        group = TransferGroup(address, 0)
        try:
            if stop_after is None:
                out.append(send_version(group, model, rank=0, world=1, receivers=[1], bucket_bytes=BUCKET))
                return
            state = {k: v.detach() for k, v in model.state_dict().items()}
            buckets = layout(model, BUCKET)
            for b, bucket in enumerate(buckets[:stop_after]):
                for work in send_bucket(group, {n: state[n] for n in bucket.names}, 1, first_tags(buckets)[b]):
                    group.wait(work)
        finally:
            group.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


async def _send(engine: VLLMEngine, model: torch.nn.Module, version: int, stop_after: int | None = None) -> Any:
    """One transfer: a fresh group, the sender in a thread, the server receiving; the server's digests (or the
    error of its receive) and what the sender sent."""
    store, port = host_store(timeout_s=20.0)
    address = GroupAddress("127.0.0.1", port, 2, f"test/{port}", 20.0)
    sent: list = []
    thread = _sender(address, model, sent, stop_after)
    buckets = [dataclasses.asdict(b) for b in layout(model, BUCKET)]
    try:
        await engine.rpc("psrl_join", address=dataclasses.asdict(address), rank=1)
        got: Any = (await engine.rpc("psrl_receive", version=version, buckets=buckets, world=1))[0]
    except RuntimeError as exc:
        got = exc
    await asyncio.to_thread(thread.join, 30)
    return got, (sent[0] if sent else None)


async def _logprob_gap(engine: VLLMEngine, policy, prompt: list[int]) -> float:
    req = await engine.generate(GenRequest(list(prompt), 8, seed=0))
    recomputed = policy.sequence_logprobs([req.context], [req.tokens])[0].tolist()
    return max(abs(a - b) for a, b in zip(recomputed, req.logprobs))


def test_a_version_sent_to_vllm_loads_only_whole_and_checked(tiny, tmp_path):
    python = vllm_python_or_skip()
    _, task, policy = tiny
    policy.save_pretrained(tmp_path / "model")
    new = copy.deepcopy(policy)
    with torch.no_grad():
        for p in new.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    server = VLLMServer(python, tmp_path / "model", tmp_path / "server.log", max_model_len=CONTEXT, receiver=True)
    engine = VLLMEngine(server=server, sampling=Sampling(temperature=1.0))
    engine.receives = True  # a member of the transfer group (what VLLMReceiver marks)
    prompt = list(task.sample_prompt(__import__("random").Random(0)).ids)
    store = SentVersions(tmp_path / "weights")

    async def run() -> None:
        await engine.start()
        try:
            digests, sent = await _send(engine, new.model, 1)
            manifest = sent_manifest(1, sent, tied_names(new.model.state_dict()))  # as the trainer's publisher
            assert manifest["tied"] == {"lm_head.weight": "transformer.wte.weight"}  # the head is not sent
            check_received("vllm", 1, digests, manifest)
            store.commit(1, manifest)
            assert await _logprob_gap(engine, policy, prompt) < 1e-4  # staged, not loaded: the old weights serve
            await engine.pause()
            await engine.update_weights(1, store)
            await engine.resume()
            assert engine.version == 1 and (await engine.rpc("psrl_loaded"))[0] == [1, manifest["digest"]]
            assert await _logprob_gap(engine, new, prompt) < 1e-4

            digests, sent = await _send(engine, policy.model, 2)  # the old weights again, as version 2
            damaged = {**sent_manifest(2, sent), "digest": "0" * 64}
            store.commit(2, damaged)
            with pytest.raises(RuntimeError, match="differs from what its writer sent"):
                await engine.update_weights(2, store)
            assert engine.version == 1 and await _logprob_gap(engine, new, prompt) < 1e-4

            failed, _ = await _send(engine, policy.model, 3, stop_after=2)
            assert isinstance(failed, RuntimeError)
            assert await _logprob_gap(engine, new, prompt) < 1e-4  # still serving version 1
        finally:
            await engine.close()

    asyncio.run(run())


@pytest.mark.parametrize("world", [1, 2])
def test_psrl_train_sends_versions_into_its_vllm_server(tmp_path, world):
    """``psrl train`` with its own vLLM server and ``weights.transport=collective``, synchronous: the first version
    goes as files (the server is not up yet), every later one over the transfer group (no directory of it is
    written, but for the last one, which final/ is made from); the server's recorded log-probs match the trainer's (< 1e-3, as the files path is checked in
    ``tests/runtime/test_train_vllm.py``), so each sent version took effect."""
    from psrl.runtime.recorder import read_jsonl
    from psrl.train_cli import main
    from tests.runtime.test_train_vllm import SMALL

    vllm_python_or_skip()
    run_dir = tmp_path / "run"
    args = [a for a in SMALL if not a.startswith("psrl.staleness=")] + [
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=3",
        "psrl.staleness=0",
        "weights.transport=collective",
        f"psrl.deployment.train_ngpus_per_node={world}",
        *(["trainer.val_every=3"] if world == 2 else []),  # a validation server of its own: not in the group
    ]
    assert main(args) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if world == 2:  # it loaded v3 from the files the ranks wrote when it asked (v3 was only sent)
        val = [r for r in rows if "val/failed" in r]
        assert val and all(r["val/failed"] == 0 for r in val)
    steps = [r for r in rows if "val/failed" not in r]  # a validation row of its own follows the last step
    assert [r["step"] for r in steps] == [1, 2, 3]
    measured = [r for r in steps if r["engine/mismatch_tokens"] > 0]
    assert measured and max(r["engine/logprob_mismatch_max"] for r in measured) < 1e-3
    assert any(r["step"] >= 2 for r in measured)  # tokens of a sent version were scored
    # v1 and v2 were only sent; the last one is written as files by the ranks at the end, for final/
    assert sorted(p.name for p in (run_dir / "weights").glob("v[0-9]")) == ["v0", "v3"]
    assert (run_dir / "final" / "config.json").is_file()
