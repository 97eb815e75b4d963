"""The OpenAI-compatible endpoint: one loopback server per agent task, one base URL per trajectory.

``http://127.0.0.1:<port>/t/<trajectory>/v1`` serves ``/models`` (the one model name, :data:`MODEL`),
``/chat/completions`` (``messages``, ``tools``, ``tool_choice``, ``n=1``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``logprobs``) and ``/completions`` (a text or token-id ``prompt``), so an
``openai.AsyncOpenAI(base_url=...)`` client talks to exactly that trajectory. Every request becomes one turn of the
trajectory's :class:`~psrl.tasks.agent.capture.Conversation` (its session, its instance, its ``V_traj``).

Sampling follows the run (``trainer.temperature`` / ``trainer.top_p``): a request's own ``temperature`` and ``top_p`` are
accepted and not applied, since the tokens trained on must come from the behaviour policy the trainer corrects
for. Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with a message naming the
cause: an unknown or finished trajectory (404), an unknown model (404), a malformed body (400), a context past the
model's length (400, ``context_length_exceeded``), a history the template rewrote (400, ``history_mismatch``).
Served by starlette under uvicorn in the running event loop (the agents run in the same loop), without uvicorn's
signal handlers or its polling main loop.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
from typing import Any

from psrl.tasks.agent.capture import Conversation, EndpointError, SampledTurn

__all__ = ["Endpoint", "MODEL"]

log = logging.getLogger(__name__)

MODEL = "psrl-policy"
"""The model name the endpoint serves (``/v1/models``); a request naming another is refused."""


def _ints(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EndpointError(400, f"{name} must be an integer, got {value!r}")
    return value


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise EndpointError(400, f"stop must be a string or a list of strings, got {value!r}")


class Endpoint:
    """The server and the trajectories it serves (``open`` / ``finish``)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self.conversations: dict[str, Conversation] = {}
        self.finished: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._sock: socket.socket | None = None
        self.requests = 0

    # ------------------------------------------------------------------ lifetime

    async def start(self) -> None:
        """Listen on ``host`` at a free port (idempotent within one event loop)."""
        if self._server is not None:
            return
        import uvicorn

        self.loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(self.app(), lifespan="off", log_level="warning", access_log=False)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # what serve() sets before startup(); its main loop is not run
        await server.startup(sockets=[sock])
        self._server = server

    async def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.shutdown(sockets=[self._sock] if self._sock else None)

    def base_url(self, uid: str) -> str:
        return f"http://{self.host}:{self.port}/t/{uid}/v1"

    def open(self, conv: Conversation) -> str:
        """Serve ``conv`` at its base URL (returned)."""
        self.conversations[conv.uid] = conv
        self.finished.pop(conv.uid, None)
        return self.base_url(conv.uid)

    def finish(self, uid: str, why: str = "finished") -> None:
        """Stop serving ``uid``: its turn in flight is cancelled, later requests get a 404 saying ``why``."""
        conv = self.conversations.pop(uid, None)
        if conv is not None:
            conv.close(why)
        self.finished[uid] = why
        while len(self.finished) > 4096:
            self.finished.popitem(last=False)

    # ------------------------------------------------------------------ the app

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(
            routes=[
                Route("/t/{uid}/v1/models", self._models, methods=["GET"]),
                Route("/t/{uid}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/t/{uid}/v1/completions", self._completions, methods=["POST"]),
            ]
        )

    async def _models(self, request):
        from starlette.responses import JSONResponse

        return await self._answer(request, lambda conv, body: self._list(), body=False, response=JSONResponse)

    async def _chat(self, request):
        from starlette.responses import JSONResponse

        return await self._answer(request, self.chat, response=JSONResponse)

    async def _completions(self, request):
        from starlette.responses import JSONResponse

        return await self._answer(request, self.complete, response=JSONResponse)

    async def _answer(self, request, handler, response, body: bool = True):
        self.requests += 1
        try:
            conv = self._conversation(request.path_params["uid"])
            data: dict = {}
            if body:
                try:
                    data = json.loads(await request.body())
                except ValueError as e:
                    raise EndpointError(400, f"the request body is not JSON: {e}") from None
                if not isinstance(data, dict):
                    raise EndpointError(400, f"the request body must be a JSON object, got {type(data).__name__}")
                self._model(data)
            out = handler(conv, data)
            if asyncio.iscoroutine(out):
                out = await out
            return response(out)
        except EndpointError as e:
            return response(e.body(), status_code=e.status)
        except Exception as e:  # noqa: BLE001 -- psrl's own failure under a turn: the agent gets it, named, not a bare 500
            log.warning("agent endpoint: %s failed: %r", request.url.path, e)
            err = EndpointError(500, f"psrl could not serve this turn: {type(e).__name__}: {e}", "server_error")
            return response(err.body(), status_code=500)

    def _conversation(self, uid: str) -> Conversation:
        conv = self.conversations.get(uid)
        if conv is not None:
            return conv
        if uid in self.finished:
            raise EndpointError(
                404, f"trajectory {uid} is {self.finished[uid]}; it takes no more requests", code="trajectory_closed"
            )
        raise EndpointError(
            404, f"unknown trajectory {uid!r}: no agent episode of this run has that base URL", code="not_found"
        )

    @staticmethod
    def _model(data: dict) -> None:
        model = data.get("model")
        if model != MODEL:
            raise EndpointError(
                404, f"the model {model!r} does not exist here; this endpoint serves {MODEL!r}", code="model_not_found"
            )
        n = data.get("n", 1)
        if n != 1:
            raise EndpointError(400, f"n={n!r}: a trajectory is one sequence, so only n=1 is served")
        if data.get("stream"):
            raise EndpointError(400, "stream=true is not served; ask without streaming")

    @staticmethod
    def _list() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "psrl"}]}

    # ------------------------------------------------------------------ requests

    async def chat(self, conv: Conversation, data: dict) -> dict:
        """One ``/chat/completions`` request on ``conv``."""
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise EndpointError(400, f"messages[{i}] must be an object with a string role, got {m!r}")
            if m.get("content") is not None and not isinstance(m["content"], str):
                raise EndpointError(400, f"messages[{i}].content must be a string (parts are not served)")
        tools = data.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise EndpointError(400, "tools must be a list of tool objects")
        if data.get("tool_choice") == "none":
            tools = None
        max_tokens = _ints(data.get("max_completion_tokens", data.get("max_tokens")), "max_tokens")
        ids = conv.chat_context(messages, tools)
        turn = await conv.turn(ids, max_tokens, _stops(data.get("stop")))
        message: dict = {"role": "assistant", "content": turn.parsed.content or None}
        if turn.parsed.tool_calls:
            message["tool_calls"] = turn.parsed.tool_calls
        elif message["content"] is None:
            message["content"] = ""
        choice = {"index": 0, "message": message, "finish_reason": turn.finish, "logprobs": None}
        if data.get("logprobs"):
            choice["logprobs"] = {"content": self._token_logprobs(conv, turn)}
        return self._completion(conv, turn, "chat.completion", choice)

    async def complete(self, conv: Conversation, data: dict) -> dict:
        """One ``/completions`` request on ``conv``."""
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not ok or not prompt:
            raise EndpointError(400, "prompt must be a non-empty string or a list of token ids")
        vocab = conv.tokenizer.vocab_size
        if isinstance(prompt, list) and not all(0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise EndpointError(400, f"prompt holds token id {bad}, outside this model's vocabulary [0, {vocab})")
        ids = conv.text_context(prompt)
        turn = await conv.turn(ids, _ints(data.get("max_tokens"), "max_tokens"), _stops(data.get("stop")))
        choice = {"index": 0, "text": self._text(conv, turn), "finish_reason": turn.finish, "logprobs": None}
        if data.get("logprobs") is not None and data.get("logprobs") is not False:
            toks = self._token_logprobs(conv, turn)
            choice["logprobs"] = {
                "tokens": [t["token"] for t in toks],
                "token_logprobs": [t["logprob"] for t in toks],
                "top_logprobs": None,
                "text_offset": None,
            }
        return self._completion(conv, turn, "text_completion", choice)

    @staticmethod
    def _text(conv: Conversation, turn: SampledTurn) -> str:
        body = turn.ids[:-1] if turn.ids and turn.ids[-1] in conv.stop_ids else turn.ids
        return conv.tokenizer.decode(body)

    @staticmethod
    def _token_logprobs(conv: Conversation, turn: SampledTurn) -> list[dict]:
        """One entry per sampled token (the stop token included: it was sampled and is trained on)."""
        return [
            {"token": conv.tokenizer.decode([t]), "logprob": float(lp), "bytes": None, "top_logprobs": []}
            for t, lp in zip(turn.ids, turn.logprobs)
        ]

    @staticmethod
    def _completion(conv: Conversation, turn: SampledTurn, kind: str, choice: dict) -> dict:
        n = len(conv.turns) - 1
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{conv.uid}-{n}",
            "object": kind,
            "created": 0,  # no wall clock in a task (tasks/base.py); the id says which turn it is
            "model": MODEL,
            "choices": [choice],
            "usage": {
                "prompt_tokens": turn.prompt_tokens,
                "completion_tokens": len(turn.ids),
                "total_tokens": turn.prompt_tokens + len(turn.ids),
            },
        }
