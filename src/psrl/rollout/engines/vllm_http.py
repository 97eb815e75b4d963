"""The HTTP edges of :class:`psrl.rollout.engines.vllm.VLLMEngine`: how long a connection is kept, when a request
whose connection failed is sent again, and how the server's answers (version spans, Prometheus gauges) are read.
Plain functions of their inputs, so they are tested without a server (or with a fake transport)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from psrl.rollout.engines.vllm_server import EngineSetupError

if TYPE_CHECKING:
    import httpx

__all__ = ["KEEPALIVE_S", "SEND_ATTEMPTS", "check_attached", "gauge", "resend_delay", "span_versions"]

KEEPALIVE_S = 2.0
"""How long the client keeps an idle connection: below the server's (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
5 s, as httpx's own default), so the client drops an idle connection before the server closes it under a
request. With both at 5 s, one CI run lost a weight update that way."""
SEND_ATTEMPTS = 3
"""Tries for a request whose connection fails before any answer, 0.2 s then 0.4 s apart (:func:`resend_delay`)."""


def resend_delay(attempt: int, exc: BaseException) -> float | None:
    """Seconds to wait before sending a request again whose try number ``attempt`` (from 0) failed with
    ``exc``: 0.2, then 0.4; None once ``SEND_ATTEMPTS`` tries are spent, or when ``exc`` is not a connection
    that failed before the server answered. Those are refused, reset, or closed by the server (an idle
    keep-alive connection the server closes just as a request goes out on it: ``RemoteProtocolError:
    Server disconnected without sending a response``), and a request that got no answer is safe to send
    again; a timeout is not one of them (the server may still be working on it)."""
    import httpx

    unanswered = isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
    return 0.2 * 2**attempt if unanswered and attempt < SEND_ATTEMPTS - 1 else None


def span_versions(spans: list[dict], n: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans over a request's ``n`` output tokens (a label
    that is not one of psrl's version numbers, such as vLLM's ``default`` before psrl's first load: -1)."""
    out: list[int] = []
    for span in spans:
        label = str(span["version"])
        v = int(label) if label.lstrip("-").isdigit() else -1
        out += [v] * (int(span["end"]) - int(span["start"]))
    if len(out) != n:
        raise RuntimeError(f"vLLM's version spans cover {len(out)} tokens of {n}")
    return out


def gauge(text: str, name: str) -> float | None:
    """The value of the Prometheus gauge ``name`` in a ``/metrics`` page ``text`` (its first sample), or None."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def check_attached(client: httpx.AsyncClient, url: str, model_name: str, request_timeout_s: float) -> None:
    """Check that the server psrl attaches to at ``url`` (``rollout.vllm.urls``) answers, is not left paused, and
    serves the token-in/token-out endpoint; :class:`EngineSetupError`, naming the fix, when it does not."""
    try:
        resp = await client.get(f"{url}/health", timeout=10.0)
        ok = resp.status_code == 200
    except Exception as exc:  # noqa: BLE001
        raise EngineSetupError(
            f"{url} does not answer /health ({type(exc).__name__}: {exc})",
            "start the server or fix the URL",
            source="rollout.vllm.urls",
        ) from None
    if not ok:
        raise EngineSetupError(
            f"{url}/health answered {resp.status_code}", "check the server's log", source="rollout.vllm.urls"
        )
    # a server left paused (a run stopped mid-update; a pause sent as that run stopped may even land after
    # its closing resume) would hold every request, the probe below included
    bound = min(request_timeout_s, 60.0)
    resp = await client.post(f"{url}/resume", timeout=bound)
    if resp.status_code != 200:
        raise EngineSetupError(
            f"{url}/resume answered {resp.status_code}",
            "start the server with VLLM_SERVER_DEV_MODE=1 (docs/engines.md)",
            source="rollout.vllm.urls",
        )
    probe = {"model": model_name, "token_ids": [0], "sampling_params": {"max_tokens": 1, "detokenize": False}}
    resp = await client.post(f"{url}/inference/v1/generate", json=probe, timeout=bound)
    if resp.status_code in (403, 404):  # 403: scale-out endpoints disabled; 404: a vLLM without them
        raise EngineSetupError(
            f"{url} does not serve vLLM's token-in/token-out endpoint /inference/v1/generate (HTTP {resp.status_code})",
            "start it with --enable-scale-out and VLLM_SERVER_DEV_MODE=1 (vLLM >= 0.32; docs/engines.md)",
            source="rollout.vllm.urls",
        )
