"""Warm-start demonstrations of an agent task, tokenised exactly as the endpoint captures a conversation.

``task.demonstration`` names ``def demonstration(row)`` (``module:function`` or ``path/to/file.py:function``; no
psrl import needed) that returns one whole conversation for a dataset row, as the agent would send it at its
last turn: ``{"messages": [...], "tools": [...]}``, the assistant messages (content and ``tool_calls``) being what
the model should learn to write. :func:`demo_tokens` renders it with the task's :class:`ChatTemplate` (psrl's
Hermes template where the tokenizer's ignores tools) through the same :class:`Conversation` the endpoint uses:

* the context before the first assistant message is the prompt, as the agent's first request would render it;
* each assistant message becomes the tokens of the text the template writes for it, then the stop token (what the
  model would sample), loss mask 1;
* the context between assistant messages (tool results, user turns) is what a later request adds after the
  recognised turns, loss mask 0.

So after the warm start the model writes turns that the endpoint parses into the same ``tool_calls`` and that
the next request recognises. A demonstration whose assistant text would not parse back into its own message (a
call the parser cannot read) or whose later context does not extend the earlier one fails with a
:class:`~psrl.errors.ConfigError` naming the row, never a silently different training sequence.
"""

from __future__ import annotations

import json
from typing import Any

from psrl.errors import ConfigError
from psrl.tasks.agent.capture import Conversation, EndpointError, SampledTurn
from psrl.tasks.agent.chat import ChatTemplate, ParsedTurn, parse_turn
from psrl.tasks.base import Demo

__all__ = ["demo_tokens"]

KEY = "task.demonstration"


def _calls(tool_calls: Any) -> list:
    out = []
    for c in tool_calls or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return out


def _reads_back(parsed: ParsedTurn, msg: dict) -> bool:
    """Whether the parsed text is the message (content and calls), as the endpoint answers and recognises it."""
    content = msg.get("content")
    content = content if isinstance(content, str) else ""
    return parsed.content.strip() == content.strip() and _calls(parsed.tool_calls) == _calls(msg.get("tool_calls"))


def _unused_generate(ids: list[int], max_new: int) -> Any:
    raise RuntimeError("a demonstration samples nothing")


def demo_tokens(
    tokenizer: Any, template: ChatTemplate, stop_id: int, parser: str, demo: Any, where: str = "a row"
) -> Demo:
    """``(prompt_ids, response_ids, loss_mask)`` of one demonstration (``{"messages", "tools"}``)."""
    if not isinstance(demo, dict) or not isinstance(demo.get("messages"), list):
        raise ConfigError(KEY, f"the demonstration of {where} is not a dict with a list of messages", _FIX)
    messages, tools = demo["messages"], demo.get("tools") or None
    turns = [j for j, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if not turns or turns[0] == 0:
        raise ConfigError(KEY, f"the demonstration of {where} has no assistant message after a prompt", _FIX)
    conv = Conversation(tokenizer, template, _unused_generate, {stop_id}, max_context=0, parser=parser, uid="demo")
    stop_text = tokenizer.decode([stop_id])
    prompt: list[int] | None = None
    response: list[int] = []
    mask: list[int] = []
    for j in turns:
        try:
            context = conv.chat_context(messages[:j], tools)
            before = template.render(messages[:j], tools, generation_prompt=True)
            whole = template.render(messages[: j + 1], tools, generation_prompt=False)
        except (EndpointError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(KEY, f"the demonstration of {where} cannot be rendered: {e}", _FIX) from None
        if prompt is None:
            prompt = context
        else:
            stored = prompt + response
            if context[: len(stored)] != stored:
                raise ConfigError(KEY, f"the demonstration of {where}: turn {len(conv.turns)} rewrites history", _FIX)
            response += context[len(stored) :]
            mask += [0] * (len(context) - len(stored))
        end = whole.rfind(stop_text, len(before))
        if not whole.startswith(before) or end < 0:
            raise ConfigError(
                KEY, f"the template does not write assistant message {len(conv.turns)} of {where}'s demonstration", _FIX
            )
        text = whole[len(before) : end]
        parsed = parse_turn(text, parser)
        msg = messages[j]
        if not _reads_back(parsed, msg):
            raise ConfigError(
                KEY,
                f"assistant message {len(conv.turns)} of {where}'s demonstration renders as {text!r}, which the "
                f"{parser} parser does not read back as the same message",
                "write tool calls the parser reads (task.tool_parser), or a plain answer",
            )
        ids = tokenizer.encode(text) + [stop_id]
        conv.turns.append(SampledTurn(ids, [0.0] * len(ids), [0] * len(ids), parsed, "stop"))
        response += ids
        mask += [1] * len(ids)
    assert prompt is not None
    return prompt, response, mask


_FIX = 'return {"messages": [...the whole conversation...], "tools": [...]} with assistant turns to learn'
