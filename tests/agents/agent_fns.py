"""Agents the tests run: written only against the ``openai`` SDK, as a user's would be (no psrl import)."""

import asyncio
import json

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
SEEN: list = []
"""What the agents saw, per call (responses, errors), for the tests to read."""


async def tool_agent(client, row):
    """Offer ``add``; run every call it makes and ask again, at most three turns; no reward (task.reward scores)."""
    model = (await client.models.list()).data[0].id
    messages = list(row["prompt"])
    for _ in range(3):
        r = await client.chat.completions.create(model=model, messages=messages, tools=[ADD], logprobs=True)
        SEEN.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return None


async def scoring_agent(client, row):
    """One turn; returns its own reward dict."""
    r = await client.chat.completions.create(model="psrl-policy", messages=row["prompt"], max_tokens=4)
    SEEN.append(r)
    return {"score": 0.25, "acc": 1.0}


async def rewriting_agent(client, row):
    """Sends the model's answer back edited (as a template that drops reasoning would render it)."""
    messages = list(row["prompt"])
    r = await client.chat.completions.create(model="psrl-policy", messages=messages)
    messages.append({"role": "assistant", "content": "(edited) " + (r.choices[0].message.content or "")})
    messages.append({"role": "user", "content": "and again?"})
    try:
        await client.chat.completions.create(model="psrl-policy", messages=messages)
    except Exception as e:
        SEEN.append(e)
        raise
    return 1.0


async def silent_agent(client, row):
    """Never calls the endpoint."""
    return 1.0


async def raising_agent(client, row):
    raise ValueError("the agent's own bug")


async def hanging_agent(client, row):
    await client.chat.completions.create(model="psrl-policy", messages=row["prompt"], max_tokens=2)
    await asyncio.Event().wait()


def not_async_agent(client, row):
    return 1.0


async def fails_on_marked_rows(client, row):
    """One turn, then raises on rows whose extra_info says so; 1.0 elsewhere."""
    await client.chat.completions.create(model="psrl-policy", messages=row["prompt"], max_tokens=2)
    if (row.get("extra_info") or {}).get("fail"):
        raise RuntimeError("agent bug on a marked row")
    return 1.0


async def follow_up_agent(client, row):
    """Asks, then follows up with a user turn, ``row["extra_info"]["turns"]`` turns in all (default 2), every
    answer sent back unchanged; no tools, no reward (task.reward scores the last answer)."""
    messages = list(row["prompt"])
    for k in range((row.get("extra_info") or {}).get("turns", 2)):
        if k:
            messages.append({"role": "user", "content": "and again?"})
        r = await client.chat.completions.create(model="psrl-policy", messages=messages, logprobs=True)
        SEEN.append(r)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
    return None
