"""A picklable model builder for the trainer ranks (issue #22): the architecture from a transformers config, the
weights from a file the driver wrote.

The driver builds its policy (and warm-starts it) as the single-process trainer does, writes the weights once with
:func:`write_start_state`, and hands the ranks a :class:`StateFileModel`: rank 0 calls it with ``"cpu"`` or
``"cuda"`` and reads the file; the other ranks call it with ``"meta"`` (shapes only, no file read, no memory) and
receive rank 0's weights by broadcast (:func:`psrl.train.shard.load_full_state`). So a model is read from disk
once, whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

__all__ = ["StateFileModel", "write_start_state"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StateFileModel:
    """``build(device) -> model``: ``config``'s architecture in ``dtype``; unless ``device`` is ``meta``, with the
    weights of ``state_path`` (a :func:`torch.save` of a state dict, tied tensors kept tied)."""

    config: PretrainedConfig
    state_path: str
    dtype: str = "float32"

    def __call__(self, device: str) -> nn.Module:
        where = "meta" if device == "meta" else "cpu"
        with torch.random.fork_rng(devices=[]), torch.device(where):
            model = AutoModelForCausalLM.from_config(self.config)
        model = model.to(DTYPES[self.dtype])
        if device != "meta":
            state = torch.load(self.state_path, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
            model = model.to(device)
        model.eval()  # no dropout: recorded and recomputed log-probs must agree
        return model


def write_start_state(model: nn.Module, path: str | Path, dtype: str = "float32") -> StateFileModel:
    """Write ``model``'s weights to ``path`` (atomically) and return the builder that reads them back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    tmp.replace(path)
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"{type(model).__name__}: the sharded trainer builds transformers models (no .config)")
    return StateFileModel(config, str(path), dtype)
