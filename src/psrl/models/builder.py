"""Picklable model builders for the trainer ranks (issues #22, #33 item 5): the architecture from a transformers
config, the weights from ``model.*`` itself (:class:`ModelRecipe`) or from a file the driver wrote
(:class:`StateFileModel`).

:class:`ModelRecipe` is how every process builds ``model.*``: the driver's policy (:func:`psrl.models.build_policy`),
and, at world size > 1, rank 0 of the trainer -- so the ranks start from the same weights as a policy built in the
driver, bit for bit, without the driver holding them. Called with ``"meta"`` it gives the architecture only (no file
read, no memory): what the other ranks build before rank 0's weights arrive by broadcast
(:func:`psrl.train.shard.load_full_state`), and the weightless policy of a driver whose engines are vLLM servers or
Ray actors.

:func:`write_start_state` and :class:`StateFileModel` remain for a driver that changed its policy's weights before
the ranks start (the supervised warm start, ``build(weights=...)``): it writes them once, rank 0 reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

__all__ = ["ModelRecipe", "StateFileModel", "write_start_state", "is_weightless"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelRecipe:
    """``build(device) -> model`` from ``model.*`` alone, identical wherever it runs.

    ``path`` set: ``AutoModelForCausalLM.from_pretrained`` (offline; ``gguf_file`` inside it), its embeddings grown
    to ``vocab_size`` when the task added tokens (the new rows drawn under ``seed``). ``path`` None: ``config``'s
    architecture initialised from ``seed`` (the built-in model). ``device == "meta"``: the same architecture with no
    weights.
    """

    config: PretrainedConfig | None
    """The architecture of a model built from a seed (``path`` None)."""
    path: str | None
    gguf_file: str | None
    vocab_size: int
    seed: int
    dtype: str = "float32"

    def __call__(self, device: str) -> nn.Module:
        model = self._meta() if device == "meta" else self._built()
        if device != "meta":
            model = model.to(device)
        model.eval()  # no dropout: recorded and recomputed log-probs must agree
        return model

    def _built(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if self.path is None:
                assert self.config is not None, "a seeded recipe carries its config"
                model = AutoModelForCausalLM.from_config(self.config)
            else:
                kw: dict = {"local_files_only": True, "dtype": DTYPES[self.dtype]}
                if self.gguf_file:
                    kw["gguf_file"] = self.gguf_file
                model = AutoModelForCausalLM.from_pretrained(self.path, **kw)
                if self.gguf_file:
                    drop_gguf_quantizer(model, self.gguf_file)
                self._grow(model, mean_resizing=True)
        return model.to(DTYPES[self.dtype])

    def _meta(self) -> nn.Module:
        config = self.config
        if self.path is not None:
            kw = {"gguf_file": self.gguf_file} if self.gguf_file else {}
            config = AutoConfig.from_pretrained(self.path, local_files_only=True, **kw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[self.dtype])
            if self.path is not None:
                self._grow(model, mean_resizing=False)  # shapes only: nothing to initialise
        return model

    def _grow(self, model: nn.Module, mean_resizing: bool) -> None:
        table = model.get_input_embeddings().weight  # type: ignore[operator]
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"model.path: {self.path}: its input embeddings have no weight table")
        if self.vocab_size > table.shape[0]:
            model.resize_token_embeddings(self.vocab_size, mean_resizing=mean_resizing)  # type: ignore[operator]


def is_weightless(model: nn.Module) -> bool:
    """Whether ``model`` was built on ``meta`` (shapes and config only: a driver that holds no weights)."""
    return any(p.is_meta for p in model.parameters())


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


def drop_gguf_quantizer(model, gguf_file: str) -> None:
    """A GGUF model we train is dequantized into plain float weights; forget the GGUF quantizer so that
    ``save_pretrained`` writes those weights (transformers refuses to serialise a "gguf-quantized" model)."""
    packed = [n for n, w in model.named_parameters() if not w.is_floating_point()]
    if packed:
        raise ValueError(
            f"model.gguf_file: {gguf_file} loaded with weights left in GGUF blocks ({packed[0]}, ...); "
            "psrl trains float weights: uninstall the 'kernels' package so transformers dequantizes it"
        )
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
