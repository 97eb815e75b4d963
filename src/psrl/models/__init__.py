"""psrl.models: the policy (a transformers causal LM) and its tokenizers."""

from psrl.models.policy import Policy, build_policy, resolve_device
from psrl.models.tokenizer import MARKERS, CharTokenizer, HFTokenizer, load_tokenizer

__all__ = ["Policy", "build_policy", "resolve_device", "CharTokenizer", "HFTokenizer", "load_tokenizer", "MARKERS"]
