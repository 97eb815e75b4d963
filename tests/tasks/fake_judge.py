"""A local OpenAI-compatible judge for the ``task.reward: judge`` tests, served from its own thread and loop.

It grades ``Score: 1`` when the answer in the prompt equals the reference, ``Score: 0`` otherwise; a prompt that
contains ``hang_on`` is never answered (until the test ends), ``garbage`` replies without a score. It counts the
requests and the most it held at once.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


class FakeJudge:
    def __init__(self, hang_on: str | None = None, garbage: bool = False, hold: float = 0.0):
        self.hang_on, self.garbage, self.hold = hang_on, garbage, hold
        self.requests = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.release = threading.Event()

    async def _chat(self, request):
        body = await request.json()
        prompt = body["messages"][0]["content"]
        self.requests += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hang_on is not None and self.hang_on in prompt:
                await asyncio.to_thread(self.release.wait)
            elif self.hold:
                await asyncio.sleep(self.hold)  # the judge's own thinking time, so requests overlap
        finally:
            self.in_flight -= 1
        m = re.search(r"Reference answer: (.*?) Answer to grade: (.*) Reply '", prompt, re.DOTALL)
        ref, answer = m.group(1), m.group(2)
        text = "I cannot say" if self.garbage else f"Score: {int(answer.strip() == ref.strip())}"
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    def __enter__(self) -> FakeJudge:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(timeout=30)
