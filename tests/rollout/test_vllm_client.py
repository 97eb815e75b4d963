"""psrl's vLLM client against a scripted server (httpx's MockTransport): no vLLM needed.

What is checked here is the client's own logic: the server's version spans replace the labels tokens get
on arrival, an abort goes to the server by the id the server reported, and a server without the
token-in/token-out endpoint is refused at start, naming the flag.
"""

import asyncio
import json
import os

import httpx
import pytest

from psrl.rollout.engines.vllm import VLLMEngine
from psrl.rollout.engines.vllm_http import check_attached, span_versions
from psrl.rollout.engines.vllm_server import EngineSetupError
from psrl.types import GenRequest


def sse(*chunks) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def chunk(rid, toks, finish=None, spans=None) -> dict:
    return {
        "request_id": rid,
        "choices": [
            {
                "token_ids": toks,
                "finish_reason": finish,
                "weight_versions": spans,
                "logprobs": {"content": [{"logprob": -1.0} for _ in toks]},
            }
        ],
    }


def engine(handler, tmp_path) -> VLLMEngine:
    eng = VLLMEngine(url="http://127.0.0.1:9")
    eng._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return eng


def test_spans_become_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert span_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert span_versions([{"version": "default", "start": 0, "end": 2}], 2) == [-1, -1]
    with pytest.raises(RuntimeError, match="cover 5 tokens of 6"):
        span_versions(spans, 6)


def test_the_servers_spans_replace_the_arrival_labels(tmp_path):
    """Tokens that arrive after the resume but were produced before the pause keep the old version."""

    def handler(request):
        assert request.url.path == "/inference/v1/generate"
        body = json.loads(request.content)
        assert body["token_ids"] == [1, 2] and body["sampling_params"]["max_tokens"] == 5
        rid = "generate-tokens-" + body["request_id"]
        return httpx.Response(
            200,
            content=sse(
                chunk(rid, [7, 8, 9]),
                chunk(
                    rid,
                    [10, 11],
                    "length",
                    [{"version": "1", "start": 0, "end": 4}, {"version": "2", "start": 4, "end": 5}],
                ),
            ),
        )

    async def main():
        eng = engine(handler, tmp_path)
        eng._token_version = 2  # as after a resume: everything arriving now would be labelled 2
        req = GenRequest([1, 2], 5)
        await eng.generate(req)
        await eng._client.aclose()
        return req

    req = asyncio.run(main())
    assert req.tokens == [7, 8, 9, 10, 11] and req.finish == "length"
    assert req.versions == [1, 1, 1, 1, 2] and len(req.logprobs) == 5


def test_abort_goes_to_the_server_by_the_id_it_reported(tmp_path):
    """abort(): POST /abort_requests with the server's id; the stream's final chunk (finish 'abort', spans)
    ends the request with every token the server produced."""
    aborted = asyncio.Event()
    seen = []

    async def stream(rid):
        yield f"data: {json.dumps(chunk(rid, [5, 6]))}\n\n".encode()
        await aborted.wait()
        yield f"data: {json.dumps(chunk(rid, [7], 'abort', [{'version': '1', 'start': 0, 'end': 3}]))}\n\n".encode()

    async def handler(request):
        if request.url.path == "/abort_requests":
            seen.append(json.loads(request.content)["request_ids"])
            aborted.set()
            return httpx.Response(200, json={"status": "aborted", "aborted": 1})
        rid = "generate-tokens-" + json.loads(request.content)["request_id"]
        return httpx.Response(200, content=stream(rid))

    async def main():
        eng = engine(handler, tmp_path)
        req = GenRequest([1], 100)
        task = asyncio.ensure_future(eng.generate(req))
        while len(req.tokens) < 2:
            await asyncio.sleep(0)
        eng.abort(req)
        await asyncio.wait_for(task, 10)
        await eng._client.aclose()
        return req

    req = asyncio.run(main())
    assert len(seen) == 1 and seen[0][0].startswith("generate-tokens-psrl-")
    assert req.finish == "abort" and req.tokens == [5, 6, 7] and req.versions == [1, 1, 1]


def test_an_attached_server_left_paused_is_resumed_before_anything_is_sent(tmp_path):
    """A run that stopped mid-update can leave the server paused (its last pause may even land after its
    closing resume); a paused server holds every request, so the next run resumes it first."""
    paused = asyncio.Event()  # set: the server is paused
    order = []

    async def handler(request):
        order.append(request.url.path)
        if request.url.path == "/resume":
            paused.clear()
            return httpx.Response(200, json={"status": "resumed"})
        if request.url.path == "/inference/v1/generate":
            assert not paused.is_set(), "a request reached a paused server"
            return httpx.Response(200, json={"choices": [{"token_ids": [3]}]})
        return httpx.Response(200)

    async def main():
        paused.set()
        eng = engine(handler, tmp_path)
        try:
            await asyncio.wait_for(check_attached(eng._client, eng.url, eng.model_name, eng.request_timeout_s), 10)
        finally:
            await eng._client.aclose()

    asyncio.run(main())
    assert order == ["/health", "/resume", "/inference/v1/generate"]


def test_an_attached_server_without_the_generate_endpoint_is_refused(tmp_path):
    def handler(request):
        if request.url.path in ("/health", "/resume"):
            return httpx.Response(200)
        return httpx.Response(403, json={"error": "Scale-out endpoints are disabled."})

    async def main():
        eng = engine(handler, tmp_path)
        try:
            await check_attached(eng._client, eng.url, eng.model_name, eng.request_timeout_s)
        finally:
            await eng._client.aclose()

    with pytest.raises(EngineSetupError, match="--enable-scale-out"):
        asyncio.run(main())


