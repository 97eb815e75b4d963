"""A published version as a Hugging Face model directory (issue #33, item 5): what ``final/`` is and what a vLLM
server starts from, made from the version's files -- no process loads the weights to write it.

``v{N}`` already holds Hugging Face's sharded layout (``model-0000b-of-0000n.safetensors`` and
``model.safetensors.index.json``, :mod:`~psrl.weights.format`); :func:`write_model_directory` adds the model's
``config.json`` and the tokenizer beside them, and ``psrl_version.txt``. The safetensors are hard links to the
version's files where the filesystem allows (no bytes copied; pruning the version later leaves them), copies
otherwise. The directory appears whole (written beside it, then renamed).
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from psrl.weights.format import INDEX, read_manifest

__all__ = ["write_model_directory", "VERSION_FILE"]

VERSION_FILE = "psrl_version.txt"
"""The version a model directory holds (``final/``), one line."""


def write_model_directory(version_dir: str | Path, out: str | Path, model: Any, tokenizer: Any) -> Path:
    """``out``: the published version ``version_dir`` as a directory ``AutoModelForCausalLM.from_pretrained`` (and
    ``model.path``, and a vLLM server) loads. ``model``: the ``transformers`` model (e.g. a weightless policy's, on
    ``meta``), or its config: the config is written with the model's class as ``architectures`` where it names
    none (a config built in code, never saved, has none, and vLLM picks its model class by it); ``tokenizer``:
    anything with ``save_pretrained(directory)``. Replaces ``out`` if it exists."""
    config = getattr(model, "config", model)
    if config is not model and not getattr(config, "architectures", None):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]
    src, out = Path(version_dir).resolve(), Path(out)
    manifest = read_manifest(src)  # a complete version only
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for name in [b["file"] for b in manifest["buckets"]] + [INDEX]:
            _link_or_copy(src / name, tmp / name)
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(tmp)
        (tmp / VERSION_FILE).write_text(f"{int(manifest['version'])}\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dst)
