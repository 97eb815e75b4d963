"""Bring your own agent (``task.name: agent``): an OpenAI-compatible endpoint per trajectory, token-exact capture.

:mod:`~psrl.tasks.agent.chat` renders chat messages and parses tool calls, :mod:`~psrl.tasks.agent.capture` keeps
one trajectory's sampled tokens across turns, :mod:`~psrl.tasks.agent.endpoint` serves them over HTTP, and
:mod:`~psrl.tasks.agent.task` runs the user's ``async def agent(client, row)`` per trajectory.
"""
