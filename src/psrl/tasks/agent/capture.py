"""Token-exact capture of one agent trajectory: the tokens actually sampled, turn by turn.

An agent sends its whole conversation with every request. The text it sends back is never re-tokenised where
psrl generated it: each assistant message of the request is compared (content and tool calls) with the turns
psrl sampled, in order, and every one recognised is replaced by its stored tokens. The template is rendered with
a marker in place of each recognised turn, the text between markers is tokenised, and the stored tokens go in
the markers' places (the stop token the model sampled stands for the end-of-turn text the template writes after
it). The result must extend what the trajectory holds so far -- prompt, sampled turns and the context between
them --, and only what it adds is appended, with loss mask 0 and version -1 (tool results, user turns). A
template that rewrites history breaks that extension (one whose generation prompt opens ``<think>`` but whose
history drops it with the reasoning, or that reformats calls). ``task.agent_history`` says what then happens,
never a silent mismatch between what was sampled and what is trained: ``error`` fails the request with
:class:`HistoryMismatch`; ``split`` closes the tokens held so far as one training sequence and starts the next
from the request's rendered context (:meth:`psrl.tasks.base.Episode.split`), so every sequence is exactly what an
engine request was given and sampled. The episode stays one trajectory (one ``V_traj``, one reward).

The first request's context is the trajectory's prompt (the agent may add a system turn and tools to the row's
messages). Each sampled token keeps its behaviour log-prob and the version of the weights that produced it.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from psrl.tasks.agent.chat import ChatTemplate, ParsedTurn, ToolsIgnored, parse_turn
from psrl.tasks.base import Episode, GenerateFn, Segment

__all__ = ["Conversation", "EndpointError", "HistoryMismatch", "SampledTurn"]

_MARK = "\x00psrl-turn-{}\x00"
_MARKS = re.compile("\x00psrl-turn-(\\d+)\x00")


class EndpointError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``type``, ``code``, the ``param`` at fault and a message naming the
    cause."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code = status, type, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": None, "code": self.code}}


class HistoryMismatch(EndpointError):
    """The rendered request does not extend the tokens the trajectory holds (the template rewrote history)."""

    def __init__(self, message: str):
        super().__init__(400, message, code="history_mismatch")


@dataclass
class SampledTurn:
    """One model turn as sampled: tokens (stop token included), log-probs, versions, and what the agent saw."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    parsed: ParsedTurn
    finish: str
    """``stop`` (a stop token or a ``stop`` string), ``length`` or ``tool_calls``."""
    prompt_tokens: int = 0


def _norm_args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _signature(content: Any, tool_calls: Any) -> tuple:
    """What identifies an assistant message: its text and its calls (name, decoded arguments)."""
    calls = []
    for c in tool_calls or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        calls.append((fn.get("name"), json.dumps(_norm_args(fn.get("arguments")), sort_keys=True)))
    text = content if isinstance(content, str) else ""
    return (text.strip(), tuple(calls))