DROPPED = httpx.RemoteProtocolError("Server disconnected without sending a response.")


def test_a_control_call_whose_connection_drops_unanswered_is_sent_again(tmp_path):
    """The server closed an idle keep-alive connection as the pause went out on it (what failed a weight
    update in CI): no answer came, so the call is sent again; pausing twice is harmless. A connection that
    keeps failing fails the call after SEND_ATTEMPTS tries, and a timeout is not sent again."""
    from psrl.rollout.engines.vllm_http import SEND_ATTEMPTS

    calls = []
    fail = {"/pause": 1, "/resume": SEND_ATTEMPTS}

    def handler(request):
        calls.append(request.url.path)
        if fail.get(request.url.path, 0) > 0:
            fail[request.url.path] -= 1
            raise DROPPED
        if request.url.path == "/update_weight_version":
            raise httpx.ReadTimeout("no answer in time")
        return httpx.Response(200, json={"status": "paused"})

    async def main():
        eng = engine(handler, tmp_path)
        try:
            await eng.pause()
            with pytest.raises(httpx.RemoteProtocolError):
                await eng.resume()
            with pytest.raises(httpx.ReadTimeout):
                await eng._label(3)
        finally:
            await eng._client.aclose()

    asyncio.run(main())
    assert calls == ["/pause"] * 2 + ["/resume"] * SEND_ATTEMPTS + ["/update_weight_version"]


def test_a_request_is_sent_again_only_if_the_server_never_answered_it(tmp_path):
    """A generate request whose connection drops before any answer goes out again with the same id (the
    server never saw it); one whose stream breaks after tokens arrived fails with those tokens, sent once."""
    sent = []

    async def broken(rid):
        yield f"data: {json.dumps(chunk(rid, [5, 6]))}\n\n".encode()
        raise DROPPED

    def handler(request):
        body = json.loads(request.content)
        sent.append(body["request_id"])
        rid = "generate-tokens-" + body["request_id"]
        if body["token_ids"] == [1] and len(sent) == 1:
            raise DROPPED
        if body["token_ids"] == [1]:
            return httpx.Response(
                200, content=sse(chunk(rid, [7, 8], "length", [{"version": "1", "start": 0, "end": 2}]))
            )
        return httpx.Response(200, content=broken(rid))

    async def main():
        eng = engine(handler, tmp_path)
        try:
            first = await eng.generate(GenRequest([1], 2))
            n = len(sent)
            second = await eng.generate(GenRequest([2], 4))
            return first, n, second
        finally:
            await eng._client.aclose()

    first, n, second = asyncio.run(main())
    assert n == 2 and sent[0] == sent[1]
    assert first.finish == "length" and first.tokens == [7, 8] and first.versions == [1, 1]
    assert len(sent) == 3
    assert second.finish == "error" and second.tokens == [5, 6] and "RemoteProtocolError" in second.error


def test_a_reload_given_up_by_its_caller_leaves_the_server_its_files(tmp_path):
    """A tied version reaches vLLM as a directory that adds the head under its own name. A reload that psrl stops
    waiting for (cancelled as the run ends) goes on in the server: its files stay until the version is pruned (a
    directory removed under a reload failed it half-way and left vLLM's engine dead for every later call)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from psrl.weights import FileVersions, publish_model

    cfg = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    publish_model(LlamaForCausalLM(cfg), tmp_path / "weights", 1)
    asked: list[str] = []

    async def handler(request):
        body = json.loads(request.content)
        assert request.url.path == "/collective_rpc" and body["method"] == "reload_weights"
        asked.append(body["kwargs"]["weights_path"])
        await asyncio.Event().wait()  # the server is still reading when psrl gives up

    async def main():
        eng = engine(handler, tmp_path)
        task = asyncio.create_task(eng.update_weights(1, FileVersions(tmp_path / "weights")))
        while not asked:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eng._client.aclose()

    asyncio.run(main())
    path = asked[0]
    index = json.loads((tmp_path / "weights" / "v1" / "untied" / "model.safetensors.index.json").read_text())
    assert os.path.samefile(path, tmp_path / "weights" / "v1" / "untied") and "lm_head.weight" in index["weight_map"]
    assert all(os.path.exists(os.path.join(path, f)) for f in set(index["weight_map"].values()))


@pytest.mark.parametrize("psrl_dies", [False, True])
def test_a_server_psrl_starts_keeps_its_temporary_files_in_a_directory_that_goes_with_it(tmp_path, psrl_dies):
    """vLLM puts its IPC sockets and distributed-init files in ``TMPDIR``: a server psrl starts gets a directory of
    its own there, removed when psrl stops it, or by its watcher when psrl is gone (its pipe closed unasked)."""
    import time

    from psrl.rollout.engines.vllm_server import VLLMServer

    fake = tmp_path / "python"  # stands for the vLLM environment's interpreter: notes its TMPDIR, then serves
    fake.write_text('#!/bin/sh\ntouch "${TMPDIR:?}/socket" && echo "tmp=$TMPDIR"\nexec sleep 600\n')
    fake.chmod(0o755)
    log = tmp_path / "server.log"
    server = VLLMServer(str(fake), tmp_path / "model", log)
    server._spawn(9)
    deadline = time.monotonic() + 30
    while "tmp=" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    tmp = log.read_text().split("tmp=", 1)[1].strip()
    assert tmp == server.tmp and os.path.exists(os.path.join(tmp, "socket"))
    if psrl_dies:
        watcher = server.watcher
        assert watcher is not None and watcher.stdin is not None
        watcher.stdin.close()  # what psrl's death does to the pipe
        watcher.wait(timeout=30)
        server.proc = None  # the watcher stopped the server's group
    else:
        server.stop()
    assert not os.path.exists(tmp)
