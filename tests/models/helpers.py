"""Small builders shared by the model tests (a tiny policy over the built-in tokenizer)."""

from __future__ import annotations

from psrl.config import ModelConfig
from psrl.models import CharTokenizer, build_policy


def tiny_policy(seed: int = 0, **sizes):
    """A 1-layer, 32-wide GPT-2 over the char tokenizer: fast, still a real transformers model."""
    cfg = ModelConfig(**{"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 96, "device": "cpu", **sizes})
    return build_policy(cfg, CharTokenizer(), seed=seed)


def masked_max_diff(recomputed, rows_logprobs, rows_mask) -> float:
    """Largest |recomputed - recorded| over the positions whose mask is 1."""
    worst = 0.0
    for i, (lps, mask) in enumerate(zip(rows_logprobs, rows_mask)):
        for t, (lp, m) in enumerate(zip(lps, mask)):
            if m:
                worst = max(worst, abs(float(recomputed[i, t]) - lp))
    return worst
