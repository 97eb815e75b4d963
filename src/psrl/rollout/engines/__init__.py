"""The inference engines behind :class:`psrl.types.Engine` (docs/engines.md): the in-process batching engine and
its no-cache twin (``base``), ``hf`` (a KV cache, in this process) and ``vllm`` (a client of vLLM servers psrl starts
or attaches to). This room imports nothing of the serving side or the protocol client (``tests/test_layers.py``).

:class:`HFEngine` needs torch and transformers: it is imported on first use, so ``import psrl.rollout`` stays light.
"""

from psrl.rollout.engines.base import BatchingEngine, NoCacheEngine, TokenModel, TokenRate, as_engine, turns
from psrl.rollout.engines.vllm import VLLMEngine, WeightFiles, build_vllm_engines
from psrl.rollout.engines.vllm_server import EngineSetupError, VLLMServer, find_vllm_python

__all__ = [
    "BatchingEngine",
    "NoCacheEngine",
    "TokenModel",
    "TokenRate",
    "as_engine",
    "turns",
    "HFEngine",
    "VLLMEngine",
    "WeightFiles",
    "build_vllm_engines",
    "EngineSetupError",
    "VLLMServer",
    "find_vllm_python",
]


def __getattr__(name: str) -> object:
    if name == "HFEngine":
        from psrl.rollout.engines.hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
