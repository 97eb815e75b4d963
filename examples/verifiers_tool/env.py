"""A multi-turn tool-use environment on verifiers' classic stack (verifiers 0.3.1), for ``task.name: verifiers``.

``load_environment()`` returns a ``vf.ToolEnv`` over ``Dataset.from_list``: each row asks for the product of a
two-digit and a one- or two-digit number, which SmolLM2-135M-Instruct cannot do in its head but the ``calculator``
tool can. The model is offered the tool (verifiers sends it as an OpenAI tool; psrl renders it with its
Hermes-style template, docs/agents.md), may call it for up to ``MAX_TURNS`` model turns, and is scored by the
rubric: 1.0 when its final answer holds the right number, plus 0.2 when it called the calculator at all -- a
signal the small model can climb before it answers right. Everything is defined here: nothing is downloaded.

``demonstration(row)`` is the conversation of a model that does the job (call the calculator on the question's
expression, answer its result): ``task.demonstration`` names it for the supervised warm start.

Outside psrl, the same environment runs against any OpenAI-compatible server::

    import asyncio, openai, verifiers as vf
    env = load_environment()
    client = vf.OpenAIChatCompletionsClient(openai.AsyncOpenAI(base_url="http://localhost:8000/v1", api_key="x"))
    state = asyncio.run(env.rollout(env.get_dataset()[0], client, "model"))
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re

import verifiers as vf
from datasets import Dataset
from verifiers.utils.tool_utils import convert_func_to_tool_def

MAX_TURNS = 3
SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then give the final number."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. 37 * 12
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        out = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(out)) if float(out).is_integer() else f"{out:.4g}"


def rows(n: int, seed: int) -> list[dict]:
    """``n`` questions (``question``: verifiers formats it into a chat prompt with the system turn) and answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(11, 99), rng.randint(3, 49)
        out.append({"question": f"What is {a} * {b}?", "answer": str(a * b)})
    return out


def _last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text or "")
    return int(numbers[-1]) if numbers else None


def correct_answer(completion, answer) -> float:
    """1.0 when the last assistant message's last number is the answer."""
    said = [m.content for m in completion if m.role == "assistant" and isinstance(m.content, str)]
    return float(bool(said) and _last_number(said[-1]) == int(answer))


def called_calculator(completion) -> float:
    """1.0 when the model called the calculator at least once."""
    return float(any(m.role == "assistant" and getattr(m, "tool_calls", None) for m in completion))


def load_environment(n: int = 256, seed: int = 0) -> vf.Environment:
    """The calculator ``ToolEnv`` over ``n`` rows (seeded)."""
    rubric = vf.Rubric(funcs=[correct_answer, called_calculator], weights=[1.0, 0.2])
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows(n, seed)),
        tools=[calculator],
        system_prompt=SYSTEM,
        rubric=rubric,
        max_turns=MAX_TURNS,
    )


def demonstration(row):
    """The whole conversation, as the environment would send it, of a model that calls the calculator on the
    question's expression and then answers with the result alone (``tools`` as the environment offers them)."""
    messages = [dict(m) for m in row["prompt"]]
    question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    expression = re.search(r"(-?\d+(?:\s*[-+*/]\s*-?\d+)+)", question).group(1)
    result = calculator(expression)
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": result},
    ]
    tool = convert_func_to_tool_def(calculator).model_dump(exclude_none=True)
    return {"messages": messages, "tools": [{"type": "function", "function": tool}]}