@dataclass
class Conversation:
    """One trajectory's capture; ``generate`` is the trajectory's session (its instance, its ``V_traj``)."""

    tokenizer: Any
    template: ChatTemplate
    generate: GenerateFn
    stop_ids: set[int]
    max_context: int
    parser: str = "hermes"
    uid: str = ""
    turn_tokens: int | None = None
    """Most tokens of one turn (a request asking for more gets this many, ``finish_reason: length``)."""
    prompt_ids: list[int] | None = None
    episode: Episode = field(default_factory=Episode)
    turns: list[SampledTurn] = field(default_factory=list)
    closed: str | None = None
    """Why the trajectory takes no more requests (it finished, or was truncated); None while open."""
    history: str = "error"
    """``task.agent_history``: what a request whose context does not extend the stored tokens does (``error`` or
    ``split``)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_flight: asyncio.Task | None = None

    # ------------------------------------------------------------------ context

    def chat_context(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The token ids of a chat request, recognised turns replaced by their stored tokens."""
        marked, k = [], 0
        for msg in messages:
            if (
                msg.get("role") == "assistant"
                and k < len(self.turns)
                and _signature(msg.get("content"), msg.get("tool_calls"))
                == _signature(self.turns[k].parsed.content, self.turns[k].parsed.tool_calls)
            ):
                marked.append({"role": "assistant", "content": _MARK.format(k)})
                k += 1
            else:
                marked.append({**msg, "content": msg.get("content") or ""})
        try:
            text = self.template.render(marked, tools)
        except ToolsIgnored as e:
            raise EndpointError(400, str(e), code="tools_ignored") from None
        except Exception as e:  # noqa: BLE001 -- a template error is the request's fault (roles, fields)
            raise EndpointError(400, f"the chat template cannot render these messages: {e}") from None
        ids: list[int] = []
        parts = _MARKS.split(text)
        after_stop = ""
        for i, part in enumerate(parts):
            if i % 2:
                turn = self.turns[int(part)]
                ids += turn.ids
                last = turn.ids[-1] if turn.ids else None
                after_stop = self.tokenizer.decode([last]) if last in self.stop_ids else ""
            else:
                if after_stop and part.startswith(after_stop):
                    part = part[len(after_stop) :]
                ids += self.tokenizer.encode(part) if part else []
        return ids

    def text_context(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a completions request: token ids as given; text that begins with the trajectory's
        text continues its stored tokens (only the rest is tokenised)."""
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        stored = self.stored()
        head = self.tokenizer.decode(stored) if stored else ""
        if stored and prompt.startswith(head):
            return stored + self.tokenizer.encode(prompt[len(head) :])
        return self.tokenizer.encode(prompt)

    def stored(self) -> list[int]:
        return [] if self.prompt_ids is None else self.prompt_ids + self.episode.response_ids

    def _extend(self, ids: list[int]) -> None:
        """Take ``ids`` as the next context: the prompt on the first turn, else it must extend the stored tokens
        (or, with ``history: split``, it is the prompt of a new sequence)."""
        if self.prompt_ids is None:
            self.prompt_ids = list(ids)
            return
        stored = self.stored()
        if ids[: len(stored)] != stored and self.history == "split":
            self.episode.split(self.prompt_ids)
            self.prompt_ids = list(ids)
            return
        if ids[: len(stored)] != stored:
            at = next((i for i, (a, b) in enumerate(zip(ids, stored)) if a != b), min(len(ids), len(stored)))
            raise HistoryMismatch(
                f"trajectory {self.uid}: the request's rendered context does not extend the {len(stored)} tokens "
                f"sampled so far (they differ from token {at}: "
                f"{self.tokenizer.decode(stored[at : at + 12])!r} stored, "
                f"{self.tokenizer.decode(ids[at : at + 12])!r} sent). Send every assistant message back unchanged "
                "(content and tool_calls), and use a chat template that does not rewrite earlier turns, or set "
                "task.agent_history=split to train such an episode as several sequences"
            )
        if len(ids) > len(stored):
            self.episode.add_tool(ids[len(stored) :])

    # ------------------------------------------------------------------ one turn

    async def turn(self, ids: list[int], max_tokens: int | None, stop: list[str]) -> SampledTurn:
        """Sample one turn after ``ids`` (a request's context) and record it; one request at a time."""
        async with self.lock:
            if self.closed:
                raise EndpointError(404, f"trajectory {self.uid} is {self.closed}; it takes no more requests")
            room = self.max_context - len(ids)
            if room <= 0:
                raise EndpointError(
                    400,
                    f"this model's maximum context length is {self.max_context} tokens; the request has "
                    f"{len(ids)} (shorten the conversation or raise the task's context)",
                    code="context_length_exceeded",
                )
            budget = min(room, self.turn_tokens or room, room if max_tokens is None else int(max_tokens))
            if budget < 1:
                raise EndpointError(400, f"max_tokens must be at least 1, got {max_tokens}")
            self._extend(ids)
            self.in_flight = asyncio.current_task()
            try:
                seg = await self.generate(list(ids), budget)
            finally:
                self.in_flight = None
            turn = self._record(seg.tokens, seg.logprobs, seg.versions, stop)
            turn.prompt_tokens = len(ids)
            return turn

    def _record(self, tokens: list[int], logprobs: list[float], versions: list[int], stop: list[str]) -> SampledTurn:
        """Keep the sampled tokens (up to the first ``stop`` string, as a stop token would end the turn)."""
        finish = "stop" if tokens and tokens[-1] in self.stop_ids else "length"
        body = tokens[:-1] if finish == "stop" else tokens
        text = self.tokenizer.decode(body)
        if stop:
            cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
            if cut >= 0:
                n = next(k for k in range(1, len(tokens) + 1) if len(self.tokenizer.decode(tokens[:k])) > cut)
                tokens, logprobs, versions = tokens[:n], logprobs[:n], versions[:n]
                text, finish = text[:cut], "stop"
        self.episode.add_model(Segment(list(tokens), list(logprobs), list(versions)))
        parsed = parse_turn(text, self.parser, call_prefix=f"call_{self.uid}_{len(self.turns)}")
        if parsed.tool_calls:
            finish = "tool_calls"
            self.episode.tool_calls += len(parsed.tool_calls)
        turn = SampledTurn(list(tokens), list(logprobs), list(versions), parsed, finish)
        self.turns.append(turn)
        return turn

    def close(self, why: str) -> None:
        """Refuse further requests (``why``: finished, truncated) and cancel the turn in flight."""
        if self.closed is None:
            self.closed = why
        if self.in_flight is not None and not self.in_flight.done():
            self.in_flight.cancel()
