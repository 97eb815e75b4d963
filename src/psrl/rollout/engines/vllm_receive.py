"""A vLLM server as a receiver of the collective transport (:class:`psrl.weights.receivers.Receiver`): the trainer's
publisher (:mod:`psrl.train.transfer`, in its thread) drives the server's worker extension
(:mod:`psrl.weights.vllm_receiver`) through the engine's ``/collective_rpc`` calls, which run on the engine's
event loop (:meth:`~psrl.rollout.engines.vllm.VLLMEngine.rpc_from_thread`): the loop keeps serving while a version
arrives. The server's engine core runs the receive between its steps: requests in flight wait, none is aborted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from psrl.rollout.engines.vllm import VLLMEngine
from psrl.weights.collective import BucketLayout, GroupAddress

__all__ = ["VLLMReceiver"]


class VLLMReceiver:
    """The receiving member of one vLLM server (its one worker)."""

    def __init__(self, engine: VLLMEngine, timeout_s: float):
        self.engine = engine
        engine.receives = True
        self.timeout_s = float(timeout_s)
        """The bound on each call (a join, a version's receive)."""

    @property
    def name(self) -> str:
        return f"vLLM server {self.engine.url}"

    def join(self, address: GroupAddress, rank: int) -> None:
        self.engine.rpc_from_thread("psrl_join", self.timeout_s, address=dataclasses.asdict(address), rank=rank)

    def receive(self, version: int, buckets: Sequence[BucketLayout], world: int) -> list[str]:
        layout = [dataclasses.asdict(b) for b in buckets]
        got = self.engine.rpc_from_thread("psrl_receive", self.timeout_s, version=version, buckets=layout, world=world)
        if len(got) != 1:
            raise RuntimeError(f"{self.name}: {len(got)} workers answered psrl_receive (one is supported)")
        return list(got[0])

    def close(self) -> None:
        self.engine.rpc_from_thread("psrl_leave", self.timeout_s)
