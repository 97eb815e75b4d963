"""Chat messages to prompt text and sampled text back to an OpenAI message: the template and the tool-call parser.

The template (``task.chat_template``) is rendered with jinja2 the way Hugging Face renders chat templates
(``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``, the
``tojson`` filter), in a sandbox:

* ``auto`` -- the tokenizer's own template; when a request offers ``tools`` and that template ignores them
  (SmolLM2-135M-Instruct's renders only ``content``), the shipped Hermes-style template :data:`HERMES` instead,
  said once in the log: the tools never silently vanish from the prompt;
* ``tokenizer`` -- the tokenizer's own template always; a request with tools it ignores is an error;
* ``hermes`` -- :data:`HERMES` always (ChatML turns ending in the tokenizer's eos token, tools in the system turn);
* a path to a ``.jinja`` file -- that template.

The parser (``task.tool_parser``) turns sampled text into ``content`` and OpenAI ``tool_calls``: ``hermes`` reads
Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; ``none`` never parses calls.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psrl.errors import ConfigError

__all__ = ["HERMES", "ChatTemplate", "ParsedTurn", "ToolsIgnored", "parse_turn", "TEMPLATES", "PARSERS"]

log = logging.getLogger(__name__)

TEMPLATES = ("auto", "tokenizer", "hermes")
"""The named values of ``task.chat_template`` (anything else is a path to a ``.jinja`` file)."""
PARSERS = ("hermes", "none")
"""The values of ``task.tool_parser``."""

HERMES = (Path(__file__).parent / "hermes.jinja").read_text()
"""A Hermes / Qwen-style ChatML template that renders ``tools`` for any model: the tool signatures in the system
turn, the assistant's calls as ``<tool_call>`` JSON, tool results as ``<tool_response>`` user turns; every turn
ends in the tokenizer's own eos token (SmolLM2's is ``<|im_end|>``, so this is its ChatML)."""

_PROBE_TOOL = {"type": "function", "function": {"name": "psrl_probe_tool_7f3a", "parameters": {"type": "object"}}}


class ToolsIgnored(ValueError):
    """A request offers tools that the chosen template does not render (``task.chat_template: tokenizer``)."""


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env


def _special(tokenizer: Any, name: str) -> str:
    """The text of the tokenizer's ``bos`` / ``eos`` token ("" when it has none)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return str(getattr(hf, f"{name}_token", None) or "")
    tid = getattr(tokenizer, f"{name}_id", None)
    return "" if tid is None else str(tokenizer.decode([tid]))


class ChatTemplate:
    """Renders chat messages (and tools) to the prompt text of ``tokenizer``, per ``task.chat_template``."""

    def __init__(self, tokenizer: Any, choice: str = "auto"):
        self.choice = choice
        self._env = _environment()
        own = getattr(tokenizer, "chat_template", None)
        if choice == "tokenizer" and not own:
            raise ConfigError(
                "task.chat_template", "the tokenizer has no chat template", "use task.chat_template=hermes or auto"
            )
        if choice == "hermes" or (not own and choice in TEMPLATES):  # a path is used whatever the tokenizer has
            self._own = self._env.from_string(HERMES)
            self.name = "hermes"
        elif choice in ("auto", "tokenizer"):
            self._own = self._env.from_string(own)
            self.name = "tokenizer"
        else:
            path = Path(choice)
            if not path.is_file():
                raise ConfigError(
                    "task.chat_template", f"no such template file {choice!r}", "use auto, tokenizer, hermes or a path"
                )
            self._own = self._env.from_string(path.read_text())
            self.name = str(path)
        self._hermes = self._env.from_string(HERMES)
        self._vars = {"bos_token": _special(tokenizer, "bos"), "eos_token": _special(tokenizer, "eos")}
        self.renders_tools = self._renders_tools()
        self._said = False

    def _renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "hi"}]
        try:
            text = self._own.render(messages=probe, tools=[_PROBE_TOOL], add_generation_prompt=True, **self._vars)
        except Exception:  # noqa: BLE001 -- a template that fails on tools does not render them
            return False
        return "psrl_probe_tool_7f3a" in text

    def render(self, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` offering ``tools``, ending where the assistant's turn starts."""
        template = self._own
        if tools and not self.renders_tools:
            if self.choice != "auto":
                raise ToolsIgnored(
                    f"the chat template ({self.name}) does not render tools; the request offers "
                    f"{len(tools)} (set task.chat_template=auto or hermes to render them)"
                )
            template = self._hermes
            if not self._said:
                self._said = True
                log.warning(
                    "the tokenizer's chat template ignores tools: requests that offer tools are rendered with "
                    "psrl's Hermes-style template instead (task.chat_template=tokenizer makes this an error)"
                )
        return template.render(
            messages=messages, tools=tools or None, add_generation_prompt=generation_prompt, **self._vars
        )


@dataclass
class ParsedTurn:
    """One sampled assistant turn as OpenAI sees it: text outside tool calls, and the calls."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_turn(text: str, parser: str = "hermes", call_prefix: str = "call") -> ParsedTurn:
    """``text`` (sampled, stop token removed) as content and OpenAI ``tool_calls`` (ids ``{call_prefix}_{k}``).

    A ``<tool_call>`` block that is not a JSON object with a string ``name`` stays in the content (the model
    wrote it; the agent sees it), so a malformed call is never silently dropped."""
    if parser == "none":
        return ParsedTurn(text)
    calls: list[dict] = []
    kept: list[str] = []
    last = 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(
            {
                "id": f"{call_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    kept.append(text[last:])
    return ParsedTurn("".join(kept).strip() if calls else text, calls)
