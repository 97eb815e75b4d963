"""The inference engines behind :class:`psrl.types.Engine` (docs/engines.md): the in-process batching engine and
its no-cache twin (``base``), ``hf`` (a KV cache, in this process) and ``vllm`` (a client of vLLM servers psrl starts
or attaches to). This room imports nothing of the serving side or the protocol client (``tests/test_layers.py``).

:class:`HFEngine` needs torch and transformers: it is imported on first use, so ``import psrl.rollout`` stays light.
"""

from psrl.rollout.engines import base, vllm
from psrl.rollout.engines.base import *  # noqa: F403 -- the room's API is its modules' __all__, listed once there
from psrl.rollout.engines.vllm import *  # noqa: F403
from psrl.rollout.engines.vllm_server import EngineSetupError, VLLMServer, find_vllm_python

__all__ = [*base.__all__, *vllm.__all__, "EngineSetupError", "VLLMServer", "find_vllm_python"]
__all__ += ["HFEngine"]  # noqa: F405 -- imported on first use, by __getattr__ below


def __getattr__(name: str) -> object:
    if name == "HFEngine":
        from psrl.rollout.engines.hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
