"""psrl.models: the policy (a transformers causal LM), its tokenizers and a decode-step batcher."""

from psrl.models.policy import Policy, build_policy, resolve_device
from psrl.models.tokenizer import MARKERS, CharTokenizer, HFTokenizer, load_tokenizer

__all__ = ["Policy", "build_policy", "resolve_device", "CharTokenizer", "HFTokenizer", "load_tokenizer", "MARKERS",
           "DecodeBatcher"]


def __getattr__(name):
    # DecodeBatcher imports psrl.tasks.base, which is light; loaded lazily to keep imports one-way.
    if name == "DecodeBatcher":
        from psrl.models.batching import DecodeBatcher

        return DecodeBatcher
    raise AttributeError(name)
