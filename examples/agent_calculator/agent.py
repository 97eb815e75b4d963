"""A calculator agent written only against the ``openai`` SDK: what you would point at any OpenAI-compatible server.

psrl trains it unchanged (``task.name: agent``, ``task.agent: examples/agent_calculator/agent.py:agent``): each
trajectory calls ``agent(client, row)`` with a client whose base URL is that trajectory's own. The model is offered
one tool, ``calculator(expression)``; every call it makes is evaluated here and sent back, for at most
``MAX_TURNS`` model turns; the reward is 1.0 when the final answer holds the right number (the row's
``reward_model.ground_truth``), else 0.0. Nothing here imports psrl.

``demonstration(row)`` is the conversation this agent has when the model does the job (call the calculator on
the question's expression, then answer its result): ``task.demonstration`` names it for the supervised warm start
(``trainer.warm_start_steps``), which psrl renders through the same template the endpoint uses.

    import asyncio, json, openai
    row = json.loads(open("examples/agent_calculator/train.jsonl").readline())
    asyncio.run(agent(openai.AsyncOpenAI(base_url="http://localhost:8000/v1", api_key="x"), row))
"""

from __future__ import annotations

import ast
import json
import operator
import re

MAX_TURNS = 3
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37 * 12"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of ``expression`` (numbers, + - * /, parentheses), or an error message the model reads."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        out = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(out)) if float(out).is_integer() else f"{out:.4g}"


def _answer(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text or "")
    return int(numbers[-1]) if numbers else None


def demonstration(row):
    """The whole conversation, as :func:`agent` would send it, of a model that calls the calculator on the
    question's expression and then answers with the result alone."""
    messages = list(row["prompt"])
    question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    expression = re.search(r"(-?\d+(?:\s*[-+*/]\s*-?\d+)+)", question).group(1)
    result = calculate(expression)
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
    return {"messages": messages, "tools": [CALCULATOR]}


async def agent(client, row):
    """Play one row; the reward (1.0 right, 0.0 wrong) plus how many tool calls were valid."""
    model = (await client.models.list()).data[0].id
    messages = list(row["prompt"])
    good_calls = 0
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], max_tokens=128)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculate(str(args.get("expression", ""))) if call.function.name == "calculator" else "?"
            except (ValueError, AttributeError):
                result = "error: arguments must be a JSON object with an expression"
            good_calls += not result.startswith(("error", "?"))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else ""
    right = _answer(final) == int(row["reward_model"]["ground_truth"])
    return {"score": float(right), "good_calls": float(good_calls)}
