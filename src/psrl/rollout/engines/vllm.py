"""``rollout.engine: vllm``: each rollout instance is a vLLM OpenAI-compatible server.

Requests go to vLLM's token-in/token-out endpoint ``POST /inference/v1/generate`` (servers run
with ``--enable-scale-out``): token ids in, token ids and the log-prob of each sampled token out
(``logprobs: 0``, vLLM's ``processed_logprobs``: the tempered distribution the trainer
recomputes), streamed, so the tokens of a request are readable while it runs. No text crosses:
nothing is re-tokenised, nothing is detokenised.

* **Versions, exact**: after every reload psrl sets the server's weight version
  (``POST /update_weight_version``); vLLM's engine labels each batch of outputs with the version
  it ran under, and the final chunk of a request carries those labels as spans over its tokens
  (``weight_versions``). Those spans replace the provisional labels psrl gives tokens as they
  arrive (the version loaded at the last resume), so a token produced before a pause but
  delivered after the resume still carries the version that produced it.

* **Weights**: the trainer's ranks publish each version as a directory (``RUN_DIR/weights/v{N}``,
  :mod:`psrl.weights`: buckets in Hugging Face's sharded layout, atomically, old versions pruned) and
  every server loads it in place with ``POST /collective_rpc`` ``reload_weights`` (dev mode), without a
  restart; the driver holds no copy. With LoRA (``model.lora_rank > 0``) the server serves the base and one
  adapter, loaded in place under one name (:mod:`psrl.rollout.engines.vllm_lora`), and every request names the
  adapter. On GPUs vLLM's NCCL weight-transfer API is the faster path (docs/engines.md says what was run).
* **Partial rollout**: ``POST /pause?mode=keep`` (in-flight requests kept, with their KV cache:
  the stale KV of PSRL's partial rollout), reload, ``POST /resume``. Until a request's final
  chunk, its tokens carry provisional labels (the version loaded at the last resume before they
  arrived); the final chunk's spans then give each token the version that produced it.
* **Abort one request** (passive abort, surplus members, migration): ``POST /abort_requests``
  with the id the server gave it (``generate-tokens-<ours>``, as its first chunk reports); its
  stream ends with ``finish_reason: abort``, its tokens so far and their version spans. Should
  that fail (the server does not know the request yet, no answer in time), the stream is
  cancelled instead (vLLM aborts a request whose client went away; provisional labels stay).
* **Faults**: a request that gets no chunk within ``rollout.request_timeout_s``, a refused
  connection or a server error fails the request (``finish == "error"``) with the tokens it
  got; the rollout instance hands it back and restarts the server (:meth:`restart`). A connection that
  fails before the server answered is first tried again (:data:`~psrl.rollout.engines.vllm_http.SEND_ATTEMPTS`):
  control calls always (they are idempotent), a generate request only if no response had begun.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psrl.rollout.engines.base import TokenRate
from psrl.rollout.engines.vllm_http import (
    KEEPALIVE_S,
    SEND_ATTEMPTS,
    check_attached,
    gauge,
    resend_delay,
    span_versions,
)
from psrl.rollout.engines.vllm_lora import ServedAdapter
from psrl.rollout.engines.vllm_server import EngineSetupError, VLLMServer
from psrl.types import EngineLoad, GenRequest, Sampling, WeightSource, stream_seed
from psrl.weights import VersionDirectories
from psrl.weights.export import untied_directory
from psrl.weights.receivers import SentVersions

if TYPE_CHECKING:
    import httpx


__all__ = ["VLLMEngine"]


class VLLMEngine:
    """A :class:`psrl.types.Engine` over one vLLM server (started by psrl, or attached to by URL).

    Args:
        url: an already running server (``rollout.vllm.urls``), or None with ``server``.
        server: a :class:`VLLMServer` psrl starts and owns.
        adapter: with LoRA, the adapter the server serves (its files; the server runs with ``--enable-lora``).
    """

    def __init__(
        self,
        url: str | None = None,
        server: VLLMServer | None = None,
        *,
        sampling: Sampling = Sampling(),
        request_timeout_s: float = 300.0,
        model_name: str = "psrl",
        adapter: ServedAdapter | None = None,
    ):
        if (url is None) == (server is None):
            raise ValueError("VLLMEngine needs exactly one of url (attach) and server (start)")
        self.url = url.rstrip("/") if url else None
        self.server = server
        self.sampling = sampling
        self.request_timeout_s = float(request_timeout_s)
        self.model_name = model_name
        self.adapter = adapter
        self.version = -1
        self.receives = False
        """A member of the run's transfer group (``weights.transport=collective``): sent versions are staged in
        its server's receiver. Others (validation servers) load a sent version from its files."""
        """Version of the weights the server holds (-1: none of psrl's yet)."""
        self._token_version = -1
        self.steps = 0
        self.tokens = 0
        self._client: httpx.AsyncClient | None = None
        self._ids = itertools.count()
        self._tag = secrets.token_hex(4)
        """Our request ids on the server: ``psrl-<tag>-<n>``, unique across engines sharing a server."""
        self._inflight: dict[int, asyncio.Task] = {}
        self._reqs: dict[int, GenRequest] = {}
        self._sids: dict[int, str] = {}
        self._server_ids: dict[int, str] = {}
        """The id the server reports for each request (what ``/abort_requests`` takes)."""
        self._aborting: set[int] = set()
        """Requests :meth:`abort` was called on (by ``id``): they end as ``abort`` unless they finished first."""
        self._aborts: set[asyncio.Task] = set()
        self._rate = TokenRate()
        self._kv: float | None = None
        self._waiting = 0
        self._poller: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the engine runs on (its client's), for :meth:`rpc_from_thread`."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        import httpx

        if self._client is None:
            # connect too: a busy server may take long to accept; a dead one refuses at once
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.request_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S),
                trust_env=False,
            )
        if self.server is not None and not self.server.alive():
            self.url = await self.server.start(self._client)
        elif self.server is None:
            assert self.url is not None  # the constructor takes exactly one of url and server
            await check_attached(self._client, self.url, self.model_name, self.request_timeout_s)
        self._loop = asyncio.get_running_loop()
        if self._poller is None:
            self._poller = self._loop.create_task(self._poll_metrics())

    async def restart(self) -> None:
        """After a failure: a server psrl owns is stopped and started again (an attached one cannot be)."""
        if self.server is None:
            raise EngineSetupError(
                f"the vLLM server at {self.url} failed and psrl did not start it, so it cannot restart it"
            )
        await self._cancel_all()
        await asyncio.to_thread(self.server.stop)
        self.version = self._token_version = -1
        self.url = await self.server.start(self._http)

    async def close(self) -> None:
        await self.abort_all()
        if self.server is None and self._client is not None:
            try:  # hand an attached server back unpaused (a run may stop between pause and resume)
                await self._unpause()
            except Exception:  # noqa: BLE001 -- best effort on the way out
                pass
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    @property
    def _http(self) -> httpx.AsyncClient:
        """The HTTP client, from :meth:`start` until :meth:`close`."""
        if self._client is None:
            raise RuntimeError("the vLLM engine is not started (or closed): start() first")
        return self._client

    # ------------------------------------------------------------------ requests

    async def generate(self, req: GenRequest) -> GenRequest:
        if req.max_new_tokens <= 0:
            req.finish = "length"
            return req
        key = id(req)
        self._sids[key] = f"psrl-{self._tag}-{next(self._ids)}"
        task = asyncio.get_running_loop().create_task(self._stream(req))
        self._inflight[key] = task
        self._reqs[key] = req
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not (task.cancelled() and key in self._aborting):  # not our own fallback: the caller cancelled us
                self.abort(req)
                raise
        finally:
            for d in (self._inflight, self._reqs, self._sids, self._server_ids):
                d.pop(key, None)
            aborted = key in self._aborting
            self._aborting.discard(key)
        if not req.finish:  # the stream ended without a finish reason: cut by abort(), or by the server
            req.finish = "abort" if aborted else "length" if len(req.tokens) >= req.max_new_tokens else "stop"
        return req

    def abort(self, req: GenRequest) -> None:
        key = id(req)
        task = self._inflight.get(key)
        if req.finish or key in self._aborting:
            return
        if task is None:
            req.finish = "abort"
            return
        self._aborting.add(key)
        # the id the server reported in the request's first chunk; before that, the one vLLM 0.32 gives it
        sid = self._server_ids.get(key) or f"generate-tokens-{self._sids[key]}"
        self._aborts.add(asyncio.get_running_loop().create_task(self._abort_on_server(sid, task)))

    async def _abort_on_server(self, sid: str, task: asyncio.Task) -> None:
        """Abort one request by its server id ``sid`` (its stream then ends with its tokens and version spans);
        if that cannot be done (the server does not know the id yet, no answer in time), cancel its stream
        (vLLM aborts a request whose client went away; the tokens' provisional labels stay)."""
        bound = min(self.request_timeout_s, 30.0)
        try:
            out = await self._post("/abort_requests", json={"request_ids": [sid]}, timeout=bound)
            if isinstance(out, dict) and out.get("aborted"):
                async with asyncio.timeout(bound):
                    await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception:  # noqa: BLE001 -- no answer: the fallback below
            pass
        finally:
            self._aborts.discard(asyncio.current_task())
        task.cancel()  # no-op once the stream ended; otherwise the fallback

    async def abort_all(self) -> None:
        for req in list(self._reqs.values()):
            self.abort(req)
        tasks = list(self._inflight.values()) + list(self._aborts)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _cancel_all(self) -> None:
        """Drop every stream at once, without asking the server (it failed): the fallback of :meth:`abort`."""
        for key, task in list(self._inflight.items()):
            self._aborting.add(key)
            task.cancel()
        await self.abort_all()

    async def _stream(self, req: GenRequest) -> None:
        key, base = id(req), len(req.tokens)
        sp = self.sampling
        params = {
            "max_tokens": int(req.max_new_tokens),
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "logprobs": 0,
            "stop_token_ids": sorted(sp.stop_ids),
            "ignore_eos": True,
            "detokenize": False,
        }
        if req.seed is not None:  # vLLM's per-request generator; a re-sent request continues from its tokens so far
            params["seed"] = stream_seed(req.seed, base) if base else req.seed
        body = {
            "model": self.adapter.name if self.adapter is not None else self.model_name,
            "request_id": self._sids[key],
            "token_ids": list(req.context),
            "sampling_params": params,
            "stream": True,
        }
        for attempt in range(SEND_ATTEMPTS):
            answered = False
            try:
                async with self._http.stream("POST", f"{self.url}/inference/v1/generate", json=body) as resp:
                    answered = True
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")[:500]
                        raise RuntimeError(f"HTTP {resp.status_code}: {text}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        self._take(req, json.loads(line[6:]), base)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 -- timeout, refused, dropped connection, server error
                delay = None if answered or key in self._aborting else resend_delay(attempt, exc)
                if delay is not None:  # never reached the server: send it again
                    await asyncio.sleep(delay)
                    continue
                if not req.finish and key not in self._aborting:
                    req.error = f"vLLM server {self.url}: {type(exc).__name__}: {exc}"
                    req.finish = "error"
                return

    def _take(self, req: GenRequest, chunk: dict, base: int) -> None:
        """One streamed chunk into ``req`` (whose first ``base`` tokens came before this call)."""
        if "error" in chunk:
            raise RuntimeError(str(chunk["error"])[:500])
        if chunk.get("request_id"):
            self._server_ids.setdefault(id(req), chunk["request_id"])
        choice = chunk["choices"][0]
        toks = choice.get("token_ids") or []
        lps = [x["logprob"] for x in (choice.get("logprobs") or {}).get("content") or []]
        if len(lps) != len(toks):
            raise RuntimeError(f"a chunk with {len(toks)} token ids and {len(lps)} log-probs")
        v = self._token_version
        req.tokens += [int(t) for t in toks]
        req.logprobs += [float(x) for x in lps]
        req.versions += [v] * len(toks)
        self.tokens += len(toks)
        self.steps += 1
        self._rate.add(len(toks))
        spans = choice.get("weight_versions")
        if spans:  # the final chunk: the engine's own labels replace the provisional ones
            req.versions[base:] = span_versions(spans, len(req.tokens) - base)
        reason = choice.get("finish_reason")
        if reason == "error":
            raise RuntimeError("the engine failed the request (finish_reason: error)")
        if reason is not None:
            req.finish = {"length": "length", "abort": "abort"}.get(reason, "stop")

    # ------------------------------------------------------------------ weights and partial rollout

    async def pause(self) -> None:
        await self._post("/pause", params={"mode": "keep"})

    async def resume(self) -> None:
        self._token_version = self.version  # tokens from here on come from the loaded weights
        await self._post("/resume")

    async def update_weights(self, version: int, store: WeightSource) -> None:
        if self.receives and isinstance(store, SentVersions) and store.sent(version):  # staged in its receiver
            manifest = store.manifest(int(version))  # its tied names: loaded under their own names too
            await self.rpc("psrl_load", version=int(version), digest=manifest["digest"], tied=manifest.get("tied", {}))
        elif not isinstance(store, VersionDirectories):
            raise TypeError(f"vLLM loads weights from a published directory: {type(store).__name__} has none")
        elif self.adapter is not None:  # an adapter version: in place, under the adapter's one name
            await self._load_adapter(self.adapter, store.directory(int(version)))
        else:  # the ranks' files: Hugging Face's sharded layout with its index (a tied head: also under its name)
            directory = store.directory(int(version))
            untied = await asyncio.to_thread(untied_directory, directory)  # the version's own: pruned with it
            await self.rpc("reload_weights", weights_path=str(untied or directory))
        await self._label(int(version))
        self.version = int(version)
        if not self._inflight:
            self._token_version = self.version

    async def _load_adapter(self, adapter: ServedAdapter, directory: Path) -> None:
        """An adapter version (checked first; its base reloaded first if it carries one), loaded in place under the
        adapter's name; the server refusing it puts the previous adapter's files back (it serves the old one)."""
        base = await asyncio.to_thread(adapter.stage, directory)
        try:
            if base is not None:
                await self.rpc("reload_weights", weights_path=str(base))
            body = {"lora_name": adapter.name, "lora_path": str(adapter.path), "load_inplace": True}
            await self._post("/v1/load_lora_adapter", json=body)
        except RuntimeError:  # the server answered and refused it: it serves the old adapter
            await asyncio.to_thread(adapter.restore)
            await asyncio.to_thread(adapter.done)
            raise
        # cancelled, or no answer: the server may still be reading the staged files, which stay until a later load
        await asyncio.to_thread(adapter.done)

    async def rpc(self, method: str, timeout: float | None = None, **kwargs: object) -> list[Any]:
        """``POST /collective_rpc``: ``method`` of every worker of the server (vLLM's, or psrl's receiver
        :mod:`psrl.weights.vllm_receiver`), with ``kwargs``; each worker's result."""
        out = await self._post("/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=timeout)
        return list((out or {}).get("results", []))

    def rpc_from_thread(self, method: str, timeout: float, **kwargs: object) -> list[Any]:
        """:meth:`rpc` called from another thread (the trainer's publishing thread), run on the engine's loop and
        waited for, at most ``timeout`` seconds (and the server's own answer within it)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the vLLM engine is not started (or its loop is gone)")
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:  # waiting here would block the loop that has to run the call
            raise RuntimeError("rpc_from_thread called on the engine's own event loop: await rpc() there")
        future = asyncio.run_coroutine_threadsafe(self.rpc(method, timeout=timeout, **kwargs), loop)
        return future.result(timeout + 5.0)

    async def _label(self, version: int) -> None:
        """Name the server's weights ``version``: vLLM labels every output produced from now on with it."""
        await self._post("/update_weight_version", json={"new_version": str(int(version))})

    async def _unpause(self, checks: int = 5, every_s: float = 0.2) -> None:
        """Resume an attached server and see it stay resumed: a pause whose call was cancelled as the run stopped
        can still reach the server after the resume (seen: UNPAUSED, then PAUSED_ALL, and the next user's requests
        hung), so ``/is_paused`` is asked ``checks`` times, ``every_s`` apart, resuming again whenever it says so."""
        await self._post("/resume")
        for _ in range(checks):
            await asyncio.sleep(every_s)
            resp = await self._http.get(f"{self.url}/is_paused", timeout=10.0)
            if resp.status_code != 200 or resp.json().get("is_paused", False):
                await self._post("/resume")

    async def _post(
        self, path: str, *, params: dict | None = None, json: dict | None = None, timeout: float | None = None
    ) -> Any:
        """POST a control call (pause, resume, reload, version, abort: all idempotent), sent again up to
        ``SEND_ATTEMPTS`` times when the connection fails before an answer (:func:`resend_delay`). ``timeout``:
        seconds instead of the client's ``request_timeout_s``."""
        import httpx

        wait = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout  # httpx reads timeout=None as "no timeout"
        for attempt in range(SEND_ATTEMPTS):
            try:
                resp = await self._http.post(f"{self.url}{path}", params=params, json=json, timeout=wait)
                break
            except Exception as exc:
                delay = resend_delay(attempt, exc)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM server {self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if not resp.content:
            return None  # /v1/load_lora_adapter answers in plain text
        return resp.json() if "json" in resp.headers.get("content-type", "") else resp.text

    # ------------------------------------------------------------------ load figures

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._inflight), queued=self._waiting, tokens_per_s=self._rate.per_s(), kv_usage=self._kv
        )

    async def _poll_metrics(self, every_s: float = 2.0) -> None:
        """KV-cache use and waiting requests from the server's Prometheus ``/metrics``, every ``every_s``."""
        while True:
            try:
                resp = await self._http.get(f"{self.url}/metrics", timeout=5.0)
                self._kv = gauge(resp.text, "vllm:kv_cache_usage_perc")
                waiting = gauge(resp.text, "vllm:num_requests_waiting")
                self._waiting = int(waiting or 0)
            except Exception:  # noqa: BLE001 -- figures only; a dead server is noticed by its requests
                pass
            await asyncio.sleep(every_s)
