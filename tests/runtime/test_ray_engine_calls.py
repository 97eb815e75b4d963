"""A :class:`~psrl.runtime.ray_runtime.RayEngine`'s bounded calls on its actor, without starting Ray (a future
stands in for the actor's reply: a Ray ref is awaited the same way)."""

from __future__ import annotations

import asyncio

import pytest

from psrl.runtime.ray_runtime import EngineStuck, RayEngine


class Actor:
    """An engine actor whose ``resume`` replies with the future the test holds."""

    def __init__(self, reply: asyncio.Future):
        self.reply = reply
        self.resume = self

    def remote(self) -> asyncio.Future:
        return self.reply


def test_a_stop_that_comes_with_the_actors_reply_is_not_dropped():
    """The run stops a rollout instance (cancels its task) just as its engine actor answers a resume: the call
    raises CancelledError, so the instance's loop ends. With ``asyncio.wait_for`` (Python 3.11) the reply won and
    the cancel was lost: the instance waited for work forever, the vLLM-on-Ray run hung after its last step."""

    async def main() -> str:
        reply = asyncio.get_running_loop().create_future()
        engine = RayEngine(Actor(reply), feed=None, name="rollout instance 0")
        call = asyncio.ensure_future(engine.resume())
        await asyncio.sleep(0)  # the call waits for the reply
        reply.set_result(None)  # the reply arrives ...
        call.cancel()  # ... as the run stops the instance
        try:
            await call
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    assert asyncio.run(main()) == "cancelled"


def test_a_call_past_its_bound_is_one_error_naming_the_instance_and_the_key():
    async def main() -> None:
        never = asyncio.get_running_loop().create_future()
        engine = RayEngine(Actor(never), feed=None, name="rollout instance 1 on node 5f3a", call_s=0.01)
        await engine.resume()

    with pytest.raises(EngineStuck) as err:
        asyncio.run(main())
    assert "rollout instance 1 on node 5f3a" in str(err.value) and "rollout.request_timeout_s" in str(err.value)
